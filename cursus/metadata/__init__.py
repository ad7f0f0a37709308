"""Authoritative cluster metadata: topic definitions, partition assignment and the broker registry.

Nothing here imports :mod:`cursus.broker` or :mod:`cursus.coordinator`; both depend on this package.
"""

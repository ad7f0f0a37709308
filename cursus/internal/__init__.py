"""The internal broker-to-broker service (gRPC over mutual TLS on ``internal_broker_port``).

``v1/`` holds the code generated from ``proto/cursus/internal/v1/*.proto`` (``make proto``).
"""

"""Cluster mode: the Raft metadata layer (:mod:`cursus.cluster.raft`), internal TLS and certificates."""

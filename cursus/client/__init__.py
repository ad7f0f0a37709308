"""Cursus Python SDK (transport layer; producers, consumers and admin follow)."""

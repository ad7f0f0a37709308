"""Authentication of internal (broker-to-broker) calls: the shared token and the certificate identity.

Two independent checks run on every call of the internal listener (see ``docs/cluster.md, "The internal listener"``):

* :class:`TokenCheck`: the ``x-cursus-internal-token`` metadata value equals ``internal_auth_token`` or,
  during a rotation, ``internal_auth_token_next``; compared in constant time. An empty configured token
  never matches anything (a broker without a token accepts no internal call).
* :func:`identity_from_pem`: the broker id in the peer's verified client certificate, the single
  ``raft://<broker-id>`` URI SubjectAlternativeName (the same rule as
  :func:`cursus.cluster.tls.identity_of`, which the Raft transport uses).

Sans-IO: no sockets, no asyncio; the server (:mod:`cursus.internal.server`) feeds them.
"""

from __future__ import annotations

import hmac

from cryptography import x509

from cursus.cluster.tls import IDENTITY_SCHEME

#: gRPC metadata key carrying the internal token on every internal call.
TOKEN_METADATA_KEY = "x-cursus-internal-token"


def _encode(token: str) -> bytes:
    return token.encode("utf-8")


class TokenCheck:
    """Constant-time check of a presented internal token against the current and the next token.

    ``token`` is ``internal_auth_token``; ``next_token`` is ``internal_auth_token_next`` ("" when no
    rotation is in progress). Both are accepted, so brokers can be moved to a new token one at a time
    (see the rotation procedure in ``docs/cluster.md, "The internal listener"``). The secrets never appear in ``repr``.
    """

    __slots__ = ("_accepted",)

    def __init__(self, token: str, next_token: str = "") -> None:
        self._accepted: tuple[bytes, ...] = tuple(_encode(t) for t in (token, next_token) if t)

    def __repr__(self) -> str:
        return f"TokenCheck(<{len(self._accepted)} accepted token(s) redacted>)"

    @property
    def configured(self) -> bool:
        """At least one non-empty token is configured (otherwise :meth:`ok` is always False)."""
        return bool(self._accepted)

    def ok(self, presented: str | bytes | None) -> bool:
        """True when ``presented`` equals one of the configured tokens (constant time per candidate).

        None, "" and anything when no token is configured give False. Every configured candidate is
        compared (no early exit) so timing does not reveal which one matched.
        """
        if not presented:
            return False
        value = presented if isinstance(presented, bytes) else _encode(presented)
        matched = False
        for candidate in self._accepted:
            matched |= hmac.compare_digest(value, candidate)
        return matched


def identity_from_pem(pem: bytes | str | None) -> str | None:
    """The broker id of a PEM certificate: its single ``raft://<id>`` URI SAN, or None.

    None when ``pem`` is empty or not a parsable certificate, has no SubjectAlternativeName, has no or
    several ``raft://`` URIs, or the id is empty. The certificate's chain is NOT verified here: pass only
    a certificate the TLS layer has already verified (``x509_pem_cert`` of a gRPC auth context).
    """
    if not pem:
        return None
    data = pem.encode("ascii", "replace") if isinstance(pem, str) else pem
    try:
        cert = x509.load_pem_x509_certificate(data)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except (ValueError, TypeError, x509.ExtensionNotFound):
        return None
    identities = [uri for uri in uris if uri.startswith(IDENTITY_SCHEME)]
    if len(identities) != 1:
        return None
    node_id = identities[0][len(IDENTITY_SCHEME):]
    return node_id or None

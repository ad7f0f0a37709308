"""TLS for the client listener, through the standard :mod:`ssl` module (spec section 1: TLS 1.2+).

Negotiation and every later frame happen inside TLS. With ``tls_ca_path`` set the listener also requires
and verifies client certificates (mutual TLS).

Failed handshakes are logged: asyncio handles the listener's handshake itself and drops an ``ssl.SSLError``
without a word (it is an ``OSError``, logged only in debug mode), so the context's ``sslobject_class`` is a
subclass whose ``do_handshake`` reports the failure (OpenSSL's reason and what it usually means) through
:data:`TLS_LOG`, at most once per reason every 10 s. The TLS object is given no transport by the event loop
(asyncio or uvloop), so the line cannot name the peer. Nothing from the peer's bytes and no key material is
logged.
"""

from __future__ import annotations

import logging
import os
import ssl

from cursus.broker.config import BrokerConfig, ConfigError
from cursus.broker.ratelog import RateLimitedLog

log = logging.getLogger("cursus.tls")

#: Handshake failures: at most one line per OpenSSL reason every 10 s (a port scanner must not flood the log).
TLS_LOG = RateLimitedLog(log)

#: What an OpenSSL reason usually means on the client listener.
_MEANINGS = {
    "WRONG_VERSION_NUMBER": "a plaintext client on the TLS listener (it must connect with TLS)",
    "HTTP_REQUEST": "an HTTP request on the TLS listener",
    "UNSUPPORTED_PROTOCOL": "the client offers only TLS versions below 1.2",
    "PEER_DID_NOT_RETURN_A_CERTIFICATE": "the client sent no certificate (mutual TLS requires one)",
    "CERTIFICATE_VERIFY_FAILED": "the client certificate failed verification against tls_ca_path",
    "TLSV1_ALERT_UNKNOWN_CA": "the client does not trust the broker's certificate (unknown CA)",
    "SSLV3_ALERT_BAD_CERTIFICATE": "the client refused the broker's certificate",
    "SSLV3_ALERT_CERTIFICATE_UNKNOWN": "the client refused the broker's certificate",
    "NO_SHARED_CIPHER": "no cipher in common with the client",
}


def describe_handshake_failure(exc: ssl.SSLError) -> tuple[str, str]:
    """(reason key, human text) for a failed server-side handshake; only OpenSSL's reason and verify message."""
    reason = str(exc.reason or type(exc).__name__)
    text = _MEANINGS.get(reason, "handshake refused")
    verify = getattr(exc, "verify_message", None)
    if verify:
        text = f"{text}: {verify}"
    return reason, text


class _LoggedHandshakeSSLObject(ssl.SSLObject):
    """An ``SSLObject`` that logs a failed handshake (rate limited) before re-raising it."""

    def do_handshake(self) -> None:
        try:
            super().do_handshake()
        except (ssl.SSLWantReadError, ssl.SSLWantWriteError):
            raise
        except ssl.SSLError as exc:
            reason, text = describe_handshake_failure(exc)
            TLS_LOG.warning(f"tls:{reason}", "TLS handshake failed on the client listener: %s (%s)", text, reason)
            raise


def server_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """The listener's SSL context, or None when ``use_tls`` is false.

    Raises:
        ConfigError: TLS enabled without a certificate/key, a missing file (named), or unreadable or invalid
            certificate, key or CA files.
    """
    if not config.use_tls:
        return None
    if not config.tls_cert_path or not config.tls_key_path:
        raise ConfigError("invalid value for use_tls: tls_cert_path and tls_key_path are required")
    for key, path in (("tls_cert_path", config.tls_cert_path), ("tls_key_path", config.tls_key_path),
                      ("tls_ca_path", config.tls_ca_path)):
        if path and not os.path.isfile(path):
            raise ConfigError(f"invalid value for {key}: file not found: {path}")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    try:
        ctx.load_cert_chain(config.tls_cert_path, config.tls_key_path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"invalid value for tls_cert_path/tls_key_path: {exc}") from None
    if config.tls_ca_path:
        try:
            ctx.load_verify_locations(cafile=config.tls_ca_path)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"invalid value for tls_ca_path: {exc}") from None
        ctx.verify_mode = ssl.CERT_REQUIRED
    ctx.sslobject_class = _LoggedHandshakeSSLObject
    return ctx

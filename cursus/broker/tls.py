"""TLS for the client listener, through the standard :mod:`ssl` module (spec section 1: TLS 1.2+).

Negotiation and every later frame happen inside TLS. With ``tls_ca_path`` set the listener also requires
and verifies client certificates (mutual TLS).
"""

from __future__ import annotations

import ssl

from cursus.broker.config import BrokerConfig, ConfigError


def server_context(config: BrokerConfig) -> ssl.SSLContext | None:
    """The listener's SSL context, or None when ``use_tls`` is false.

    Raises:
        ConfigError: TLS enabled without a certificate/key, or unreadable certificate, key or CA files.
    """
    if not config.use_tls:
        return None
    if not config.tls_cert_path or not config.tls_key_path:
        raise ConfigError("invalid value for use_tls: tls_cert_path and tls_key_path are required")
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
    return ctx

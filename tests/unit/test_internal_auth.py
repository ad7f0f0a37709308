"""Internal-call authentication: the constant-time token check and the certificate identity rule."""

from __future__ import annotations

from cryptography.hazmat.primitives import serialization

from cursus.cluster.certs import issue_node_cert, new_authority
from cursus.cluster.tls import IDENTITY_SCHEME
from cursus.internal.auth import TokenCheck, identity_from_pem


def test_token_check_accepts_current_and_next_only() -> None:
    check = TokenCheck("current-secret", "next-secret")
    assert check.ok("current-secret") and check.ok("next-secret") and check.ok(b"next-secret")
    for bad in (None, "", "current-secre", "current-secret ", "CURRENT-SECRET", "x" * 200):
        assert not check.ok(bad)
    assert TokenCheck("only").ok("only") and not TokenCheck("only").ok("next-secret")


def test_empty_configured_token_never_matches() -> None:
    check = TokenCheck("", "")
    assert not check.configured
    assert not check.ok("") and not check.ok(None) and not check.ok("anything")
    assert TokenCheck("", "n").ok("n") and not TokenCheck("", "n").ok("")


def test_secrets_stay_out_of_repr() -> None:
    text = repr(TokenCheck("current-secret", "next-secret")) + str(TokenCheck("current-secret"))
    assert "secret" not in text and "redacted" in text


def _pem(node_id: str, *, identity: str | None = None, hosts: tuple[str, ...] = ("127.0.0.1",)) -> bytes:
    cert, _ = issue_node_cert(new_authority(days=1), node_id, hosts, days=1, identity=identity)
    return cert.public_bytes(serialization.Encoding.PEM)


def test_identity_is_the_single_raft_uri() -> None:
    assert IDENTITY_SCHEME == "raft://"
    assert identity_from_pem(_pem("node-2")) == "node-2"
    assert identity_from_pem(_pem("node-2").decode()) == "node-2"
    assert identity_from_pem(_pem("node-2", hosts=())) == "node-2"  # SAN with only the URI


def test_identity_refusals() -> None:
    assert identity_from_pem(_pem("node-2", identity="")) is None  # no raft:// URI
    assert identity_from_pem(_pem("node-2", identity="", hosts=())) is None  # no SAN at all
    assert identity_from_pem(None) is None and identity_from_pem(b"") is None
    assert identity_from_pem(b"-----BEGIN CERTIFICATE-----\ngarbage\n-----END CERTIFICATE-----\n") is None
    assert identity_from_pem(b"not a pem") is None


def test_identity_with_two_raft_uris_is_refused() -> None:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "two")])
    now = datetime.datetime.now(datetime.UTC)
    san = x509.SubjectAlternativeName([x509.UniformResourceIdentifier("raft://node-1"),
                                       x509.UniformResourceIdentifier("raft://node-2")])
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(san, critical=False).sign(key, hashes.SHA256()))
    assert identity_from_pem(cert.public_bytes(serialization.Encoding.PEM)) is None

"""``cursusctl certs`` and the certificate identity rules."""

from __future__ import annotations

import stat
from pathlib import Path

from cryptography import x509

from cursus.cli.ctl import main
from cursus.cluster.tls import identity_of


def test_certs_command_writes_a_ca_and_node_certificates(tmp_path: Path) -> None:
    out = tmp_path / "certs"
    assert main(["certs", "--out", str(out), "--nodes", "3", "--host", "127.0.0.1", "--host", "broker-1"]) == 0
    ca = x509.load_pem_x509_certificate((out / "ca.crt").read_bytes())
    for index in (1, 2, 3):
        cert = x509.load_pem_x509_certificate((out / f"node-{index}.crt").read_bytes())
        assert cert.issuer == ca.subject
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        assert san.get_values_for_type(x509.UniformResourceIdentifier) == [f"raft://node-{index}"]
        assert san.get_values_for_type(x509.DNSName) == ["broker-1"]
        usage = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
        assert {oid.dotted_string for oid in usage} == {"1.3.6.1.5.5.7.3.1", "1.3.6.1.5.5.7.3.2"}
        assert stat.S_IMODE((out / f"node-{index}.key").stat().st_mode) == 0o600
    assert stat.S_IMODE((out / "ca.key").stat().st_mode) == 0o600
    assert main(["certs", "--out", str(out), "--nodes", "3"]) == 2  # never overwrites a CA
    assert main(["certs", "--out", str(tmp_path / "none"), "--nodes", "0"]) == 2


def test_identity_needs_exactly_one_raft_uri() -> None:
    def cert(*uris: str) -> dict:
        return {"subjectAltName": (("DNS", "localhost"), *(("URI", uri) for uri in uris))}

    assert identity_of(cert("raft://node-1")) == "node-1"
    assert identity_of(cert()) is None
    assert identity_of(cert("raft://node-1", "raft://node-2")) is None
    assert identity_of(cert("raft://")) is None
    assert identity_of(cert("https://node-1")) is None
    assert identity_of(None) is None

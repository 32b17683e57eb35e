"""The fleet CA (pgcarve.guest.tls): certificates it issues verify against it and only it, carry
the names asked for, and its files are private, made once and refused when others can read them."""

from __future__ import annotations

import datetime as dt
import os
import shutil
import ssl
import subprocess
from pathlib import Path

import pytest
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID
from cryptography.x509.verification import PolicyBuilder, Store, VerificationError
from pgcarve.errors import ConfigError, StateMissing
from pgcarve.guest.tls import (
    FleetCA,
    KeyAndCertificate,
    certificate_names,
    issue_server_certificate,
    new_ca,
)

DNS = ["pgc-01.db.example", "localhost"]
IPS = ["10.77.0.12", "127.0.0.1", "::1"]
OPENSSL = shutil.which("openssl")


@pytest.fixture(scope="module")
def ca() -> KeyAndCertificate:
    return new_ca()


@pytest.fixture(scope="module")
def server(ca: KeyAndCertificate) -> KeyAndCertificate:
    return issue_server_certificate(ca, DNS, IPS)


def _verify(leaf_pem: bytes, ca_pem: bytes, name: x509.DNSName | x509.IPAddress) -> None:
    """Chain and name verification as a TLS client does it (RFC 5280 path validation, serverAuth)."""
    store = Store([x509.load_pem_x509_certificate(ca_pem)])
    verifier = PolicyBuilder().store(store).build_server_verifier(name)
    verifier.verify(x509.load_pem_x509_certificate(leaf_pem), [])


def test_the_chain_verifies_for_every_name(ca: KeyAndCertificate, server: KeyAndCertificate) -> None:
    import ipaddress

    for dns in DNS:
        _verify(server.cert_pem, ca.cert_pem, x509.DNSName(dns))
    for ip in IPS:
        _verify(server.cert_pem, ca.cert_pem, x509.IPAddress(ipaddress.ip_address(ip)))
    with pytest.raises(VerificationError):
        _verify(server.cert_pem, ca.cert_pem, x509.DNSName("pgc-02.db.example"))


def test_the_certificate_says_what_it_is_for(ca: KeyAndCertificate, server: KeyAndCertificate) -> None:
    """SANs exactly as asked, serverAuth only, not a CA, 825 days, ECDSA P-256, key matches."""
    cert = x509.load_pem_x509_certificate(server.cert_pem)
    assert certificate_names(server.cert_pem) == (DNS, IPS)
    assert list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value) == [
        ExtendedKeyUsageOID.SERVER_AUTH]
    assert cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is False
    assert cert.not_valid_after_utc - cert.not_valid_before_utc == dt.timedelta(days=825)
    assert isinstance(cert.public_key(), ec.EllipticCurvePublicKey)
    ca_cert = x509.load_pem_x509_certificate(ca.cert_pem)
    assert ca_cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca is True
    assert ca_cert.not_valid_after_utc - ca_cert.not_valid_before_utc == dt.timedelta(days=3650)
    cert.verify_directly_issued_by(ca_cert)


def test_a_certificate_from_another_ca_fails(server: KeyAndCertificate) -> None:
    other = new_ca()
    with pytest.raises(VerificationError):
        _verify(server.cert_pem, other.cert_pem, x509.DNSName(DNS[0]))
    stranger = issue_server_certificate(other, DNS, IPS)
    with pytest.raises(VerificationError):
        _verify(stranger.cert_pem, new_ca().cert_pem, x509.DNSName(DNS[0]))


def test_pythons_tls_client_accepts_the_pair(ca: KeyAndCertificate, server: KeyAndCertificate,
                                             tmp_path: Path) -> None:
    """The key and certificate load into an ssl server context, and a client context trusts the CA
    (what uvicorn and httpx do with these files)."""
    (tmp_path / "s.pem").write_bytes(server.cert_pem)
    (tmp_path / "s.key").write_bytes(server.key_pem)
    ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(tmp_path / "s.pem", tmp_path / "s.key")
    ssl.create_default_context(cadata=ca.cert_pem.decode())


@pytest.mark.skipif(OPENSSL is None, reason="openssl (Debian package openssl) is not installed")
def test_openssl_verify_agrees(ca: KeyAndCertificate, server: KeyAndCertificate, tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(ca.cert_pem)
    (tmp_path / "other.pem").write_bytes(new_ca().cert_pem)
    (tmp_path / "server.pem").write_bytes(server.cert_pem)

    def verify(ca_file: str, *extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([str(OPENSSL), "verify", "-purpose", "sslserver", "-CAfile", str(tmp_path / ca_file),
                               *extra, str(tmp_path / "server.pem")], capture_output=True, text=True, check=False)

    good = verify("ca.pem")
    assert good.returncode == 0 and good.stdout.strip().endswith(": OK"), good.stdout + good.stderr
    assert verify("ca.pem", "-verify_ip", "10.77.0.12").returncode == 0
    assert verify("ca.pem", "-verify_hostname", "pgc-01.db.example").returncode == 0
    assert verify("ca.pem", "-verify_hostname", "evil.test").returncode != 0
    assert verify("other.pem").returncode != 0


@pytest.mark.parametrize("dns, ips", [
    (["a b"], []), (["evil.test\nDNS:x"], []), (["10.0.0.1"], []), ([], ["10.0.0.300"]), ([], ["db1"]), ([], []),
])
def test_names_that_are_not_names_are_refused(ca: KeyAndCertificate, dns: list[str], ips: list[str]) -> None:
    with pytest.raises(ConfigError):
        issue_server_certificate(ca, dns, ips)


# --- the files ------------------------------------------------------------------------------

def test_the_ca_is_made_once_with_a_private_key(tmp_path: Path) -> None:
    """Made only when asked (a new fleet), with ca.key 0600 whatever the umask, then reused unchanged."""
    fleet_ca = FleetCA(tmp_path / "tls")
    with pytest.raises(StateMissing, match="pgcarve state import"):
        fleet_ca.load()
    with pytest.raises(StateMissing):
        fleet_ca.issue_server_certificate(["api.db.example"])
    assert not fleet_ca.exists() and not (tmp_path / "tls" / "ca.key").exists(), "loading makes nothing"
    old = os.umask(0)
    try:
        first = fleet_ca.create()
    finally:
        os.umask(old)
    assert fleet_ca.key_file.stat().st_mode & 0o777 == 0o600
    assert fleet_ca.cert_file.stat().st_mode & 0o777 == 0o644
    before = fleet_ca.key_file.stat().st_mtime_ns
    assert FleetCA(tmp_path / "tls").load() == first
    assert FleetCA(tmp_path / "tls").create() == first, "made once"
    assert fleet_ca.certificate_pem() == first.cert_pem
    assert fleet_ca.key_file.stat().st_mtime_ns == before


def test_server_certificate_files(tmp_path: Path) -> None:
    fleet_ca = FleetCA(tmp_path / "tls")
    fleet_ca.create()
    issued = fleet_ca.issue_server_certificate(["api.db.example"], ["10.1.2.3"])
    cert_file, key_file = fleet_ca.write_server_certificate("api", issued)
    assert key_file.stat().st_mode & 0o777 == 0o600 and key_file.read_bytes() == issued.key_pem
    _verify(cert_file.read_bytes(), fleet_ca.certificate_pem(), x509.DNSName("api.db.example"))
    with pytest.raises(ConfigError):
        fleet_ca.write_server_certificate("../api", issued)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o644])
def test_a_ca_key_others_can_read_is_refused(tmp_path: Path, mode: int) -> None:
    fleet_ca = FleetCA(tmp_path / "tls")
    fleet_ca.create()
    fleet_ca.key_file.chmod(mode)
    with pytest.raises(ConfigError) as err:
        fleet_ca.load()
    message = str(err.value)
    assert str(fleet_ca.key_file) in message and f"{mode:04o}" in message
    assert f"chmod 600 {fleet_ca.key_file}" in message
    assert fleet_ca.key_file.stat().st_mode & 0o777 == mode, "refusing changes nothing"


def test_an_incomplete_or_mismatched_ca_is_refused(tmp_path: Path) -> None:
    fleet_ca = FleetCA(tmp_path / "tls")
    fleet_ca.create()
    key = fleet_ca.key_file.read_bytes()
    fleet_ca.cert_file.unlink()
    with pytest.raises(ConfigError, match="incomplete"):
        fleet_ca.load()
    assert fleet_ca.key_file.read_bytes() == key and not fleet_ca.cert_file.exists(), "no new CA over the old key"
    fleet_ca.cert_file.write_bytes(new_ca().cert_pem)
    with pytest.raises(ConfigError, match=r"the certificate is not the key.s"):
        fleet_ca.load()

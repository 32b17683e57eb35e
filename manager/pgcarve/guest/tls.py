"""The fleet's certificate authority, and the certificates it issues.

One CA per state directory: `<state>/tls/ca.key` (the private key, 0600) and `<state>/tls/ca.pem`
(its certificate, public). It is made once, when a new fleet first starts, and reused for ten years; guests'
PostgreSQL servers and the API server get certificates from it, and clients verify them with
ca.pem (`GET /v1/ca.pem`; libpq `sslmode=verify-ca`, or `verify-full` when the name matches).

etcd needs both kinds (`issue_certificate`): each member a certificate that is a server (clients
and peers verify its IP addresses) and a client (it dials its peers, who check it); the manager,
and later each guest's Patroni, a client certificate whose common name says who it is (etcd takes
a client certificate's CN as its user name once authentication is on).

The functions here are pure (PEM bytes in, PEM bytes out); `FleetCA` is the one place that reads
and writes the files.
"""

from __future__ import annotations

import contextlib
import datetime as dt
import ipaddress
import os
import re
import secrets
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from pgcarve.errors import ConfigError, StateMissing
from pgcarve.filelock import locked

CA_VALIDITY = dt.timedelta(days=3650)
SERVER_VALIDITY = dt.timedelta(days=825)  # the longest validity clients (Apple's, browsers) accept
CLOCK_SKEW = dt.timedelta(minutes=5)  # not-before set back, for clients whose clock runs behind
# An RFC 1123 host name: dot-separated labels of letters, digits and inner hyphens.
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
DNS_NAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*\.?$")

SigningKey = ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey


@dataclass(frozen=True)
class KeyAndCertificate:
    """A private key and its certificate, both PEM (the key never shows in a repr or a log)."""

    key_pem: bytes = field(repr=False)
    cert_pem: bytes


def _new_key() -> ec.EllipticCurvePrivateKey:
    return ec.generate_private_key(ec.SECP256R1())


def _key_pem(key: SigningKey) -> bytes:
    return key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                             serialization.NoEncryption())


def _now(now: dt.datetime | None) -> dt.datetime:
    return now if now is not None else dt.datetime.now(dt.UTC)


def new_ca(common_name: str | None = None, now: dt.datetime | None = None) -> KeyAndCertificate:
    """A new self-signed CA (ECDSA P-256, ten years) that signs leaf certificates only (path length 0)."""
    key = _new_key()
    # A random suffix keeps every fleet's CA name distinct, so a client trusting two never mixes them up.
    name = x509.Name([
        x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pgcarve"),
        x509.NameAttribute(NameOID.COMMON_NAME, common_name or f"pgcarve fleet CA {secrets.token_hex(4)}"),
    ])
    start = _now(now) - CLOCK_SKEW
    public = key.public_key()
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(start + CA_VALIDITY)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=True,
                                     crl_sign=True, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .sign(key, hashes.SHA256())
    )
    return KeyAndCertificate(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def check_names(dns_names: Sequence[str], ip_addresses: Sequence[str]) -> tuple[list[str], list[str]]:
    """The names as they go into a certificate; ConfigError naming the first that is not a host
    name or an IP address, or if there are none at all."""
    dns, ips = [], []
    for name in dns_names:
        if not isinstance(name, str) or not DNS_NAME.match(name) or name.replace(".", "").isdigit():
            raise ConfigError(f"{name!r} is not a DNS host name (letters, digits, '-' and '.'), "
                              "so it cannot go into a certificate")
        dns.append(name.rstrip(".").lower())
    for address in ip_addresses:
        try:
            ips.append(str(ipaddress.ip_address(address)))
        except ValueError:
            raise ConfigError(f"{address!r} is not an IP address, so it cannot go into a certificate") from None
    if not dns and not ips:
        raise ConfigError("a server certificate needs at least one DNS name or IP address")
    return list(dict.fromkeys(dns)), list(dict.fromkeys(ips))


def _load_ca(ca: KeyAndCertificate) -> tuple[SigningKey, x509.Certificate]:
    key = serialization.load_pem_private_key(ca.key_pem, password=None)
    if not isinstance(key, ec.EllipticCurvePrivateKey | rsa.RSAPrivateKey):
        raise ConfigError(f"the CA key is a {type(key).__name__}; an ECDSA or RSA key is needed")
    return key, x509.load_pem_x509_certificate(ca.cert_pem)


def issue_certificate(ca: KeyAndCertificate, *, common_name: str | None = None, dns_names: Sequence[str] = (),
                      ip_addresses: Sequence[str] = (), server: bool = True, client: bool = False,
                      validity: dt.timedelta = SERVER_VALIDITY, now: dt.datetime | None = None) -> KeyAndCertificate:
    """A new key and a certificate signed by `ca`, for TLS servers (serverAuth: then exactly these
    DNS names and IP addresses, in subjectAltName), TLS clients (clientAuth), or both.

    The subject's common name is `common_name`, else the first name or address. A client-only
    certificate needs a common name and may list no names; a server certificate needs at least one.
    """
    if not server and not client:
        raise ConfigError("a certificate must be for a server, a client, or both")
    if server:
        dns, ips = check_names(dns_names, ip_addresses)
    else:
        dns, ips = check_names(dns_names, ip_addresses) if (dns_names or ip_addresses) else ([], [])
    subject = common_name or (dns or ips or [""])[0]
    if not subject or len(subject) > 64 or not subject.isprintable():
        raise ConfigError(f"{subject!r} cannot be a certificate's common name (1 to 64 printable characters)")
    ca_key, ca_cert = _load_ca(ca)
    key = _new_key()
    public = key.public_key()
    start = _now(now) - CLOCK_SKEW
    not_after = min(start + validity, ca_cert.not_valid_after_utc)  # never outlive the CA
    sans: list[x509.GeneralName] = [x509.DNSName(n) for n in dns]
    sans += [x509.IPAddress(ipaddress.ip_address(a)) for a in ips]
    usages = [usage for usage, wanted in ((ExtendedKeyUsageOID.SERVER_AUTH, server),
                                          (ExtendedKeyUsageOID.CLIENT_AUTH, client)) if wanted]
    ca_ski = ca_cert.extensions.get_extension_for_class(x509.SubjectKeyIdentifier).value
    builder = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pgcarve"),
                                 x509.NameAttribute(NameOID.COMMON_NAME, subject)]))
        .issuer_name(ca_cert.subject)
        .public_key(public)
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(not_after)
    )
    if sans:
        builder = builder.add_extension(x509.SubjectAlternativeName(sans), critical=False)
    cert = (
        builder
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                                     data_encipherment=False, key_agreement=False, key_cert_sign=False,
                                     crl_sign=False, encipher_only=False, decipher_only=False), critical=True)
        .add_extension(x509.ExtendedKeyUsage(usages), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(public), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_subject_key_identifier(ca_ski), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    return KeyAndCertificate(_key_pem(key), cert.public_bytes(serialization.Encoding.PEM))


def issue_server_certificate(ca: KeyAndCertificate, dns_names: Sequence[str] = (),
                             ip_addresses: Sequence[str] = (), validity: dt.timedelta = SERVER_VALIDITY,
                             now: dt.datetime | None = None) -> KeyAndCertificate:
    """A new key and a server certificate (serverAuth) signed by `ca`, for exactly these DNS
    names and IP addresses (subjectAltName; the first also names the subject)."""
    return issue_certificate(ca, dns_names=dns_names, ip_addresses=ip_addresses, validity=validity, now=now)


def certificate_names(cert_pem: bytes) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) a certificate's subjectAltName lists."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return [], []
    return san.get_values_for_type(x509.DNSName), [str(a) for a in san.get_values_for_type(x509.IPAddress)]


def _same_public_key(key: SigningKey, cert: x509.Certificate) -> bool:
    der = serialization.Encoding.DER
    spki = serialization.PublicFormat.SubjectPublicKeyInfo
    return key.public_key().public_bytes(der, spki) == cert.public_key().public_bytes(der, spki)


def _write_private(path: Path, data: bytes) -> None:
    """Write a file that is 0600 from its creation (a permissive umask cannot widen it)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def _write_public(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    tmp.chmod(0o644)
    tmp.replace(path)


def check_private_file(path: Path, what: str) -> None:
    """ConfigError if a file holding a secret (a private key, passwords) can be read or written by
    group or others."""
    mode = path.stat().st_mode & 0o777
    if mode & 0o077:
        raise ConfigError(f"{what} {path} has mode {mode:04o}: group or others can read or write it. "
                          f"Run `chmod 600 {path}` (and consider whether someone copied it); pgcarve will "
                          "not use a secret others can read")


def check_ca_pair(ca: KeyAndCertificate, what: str) -> None:
    """ConfigError unless `ca` is an unencrypted PEM private key and the PEM certificate of that key."""
    try:
        key, cert = _load_ca(ca)
    except ValueError as exc:
        raise ConfigError(f"{what} cannot be read ({exc}): the key must be an unencrypted PEM private key and the "
                          "certificate a PEM certificate") from None
    if not _same_public_key(key, cert):
        raise ConfigError(f"{what}: the certificate is not the key's; restore the pair from a backup")


class FleetCA:
    """The fleet CA's files in one directory (`<state>/tls`), and the certificates it writes."""

    def __init__(self, directory: Path):
        self.directory = directory

    @property
    def key_file(self) -> Path:
        return self.directory / "ca.key"

    @property
    def cert_file(self) -> Path:
        return self.directory / "ca.pem"

    def _locked(self) -> contextlib.AbstractContextManager[None]:
        """Held while the CA is created, so two processes starting at once make one CA."""
        return locked(self.directory / ".lock", directory_mode=0o755)

    def exists(self) -> bool:
        """Whether any of the CA's two files is there (an incomplete pair is an error to load)."""
        return self.key_file.exists() or self.cert_file.exists()

    def load(self) -> KeyAndCertificate:
        """The CA's key and certificate, read from the directory. StateMissing if neither file is
        there: the CA is made only for a new fleet (`create`), since one made over running guests
        would chain to none of their certificates. ConfigError if the key file is readable by
        others, or the pair is incomplete or mismatched."""
        has_key, has_cert = self.key_file.exists(), self.cert_file.exists()
        if not has_key and not has_cert:
            raise StateMissing(
                f"the fleet CA ({self.key_file} and {self.cert_file}) is missing: every guest's certificate "
                "chains to the one the fleet was made with. Restore it with `pgcarve state import BACKUP "
                "--key-file KEY` (a new fleet makes one when `pgcarve up` or `pgcarve serve` first starts)")
        if has_key != has_cert:
            present, absent = (self.key_file, self.cert_file) if has_key else (self.cert_file, self.key_file)
            raise StateMissing(
                f"the fleet CA in {self.directory} is incomplete: {present} exists but {absent} does not. "
                f"Restore it with `pgcarve state import BACKUP --key-file KEY`, or from a backup of {absent.name}")
        return self._load()

    def create(self) -> KeyAndCertificate:
        """A new CA for a new fleet, written here (the key 0600); the one there if another process
        made it first. Callers make sure first that no guest depends on an older one
        (control/state_check.py)."""
        with self._locked():
            if not self.exists():
                ca = new_ca()
                _write_private(self.key_file, ca.key_pem)
                _write_public(self.cert_file, ca.cert_pem)
        return self.load()

    def _load(self) -> KeyAndCertificate:
        check_private_file(self.key_file, "the fleet CA's private key")
        ca = KeyAndCertificate(self.key_file.read_bytes(), self.cert_file.read_bytes())
        check_ca_pair(ca, f"the fleet CA in {self.directory} ({self.key_file.name}, {self.cert_file.name})")
        return ca

    def certificate_pem(self) -> bytes:
        """The CA certificate, what clients verify servers with."""
        return self.load().cert_pem

    def issue_server_certificate(self, dns_names: Sequence[str] = (),
                                 ip_addresses: Sequence[str] = ()) -> KeyAndCertificate:
        return issue_server_certificate(self.load(), dns_names, ip_addresses)

    def issue_certificate(self, *, common_name: str | None = None, dns_names: Sequence[str] = (),
                          ip_addresses: Sequence[str] = (), server: bool = True,
                          client: bool = False) -> KeyAndCertificate:
        """See the module's `issue_certificate`."""
        return issue_certificate(self.load(), common_name=common_name, dns_names=dns_names,
                                 ip_addresses=ip_addresses, server=server, client=client)

    def write_server_certificate(self, name: str, issued: KeyAndCertificate) -> tuple[Path, Path]:
        """Write `issued` as `<name>.pem` and `<name>.key` (0600) beside the CA; their paths."""
        return write_key_and_certificate(self.directory, name, issued)


def write_key_and_certificate(directory: Path, name: str, issued: KeyAndCertificate) -> tuple[Path, Path]:
    """Write `issued` as `<directory>/<name>.pem` and `<name>.key` (0600); their paths."""
    if not re.fullmatch(r"[a-z0-9][a-z0-9_-]{0,63}", name):
        raise ConfigError(f"{name!r} is not a certificate file name (lower-case letters, digits, '-', '_')")
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
    _write_private(key_file, issued.key_pem)
    _write_public(cert_file, issued.cert_pem)
    return cert_file, key_file

import base64
import dataclasses
import hashlib
import hmac
import json

import pytest
from cryptography import x509
from pgcarve.errors import ConfigError
from pgcarve.guest.credentials import Credentials, InstanceSecrets
from pgcarve.guest.seed import scram_verifier
from pgcarve.guest.tls import certificate_names
from pgcarve.postgres.replication import synchronous_standby_names

from tests.support.seeds import CREDS, SECRETS, guest_seed, throwaway_ca


def scram_accepts(verifier: str, password: str) -> bool:
    """Whether a SCRAM-SHA-256 verifier was made from `password` (what the server checks)."""
    head, keys = verifier.split("$", 1)[1].split("$")
    iterations, salt_b64 = head.split(":")
    stored_b64, _server = keys.split(":")
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), base64.b64decode(salt_b64), int(iterations))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    return hashlib.sha256(client_key).digest() == base64.b64decode(stored_b64)


def test_scram_verifier_matches_rfc_5802_derivation() -> None:
    salt = b"0123456789abcdef"
    verifier = scram_verifier("pencil", salt=salt, iterations=4096)
    head, keys = verifier.split("$", 1)[1].split("$")
    iterations, salt_b64 = head.split(":")
    stored_b64, server_b64 = keys.split(":")
    assert verifier.startswith("SCRAM-SHA-256$4096:") and base64.b64decode(salt_b64) == salt
    salted = hashlib.pbkdf2_hmac("sha256", b"pencil", salt, int(iterations))
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    assert base64.b64decode(stored_b64) == hashlib.sha256(client_key).digest()
    assert base64.b64decode(server_b64) == hmac.new(salted, b"Server Key", hashlib.sha256).digest()


def _instance(user_data: str) -> dict[str, object]:
    config = json.loads(user_data.split("\n", 1)[1])
    result: dict[str, object] = json.loads(config["write_files"][0]["content"])
    return result


def test_primary_seed_carries_verifiers_and_no_plaintext_password() -> None:
    seed = guest_seed("pgc-01", "primary", synchronous_standby_names="FIRST 1 (a, b)")
    user_data = seed.user_data()
    assert user_data.startswith("#cloud-config\n")
    for password in (CREDS.admin_password, SECRETS.app_password, SECRETS.replication_password):
        assert password not in user_data
    instance = _instance(user_data)
    assert instance["role"] == "primary"
    assert scram_accepts(str(instance["admin_password_scram"]), CREDS.admin_password)
    assert scram_accepts(str(instance["app_password_scram"]), SECRETS.app_password)
    assert scram_accepts(str(instance["replication_password_scram"]), SECRETS.replication_password)
    assert (instance["app_user"], instance["app_database"]) == ("app", "app")
    assert json.loads(seed.meta_data("iid-1")) == {"instance-id": "iid-1", "local-hostname": "pgc-01"}


def test_standby_seed_names_its_primary_and_slot_and_carries_only_the_replication_password() -> None:
    seed = guest_seed("pgc-01-s1", "standby", primary_host="10.77.0.12")
    instance = seed.instance_json()
    assert instance["primary_host"] == "10.77.0.12"
    assert instance["slot_name"] == "pgcarve_pgc_01_s1"
    assert instance["replication_password"] == SECRETS.replication_password
    assert "app_password_scram" not in instance, "the application role is made on the primary only"
    text = seed.user_data()
    assert SECRETS.app_password not in text and CREDS.admin_password not in text


def test_seed_carries_the_guests_certificate_for_its_names_and_the_ca() -> None:
    instance = guest_seed("pgc-01-s2", "standby").instance_json()
    cert = str(instance["tls_certificate"]).encode()
    assert certificate_names(cert) == (["pgc-01-s2", "pgc-01"], [])
    assert instance["tls_ca"] == throwaway_ca().cert_pem.decode()
    issued = x509.load_pem_x509_certificate(cert)
    assert issued.issuer == x509.load_pem_x509_certificate(throwaway_ca().cert_pem).subject
    assert str(instance["tls_private_key"]).startswith("-----BEGIN PRIVATE KEY-----")


def test_secrets_never_show_in_a_repr() -> None:
    """A seed (or its parts) logged by mistake shows no password and no private key."""
    seed = guest_seed("pgc-01", "primary")
    text = repr(seed) + repr(SECRETS) + repr(CREDS) + repr(seed.tls)
    for secret in (CREDS.admin_password, SECRETS.app_password, SECRETS.replication_password):
        assert secret not in text
    assert "PRIVATE KEY" not in text


@pytest.mark.parametrize("changes, problem", [
    ({"name": "PGC 01"}, "instance name"),
    ({"allowed_cidrs": ("10.0.0.0/33",)}, "CIDR"),
    ({"role": "standby", "primary_host": None}, "primary's address"),
    ({"ca_pem": b"not a certificate"}, "PEM certificate"),
])
def test_bad_seed_values_are_refused(changes: dict[str, object], problem: str) -> None:
    seed = guest_seed()
    with pytest.raises(ConfigError, match=problem):
        dataclasses.replace(seed, **changes)  # type: ignore[arg-type]


def test_passwords_must_be_safe_tokens() -> None:
    with pytest.raises(ConfigError):
        Credentials(admin_password="short")
    with pytest.raises(ConfigError):
        Credentials(admin_password="x' OR '1'='1" + "a" * 10)
    with pytest.raises(ConfigError):
        InstanceSecrets(app_password="a" * 24, replication_password="pw' host=10.6.6.6" + "a" * 10)


def test_synchronous_standby_names() -> None:
    assert synchronous_standby_names("FIRST", 1, ["pgc-01-s1", "pgc-01-s2"]) == "FIRST 1 (pgc_01_s1, pgc_01_s2)"
    assert synchronous_standby_names("ANY", 2, ["a", "b"]) == "ANY 2 (a, b)"
    assert synchronous_standby_names("FIRST", 1, []) == ""
    with pytest.raises(ConfigError):
        synchronous_standby_names("FIRST", 3, ["a", "b"])

import base64
import hashlib
import hmac
import json

import pytest
from pgcarve.errors import ConfigError
from pgcarve.guest.credentials import Credentials
from pgcarve.guest.seed import GuestSeed, scram_verifier
from pgcarve.postgres.replication import synchronous_standby_names

CREDS = Credentials(admin_password="a" * 24, replication_password="b" * 24)


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


def test_primary_seed_carries_no_plaintext_password() -> None:
    seed = GuestSeed("pgc-01", "primary", CREDS, ("10.77.0.0/16",), synchronous_standby_names="FIRST 1 (a, b)")
    user_data = seed.user_data()
    assert user_data.startswith("#cloud-config\n")
    assert CREDS.admin_password not in user_data and CREDS.replication_password not in user_data
    config = json.loads(user_data.split("\n", 1)[1])
    instance = json.loads(config["write_files"][0]["content"])
    assert instance["role"] == "primary" and instance["admin_password_scram"].startswith("SCRAM-SHA-256$")
    assert json.loads(seed.meta_data("iid-1")) == {"instance-id": "iid-1", "local-hostname": "pgc-01"}


def test_standby_seed_names_its_primary_and_slot() -> None:
    seed = GuestSeed("pgc-01-s1", "standby", CREDS, ("10.77.0.0/16",), primary_host="10.77.0.12")
    instance = seed.instance_json()
    assert instance["primary_host"] == "10.77.0.12"
    assert instance["slot_name"] == "pgcarve_pgc_01_s1"


@pytest.mark.parametrize("kwargs, problem", [
    ({"name": "PGC 01"}, "instance name"),
    ({"allowed_cidrs": ("10.0.0.0/33",)}, "CIDR"),
    ({"role": "standby"}, "primary's address"),
])
def test_bad_seed_values_are_refused(kwargs: dict[str, object], problem: str) -> None:
    fields: dict[str, object] = {"name": "pgc-01", "role": "primary", "credentials": CREDS,
                                 "allowed_cidrs": ("10.77.0.0/16",)}
    fields.update(kwargs)
    with pytest.raises(ConfigError, match=problem):
        GuestSeed(**fields)  # type: ignore[arg-type]


def test_passwords_must_be_safe_tokens() -> None:
    with pytest.raises(ConfigError):
        Credentials(admin_password="short", replication_password="b" * 24)
    with pytest.raises(ConfigError):
        Credentials(admin_password="x' OR '1'='1" + "a" * 10, replication_password="b" * 24)


def test_synchronous_standby_names() -> None:
    assert synchronous_standby_names("FIRST", 1, ["pgc-01-s1", "pgc-01-s2"]) == "FIRST 1 (pgc_01_s1, pgc_01_s2)"
    assert synchronous_standby_names("ANY", 2, ["a", "b"]) == "ANY 2 (a, b)"
    assert synchronous_standby_names("FIRST", 1, []) == ""
    with pytest.raises(ConfigError):
        synchronous_standby_names("FIRST", 3, ["a", "b"])

"""Guest seeds for tests: fixed passwords, and certificates from one throwaway CA per test run."""

from __future__ import annotations

from functools import cache
from typing import Any

from pgcarve.guest.credentials import Credentials, InstanceSecrets
from pgcarve.guest.seed import GuestSeed
from pgcarve.guest.tls import KeyAndCertificate, issue_server_certificate, new_ca

CREDS = Credentials(admin_password="Adm1n" + "x" * 20)
SECRETS = InstanceSecrets(app_password="App1" + "a" * 20, replication_password="Repl1" + "y" * 20)
CIDRS = ("10.77.0.0/16", "192.168.7.0/24")


@cache
def throwaway_ca() -> KeyAndCertificate:
    return new_ca("pgcarve test CA")


def guest_seed(name: str = "pgc-01", role: str = "primary", allowed_cidrs: tuple[str, ...] = CIDRS,
               **changes: Any) -> GuestSeed:
    """A seed as the provisioner makes it: a certificate for the guest and its instance's names."""
    instance = changes.pop("instance", name.split("-s")[0])
    if role == "standby":
        changes.setdefault("primary_host", "10.77.0.12")
    fields: dict[str, Any] = dict(
        name=name, role=role, credentials=CREDS, allowed_cidrs=allowed_cidrs, secrets=SECRETS,
        tls=issue_server_certificate(throwaway_ca(), list(dict.fromkeys([name, instance]))),
        ca_pem=throwaway_ca().cert_pem,
    )
    fields.update(changes)
    return GuestSeed(**fields)

"""Which certificate the API server serves, if any.

Off loopback the API speaks HTTPS only (the token must never cross a network in clear): with the
operator's own certificate (PGCARVE_TLS_CERT and PGCARVE_TLS_KEY), else with one the fleet CA
issues at every start for the names the server was started for (`<state>/tls/api.pem`,
`api.key`), which clients verify with the fleet CA (`GET /v1/ca.pem`). On loopback it stays plain
HTTP, unless the operator gives a certificate.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import ConfigError
from pgcarve.guest.tls import FleetCA

from pgcarve_api.listener import Listener, ServerNames
from pgcarve_api.settings import Settings


@dataclass(frozen=True)
class ServerTls:
    cert_file: Path
    key_file: Path
    ca_file: Path | None  # what a client verifies the certificate with; None: the operator's own


def _check_pair(cert: Path, key: Path) -> None:
    for setting, path in (("PGCARVE_TLS_CERT", cert), ("PGCARVE_TLS_KEY", key)):
        if not path.is_file():
            raise ConfigError(f"{setting}={path}: no such file")
    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(cert, key)
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"PGCARVE_TLS_CERT={cert} and PGCARVE_TLS_KEY={key} are not a PEM certificate and "
                          f"its unencrypted private key ({exc})") from None


def server_tls(settings: Settings, fleet_ca: FleetCA, listener: Listener, names: ServerNames) -> ServerTls | None:
    """The certificate and key to serve, or None for plain HTTP (loopback without the operator's
    certificate). ConfigError, before anything is served, if the settings are incomplete or wrong."""
    cert, key = settings.tls_cert, settings.tls_key
    if cert is not None and key is not None:
        _check_pair(cert, key)
        return ServerTls(cert, key, None)
    if cert is not None or key is not None:
        given, missing = ("PGCARVE_TLS_CERT", "PGCARVE_TLS_KEY") if cert else ("PGCARVE_TLS_KEY", "PGCARVE_TLS_CERT")
        raise ConfigError(f"{given} is set but {missing} is not: set both (your certificate and its key), or "
                          "neither (off loopback the API then serves a certificate from the fleet CA)")
    if listener.loopback:
        return None
    issued = fleet_ca.issue_server_certificate(names.dns, names.ips)
    cert_file, key_file = fleet_ca.write_server_certificate("api", issued)
    return ServerTls(cert_file, key_file, fleet_ca.cert_file)

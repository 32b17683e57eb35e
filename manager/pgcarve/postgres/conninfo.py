"""How clients name a guest's PostgreSQL: TLS verification, libpq URIs (one host, or all of an
instance's hosts with target_session_attrs) and the conninfo a standby streams with.

Every connection pgcarve makes, or hands out, verifies the server's certificate with the fleet CA
(`sslmode=verify-ca`): guests get their addresses from DHCP after their certificate was issued,
so the certificate names the guest and its instance, not an address (`verify-full` works where a
client connects by one of those names).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping, Sequence
from typing import Literal
from urllib.parse import quote

from psycopg.conninfo import make_conninfo

from pgcarve.errors import ConfigError
from pgcarve.naming import application_name
from pgcarve.postgres.session import ADMIN_USER, CLIENT_DATABASE, DEAD_SERVER_PARAMS, REPLICATION_USER, ClientTls

# Where the image's setup script puts the fleet CA in every guest (a standby verifies its primary with it).
GUEST_CA_FILE = "/etc/pgcarve/tls/ca.pem"
# A multi-host URI gives each host this long before moving on to the next one.
CONNECT_TIMEOUT_S = 10

SessionAttrs = Literal["read-write", "prefer-standby"]


def _uri_host(host: str) -> str:
    try:
        return f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:
        return quote(host, safe="")


def uri(user: str, database: str, hosts: Sequence[tuple[str, int]], tls: ClientTls,
        password: str | None = None, params: Mapping[str, str] | None = None) -> str:
    """A libpq URI `postgresql://user[:password]@h1:p1,h2:p2/database?...` with the TLS settings
    (and `params`) as query parameters; psql, psycopg and every libpq client read it."""
    if not hosts:
        raise ConfigError(f"a URI for database {database} needs at least one host")
    auth = quote(user, safe="") + (f":{quote(password, safe='')}" if password is not None else "")
    netloc = ",".join(f"{_uri_host(host)}:{int(port)}" for host, port in hosts)
    query = {**(params or {}), **tls.params()}
    encoded = "&".join(f"{key}={quote(value, safe='/')}" for key, value in query.items())
    return f"postgresql://{auth}@{netloc}/{quote(database, safe='')}?{encoded}"


def endpoint_uri(user: str, database: str, hosts: Sequence[tuple[str, int]], attrs: SessionAttrs,
                 tls: ClientTls, password: str | None = None) -> str:
    """A URI over all of an instance's hosts that reaches its primary (`read-write`) or,
    preferably, a standby (`prefer-standby`) wherever they are now: libpq tries the hosts in
    order and keeps the first that suits, so the same string follows a failover; a session on a
    server that died fails within about 30 s (DEAD_SERVER_PARAMS), so the application reconnects."""
    return uri(user, database, hosts, tls, password, endpoint_params(attrs))


def endpoint_params(attrs: SessionAttrs) -> dict[str, str]:
    """An endpoint's libpq parameters besides TLS, in ENDPOINT_PARAM_ORDER."""
    return {"target_session_attrs": attrs, "connect_timeout": str(CONNECT_TIMEOUT_S), **DEAD_SERVER_PARAMS}


# The order an endpoint's URI and service entry list its parameters in.
ENDPOINT_PARAM_ORDER = tuple(endpoint_params("read-write"))


def standby_conninfo(primary_address: str, standby_guest: str, password: str) -> str:
    """A standby's primary_conninfo: the replication role over TLS verified with the fleet CA in
    the guest. The image's setup script writes the same string when a standby first clones."""
    return (f"host={primary_address} port=5432 user={REPLICATION_USER} "
            f"application_name={application_name(standby_guest)} "
            f"sslmode=verify-ca sslrootcert={GUEST_CA_FILE} password={password}")


def admin_conninfo(host: str, port: int, password: str, tls: ClientTls, database: str = CLIENT_DATABASE,
                   connect_timeout_s: int = 3) -> str:
    """A keyword/value conninfo for the admin role on one guest (the collector's), TLS verified."""
    return make_conninfo(host=host, port=str(port), user=ADMIN_USER, password=password, dbname=database,
                         connect_timeout=str(connect_timeout_s), **DEAD_SERVER_PARAMS, **tls.params())

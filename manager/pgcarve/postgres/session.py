"""Logging in to a guest's PostgreSQL as pgcarve: who, which database, over which TLS, how long
to wait.

Role names are fixed: the admin and replication roles are made in the image, the application
role and its database on a primary's first boot; only their passwords vary (the admin's per
fleet, the others' per instance). pgcarve's own sessions log in to MANAGER_DATABASE (made in the
image), so what they do is never counted as the clients' work (see control/collector.py);
clients use the other databases. Every session verifies the guest's certificate (ClientTls).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import psycopg
from psycopg.conninfo import make_conninfo

ADMIN_USER = "pgcarve"
REPLICATION_USER = "replicator"
MANAGER_DATABASE = "pgcarve"
CLIENT_DATABASE = "postgres"
# Each instance's application login and the database it owns (CloudNativePG's convention).
APP_USER = "app"
APP_DATABASE = "app"
APPLICATION_NAME = "pgcarve-manager"

# How a client (the manager's sessions, the endpoints handed to applications) notices that its
# server died (the guest killed, the host lost). Without these, a session waiting for a reply
# from a dead peer waits for the kernel's defaults, two hours of keepalive silence or about
# fifteen minutes of retransmits, before libpq reports an error and the client can reconnect to
# the new primary. With them, TCP probes an idle connection after 10 s (every 5 s, 3 times) and
# gives up on unacknowledged data after 30 s. A commit waiting for a synchronous standby is not
# cut short by them: the server's kernel still answers the probes.
DEAD_SERVER_PARAMS = {"keepalives": "1", "keepalives_idle": "10", "keepalives_interval": "5",
                      "keepalives_count": "3", "tcp_user_timeout": "30000"}

Connection = psycopg.Connection[tuple[Any, ...]]
SslMode = Literal["verify-ca", "verify-full"]


@dataclass(frozen=True)
class ClientTls:
    """TLS for a client of a guest: the fleet CA's certificate file, and how strictly to verify."""

    root_cert: str
    mode: SslMode = "verify-ca"

    def params(self) -> dict[str, str]:
        """libpq connection parameters."""
        return {"sslmode": self.mode, "sslrootcert": self.root_cert}

    def environment(self) -> dict[str, str]:
        """The same as libpq environment variables, for tools given no conninfo (pgbench)."""
        return {"PGSSLMODE": self.mode, "PGSSLROOTCERT": self.root_cert}


def connect(host: str, port: int, password: str, database: str = MANAGER_DATABASE,
            timeout_s: float = 5.0, *, tls: ClientTls) -> Connection:
    """An autocommit admin session over TLS; ``database`` selects a client database to act in.

    A guest from an image older than the manager database has none: pgcarve's work then runs in
    CLIENT_DATABASE (and counts as clients' there) rather than failing.
    """

    def open_session(dbname: str) -> Connection:
        return psycopg.connect(make_conninfo(**DEAD_SERVER_PARAMS), host=host, port=port, user=ADMIN_USER,
                               password=password, dbname=dbname, connect_timeout=int(max(1, timeout_s)),
                               autocommit=True, application_name=APPLICATION_NAME,
                               sslmode=tls.mode, sslrootcert=tls.root_cert)

    try:
        return open_session(database)
    except psycopg.errors.InvalidCatalogName:
        if database != MANAGER_DATABASE:
            raise
        return open_session(CLIENT_DATABASE)


def first_line(exc: BaseException) -> str:
    """The first line of a driver error, for messages an operator reads."""
    text = str(exc).strip()
    return text.splitlines()[0].strip() if text else type(exc).__name__

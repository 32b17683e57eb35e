"""Logging in to a guest's PostgreSQL as pgcarve: who, which database, how long to wait.

Role names are fixed in the image (created at build time); only their passwords vary per fleet.
pgcarve's own sessions log in to MANAGER_DATABASE (made in the image), so what they do is never
counted as the clients' work (see control/collector.py); clients use the other databases.
"""

from __future__ import annotations

from typing import Any

import psycopg

ADMIN_USER = "pgcarve"
REPLICATION_USER = "replicator"
MANAGER_DATABASE = "pgcarve"
CLIENT_DATABASE = "postgres"
APPLICATION_NAME = "pgcarve-manager"

Connection = psycopg.Connection[tuple[Any, ...]]


def connect(host: str, port: int, password: str, database: str = MANAGER_DATABASE,
            timeout_s: float = 5.0) -> Connection:
    """An autocommit admin session; ``database`` selects a client database to act in.

    A guest from an image older than the manager database has none: pgcarve's work then runs in
    CLIENT_DATABASE (and counts as clients' there) rather than failing.
    """

    def open_session(dbname: str) -> Connection:
        return psycopg.connect(host=host, port=port, user=ADMIN_USER, password=password, dbname=dbname,
                               connect_timeout=int(max(1, timeout_s)), autocommit=True,
                               application_name=APPLICATION_NAME)

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

"""The session-wide guard in tests/conftest.py: tests reach loopback only, never the real network."""

from __future__ import annotations

import socket

import psycopg
import pytest

from tests.conftest import OffMachineTraffic


def test_the_guard_refuses_the_real_network() -> None:
    """libvirt's test driver lists guests at 192.168.122.x: following one must fail at once."""
    for host in ("192.168.122.23", "10.77.0.5", "8.8.8.8"):
        with pytest.raises(OffMachineTraffic):
            psycopg.connect(host=host, port=5432, connect_timeout=1)
        with pytest.raises(OffMachineTraffic), socket.socket() as sock:
            sock.connect((host, 5432))
    with pytest.raises(OffMachineTraffic):
        psycopg.connect(f"postgresql://u@127.0.0.1:1,{'10.0.0.1'}:2/db")


def test_the_collector_path_is_guarded_too() -> None:
    import asyncio

    with pytest.raises(OffMachineTraffic):
        asyncio.run(psycopg.AsyncConnection.connect("host=192.168.122.43 port=5432 connect_timeout=1"))
    with pytest.raises(psycopg.OperationalError):  # loopback is allowed (nothing listens on port 1)
        psycopg.connect(host="127.0.0.1", port=1, connect_timeout=1)


def test_a_name_to_verify_is_not_where_libpq_connects() -> None:
    """With hostaddr, libpq connects to hostaddr and only checks the certificate against host
    (sslmode=verify-full): hostaddr is what the guard looks at."""
    with pytest.raises(psycopg.OperationalError):  # loopback: allowed (nothing listens on port 1)
        psycopg.connect(host="pgc-01", hostaddr="127.0.0.1", port=1, connect_timeout=1)
    with pytest.raises(OffMachineTraffic):
        psycopg.connect(host="localhost", hostaddr="10.77.0.5", port=5432, connect_timeout=1)
    with pytest.raises(OffMachineTraffic):
        psycopg.connect(host="db1.example.com", port=5432, connect_timeout=1)

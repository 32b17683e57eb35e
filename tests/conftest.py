"""Shared test configuration, and a guard that keeps every test's traffic on this machine."""

import ipaddress
import os
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

# Fixtures shared by test modules in several directories; the per-module clock of `make test`.
pytest_plugins = ["tests.support.guest_script", "tests.support.timing"]

# The order test modules run in, decided here rather than by file names: the fast tests first (a
# typo fails within minutes), and the modules that boot guests in the order their fleets are
# shared. test_carve.py boots the shared 3-host sandbox and leaves pgc-01 and pgc-02 in it;
# test_etcd.py checks the sandbox's etcd (from a guest too) and leaves it as it was;
# test_connect.py uses both and purges pgc-02; test_faults.py and test_host_failures.py play their
# faults on pgc-01; the sandbox stops after its last user, then the ssh and Terraform sandboxes
# boot their own guests. A new module runs after the listed ones of its directory, so adding a
# file never moves a fleet.
DIRECTORY_ORDER = ("unit", "integration", "browser", "monitoring")
FLEET_ORDER = ("test_carve.py", "test_etcd.py", "test_connect.py", "test_faults.py", "test_host_failures.py",
               "test_remote_hosts.py", "test_terraform.py")


def module_rank(nodeid: str) -> tuple[int, int, str]:
    """Where a test module runs: by directory, then the fleet order, then its name."""
    path = nodeid.split("::", 1)[0]
    parts = path.split("/")
    directory = parts[1] if len(parts) > 2 else ""
    name = parts[-1]
    directory_rank = DIRECTORY_ORDER.index(directory) if directory in DIRECTORY_ORDER else len(DIRECTORY_ORDER)
    fleet_rank = FLEET_ORDER.index(name) if directory == "integration" and name in FLEET_ORDER else len(FLEET_ORDER)
    return directory_rank, fleet_rank, path


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    # A stable sort: tests within a module keep their file order.
    items.sort(key=lambda item: module_rank(item.nodeid))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--regenerate-output", action="store_true", default=False,
                     help="rewrite golden files under tests/data/ instead of comparing against them")


@pytest.fixture
def regenerate(request: pytest.FixtureRequest) -> bool:
    return bool(request.config.getoption("--regenerate-output"))


def image_dir() -> Path:
    return Path(os.environ.get("PGCARVE_IMAGE_DIR", "/var/lib/pgcarve/image"))


class OffMachineTraffic(AssertionError):
    """A test tried to reach an address that is not this machine's loopback."""


def _netns_id(path: str) -> tuple[int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino


MACHINE_NETNS = _netns_id("/proc/self/ns/net")  # the test process's namespace at start


def _in_a_sandbox_namespace() -> bool:
    """This thread has joined a network namespace a sandbox created (/run/netns/pgc-*): a
    writer acting from the ssh sandbox's manager namespace. Its addresses exist only there."""
    here = _netns_id("/proc/thread-self/ns/net")
    if here == MACHINE_NETNS:
        return False
    return any(_netns_id(str(ns)) == here for ns in Path("/run/netns").glob("pgc-*"))


def _refuse_off_machine(host: object, what: str) -> None:
    """Allow loopback and unix sockets only (or any address from a thread inside a sandbox's own
    namespace): libvirt's test driver hands out 192.168.122.x addresses, and a test that
    followed one would send traffic to the real network."""
    if host is None or host == "" or (isinstance(host, str) and (host.startswith("/") or host == "localhost")):
        return
    try:
        address = ipaddress.ip_address(str(host).split("%")[0])
    except ValueError:
        raise OffMachineTraffic(f"{what} to {host!r}: tests may only reach 127.0.0.1 or unix sockets") from None
    if not address.is_loopback and not _in_a_sandbox_namespace():
        raise OffMachineTraffic(f"{what} to {address}: tests may only reach loopback addresses")


@pytest.fixture(autouse=True, scope="session")
def traffic_stays_on_this_machine() -> Iterator[None]:
    """Every socket and libpq connection the test process opens goes to loopback (or a unix
    socket); anything else fails the test before a packet leaves. Subprocesses (the API server,
    forwards into the sandbox's namespaces) are not covered: they reach guests only by loopback
    forwards or from inside the sandbox."""
    mp = pytest.MonkeyPatch()
    real_connect = socket.socket.connect
    real_connect_ex = socket.socket.connect_ex

    def checked(sock: socket.socket, address: Any) -> None:
        if sock.family in (socket.AF_INET, socket.AF_INET6):
            _refuse_off_machine(address[0], "a socket connection")

    def connect(self: socket.socket, address: Any) -> None:
        checked(self, address)
        real_connect(self, address)

    def connect_ex(self: socket.socket, address: Any) -> int:
        checked(self, address)
        return real_connect_ex(self, address)

    def libpq_hosts(conninfo: str, kwargs: dict[str, Any]) -> None:
        params = {**conninfo_to_dict(conninfo), **kwargs}
        # With hostaddr, libpq connects there and uses host only as the name to verify (verify-full).
        key = "hostaddr" if params.get("hostaddr") else "host"
        for host in str(params.get(key) or "").split(","):
            _refuse_off_machine(host.strip() or None, "a PostgreSQL connection")

    real_sync = psycopg.Connection.connect.__func__  # type: ignore[attr-defined]
    real_async = psycopg.AsyncConnection.connect.__func__  # type: ignore[attr-defined]

    def sync_connect(cls: Any, conninfo: str = "", **kwargs: Any) -> Any:
        libpq_hosts(conninfo, kwargs)
        return real_sync(cls, conninfo, **kwargs)

    async def async_connect(cls: Any, conninfo: str = "", **kwargs: Any) -> Any:
        libpq_hosts(conninfo, kwargs)
        return await real_async(cls, conninfo, **kwargs)

    mp.setattr(socket.socket, "connect", connect)
    mp.setattr(socket.socket, "connect_ex", connect_ex)
    mp.setattr(psycopg.Connection, "connect", classmethod(sync_connect))
    mp.setattr(psycopg.AsyncConnection, "connect", classmethod(async_connect))
    mp.setattr(psycopg, "connect", psycopg.Connection.connect)  # the module's alias, bound at import
    try:
        yield
    finally:
        mp.undo()


# CI sees only the log of `make test`, and a run stopped at its time limit prints no summary:
# each slow test's time, and each failure in full, go to the log as soon as they are known.
SLOW_TEST_S = 60.0


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    reporter = item.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is None:
        return
    if report.failed:
        reporter.write_line("")
        reporter.write_line(f"{time.strftime('%H:%M:%S')} FAILED {report.nodeid} ({report.when}, "
                            f"{report.duration:.0f} s):", red=True)
        reporter.write_line(report.longreprtext)
    elif report.when == "call" and report.duration >= SLOW_TEST_S:
        reporter.write_line("")
        reporter.write_line(f"{time.strftime('%H:%M:%S')} {report.nodeid}: {report.outcome} in {report.duration:.0f} s")

"""One 3-host sandbox, booted once and shared by the carve tests (booting under TCG is slow).

The fixture starts the sandbox and the real API server (`pgcarve serve`, a subprocess) in a
state directory of its own, so it never touches a running `make demo`.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pgcarve.config import FleetConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import remove_instance
from pgcarve.control.retired import retired_instances
from pgcarve.control.retirement import purge
from pgcarve.processes import ProcessStatus, check, stop_pid
from pgcarve.sandbox.hosts import Sandbox
from pgcarve.settings import Paths

from tests.conftest import image_dir

IT_STATE = Path(os.environ.get("PGCARVE_IT_STATE", "/var/tmp/pgcarve-it"))
# The guests' consoles and the daemons' logs of each shared sandbox, kept after its teardown.
SANDBOX_LOGS = Path(__file__).resolve().parents[1] / "output" / "sandbox-logs"
TOKEN = "integration-test-token-" + "x" * 16


def start_server(port: int, hosts_file: Path | None = None, extra_env: dict[str, str] | None = None,
                 state_dir: Path = IT_STATE) -> subprocess.Popen[bytes]:
    """`pgcarve serve` as a subprocess of its own session, logging to server.log in `state_dir`;
    returns once /healthz answers."""
    env_vars = dict(os.environ, PGCARVE_STATE_DIR=str(state_dir), PGCARVE_IMAGE_DIR=str(image_dir()),
                    PGCARVE_TOKEN=TOKEN)
    # Under TCG on a loaded 2-core machine a guest can take minutes to boot.
    env_vars.setdefault("PGCARVE_BOOT_TIMEOUT", "1200")
    if hosts_file is not None:
        env_vars["PGCARVE_HOSTS_FILE"] = str(hosts_file)
    env_vars.update(extra_env or {})
    with (state_dir / "server.log").open("ab") as log:
        server = subprocess.Popen([sys.executable, "-m", "pgcarve.cli", "serve", "--port", str(port)],
                                  env=env_vars, stdout=log, stderr=log, start_new_session=True)
    deadline = time.monotonic() + 60
    while True:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        if server.poll() is not None:
            raise AssertionError(f"API server exited: see {state_dir / 'server.log'}")
        if time.monotonic() > deadline:
            stop_pid(server.pid, timeout_s=20)
            raise AssertionError("API server did not start in 60 s")
        time.sleep(0.2)


@dataclass
class CarveEnv:
    paths: Paths
    config: FleetConfig  # the series' hosts file: the sandbox's, with the short repair timers below
    sandbox: Sandbox
    url: str
    server: subprocess.Popen[bytes]
    hosts_file: Path

    def client(self, token: str | None = TOKEN) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, headers=headers, timeout=30)

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    def restart_server(self, kill: bool = False, hosts_file: Path | None = None,
                       extra_env: dict[str, str] | None = None) -> None:
        """Stop the API server (SIGKILL if `kill`, else SIGTERM and wait; nothing if it exited)
        and start it again, with `hosts_file` (else the series' own) and `extra_env` if given."""
        if self.server.poll() is None:
            if kill:
                os.kill(self.server.pid, 9)
                self.server.wait(timeout=30)
            else:
                stop_pid(self.server.pid, timeout_s=30)
        self.server = start_server(self.port, hosts_file or self.hosts_file, extra_env, self.paths.state_dir)

    def teardown(self, keep_logs: Path | None = None) -> list[str]:
        """Stop the server, remove every guest, stop the sandbox; what is left (should be []).
        With `keep_logs`, the guests' consoles and libvirt's and etcd's logs are copied there
        first (before the guests are removed), for whoever reads a failure afterwards."""
        if keep_logs is not None and self.sandbox.is_up():
            shutil.rmtree(keep_logs, ignore_errors=True)
            self.sandbox.copy_logs(keep_logs)
        if self.server.poll() is None:
            stop_pid(self.server.pid, timeout_s=20)
        if self.sandbox.is_up():
            fleet = Fleet(self.config, self.paths)
            for inst in fleet.observe(with_endpoints=False):
                remove_instance(fleet, inst)
            for retired in retired_instances(fleet):
                purge(fleet, retired.name)
            fleet.close()
        self.sandbox.down()
        return self.sandbox.leftovers()


def wait_for(predicate: Any, what: str, timeout_s: float = 300) -> Any:
    """Poll `predicate` until it returns something true; that value, or AssertionError."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.5)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_operation(env: CarveEnv, op_id: str, timeout_s: float = 1500) -> dict[str, object]:
    deadline = time.monotonic() + timeout_s
    with env.client() as client:
        while time.monotonic() < deadline:
            op = client.get(f"/v1/operations/{op_id}").json()
            if op["status"] in ("succeeded", "failed"):
                return dict(op)
            time.sleep(1)
    raise AssertionError(f"operation {op_id} did not finish in {timeout_s} s")


def clean_sandbox(state_dir: Path) -> tuple[Paths, Sandbox]:
    """The paths and sandbox of a test state directory, with whatever a crashed earlier run left
    there stopped; skips without root, fails without the guest image."""
    if os.geteuid() != 0:
        pytest.skip("integration tests need root (network namespaces, libvirtd)")
    if not (image_dir() / "image.tag").exists():
        pytest.fail(f"no guest image in {image_dir()}: run `make image` first (make test does)")
    paths = Paths(state_dir, image_dir())
    sandbox = Sandbox(paths.sandbox_dir)
    sandbox.down()
    left = sandbox.leftovers()
    assert left == [], f"an earlier run's sandbox in {state_dir} could not be stopped: {left}"
    # Test state is per run: an earlier run's server.log, synchronous-set records, journal,
    # secrets or failpoint markers are never read by this one. Only the domain-type probe's
    # answer is kept (it is the machine's, not the run's).
    for entry in state_dir.iterdir() if state_dir.exists() else ():
        if entry.name == paths.probe_cache.name:
            continue
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    return paths, sandbox


# How to stop the shared sandbox, while it runs: called after the last test that uses it, so its
# guests take no CPU from the sandboxes and guests of the tests after it.
_STOP_CARVE_ENV: list[Callable[[], None]] = []


# The series' repair timers (hosts file, recovery.*): the manager looks over its guests and
# retries a failed repair sooner than the production defaults (15 s, 30 s, 60 s), so that a test
# waits for the repair itself rather than for the next sweep. The decisions are the same.
SERIES_TIMERS = {"sweep_interval_s": 5, "retry_after_s": 10, "refollow_grace_s": 30}


# Who decides roles in the shared series: the hosts file's default (the manager's HA loop), or
# Patroni for its fault series (`make test-patroni` sets PGCARVE_IT_ROLES=patroni).
SERIES_ROLES = os.environ.get("PGCARVE_IT_ROLES")


def series_config(sandbox_config: FleetConfig) -> FleetConfig:
    raw = sandbox_config.model_dump(mode="json")
    raw["recovery"].update(SERIES_TIMERS)
    if SERIES_ROLES:
        raw["replication"]["roles"] = SERIES_ROLES
    return FleetConfig.model_validate(raw)


@pytest.fixture(scope="session")
def carve_env() -> Iterator[CarveEnv]:
    paths, sandbox = clean_sandbox(IT_STATE)
    config = series_config(sandbox.up(3))
    hosts_file = IT_STATE / "hosts-series.yaml"
    hosts_file.write_text(yaml.safe_dump(config.model_dump(mode="json")))
    port = free_port()
    try:
        server = start_server(port, hosts_file)
    except BaseException:
        sandbox.down()
        raise
    env = CarveEnv(paths=paths, config=config, sandbox=sandbox, url=f"http://127.0.0.1:{port}", server=server,
                   hosts_file=hosts_file)

    def stop() -> None:
        etcd = [r for m in sandbox.etcd.members() if (r := sandbox.etcd.running(m)) is not None]
        try:
            left = env.teardown(keep_logs=SANDBOX_LOGS / "series")
        finally:
            shutil.rmtree(IT_STATE / "sandbox", ignore_errors=True)
        # An error in teardown if any guest, daemon or namespace survived.
        assert left == [], f"integration teardown left: {json.dumps(left)}"
        assert etcd and not [r for r in etcd if check(r) is ProcessStatus.RUNNING], "an etcd member survived"
        out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
        assert sandbox.tag not in out, f"a namespace of sandbox {sandbox.tag} survived: {out}"

    _STOP_CARVE_ENV.append(stop)
    try:
        yield env
    finally:
        while _STOP_CARVE_ENV:  # not stopped after its last test (the session was cut short)
            _STOP_CARVE_ENV.pop()()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    """After the last test of the session that uses carve_env, stop it then, not at the end."""
    yield
    if not _STOP_CARVE_ENV or "carve_env" not in getattr(item, "fixturenames", ()):
        return
    items = item.session.items
    later = items[items.index(item) + 1:]
    if not any("carve_env" in getattr(i, "fixturenames", ()) for i in later):
        _STOP_CARVE_ENV.pop()()

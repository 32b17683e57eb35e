"""Several managers, one acting (issue 32, item 1), with real processes: `pgcarve server start`
run twice on one fleet whose hosts file names a real etcd on loopback (tests/support/local_etcd.py),
hosts on libvirt's test driver (no guest: the local lane). Each server has its own in-memory test
driver, so what is checked is the control plane: the lease, the 503 of a standby naming the leader,
the takeover after `kill -9` within the stated bound, a leader paused (SIGSTOP) past its lease that
acts on nothing when it resumes, and `pgcarve server stop` stopping every server it started.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from pgcarve.config import EtcdConfig
from pgcarve.control.leadership import TAKEOVER_BOUND_S
from pgcarve.processes import read_record

from tests.support.local_etcd import etcd_binary, local_etcd
from tests.support.localpg import free_ports

pytestmark = pytest.mark.skipif(etcd_binary() is None, reason="etcd is not installed (make deps installs it)")

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "two-managers-test-token-0123456789abcdef"
CLI = [sys.executable, "-m", "pgcarve.cli"]


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EtcdConfig]:
    with local_etcd(tmp_path_factory.mktemp("etcd")) as config:
        yield config


def fleet_of(tmp_path: Path) -> str:
    """A fleet name per test: the module's etcd serves both tests, and each needs its own key."""
    return "lm" + "".join(c for c in tmp_path.name.lower() if c.isalnum())[-8:]


def env_for(tmp_path: Path, etcd: EtcdConfig, state: str) -> dict[str, str]:
    hosts = tmp_path / "hosts.yaml"
    hosts.write_text(yaml.safe_dump({"replication": {"standbys": 0}, "fleet": fleet_of(tmp_path),
                                     "hosts": [{"name": "h1", "uri": "test:///default"}],
                                     "etcd": {**etcd.model_dump(), "manager_lease": True}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PGCARVE_")}
    env.update(PGCARVE_STATE_DIR=str(tmp_path / state), PGCARVE_HOSTS_FILE=str(hosts),
               PGCARVE_IMAGE_DIR=str(tmp_path / "no-image"), PGCARVE_COLLECT="0", PGCARVE_SUPERVISE="0",
               PGCARVE_TOKEN=TOKEN, PYTHONPATH=str(ROOT))
    return env


def cli(env: dict[str, str], *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout, check=False)


def start_server(env: dict[str, str], port: int) -> dict[str, Any]:
    started = cli(env, "server", "start", "--port", str(port))
    assert started.returncode == 0, started.stdout + started.stderr
    record = json.loads((Path(env["PGCARVE_STATE_DIR"]) / "servers").joinpath(f"{server_pid(env, port)}.json")
                        .read_text())
    return record


def server_pid(env: dict[str, str], port: int) -> int:
    for path in (Path(env["PGCARVE_STATE_DIR"]) / "servers").glob("*.json"):
        data = json.loads(path.read_text())
        if data.get("port") == port:
            return int(data["pid"])
    raise AssertionError(f"no server record for port {port}")


def health(url: str) -> dict[str, Any]:
    response = httpx.get(f"{url}/healthz", timeout=5)
    assert response.status_code == 200, response.text
    doc: dict[str, Any] = response.json()
    return doc


def scale(url: str, instances: int, timeout: float = 10) -> httpx.Response:
    return httpx.put(f"{url}/v1/scale", json={"instances": instances}, timeout=timeout,
                     headers={"Authorization": f"Bearer {TOKEN}"})


def wait_for(condition: Callable[[], bool], timeout_s: float, what: str) -> float:
    start = time.monotonic()
    while not condition():
        assert time.monotonic() - start < timeout_s, f"{what} did not happen within {timeout_s:.0f} s"
        time.sleep(0.1)
    return time.monotonic() - start


def nothing_listens(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def role(url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError):
        return str(health(url)["role"])
    return None


@contextlib.contextmanager
def stopping(envs: list[dict[str, str]]) -> Iterator[None]:
    """`pgcarve server stop` for each state directory afterwards, whatever happened."""
    try:
        yield
    finally:
        for env in envs:
            cli(env, "server", "stop", timeout=60)


def test_two_servers_on_one_state_directory_one_leader_and_a_takeover_after_kill(
        tmp_path: Path, etcd: EtcdConfig) -> None:
    env = env_for(tmp_path, etcd, "state")
    p1, p2 = free_ports(2)
    with stopping([env]):
        first = start_server(env, p1)
        wait_for(lambda: role(first["url"]) == "leader", 15, "the first server leading")
        second = start_server(env, p2)  # beside it, on the same state directory: a standby, not refused
        assert role(second["url"]) == "standby"
        standby = health(second["url"])
        assert standby["leadership"]["leader"]["url"] == first["url"] and standby["ha_loop"] == "off"
        assert health(first["url"])["leadership"]["epoch"] >= 1

        accepted = scale(first["url"], 1)
        assert accepted.status_code == 202, accepted.text
        refused = scale(second["url"], 1)
        assert refused.status_code == 503, refused.text
        assert first["url"] in refused.json()["detail"] and refused.headers["x-pgcarve-leader"] == first["url"]
        assert httpx.get(f"{second['url']}/v1/instances", timeout=5).status_code == 200  # reads are served
        up = cli(env, "up", "--instances", "1", timeout=60)  # one-shot commands still wait for no server
        assert up.returncode != 0, up.stdout

        # kill -9 the leader (the server this test started, by its PID): the standby takes over. On
        # one machine it sees that the process the key names is gone and does not wait for the
        # lease (on another machine it would: the paused leader's test below measures that path).
        epoch = health(first["url"])["leadership"]["epoch"]
        os.kill(int(first["pid"]), signal.SIGKILL)
        took = wait_for(lambda: role(second["url"]) == "leader", TAKEOVER_BOUND_S + 5, "the standby taking over")
        print(f"\ntakeover after kill -9 of the leader: {took:.1f} s (bound {TAKEOVER_BOUND_S:.1f} s)")
        assert took <= TAKEOVER_BOUND_S
        assert health(second["url"])["leadership"]["epoch"] == epoch + 1
        assert scale(second["url"], 1).status_code == 202

        stopped = cli(env, "server", "stop", timeout=60)
        assert f"stopped (pid {second['pid']}" in stopped.stdout, stopped.stdout + stopped.stderr
        assert f"pid {first['pid']}" not in stopped.stdout.split("stopped")[-1] or "not signalled" in stopped.stdout
    state = Path(env["PGCARVE_STATE_DIR"])
    assert not list((state / "servers").glob("*.json")) and not (state / "server.json").exists()
    assert read_record(state / "manager.lock")[0] is None  # shared holders write no description
    assert nothing_listens(p1) and nothing_listens(p2)


def test_a_paused_leader_acts_on_nothing_when_it_resumes(tmp_path: Path, etcd: EtcdConfig) -> None:
    """Two state directories (two machines' worth). The leader is stopped (SIGSTOP) past its lease;
    the other takes over; a scale sent to the old leader while it was stopped waits in its socket
    and is answered, after SIGCONT, with 503 naming the new leader: the first thing the old leader
    does after the pause is refused, before its campaign loop has noticed anything."""
    env_a, env_b = env_for(tmp_path, etcd, "state-a"), env_for(tmp_path, etcd, "state-b")
    pa, pb = free_ports(2)
    with stopping([env_a, env_b]):
        a = start_server(env_a, pa)
        wait_for(lambda: role(a["url"]) == "leader", 15, "a leading")
        b = start_server(env_b, pb)
        wait_for(lambda: health(b["url"])["leadership"].get("leader", {}).get("url") == a["url"], 10,
                 "b reading the leader")
        before = httpx.get(f"{a['url']}/v1/operations", timeout=5).json()

        os.kill(int(a["pid"]), signal.SIGSTOP)
        try:
            took = wait_for(lambda: role(b["url"]) == "leader", TAKEOVER_BOUND_S + 5, "b taking over")
            print(f"\ntakeover from a paused leader: {took:.1f} s (bound {TAKEOVER_BOUND_S:.1f} s)")
            assert took <= TAKEOVER_BOUND_S
            answer: list[httpx.Response] = []
            sender = threading.Thread(target=lambda: answer.append(scale(a["url"], 1, timeout=30)))
            sender.start()
            time.sleep(0.5)  # the request reaches a's socket (not a readiness wait: a cannot answer)
            assert not answer
        finally:
            os.kill(int(a["pid"]), signal.SIGCONT)
        sender.join(30)
        assert answer and answer[0].status_code == 503, answer[0].text if answer else "no answer"
        assert b["url"] in answer[0].json()["detail"]
        wait_for(lambda: role(a["url"]) == "standby", 10, "a reporting standby")
        after = health(a["url"])
        assert after["leadership"]["leader"]["url"] == b["url"]
        assert after["leadership"]["leader"]["epoch"] > 1 and after["leadership"]["epoch"] is None
        assert httpx.get(f"{a['url']}/v1/operations", timeout=5).json() == before  # it accepted nothing
        assert scale(b["url"], 1).status_code == 202

"""`pgcarve switchover`, `failover` and `incidents` against a real server on libvirt's test
driver: refusals say why and change nothing; a forced failover needs the instance's name again
before anything is sent. (Role changes that really happen: tests/integration/test_host_failures.py
runs `pgcarve switchover` under a writer, test_faults.py `pgcarve incidents` after a repair.)"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.localpg import free_ports
from tests.unit.test_api_hardening import _server_env

CLI = [sys.executable, "-m", "pgcarve.cli"]


@pytest.fixture(scope="module")
def server_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    tmp = tmp_path_factory.mktemp("cli-ha")
    env = _server_env(tmp)
    started = subprocess.run([*CLI, "server", "start", "--port", str(free_ports(1)[0])], env=env,
                             capture_output=True, text=True, timeout=90, check=False)
    assert started.returncode == 0, started.stderr
    yield env
    subprocess.run([*CLI, "server", "stop"], env=env, capture_output=True, text=True, timeout=60, check=False)


def run(env: dict[str, str], *args: str) -> tuple[int, str]:
    done = subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=60, check=False,
                          stdin=subprocess.DEVNULL)
    return done.returncode, " ".join((done.stdout + done.stderr).split())


def test_a_switchover_of_an_unknown_instance_is_refused(server_env: dict[str, str]) -> None:
    code, said = run(server_env, "switchover", "pgc-09")
    assert code == 1 and "switchover refused (404)" in said and "pgc-09" in said, said


def test_a_forced_failover_needs_the_name_again(server_env: dict[str, str]) -> None:
    code, said = run(server_env, "failover", "pgc-01", "--to", "pgc-01-s1", "--force")
    assert code == 2 and "nothing promoted" in said and "--confirm pgc-01" in said, said
    code, said = run(server_env, "failover", "pgc-01", "--to", "pgc-01-s1", "--force", "--confirm", "pgc-02")
    assert code == 2 and "nothing promoted" in said, said
    code, said = run(server_env, "failover", "pgc-01", "--to", "pgc-01-s1", "--force", "--confirm", "pgc-01")
    assert code == 1 and "failover refused (404)" in said, said  # confirmed: now the server answers


def test_incidents_lists_none_on_a_quiet_fleet(server_env: dict[str, str]) -> None:
    code, said = run(server_env, "incidents")
    assert code == 0 and said == "no incidents", said
    done = subprocess.run([*CLI, "incidents", "--json"], env=server_env, capture_output=True, text=True, timeout=60,
                          check=False)
    assert done.returncode == 0 and json.loads(done.stdout) == []


def test_without_a_server_the_commands_say_how_to_start_one(tmp_path: Path) -> None:
    env = _server_env(tmp_path)
    code, said = run(env, "incidents", "--url", f"http://127.0.0.1:{free_ports(1)[0]}")
    assert code == 1 and "no pgcarve API answers" in said and "pgcarve server start" in said, said

"""One acting manager per state directory (control/manager_lock.py): a second server, or `pgcarve
up` while a server runs, is refused naming the first and changes nothing; the lock goes with its
holder however the holder ends."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from pgcarve.control.manager_lock import ManagerLock
from pgcarve.errors import Conflict

from tests.support.localpg import free_ports
from tests.unit.test_api_hardening import _nothing_listens, _server_env

HOLD = "import sys, time; from pathlib import Path; from pgcarve.control.manager_lock import ManagerLock\n" \
       "ManagerLock(Path(sys.argv[1]), 'pgcarve serve').acquire(); print('held', flush=True); time.sleep(120)"


def test_a_second_holder_is_refused_naming_the_first(tmp_path: Path) -> None:
    first = ManagerLock(tmp_path, "pgcarve serve")
    first.acquire()
    first.note(url="http://127.0.0.1:8080")
    second = ManagerLock(tmp_path, "pgcarve up")
    with pytest.raises(Conflict) as refused:
        second.acquire()
    message = str(refused.value)
    assert "pgcarve serve (pid" in message and "http://127.0.0.1:8080" in message
    assert "pgcarve up did not start" in message
    assert json.loads((tmp_path / "manager.lock").read_text())["doing"] == "pgcarve serve"  # the refusal wrote nothing
    first.release()
    with second:
        assert json.loads((tmp_path / "manager.lock").read_text())["doing"] == "pgcarve up"


def test_the_lock_goes_with_a_killed_holder(tmp_path: Path) -> None:
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(Conflict, match=f"pid {holder.pid}"):
            ManagerLock(tmp_path, "pgcarve up").acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        with ManagerLock(tmp_path, "pgcarve up"):  # no stale file blocks anyone
            pass
    finally:
        holder.kill()
        holder.wait()


def test_a_second_server_on_one_state_directory_refuses_to_start(tmp_path: Path) -> None:
    """The bug an operator hit: `pgcarve serve --port 8081` beside a running server started a second
    HA loop. Now it exits with code 2 naming the first; nothing listens on its port, server.json
    still names the first, and `pgcarve up` is refused too; once the first stops, a server starts."""
    first_port, second_port = free_ports(2)
    env = _server_env(tmp_path)
    cli = [sys.executable, "-m", "pgcarve.cli"]
    started = subprocess.run([*cli, "server", "start", "--port", str(first_port)], env=env, capture_output=True,
                             text=True, timeout=90, check=False)
    try:
        assert started.returncode == 0, started.stderr
        first = json.loads((tmp_path / "state" / "server.json").read_text())
        second = subprocess.run([sys.executable, "-m", "pgcarve_api", "--port", str(second_port)], env=env,
                                capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 2, second.stderr
        refusal = " ".join(second.stderr.split())
        assert f"pgcarve serve (pid {first['pid']}, http://127.0.0.1:{first_port})" in refusal, refusal
        assert "Traceback" not in second.stderr and _nothing_listens(second_port)
        assert json.loads((tmp_path / "state" / "server.json").read_text())["pid"] == first["pid"]
        up = subprocess.run([*cli, "up", "--instances", "1"], env=env, capture_output=True, text=True, timeout=60,
                            check=False)
        assert up.returncode != 0 and "owns the fleet" in " ".join((up.stdout + up.stderr).split())
    finally:
        stopped = subprocess.run([*cli, "server", "stop"], env=env, capture_output=True, text=True, timeout=60,
                                 check=False)
    assert "stopped" in stopped.stdout, stopped.stdout + stopped.stderr
    again = subprocess.run([*cli, "server", "start", "--port", str(second_port)], env=env, capture_output=True,
                           text=True, timeout=90, check=False)
    subprocess.run([*cli, "server", "stop"], env=env, capture_output=True, text=True, timeout=60, check=False)
    assert again.returncode == 0, again.stderr

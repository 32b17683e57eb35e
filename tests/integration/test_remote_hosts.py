"""The sandbox as production runs it (`pgcarve sandbox up --transport ssh`): the manager in a
network namespace of its own reaches every host's libvirtd over `qemu+ssh://` (keys, host keys
checked) and every guest by its routed address (`reach: direct`, no forwards); its API is offered
on this machine's 127.0.0.1 through one forward.

In its own three-host sandbox (state in /var/tmp/pgcarve-it-ssh, or PGCARVE_IT_SSH_STATE):
known_hosts is enforced; `pgcarve doctor` connects to every host over ssh; a scale to one instance
through the API uploads the image over ssh and clones both standbys across hosts by address; the
collector counts a pgbench run; a writer through the rw endpoint while the primary's QEMU is
killed and the manager restarts it, with every acknowledged commit on the final primary; down
leaves nothing. Needs root, the sandbox's tools, openssh-server and the guest image.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg
import pytest
from pgcarve.config import load_fleet_config
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import remove_instance
from pgcarve.processes import stop_pid
from pgcarve.sandbox.faults import SandboxFaults
from pgcarve.sandbox.hosts import Sandbox
from pgcarve.sandbox.remote import SSHD
from pgcarve.settings import Paths
from psycopg.conninfo import make_conninfo

from tests.conftest import image_dir
from tests.integration.conftest import SANDBOX_LOGS, TOKEN, clean_sandbox, free_port, wait_for
from tests.integration.writer import AckedWriter, in_netns

pytestmark = pytest.mark.integration

STATE_DIR = Path(os.environ.get("PGCARVE_IT_SSH_STATE", "/var/tmp/pgcarve-it-ssh"))
INSTANCE = "pgc-01"


def log(message: str) -> None:
    print(f"[ssh] {message}", flush=True)


@dataclass
class Remote:
    paths: Paths
    sandbox: Sandbox
    port: int
    server: subprocess.Popen[bytes] | None = None

    def env(self) -> dict[str, str]:
        return dict(os.environ, PGCARVE_STATE_DIR=str(self.paths.state_dir), PGCARVE_IMAGE_DIR=str(image_dir()),
                    PGCARVE_TOKEN=TOKEN, PGCARVE_BOOT_TIMEOUT="1200")

    def in_manager(self, *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
        """A pgcarve command run in the manager's namespace, as `pgcarve sandbox exec` runs it."""
        command = self.sandbox.manager_command([sys.executable, "-m", "pgcarve.cli", *args])
        return subprocess.run(command, env=self.env(), capture_output=True, text=True, timeout=timeout_s, check=False)

    def start_server(self) -> None:
        with (self.paths.state_dir / "server.log").open("ab") as server_log:
            self.server = subprocess.Popen(
                self.sandbox.manager_command([sys.executable, "-m", "pgcarve.cli", "serve", "--port", str(self.port)]),
                env=self.env(), stdout=server_log, stderr=server_log, start_new_session=True)
        # One forward offers the namespace's API here, as `pgcarve sandbox publish` does.
        self.sandbox.forwards.publish("api", str(self.sandbox.manager.netns_path), f"127.0.0.1:{self.port}", self.port)

        def healthy() -> bool:
            assert self.server is not None and self.server.poll() is None, "the API server exited: see server.log"
            try:
                return httpx.get(f"http://127.0.0.1:{self.port}/healthz", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(healthy, "the API server in the manager namespace, through the published forward", 90)

    def api(self, path: str, method: str = "GET", body: Any = None) -> Any:
        response = httpx.request(method, f"http://127.0.0.1:{self.port}{path}", json=body, timeout=30,
                                 headers={"Authorization": f"Bearer {TOKEN}"})
        response.raise_for_status()
        return response.json()

    def teardown(self, keep_logs: Path) -> list[str]:
        if self.server is not None and self.server.poll() is None:
            stop_pid(self.server.pid, timeout_s=30)
        if self.sandbox.is_up():
            shutil.rmtree(keep_logs, ignore_errors=True)
            self.sandbox.copy_logs(keep_logs)
        if self.sandbox.is_up() and self.paths.sandbox_hosts_file.exists():
            fleet = Fleet(self.sandbox.backdoor(load_fleet_config(self.paths.sandbox_hosts_file)), self.paths)
            for inst in fleet.observe(with_endpoints=False):
                remove_instance(fleet, inst)
            fleet.close()
        self.sandbox.down()
        return self.sandbox.leftovers()


@pytest.fixture(scope="module")
def remote() -> Iterator[Remote]:
    paths, sandbox = clean_sandbox(STATE_DIR)
    if not SSHD.exists():
        pytest.fail(f"{SSHD} is missing: run `make deps` (installs openssh-server)")
    env = Remote(paths, sandbox, free_port())
    try:
        sandbox.up(3, transport="ssh")
        yield env
    finally:
        left = env.teardown(keep_logs=SANDBOX_LOGS / "remote")
    assert left == [], f"the ssh sandbox's teardown left: {json.dumps(left)}"
    namespaces = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True).stdout
    assert sandbox.tag not in namespaces, f"a namespace of sandbox {sandbox.tag} survived: {namespaces}"


def test_hosts_are_reached_over_ssh_with_their_host_keys_checked(remote: Remote) -> None:
    config = load_fleet_config(remote.paths.sandbox_hosts_file)
    for host in config.hosts:
        assert host.uri.startswith("qemu+ssh://root@10.76.0.") and "keyfile=" in host.uri, host.uri
        assert host.reach == "direct" and host.netns is None
    # This machine has no route to the sandbox: only the manager's namespace reaches the hosts.
    virsh = remote.sandbox.manager_command(["virsh", "-c", config.hosts[1].uri, "hostname"])
    assert subprocess.run(virsh, capture_output=True, text=True, check=False).returncode == 0
    # A host whose key is not the one on record is refused, not learnt.
    known_hosts = remote.sandbox.manager.etc_ssh / "ssh_known_hosts"
    genuine = known_hosts.read_text()
    h0_key = genuine.splitlines()[0].split(" ", 1)[1]
    known_hosts.write_text("".join(f"{line.split(' ', 1)[0]} {h0_key}\n" for line in genuine.splitlines()))
    try:
        refused = subprocess.run(virsh, capture_output=True, text=True, check=False)
    finally:
        known_hosts.write_text(genuine)
    assert refused.returncode != 0 and "Host key verification failed" in refused.stderr, refused.stderr
    # `pgcarve doctor` checks every host through the same transport.
    doctor = remote.in_manager("doctor")
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert doctor.stdout.count("connected to qemu+ssh://root@10.76.0.") == 3, doctor.stdout


def test_carve_replicate_collect_and_repair_over_ssh(remote: Remote) -> None:
    remote.start_server()
    started = time.monotonic()
    op = remote.api("/v1/scale", "PUT", {"instances": 1})["operation"]

    def finished() -> dict[str, Any] | None:
        doc = remote.api(f"/v1/operations/{op}")
        return doc if doc["status"] in ("succeeded", "failed") else None

    done = wait_for(finished, "a scale to one instance over ssh", 1500)
    assert done["status"] == "succeeded", done
    log(f"scale to 1 over ssh: {time.monotonic() - started:.0f} s")

    def whole() -> dict[str, Any] | None:
        doc = remote.api(f"/v1/instances/{INSTANCE}")
        live = [s for s in doc["standbys"] if s["state"] == "streaming"]
        synced = [s for s in live if s["sync_state"] == "sync"]
        return doc if doc["writes"] == "accepted" and len(live) == 2 and len(synced) == 1 else None

    doc = wait_for(whole, "pgc-01 writable with two standbys streaming, one synchronous", 300)
    assert doc["host"] == "h0" and {s["host"] for s in doc["standbys"]} == {"h1", "h2"}, doc
    # Guests are reached by their own addresses: the endpoints name them, and no forward runs to a
    # guest. (The API's is published here; the sandbox keeps its own to the etcd members, its way
    # in like the unix sockets, while the manager in its namespace reaches etcd on the wire.)
    rw_hosts = doc["endpoints"]["rw"].split("@", 1)[1].split("/", 1)[0].split(",")
    assert [h.rsplit(".", 1)[0] for h in rw_hosts] == ["10.77.0", "10.77.1", "10.77.2"], rw_hosts
    forwards = sorted(p.stem for p in remote.sandbox.forwards.directory.glob("*.json"))
    to_guests = [name for name in forwards if name not in ("api", "ports") and not name.startswith("etcd-")]
    assert "api" in forwards and to_guests == [], forwards

    # The collector counts what pgbench does.
    load = remote.in_manager("load", "--seconds", "8", "--clients", "2")
    assert load.returncode == 0, load.stdout + load.stderr
    log(next((line for line in load.stdout.splitlines() if line.startswith("API over the run")), load.stdout[-300:]))
    counted = remote.api("/v1/tps/history?seconds=120")[-1]["xacts_total"]
    assert counted > 0, "the collector counted no transaction of the pgbench run"

    # A fault under a writer: the primary's QEMU is killed, the manager restarts it.
    password = remote.api(f"/v1/instances/{INSTANCE}/credentials")["password"]
    uri = make_conninfo(doc["endpoints"]["rw"], password=password)
    netns = remote.sandbox.manager.netns_path
    writer = AckedWriter(lambda: uri, ca_file=remote.paths.tls_dir / "ca.pem", netns=netns)
    with writer:
        writer.wait_for_acks(50, 120, "writes before the fault")
        killed_at = time.time()
        SandboxFaults(remote.sandbox).kill_guest("h0", INSTANCE)

        def recovered() -> dict[str, Any] | None:
            return next((i for i in remote.api("/v1/incidents") if i["guest"] == INSTANCE
                         and i["detected_at"] >= killed_at - 1 and i["status"] == "recovered"), None)

        incident = wait_for(recovered, "the manager to restart pgc-01 over ssh", 600)
        assert incident["action"] == "restart", incident
        log(f"recovered {incident['finished_at'] - killed_at:.1f} s after the kill: {incident['message']}")
        wait_for(whole, "pgc-01 whole again", 600)
        writer.wait_for_acks(50, 300, "writes after the primary came back")

    def check() -> list[int]:
        with psycopg.connect(uri, connect_timeout=10, sslmode="verify-ca",
                             sslrootcert=str(remote.paths.tls_dir / "ca.pem")) as conn:
            return writer.missing(conn)

    missing = in_netns(netns, check)
    log(f"writer: {len(writer.acked)} commits acknowledged, {len(missing)} missing, {len(writer.errors)} failed tries")
    assert writer.acked and missing == [], f"acknowledged commits lost: {missing[:20]}"

"""The sandbox's production-like transport (`--transport ssh`), without starting anything:
the hosts file it writes, the manager's ssh client files, the way in for its own work, and the
refusals that change nothing. tests/integration/test_remote_hosts.py runs it for real."""

from __future__ import annotations

import socket
import subprocess
from pathlib import Path

import pytest
from pgcarve.config import FleetConfig
from pgcarve.errors import SandboxError
from pgcarve.sandbox import hosts as sandbox_hosts
from pgcarve.sandbox.etcd import plan_members
from pgcarve.sandbox.forward import ForwardRegistry
from pgcarve.sandbox.hosts import Sandbox
from pgcarve.sandbox.remote import ManagerSide, authorize, host_public_key, ssh_keygen, sshd_config


def ssh_sandbox(tmp_path: Path, hosts: int = 3) -> Sandbox:
    """A sandbox whose directories say it is up with the ssh transport (nothing runs)."""
    sandbox = Sandbox(tmp_path / "sandbox")
    for index in range(hosts):
        sandbox.host(index).directory.mkdir(parents=True)
    (sandbox.directory / "transport").write_text("ssh\n")
    return sandbox


def test_ssh_hosts_file_reaches_hosts_over_ssh_and_guests_directly(tmp_path: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sandbox_hosts, "machine_cores_per_socket", lambda: 2)
    sandbox = ssh_sandbox(tmp_path)
    config = sandbox.fleet_config(3)
    key = sandbox.manager.key
    assert [h.uri for h in config.hosts] == [f"qemu+ssh://root@10.76.0.{i}/system?keyfile={key}" for i in (1, 2, 3)]
    assert {(h.reach, h.netns) for h in config.hosts} == {("direct", None)}
    assert "10.76.0.0/24" in config.allowed_cidrs  # the manager logs in from 10.76.0.254
    assert sandbox.manager.address == "10.76.0.254"
    # The unix transport is what it always was.
    unix = Sandbox(tmp_path / "other").fleet_config(2)
    assert unix.hosts[0].uri.startswith("qemu+unix:///system?socket=") and unix.hosts[0].reach == "sandbox"


def test_backdoor_reaches_every_sandbox_host_through_its_socket(tmp_path: Path) -> None:
    sandbox = ssh_sandbox(tmp_path, hosts=2)
    config = sandbox.fleet_config(2)
    inside = sandbox.backdoor(config)
    for host, original in zip(inside.hosts, config.hosts, strict=True):
        ours = sandbox.host_named(host.name)
        assert (host.uri, host.reach, host.netns) == (ours.uri, "sandbox", ours.netns)
        assert (host.role, host.core_offset, host.pool) == (original.role, original.core_offset, original.pool)
    # A host the sandbox does not have is left as it is.
    foreign = config.hosts[0].model_copy(update={"name": "db9", "uri": "qemu+ssh://root@db9/system"})
    mixed = sandbox.backdoor(FleetConfig(**{**config.model_dump(), "hosts": [*config.hosts, foreign]}))
    assert mixed.hosts[-1].uri == "qemu+ssh://root@db9/system"



def test_backdoor_reaches_the_sandbox_etcd_through_its_forwards(tmp_path: Path) -> None:
    sandbox = ssh_sandbox(tmp_path, hosts=3)
    for member in plan_members(sandbox.etcd.root, sandbox.tag, [(h.name, h.netns, f"10.76.0.{h.index + 1}")
                                                                 for h in sandbox.hosts()]):
        member.directory.mkdir(parents=True)
        (member.directory / "member.json").write_text(member.to_json())
    config = sandbox.fleet_config(3)
    # The manager reaches the members on the wire, from its namespace.
    assert config.etcd is not None and config.etcd.endpoints[0] == "https://10.76.0.1:2379"
    inside = sandbox.backdoor(config).etcd
    assert inside is not None and inside.endpoints == sandbox.etcd.config(direct=False).endpoints
    assert all(url.startswith("https://127.0.0.1:") for url in inside.endpoints), inside.endpoints
    assert (inside.ca_file, inside.timeout_s) == (config.etcd.ca_file, config.etcd.timeout_s)
    # Another fleet's etcd is left as it is.
    foreign = config.etcd.model_copy(update={"endpoints": ["https://db9:2379"]})
    assert sandbox.backdoor(config.model_copy(update={"etcd": foreign})).etcd == foreign

def test_manager_commands_enter_its_namespace_only_with_ssh(tmp_path: Path) -> None:
    sandbox = ssh_sandbox(tmp_path)
    command = sandbox.manager_command(["pgcarve", "status"])
    assert command[:4] == ["ip", "netns", "exec", sandbox.manager.netns]
    assert command[-3:] == [str(sandbox.manager.etc_ssh), "pgcarve", "status"]
    (sandbox.directory / "transport").write_text("unix\n")
    assert sandbox.manager_command(["pgcarve", "status"]) == ["pgcarve", "status"]
    assert Sandbox(tmp_path / "never-up").transport == "unix"


def test_up_refuses_an_unknown_or_changed_transport_and_changes_nothing(tmp_path: Path) -> None:
    sandbox = ssh_sandbox(tmp_path, hosts=1)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    with pytest.raises(SandboxError, match="unknown sandbox transport 'tls': use one of unix, ssh"):
        sandbox.up(1, transport="tls")
    with pytest.raises(SandboxError, match="is up with transport ssh; run `pgcarve sandbox down` first"):
        sandbox.up(1, transport="unix")
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert (sandbox.directory / "transport").read_text() == "ssh\n"


def test_manager_client_refuses_hosts_it_does_not_know(tmp_path: Path) -> None:
    manager = ManagerSide("pgc-test-mgr", tmp_path / "manager", "10.76.0.254")
    host_dir = tmp_path / "h0"
    (host_dir / "pids").mkdir(parents=True)
    config = sshd_config(host_dir, "10.76.0.1").read_text()
    manager.write_client_files({"10.76.0.1": host_public_key(host_dir)})
    authorize(host_dir, manager.key)
    known = (manager.etc_ssh / "ssh_known_hosts").read_text()
    assert known == f"10.76.0.1 {host_public_key(host_dir)}\n" and known.startswith("10.76.0.1 ssh-ed25519 ")
    client = (manager.etc_ssh / "ssh_config").read_text()
    for line in ("StrictHostKeyChecking yes", "UserKnownHostsFile /dev/null", "BatchMode yes"):
        assert line in client
    for line in ("ListenAddress 10.76.0.1:22", "PermitRootLogin prohibit-password", "PasswordAuthentication no"):
        assert line in config
    authorized = (host_dir / "ssh" / "authorized_keys").read_text()
    assert authorized.split()[:2] == (manager.key.with_name("id_ed25519.pub").read_text().split()[:2])
    # Keys are made once: a second call keeps them (known_hosts stays true across restarts).
    first = host_public_key(host_dir)
    sshd_config(host_dir, "10.76.0.1")
    ssh_keygen(manager.key, "again")
    assert host_public_key(host_dir) == first
    mode = (host_dir / "ssh" / "ssh_host_ed25519_key").stat().st_mode & 0o777
    assert mode == 0o600


def test_publish_names_a_taken_port_and_leaves_no_forward(tmp_path: Path) -> None:
    registry = ForwardRegistry(tmp_path / "forwards")
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        with pytest.raises(SandboxError, match=f"127.0.0.1:{port} is taken by another program"):
            registry.publish("api", "/proc/self/ns/net", f"127.0.0.1:{port}", port)
    assert registry.get("api") is None


def test_exec_without_a_command_says_what_to_give(tmp_path: Path) -> None:
    proc = subprocess.run(["pgcarve", "sandbox", "exec", "--"], capture_output=True, text=True, check=False,
                          env={"PATH": str(Path(__file__).resolve().parents[2] / ".venv" / "bin") + ":/usr/bin:/bin",
                               "PGCARVE_STATE_DIR": str(tmp_path)})
    assert proc.returncode != 0
    assert "nothing to run: give a command after --" in proc.stdout + proc.stderr


def test_the_traffic_guard_still_refuses_real_addresses_from_this_namespace() -> None:
    """The test guard lets a thread that joined a sandbox namespace reach guests there, and
    nothing else: from the machine's own namespace a 10.x address is still refused."""
    import psycopg

    from tests.conftest import OffMachineTraffic
    with pytest.raises(OffMachineTraffic, match="tests may only reach loopback addresses"):
        psycopg.connect("host=10.77.0.10 port=5432 connect_timeout=1")

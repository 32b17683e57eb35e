"""The sandbox's backup repository host: an OpenSSH SFTP server alone in a namespace on the wire.

It stands for the repository host a real fleet names in its hosts file (`backup.repository`): off
every database host, reached by the guests over the wire through their host (as the etcd witnesses
are), storage on this machine's disk under the sandbox directory (`<sandbox>/repository/`), started
with the sandbox and stopped with it. SFTP rather than pgBackRest's own TLS server: the guests run
Debian 13's pgBackRest and this machine Debian 12's, and the tool's own protocol needs the same
version on both ends; SFTP ties nothing.

Logins: root by key only, forced into SFTP and chrooted (the repository, `<sandbox>/repository/storage`,
is `/repo` in there). The guests' key pair is the fleet's (made here, its public half
authorized); the server's host key goes into the hosts file, and the guests pin it.

sshd is recorded (PID, start time, boot) beside its files and stopped by that record only.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import time
from pathlib import Path

import pgcarve.processes as processes
from pgcarve.config import BackupConfig, BackupRepository
from pgcarve.errors import SandboxError
from pgcarve.processes import ProcessRecord
from pgcarve.sandbox.namespaces import (
    NETNS_DIR,
    adopt_daemon,
    netns_exists,
    run_checked,
    stop_namespace_processes,
)
from pgcarve.sandbox.remote import SSHD

ADDRESS = "10.76.0.250"  # on the sandbox wire (hosts are .1-.8, witnesses .241-.242, the manager .254)
PORT = 22
REPO_PATH = "/repo"  # inside the chroot (CHROOT)
MAX_HOSTS = 8  # as sandbox/hosts.py: every guest network the repository answers
READY_TIMEOUT_S = 10.0

CHROOT = "/mnt/pgcarve-repository"  # in sshd's own mount namespace only
# Runs inside `ip netns exec`, whose mount namespace is the command's own: sshd's chroot must be
# root's and writable by nobody else all the way up, which a state directory below /var/tmp is not,
# so a small tmpfs is the chroot and the storage on disk is bound into it.
_START = r"""
set -eu
sshd=$1 config=$2 storage=$3
mount -t tmpfs -o mode=0755,size=1m pgcarve-repository /mnt
mkdir -m 0755 /mnt/pgcarve-repository /mnt/pgcarve-repository/repo
mount --bind "$storage" /mnt/pgcarve-repository/repo
mkdir -p /run/sshd
exec "$sshd" -f "$config"
"""


def keygen_rsa(key: Path, comment: str) -> None:
    """An RSA key pair in PEM form at `key` and `key`.pub (kept if it exists): the form libssh2,
    which pgBackRest's SFTP client uses, reads with every crypto backend."""
    if key.exists():
        return
    key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    proc = subprocess.run(["ssh-keygen", "-q", "-t", "rsa", "-b", "3072", "-m", "PEM", "-N", "", "-C", comment,
                           "-f", str(key)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"ssh-keygen could not make {key}: {(proc.stderr or proc.stdout).strip()}")


def public_line(key: Path) -> str:
    return " ".join(key.with_name(key.name + ".pub").read_text().split()[:2])


class SandboxRepository:
    """The repository host of one sandbox (`<sandbox>/repository/`)."""

    def __init__(self, sandbox_dir: Path, tag: str, wire_netns: str):
        self.directory = sandbox_dir / "repository"
        self.netns = f"pgc-{tag}-repo"
        self.wire_netns = wire_netns

    @property
    def storage(self) -> Path:
        """Where the backups and archived WAL are, on this machine."""
        return self.directory / "storage"

    @property
    def host_key(self) -> Path:
        return self.directory / "ssh" / "ssh_host_rsa_key"

    @property
    def client_key(self) -> Path:
        """The fleet's key pair for the repository (the guests get it through their seeds)."""
        return self.directory / "client" / "id_repository"

    @property
    def record_file(self) -> Path:
        return self.directory / "sshd.json"

    def config(self) -> BackupConfig:
        """The hosts file's backup section for this repository (defaults for schedule and retention)."""
        return BackupConfig(repository=BackupRepository(
            host=ADDRESS, port=PORT, user="root", path=REPO_PATH, host_key=public_line(self.host_key),
            private_key_file=str(self.client_key)))

    def running(self) -> ProcessRecord | None:
        return processes.running_record(self.record_file)

    # -- up ------------------------------------------------------------------------------------

    def up(self) -> BackupConfig:
        """The repository host running (idempotent); its backup section."""
        if not SSHD.exists():
            raise SandboxError(f"the sandbox's backup repository needs {SSHD}: run `make deps` (openssh-server)")
        if self.running() is None:
            self._prepare()
            if not netns_exists(self.netns):
                self._namespace()
            self._start()
        return self.config()

    def _prepare(self) -> None:
        keygen_rsa(self.host_key, "pgcarve-sandbox-repository")
        keygen_rsa(self.client_key, "pgcarve-fleet-repository")
        ssh = self.host_key.parent
        (ssh / "authorized_keys").write_text(public_line(self.client_key) + " pgcarve-fleet-repository\n")
        self.storage.mkdir(parents=True, exist_ok=True, mode=0o750)
        (ssh / "sshd_config").write_text(
            "# pgcarve sandbox: the backup repository host. SFTP only, by key, chrooted.\n"
            f"ListenAddress {ADDRESS}:{PORT}\n"
            f"HostKey {self.host_key}\n"
            f"PidFile {self.directory / 'sshd.pid'}\n"
            f"AuthorizedKeysFile {ssh / 'authorized_keys'}\n"
            "PermitRootLogin prohibit-password\n"
            "PasswordAuthentication no\n"
            "KbdInteractiveAuthentication no\n"
            "UsePAM no\n"
            "StrictModes no\n"  # the state directory may sit below a world-writable one
            "X11Forwarding no\n"
            "AllowTcpForwarding no\n"
            "AllowAgentForwarding no\n"
            "PermitTunnel no\n"
            "PrintMotd no\n"
            "Subsystem sftp internal-sftp\n"
            f"ChrootDirectory {CHROOT}\n"
            "ForceCommand internal-sftp\n"
            # pgBackRest keeps one session per process for a whole backup.
            "ClientAliveInterval 15\n"
            "MaxStartups 30:50:100\n"
            "MaxSessions 30\n"
        )

    def _namespace(self) -> None:
        run_checked(["ip", "netns", "add", self.netns])
        run_checked(["ip", "-n", self.netns, "link", "set", "lo", "up"])
        run_checked(["ip", "-n", self.netns, "link", "add", "uplink", "type", "veth", "peer", "name", "wr",
                     "netns", self.wire_netns])
        run_checked(["ip", "-n", self.wire_netns, "link", "set", "wr", "master", "wire0", "up"])
        run_checked(["ip", "-n", self.netns, "addr", "add", f"{ADDRESS}/24", "dev", "uplink"])
        run_checked(["ip", "-n", self.netns, "link", "set", "uplink", "up"])
        # Guests on every host reach the repository through their host; answers go back that way.
        for index in range(MAX_HOSTS):
            run_checked(["ip", "-n", self.netns, "route", "add", f"10.77.{index}.0/24", "via", f"10.76.0.{index + 1}"])

    def _start(self) -> None:
        pid_file = self.directory / "sshd.pid"
        pid_file.unlink(missing_ok=True)
        self.record_file.unlink(missing_ok=True)
        reaper = self.directory / f"reaper-{time.time_ns()}.json"
        # sshd detaches itself; the reaper collects it (and its sessions) the moment they exit.
        run_checked([sys.executable, str(Path(__file__).with_name("reaper.py")), str(reaper),
                     "ip", "netns", "exec", self.netns, "sh", "-c", _START, "pgcarve-repository", str(SSHD),
                     str(self.host_key.parent / "sshd_config"), str(self.storage)])
        deadline = time.monotonic() + READY_TIMEOUT_S
        while self._adopt(pid_file) is None:
            if time.monotonic() > deadline:
                raise SandboxError(f"the backup repository's sshd did not start in namespace {self.netns} "
                                   f"(pid file {pid_file})")
            time.sleep(0.05)

    def _adopt(self, pid_file: Path) -> ProcessRecord | None:
        return adopt_daemon(pid_file, "sshd", NETNS_DIR / self.netns, self.record_file)

    # -- stopped and started (tests: a lost repository) --------------------------------------

    def stop(self) -> None:
        record = self.running()
        if record is not None:
            processes.stop(record)

    def start(self) -> None:
        if self.running() is None:
            if not netns_exists(self.netns):
                self._namespace()
            self._start()

    # -- down ----------------------------------------------------------------------------------

    def down(self) -> None:
        """sshd and its sessions stopped by PID, the namespace and every backup removed."""
        self.stop()
        for reaper_file in self.directory.glob("reaper-*.json"):
            reaper = processes.running_record(reaper_file)
            if reaper is not None:
                processes.stop(reaper)
        if netns_exists(self.netns):
            stop_namespace_processes(self.netns)
            run_checked(["ip", "netns", "del", self.netns], check=False)
        shutil.rmtree(self.directory, ignore_errors=True)

    def leftovers(self) -> list[str]:
        return ([f"namespace {self.netns}"] if netns_exists(self.netns) else []) + (
            [f"directory {self.directory}"] if self.directory.exists() else [])

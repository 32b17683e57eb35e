"""The sandbox as production runs: hosts reached over ssh, guests by their routed addresses.

`pgcarve sandbox up --transport ssh` gives each sandbox host an sshd on its wire address (its own
host key, root login by key only) and gives the manager a network namespace of its own on the
same wire, routed to every host's guest network. Whatever runs in there (`pgcarve sandbox exec
-- CMD`) sees the sandbox as a manager machine sees real hosts:

* libvirt through `qemu+ssh://root@10.76.0.N/system?keyfile=...`, with OpenSSH checking each
  host's key against the known-hosts file the sandbox wrote (StrictHostKeyChecking yes: an
  unknown or changed key is refused, never learnt);
* guests by their addresses (`reach: direct`), no forwards;
* the API served on that namespace's 127.0.0.1, offered on this machine's 127.0.0.1 by one
  forward (`pgcarve sandbox publish --port P`).

The manager namespace gets its own /etc/ssh (a bind mount made as each command enters it), so
the machine's ssh configuration and known hosts are neither read nor written.
"""

from __future__ import annotations

import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from pgcarve.errors import SandboxError

TRANSPORTS = ("unix", "ssh")
SSHD = Path("/usr/sbin/sshd")
SSH_PORT = 22

# Entering the manager namespace: `ip netns exec` makes a mount namespace of its own for the
# command, in which the sandbox's client configuration replaces /etc/ssh; then the command runs.
_ENTER_MANAGER = 'mount --bind "$0" /etc/ssh && exec "$@"'


def ssh_keygen(key: Path, comment: str) -> None:
    """An ed25519 key pair at `key` and `key`.pub (kept if it exists)."""
    if key.exists():
        return
    key.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    proc = subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", str(key)],
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"ssh-keygen could not make {key}: {(proc.stderr or proc.stdout).strip()}")


def public_key(key: Path) -> str:
    """The public half of `key` as one line: type and base64, without the comment."""
    return " ".join(key.with_name(key.name + ".pub").read_text().split()[:2])


@dataclass(frozen=True)
class ManagerSide:
    """The manager's namespace and its ssh client files, under the sandbox's directory."""

    netns: str
    directory: Path  # <sandbox>/manager
    address: str  # on the sandbox wire

    @property
    def netns_path(self) -> Path:
        return Path("/run/netns") / self.netns

    @property
    def etc_ssh(self) -> Path:
        return self.directory / "etc-ssh"

    @property
    def key(self) -> Path:
        return self.directory / "id_ed25519"

    def host_uri(self, address: str) -> str:
        return f"qemu+ssh://root@{address}/system?keyfile={self.key}"

    def ensure_key(self) -> None:
        """The manager's client key, which each host lets in (made once)."""
        ssh_keygen(self.key, "pgcarve-sandbox-manager")

    def write_client_files(self, host_keys: dict[str, str]) -> None:
        """The client key, and /etc/ssh for the namespace: known hosts (address -> host key)
        and a client configuration that refuses any host not in them."""
        self.ensure_key()
        self.etc_ssh.mkdir(parents=True, exist_ok=True, mode=0o755)
        (self.etc_ssh / "ssh_known_hosts").write_text(
            "".join(f"{address} {key}\n" for address, key in sorted(host_keys.items())))
        (self.etc_ssh / "ssh_config").write_text(
            "# pgcarve sandbox: the manager's ssh client. Host keys are in /etc/ssh/ssh_known_hosts,\n"
            "# written by `pgcarve sandbox up`; a host missing there or with another key is refused.\n"
            "Host *\n"
            "    StrictHostKeyChecking yes\n"
            "    UserKnownHostsFile /dev/null\n"
            "    BatchMode yes\n"
            "    ConnectTimeout 10\n"
            "    ServerAliveInterval 5\n"
            "    ServerAliveCountMax 3\n"
        )

    def command(self, args: list[str]) -> list[str]:
        """`args` as a command run inside the manager's namespace, with its /etc/ssh."""
        return ["ip", "netns", "exec", self.netns, "sh", "-c", _ENTER_MANAGER, str(self.etc_ssh), *args]


def sshd_config(host_dir: Path, address: str) -> Path:
    """The sandbox host's sshd configuration (host key made on first use); its path."""
    ssh_dir = host_dir / "ssh"
    ssh_keygen(ssh_dir / "ssh_host_ed25519_key", f"pgcarve-sandbox-{host_dir.name}")
    config = ssh_dir / "sshd_config"
    config.write_text(
        "# pgcarve sandbox host: root by key only, on the host's wire address.\n"
        f"ListenAddress {address}:{SSH_PORT}\n"
        f"HostKey {ssh_dir / 'ssh_host_ed25519_key'}\n"
        f"PidFile {host_dir / 'pids' / 'sshd.pid'}\n"
        f"AuthorizedKeysFile {ssh_dir / 'authorized_keys'}\n"
        "PermitRootLogin prohibit-password\n"
        "PasswordAuthentication no\n"
        "KbdInteractiveAuthentication no\n"
        "UsePAM no\n"
        # The keys live under the state directory, which may sit below /var/tmp (world-writable).
        "StrictModes no\n"
        "X11Forwarding no\n"
        "AllowTcpForwarding no\n"
        "PrintMotd no\n"
    )
    return config


def authorize(host_dir: Path, client_key: Path) -> None:
    (host_dir / "ssh" / "authorized_keys").write_text(public_key(client_key) + " pgcarve-sandbox-manager\n")


def host_public_key(host_dir: Path) -> str:
    return public_key(host_dir / "ssh" / "ssh_host_ed25519_key")


def wire_manager(manager: ManagerSide, wire_netns: str, routes: dict[str, str],
                 run: Callable[[list[str]], object]) -> None:
    """The manager's namespace on the wire (`manager.address`), routed to every host's guests."""
    if manager.netns_path.exists():
        return
    run(["ip", "netns", "add", manager.netns])
    run(["ip", "-n", manager.netns, "link", "set", "lo", "up"])
    run(["ip", "-n", manager.netns, "link", "add", "uplink", "type", "veth", "peer", "name", "wm",
         "netns", wire_netns])
    run(["ip", "-n", wire_netns, "link", "set", "wm", "master", "wire0", "up"])
    run(["ip", "-n", manager.netns, "addr", "add", f"{manager.address}/24", "dev", "uplink"])
    run(["ip", "-n", manager.netns, "link", "set", "uplink", "up"])
    for network, via in routes.items():  # each host's guest network, through that host
        run(["ip", "-n", manager.netns, "route", "add", network, "via", via])

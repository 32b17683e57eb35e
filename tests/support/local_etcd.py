"""A real single-member etcd on loopback for tests: TLS with client certificates from a CA made
here (as the sandbox's members run), its data in a temporary directory, stopped by its PID.

Used by the lease tests (tests/unit/test_lease.py) and the two-manager test
(tests/integration/test_managers_local.py): what they check is etcd's own behaviour (a lease
that lapses, a transaction that creates a key only if absent), which no fake would prove.
"""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

from pgcarve.config import EtcdConfig
from pgcarve.dcs.etcd import EtcdClient
from pgcarve.errors import DcsUnavailable
from pgcarve.guest.tls import issue_certificate, new_ca

from tests.support.localpg import free_ports

READY_TIMEOUT_S = 30.0


def etcd_binary() -> str | None:
    return shutil.which("etcd") or (str(Path("/usr/bin/etcd")) if Path("/usr/bin/etcd").exists() else None)


@contextlib.contextmanager
def local_etcd(directory: Path) -> Iterator[EtcdConfig]:
    """Start one etcd member on 127.0.0.1 (client port over TLS, client certificates required),
    yield the hosts file's etcd section that reaches it, and stop it by its PID afterwards."""
    binary = etcd_binary()
    if binary is None:
        raise RuntimeError("etcd is not installed (make deps installs Debian's etcd-server)")
    directory.mkdir(parents=True, exist_ok=True)
    ca = new_ca("pgcarve test etcd CA")
    member = issue_certificate(ca, common_name="etcd-test", ip_addresses=["127.0.0.1"], server=True, client=True)
    client = issue_certificate(ca, common_name="pgcarve-manager", server=False, client=True)
    files = {"ca.pem": ca.cert_pem, "member.pem": member.cert_pem, "member.key": member.key_pem,
             "client.pem": client.cert_pem, "client.key": client.key_pem}
    for name, data in files.items():
        (directory / name).write_bytes(data)
        (directory / name).chmod(0o600)
    client_port, peer_port = free_ports(2)
    client_url, peer_url = f"https://127.0.0.1:{client_port}", f"http://127.0.0.1:{peer_port}"
    args = [binary, "--name", "t0", "--data-dir", str(directory / "data"),
            "--listen-client-urls", client_url, "--advertise-client-urls", client_url,
            "--listen-peer-urls", peer_url, "--initial-advertise-peer-urls", peer_url,
            "--initial-cluster", f"t0={peer_url}", "--initial-cluster-state", "new",
            "--cert-file", str(directory / "member.pem"), "--key-file", str(directory / "member.key"),
            "--trusted-ca-file", str(directory / "ca.pem"), "--client-cert-auth",
            # A short heartbeat: lease expiry is checked by the leader, and a lone member is leader at once.
            "--heartbeat-interval", "100", "--election-timeout", "1000", "--logger", "zap", "--log-outputs", "stderr"]
    log = (directory / "etcd.log").open("wb")
    proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=log, stderr=log, start_new_session=True)
    config = EtcdConfig(endpoints=[client_url], ca_file=str(directory / "ca.pem"),
                        cert_file=str(directory / "client.pem"), key_file=str(directory / "client.key"))
    try:
        _wait_ready(config, proc, directory / "etcd.log")
        yield config
    finally:
        proc.terminate()  # by its PID: the process this function started
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        log.close()


def _wait_ready(config: EtcdConfig, proc: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    with EtcdClient(config, timeout_s=1.0) as client:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"etcd exited at start (code {proc.returncode}): {log.read_text()[-800:]}")
            try:
                if client.status(config.endpoints[0]).healthy:
                    return
            except DcsUnavailable:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"etcd did not become healthy within {READY_TIMEOUT_S:g} s: "
                                   f"{log.read_text()[-800:]}")
            time.sleep(0.1)

"""Commands run inside a guest through its QEMU guest agent (virtio-serial, no network).

Every guest has the agent's channel (virt/domain_xml.py) and the image runs qemu-guest-agent. The
manager uses it for what is neither SQL nor a file in the seed: the backup tool's commands. It
reaches a guest on any host libvirt reaches, whatever the network between them, and needs no
login or key of its own in the guest. The agent is asked to start the program (guest-exec) and
then, until it has exited, for its status (guest-exec-status), which carries its exit code and
output (base64).
"""

from __future__ import annotations

import base64
import json
import time
from collections.abc import Sequence
from dataclasses import dataclass

import libvirt
import libvirt_qemu

from pgcarve.errors import GuestCommandFailed, PgcarveError
from pgcarve.virt.host import LibvirtHost

AGENT_TIMEOUT_S = 10  # one request to the agent
POLL_S = 0.5  # between status requests while the program runs
RUN_AS = "/usr/sbin/runuser"


@dataclass(frozen=True)
class GuestCommandResult:
    exit_code: int
    stdout: str
    stderr: str


def _agent(host: LibvirtHost, name: str, command: dict[str, object],
           timeout_s: int = AGENT_TIMEOUT_S) -> dict[str, object]:
    result = _agent_answer(host, name, command, timeout_s)
    if not isinstance(result, dict):
        raise GuestCommandFailed(f"{name}: its guest agent answered {str(result)[:200]!r}")
    return result


def _agent_answer(host: LibvirtHost, name: str, command: dict[str, object], timeout_s: int) -> object:
    """What the agent returned for `command` (its "return" member)."""
    with host.translate(f"asking {name}'s guest agent"):
        dom = host.conn.lookupByName(name)
        try:
            answer = libvirt_qemu.qemuAgentCommand(dom, json.dumps(command), timeout_s, 0)
        except libvirt.libvirtError as exc:
            if exc.get_error_code() in (libvirt.VIR_ERR_AGENT_UNRESPONSIVE, libvirt.VIR_ERR_OPERATION_INVALID,
                                        libvirt.VIR_ERR_ARGUMENT_UNSUPPORTED):
                raise GuestCommandFailed(f"{name}: its guest agent does not answer ({exc.get_error_message()})"
                                         ) from None
            raise
    doc = json.loads(answer)
    if not isinstance(doc, dict) or "return" not in doc:
        raise GuestCommandFailed(f"{name}: its guest agent answered {answer[:200]!r}")
    return doc["return"]


def agent_answers(host: LibvirtHost, name: str) -> bool:
    """Does guest `name`'s agent answer a ping? (Then its kernel and systemd are up: the agent is
    a service of the guest's own.)"""
    try:
        _agent(host, name, {"execute": "guest-ping"}, timeout_s=2)
    except PgcarveError:
        return False
    return True


def guest_addresses(host: LibvirtHost, name: str) -> set[str]:
    """The IPv4 addresses guest `name` itself holds, as its agent says (empty when it does not
    answer): unlike a DHCP lease listed on its host, never a former guest's of the same name."""
    try:
        answer = _agent_answer(host, name, {"execute": "guest-network-get-interfaces"}, timeout_s=2)
    except PgcarveError:
        return set()
    interfaces = answer if isinstance(answer, list) else []
    return {str(a.get("ip-address")) for i in interfaces if isinstance(i, dict)
            for a in i.get("ip-addresses") or [] if isinstance(a, dict) and a.get("ip-address-type") == "ipv4"}


def run_in_guest(host: LibvirtHost, name: str, argv: Sequence[str], timeout_s: float,
                 user: str | None = None) -> GuestCommandResult:
    """Run `argv` in guest `name` on `host` (as `user`, through runuser, when given) and wait for
    it; GuestCommandFailed when it cannot start or has not exited after `timeout_s`."""
    path, args = (RUN_AS, ["-u", user, "--", *argv]) if user else (argv[0], list(argv[1:]))
    started = _agent(host, name, {"execute": "guest-exec",
                                  "arguments": {"path": path, "arg": args, "capture-output": True}})
    pid = started.get("pid")
    if not isinstance(pid, int):
        raise GuestCommandFailed(f"{name}: the guest agent did not start {argv[0]} (answer {started})")
    deadline = time.monotonic() + timeout_s
    while True:
        status = _agent(host, name, {"execute": "guest-exec-status", "arguments": {"pid": pid}})
        if status.get("exited"):
            break
        if time.monotonic() > deadline:
            raise GuestCommandFailed(f"{name}: {' '.join(argv[:3])} ... still running after {timeout_s:.0f} s")
        time.sleep(POLL_S)

    def text(key: str) -> str:
        raw = status.get(key)
        return base64.b64decode(raw).decode(errors="replace") if isinstance(raw, str) else ""

    code = status.get("exitcode")
    signal = status.get("signal")
    return GuestCommandResult(exit_code=code if isinstance(code, int) else 128 + (signal if isinstance(signal, int)
                                                                                  else 0),
                              stdout=text("out-data"), stderr=text("err-data"))

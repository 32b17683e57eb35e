"""A new guest's boot, followed stage by stage so that a stuck one is named and explained early.

A guest passes stages the manager can observe from outside: its system comes up (its guest agent
answers), it gets an address (a DHCP lease), and its PostgreSQL accepts the manager's login. Each
stage has a bound, set from boot times measured here (README, "Boot stages"), so a guest that
stopped early is found at its stage's bound rather than at the end of the whole boot timeout.
The console is read meanwhile: a kernel panic or systemd's emergency mode ends the wait at once,
and the last console lines go into the diagnosis.

The watch only says what it saw; whether a stuck guest is built again is the provisioner's call
(control/provisioning.py): only a guest that holds no data yet may be.
"""

from __future__ import annotations

import logging
import re
import time
from dataclasses import dataclass
from pathlib import Path

import psycopg

from pgcarve.config import HostConfig
from pgcarve.control.access import refresh_replication_access
from pgcarve.control.fleet import Fleet, Guest, Progress
from pgcarve.errors import CapacityError, GuestNotReady, GuestStuck, PgcarveError
from pgcarve.postgres import replication
from pgcarve.postgres.session import first_line
from pgcarve.virt.agent import agent_answers, guest_addresses
from pgcarve.virt.console import ConsoleTap
from pgcarve.virt.host import LibvirtHost

log = logging.getLogger(__name__)
REBUILDING = "building it again, once: "  # the step of a guest whose first boot got stuck (the API keeps it)
AGENT_EVERY_S = 2.0  # between pings of the guest agent while its system is not up yet

# The stages in boot order: (key, what reaching it means, what not reaching it means).
STAGES = (
    ("system", "its system is up (the guest agent answers)",
     "its kernel and systemd never came up (its guest agent never answered)"),
    ("address", "it holds an address", "it got no address (no DHCP lease)"),
    ("sql", "PostgreSQL accepts the manager's login", "PostgreSQL never accepted the manager's login"),
)

# Console lines that mean the boot will not go on by itself, and what they mean in words.
FATAL_CONSOLE = (
    (re.compile(r"Kernel panic - not syncing"), "its kernel panicked"),
    (re.compile(r"You are in emergency mode|Give root password for maintenance|Entering emergency mode"),
     "systemd stopped in emergency mode (a disk or file system did not come up)"),
)
SETUP_LINE = re.compile(r"pgcarve-guest-setup: (.+)$")
KERNEL_TIME = re.compile(r"^\s*\[\s*\d+\.\d+\]\s*")
# A kernel oops's registers, code bytes and stack frames: what an operator's message can do without.
KERNEL_DUMP = re.compile(r"^\s*\[\s*\d+\.\d+\]\s+(\?|R[A-Z0-9]{1,3}:|Code:|CR\d|DR\d|CS:|FS:|</?TASK>|[\w.]+\+0x)")


@dataclass(frozen=True)
class BootBounds:
    """How long each stage may take: the system from the domain's start, the address from the
    system's coming up (DHCP is one of the first things it does), PostgreSQL from the start."""

    system_s: float
    address_s: float
    sql_s: float


# Measured (README, "Boot stages"). Under emulation (QEMU TCG) on 2 cores, six guests booting side
# by side took 145-310 s to come up, so how long a system takes says little there: its bound is
# the boot timeout, and a kernel that dies says so on the console at once. Once up, a guest asks
# for its address at once: 0-32 s later under the same load. Under KVM a guest is up in seconds.
# Each bound is a few times the slowest seen, so a loaded host is not taken for a stuck guest.
TCG_BOUNDS = (600.0, 150.0)
KVM_BOUNDS = (60.0, 30.0)


def bounds_for(domain_type: str, sql_timeout_s: float) -> BootBounds:
    system_s, address_s = KVM_BOUNDS if domain_type == "kvm" else TCG_BOUNDS
    return BootBounds(min(system_s, sql_timeout_s), address_s, sql_timeout_s)


def fatal_in(console: str) -> str | None:
    """What in a console's text means the boot cannot go on, in words and in the console's own
    line (None: nothing of that kind)."""
    for pattern, meaning in FATAL_CONSOLE:
        if (found := pattern.search(console)) is not None:
            start = console.rfind("\n", 0, found.start()) + 1
            end = console.find("\n", found.end())
            line = KERNEL_TIME.sub("", console[start:end if end >= 0 else None]).strip(" -[]\t")
            return f"{meaning} (\"{line[:160]}\")"
    return None


def setup_step(console: str) -> str | None:
    """The last step the guest's own set-up printed on the console, if any."""
    steps = [m.group(1) for line in console.splitlines() if (m := SETUP_LINE.search(line))]
    return " ".join(steps[-1].split())[:200] if steps else None


Boot = tuple[float, ConsoleTap]
"""A guest's start (time.monotonic()) and its console, opened right after it started."""


def started(lv: LibvirtHost, name: str) -> Boot:
    """Guest `name`, started just now: its console opened before it prints anything of note."""
    return time.monotonic(), ConsoleTap(lv, name)


class BootWatch:
    """The boot of new guest `name` on `host`, started just now."""

    def __init__(self, lv: LibvirtHost, name: str, domain_type: str, sql_timeout_s: float,
                 console_dir: Path | None, boot: Boot | None = None) -> None:
        """`boot`: when the guest was started and its console opened then (else: both now)."""
        self.lv = lv
        self.name = name
        self.bounds = bounds_for(domain_type, sql_timeout_s)
        self.console_dir = console_dir
        self.started, self.console = boot if boot is not None else (time.monotonic(), ConsoleTap(lv, name))
        # A guest waited for only now (a new instance's standby, once its primary answers) has
        # the system bound from now: never less time than the boot timeout gave it before.
        self.waited = time.monotonic()
        self.reached: dict[str, float] = {}
        self._agent_asked = float("-inf")

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def check(self, address: str | None) -> str:
        """Take in what can be seen now; GuestStuck when the boot cannot go on or a stage is past
        its bound. Returns the stage being waited for, in words, for progress."""
        now = self.elapsed()
        self.console.drain()
        if "address" not in self.reached and time.monotonic() - self._agent_asked >= AGENT_EVERY_S:
            self._agent_asked = time.monotonic()
            if "system" not in self.reached and agent_answers(self.lv, self.name):
                self.reached["system"] = self.elapsed()
            # The guest's own word: a lease listed on its host may be a former guest's of the same name.
            if "system" in self.reached and address is not None and address in guest_addresses(self.lv, self.name):
                self.reached["address"] = self.elapsed()
        text = self.console.text()
        if (fatal := fatal_in(text)) is not None:
            raise self.stuck(fatal, said_by_console=True)
        waiting = self.waiting_for()
        if waiting == "system" and time.monotonic() - max(self.started, self.waited) > self.bounds.system_s:
            raise self.stuck(f"not within {self.bounds.system_s:.0f} s")
        if waiting == "address" and now > self.reached.get("system", now) + self.bounds.address_s:
            raise self.stuck(f"not within {self.bounds.address_s:.0f} s of its system coming up")
        step = setup_step(text) if "system" in self.reached else None
        return f"waiting until {self._meaning(waiting, 1)}" + (f" (set-up: {step})" if step else "")

    def waiting_for(self) -> str:
        """The first stage in boot order not reached yet, nor passed (PostgreSQL answering means
        the others were)."""
        keys = [key for key, _r, _n in STAGES]
        return next((key for i, key in enumerate(keys)
                     if key not in self.reached and not self.reached.keys() & set(keys[i + 1:])), "sql")

    def ready(self) -> None:
        """PostgreSQL answered: the boot is done; its stage times go to the log (README's figures)."""
        self.reached["sql"] = self.elapsed()
        log.info("%s booted: %s", self.name, ", ".join(f"{k} {v:.1f} s" for k, v in sorted(
            self.reached.items(), key=lambda kv: kv[1])))
        self.close()

    def stuck(self, why: str, said_by_console: bool = False) -> GuestStuck:
        """The error for a boot stopped at the stage it waits for, with the console's last lines,
        the console kept in the state directory. `said_by_console`: `why` is what the console
        said, which tells more than the stage not reached."""
        stage = self.waiting_for()
        self.console.drain()
        kept = ""
        if self.console_dir is not None:
            try:
                path = self.console.save(self.console_dir / f"{self.name}-{time.strftime('%Y%m%dT%H%M%S')}.log")
                kept = f"; its console is kept in {path}"
            except OSError as exc:
                kept = f"; its console could not be kept ({exc})"
        tail = [line for line in self.console.tail(100) if not KERNEL_DUMP.match(line)][-8:]
        lines = ("; last console lines: " + " | ".join(tail)) if tail else "; its console printed nothing"
        seen = ", ".join(f"{key} at {self.reached[key]:.0f} s" for key, _r, _n in STAGES if key in self.reached)
        message = (f"{self.name} on {self.lv.name}: boot stopped at stage '{stage}' after {self.elapsed():.0f} s: "
                   f"{why if said_by_console else self._meaning(stage, 2) + ', ' + why} "
                   f"(reached: {seen or 'nothing'}){lines}{kept}")
        self.close()
        return GuestStuck(message, stage)

    @staticmethod
    def _meaning(stage: str, column: int) -> str:
        return next(row[column] for row in STAGES if row[0] == stage)

    def close(self) -> None:
        self.console.close()


def wait_sql(fleet: Fleet, host: HostConfig, name: str, progress: Progress, standby: bool | None = False,
             boot: Boot | None = None) -> Guest:
    """Guest `name` once PostgreSQL in it accepts the manager's login (and, for a standby, is in
    recovery; `standby` None: in whichever role Patroni gives it), its boot watched meanwhile
    (from `boot` when the caller started it); GuestStuck (the stage, why, the console's last
    lines) when it does not come."""
    lv = fleet.hosts[host.name]
    watch = BootWatch(lv, name, fleet.domain_types.of(host.name), fleet.boot_timeout_s,
                      fleet.paths.state_dir / "consoles", boot)
    last_error = "no answer yet"
    # A standby replicates only once its instance's guests let its address in. Let in again if
    # the address changes: a guest re-created under an old name may first show the old
    # guest's DHCP lease (same MAC) until it gets its own.
    let_in: str | None = None
    # PostgreSQL's bound counts from this wait: a standby waited for only once its new primary
    # answers has been booting all that time, its PostgreSQL waiting for the primary.
    deadline = time.monotonic() + fleet.boot_timeout_s
    try:
        while time.monotonic() < deadline:
            info = lv.guest(name)
            if info.state == "paused":
                errors = lv.disk_errors(name)
                if "no space left" in errors.values():
                    raise CapacityError(
                        f"{name} on {host.name}: its disk ran out of space while booting (storage pool "
                        f"{lv.storage.pool_name} at {lv.storage.pool_path} is full); free space there or lower "
                        "instance.disk_gib"
                    )
                if errors:
                    raise GuestNotReady(f"{name} on {host.name} stopped on a disk error: {errors}")
            if info.state not in ("running", "paused"):
                raise watch.stuck(f"the domain stopped while booting (state {info.state})")
            guest = fleet.reach(info)
            waiting = watch.check(guest.address)
            if standby is not False and guest.address is not None and guest.address != let_in:
                try:
                    refresh_replication_access(fleet, info.metadata.index)
                    let_in = guest.address
                except PgcarveError as exc:
                    last_error = f"letting it replicate: {exc}"
            if guest.endpoint is not None:
                try:
                    with fleet.connect(guest, timeout_s=3) as conn:
                        if standby is None or replication.in_recovery(conn) == standby:
                            watch.ready()
                            return guest
                        last_error = "not in the expected role yet"
                except psycopg.Error as exc:
                    last_error = first_line(exc)
            progress(name, waiting, min(0.9, 0.25 + 0.65 * watch.elapsed() / 60))
            time.sleep(0.5)
        raise watch.stuck(f"not within {fleet.boot_timeout_s:.0f} s (last: {last_error})")
    finally:
        watch.close()

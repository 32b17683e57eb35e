"""`pgcarve doctor`'s etcd checks: every endpoint answers, the member list, each member's
health, a leader, a quorum, and at least three members.

`etcd_findings` asks (through dcs/etcd.py, the seam `probe`); `decide` is pure: the findings
from a ClusterHealth (dcs/health.py), so the rules are unit-tested without an etcd. An endpoint or
member down while the quorum holds is a warning (commits and failover go on; one more loss stops
them); no quorum, no leader, no member list or fewer than three members fail.
"""

from __future__ import annotations

from collections.abc import Callable

from pgcarve.config import EtcdConfig
from pgcarve.control.doctor_report import Finding, plural
from pgcarve.dcs.etcd import EtcdClient, Probe
from pgcarve.dcs.health import MIN_MEMBERS, ClusterHealth, assess
from pgcarve.errors import PgcarveError

ETCD = "(etcd)"  # the host column of etcd's findings
WHY_THREE = ("a cluster needs three members to lose one and keep a quorum (two members stop as soon as either "
             "stops); a fleet on two hosts needs a third, witness member on another machine (README, \"etcd on the "
             "hosts\")")


def probe_etcd(config: EtcdConfig) -> Probe:
    with EtcdClient(config) as client:
        return client.probe()


def etcd_findings(config: EtcdConfig | None, probe: Callable[[EtcdConfig], Probe] = probe_etcd) -> list[Finding]:
    """Every etcd finding for the hosts file's etcd section."""
    if config is None:
        # A warning while the guests do not use etcd yet; Patroni in the guests will need it.
        return [Finding(ETCD, "etcd", "warn", (
            "no etcd section in the hosts file: Patroni keeps each instance's leader key in etcd, so the fleet needs "
            f"one: add `etcd:` with the client URLs of {MIN_MEMBERS} or more members and the manager's TLS files "
            "(hosts.sample.yaml)"))]
    try:
        found = probe(config)
    except PgcarveError as exc:
        return [Finding(ETCD, "etcd", "fail", f"etcd cannot be asked: {exc}")]
    return decide(assess(found), config)


def decide(health: ClusterHealth, config: EtcdConfig) -> list[Finding]:
    """The findings for `health` (pure)."""
    findings = []
    quorum_kept = health.has_quorum
    for probe in health.unreachable:
        findings.append(Finding(ETCD, "endpoint", "warn" if quorum_kept else "fail", (
            f"etcd endpoint {probe.endpoint} does not answer: {probe.error}; check that the member there runs "
            "and that this machine reaches it with its client certificate")))
    answering = len(config.endpoints) - len(health.unreachable)
    if answering:
        findings.append(Finding(ETCD, "endpoint", "ok",
                                f"{answering} of {plural(len(config.endpoints), 'endpoint')} answer over TLS"))
    if not health.members_known:
        findings.append(Finding(ETCD, "members", "fail", (
            "no etcd endpoint gave the member list: etcd does not answer this machine at any endpoint the hosts file "
            "names; start the members, or fix etcd.endpoints and the TLS files")))
        return findings
    count = len(health.members)
    if count < MIN_MEMBERS:
        names = ", ".join(m.name for m in health.members) or "none"
        findings.append(Finding(ETCD, "members", "fail", (
            f"etcd has {plural(count, 'member')} ({names}), fewer than {MIN_MEMBERS}: {WHY_THREE}")))
    else:
        findings.append(Finding(ETCD, "members", "ok", f"{plural(count, 'member')}: "
                                + ", ".join(m.name for m in health.members)))
    for member in health.members:
        if member.up:
            role = "leader" if member.leader else "follower"
            findings.append(Finding(ETCD, "member", "ok", f"member {member.name} is up ({role}): {member.detail}"))
        else:
            findings.append(Finding(ETCD, "member", "warn" if quorum_kept else "fail", (
                f"member {member.name} is down: {member.detail}; "
                + ("the others keep the quorum, but one more member lost stops it" if quorum_kept
                   else "without it there is no quorum"))))
    up = health.up
    if quorum_kept:
        findings.append(Finding(ETCD, "quorum", "ok", (
            f"quorum: {up} of {plural(count, 'member')} up ({health.quorum} needed), leader {health.leader}")))
    elif up >= health.quorum:
        findings.append(Finding(ETCD, "quorum", "fail", (
            f"no etcd leader: {up} of {plural(count, 'member')} answer but follow no leader that is up (an "
            "election under way, or members that cannot reach each other); check their logs and the network "
            "between them")))
    else:
        findings.append(Finding(ETCD, "quorum", "fail", (
            f"etcd has no quorum: {up} of {plural(count, 'member')} up, {health.quorum} needed; until more members "
            "return nothing can be written to etcd (Patroni cannot renew a leader key)")))
    return findings

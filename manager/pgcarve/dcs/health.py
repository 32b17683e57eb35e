"""What a probe of etcd means: which members are up, who leads, whether there is a quorum.

Pure: a `Probe` (dcs/etcd.py) in, a `ClusterHealth` out, so `pgcarve doctor`, /metrics and the
tests decide from the same rules. A member is up when an endpoint answered as that member, it
reports itself healthy (a leader, no alarm) and it raised no error. The cluster has a quorum when
more than half of its members (an added but unstarted member counts: etcd counts it) are up and
they follow a leader that is itself up.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from pgcarve.dcs.etcd import EndpointProbe, EtcdMember, Probe

# Fewer members than this cannot lose one and keep a quorum: a two-member cluster stops when
# either member stops, so a two-host fleet needs a third, witness member.
MIN_MEMBERS = 3


@dataclass(frozen=True)
class MemberHealth:
    name: str  # the member's name, or "(unstarted <id>)"
    id: str
    up: bool
    leader: bool
    endpoint: str | None  # the configured endpoint that answered as this member
    detail: str  # why it is not up, or its version and term when it is


@dataclass(frozen=True)
class ClusterHealth:
    members: tuple[MemberHealth, ...]
    members_known: bool  # False: no endpoint gave the member list (and none was known before)
    leader: str | None  # the leader's name, when up members agree on one that is up
    quorum: int  # members that must be up
    has_quorum: bool
    unreachable: tuple[EndpointProbe, ...]  # configured endpoints that did not answer
    at: float

    @property
    def up(self) -> int:
        return sum(1 for m in self.members if m.up)


def quorum_of(members: int) -> int:
    return members // 2 + 1


def assess(probe: Probe, known_members: tuple[EtcdMember, ...] | None = None) -> ClusterHealth:
    """The cluster as `probe` found it; `known_members` (an earlier list) stands in when no
    endpoint gave the member list, so members that stopped answering still show as down."""
    members = probe.members if probe.members is not None else known_members
    answered = {a.status.member_id: a for a in probe.endpoints if a.status is not None}
    up_ids = {member_id for member_id, a in answered.items()
              if a.status is not None and a.status.healthy and not a.status.errors}
    votes = Counter(a.status.leader_id for member_id, a in answered.items()
                    if member_id in up_ids and a.status is not None and a.status.leader_id != "0")
    leader_id = votes.most_common(1)[0][0] if votes else None
    if leader_id not in up_ids:
        leader_id = None
    found = []
    for member in members or ():
        name = member.name or f"(unstarted {member.id})"
        seen = answered.get(member.id)
        status = seen.status if seen is not None else None
        if status is None:
            detail = ("no configured endpoint answered as this member" if member.name
                      else "added to the cluster but never started")
        elif member.id not in up_ids:
            why = [f"alarm {e}" for e in status.errors] + ([] if status.healthy else ["reports itself unhealthy"])
            detail = f"answers at {status.endpoint} but " + ", ".join(why or ["is not healthy"])
        else:
            detail = f"etcd {status.version}, raft term {status.raft_term}"
        found.append(MemberHealth(name=name, id=member.id, up=member.id in up_ids, leader=member.id == leader_id,
                                  endpoint=seen.endpoint if seen is not None else None, detail=detail))
    leader = next((m.name for m in found if m.leader), None)
    quorum = quorum_of(len(found)) if found else 0
    up = sum(1 for m in found if m.up)
    return ClusterHealth(
        members=tuple(found), members_known=members is not None, leader=leader, quorum=quorum,
        has_quorum=bool(found) and up >= quorum and leader is not None,
        unreachable=tuple(a for a in probe.endpoints if a.status is None), at=probe.at)

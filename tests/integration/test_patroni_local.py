"""pgcarve's Patroni modules against a real etcd and two real Patroni members on 127.0.0.1 (this
host's Patroni from Debian, and PostgreSQL 15; no guests): the view read from etcd (one request for
every scope), a switchover and a forced failover asked through the REST client and followed in the
view, refusals and unreachable members translated into pgcarve's errors, pause and resume, a fleet
of 1024 instances' keys read in one request, and a purge of the scope's keys. Everything over TLS
from a throw-away CA (tests/support/patroni_local.py); every process is stopped by its PID at the
end."""

from __future__ import annotations

import base64
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from pgcarve.dcs.etcd import EtcdClient, prefix_range_end
from pgcarve.errors import ConfigError, PatroniRefused, PatroniUnavailable
from pgcarve.guest.tls import new_ca
from pgcarve.patroni.rest import PatroniClient
from pgcarve.patroni.store import purge_cluster, read_all, read_cluster
from pgcarve.patroni.view import ClusterView

from tests.support import localpg, patroni_local
from tests.support.patroni_local import API_PASSWORD, API_USER, LocalPatroniCluster

pytestmark = pytest.mark.localpg

if not patroni_local.available():  # pragma: no cover - depends on the machine
    pytest.skip("patroni, etcd or PostgreSQL 15 is not installed (make apt installs them)", allow_module_level=True)

SCOPE = "pgc-07"
MEMBERS = ("pgc-07", "pgc-07-s1")
T = TypeVar("T")


def eventually(what: str, probe: Callable[[], T | None], timeout_s: float = 45.0) -> T:
    """Poll `probe` until it returns something, or fail saying what never happened."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = probe()
        if found is not None:
            return found
        if time.monotonic() > deadline:
            pytest.fail(f"{what}: not within {timeout_s:g} s")
        time.sleep(0.2)


def b64(text: str) -> str:
    return base64.b64encode(text.encode()).decode()


class Local:
    def __init__(self, cluster: LocalPatroniCluster, etcd: EtcdClient):
        self.cluster = cluster
        self.etcd = etcd

    def view(self) -> ClusterView | None:
        return read_cluster(self.etcd, SCOPE)

    def settled(self, leader: str | None = None) -> ClusterView | None:
        """The view once a leader (`leader`, if named) has a synchronous standby and both members run."""
        view = self.view()
        for member in self.cluster.members:
            if not member.running():
                pytest.fail(f"Patroni {member.name} exited: {member.log_tail()}")
        if view is None or view.leader is None or (leader is not None and view.leader != leader):
            return None
        ok = len(view.members) == 2 and all(m.running for m in view.members) and view.synchronous_standbys
        return view if ok else None

    def rest(self, member: str, **changes: str) -> PatroniClient:
        return PatroniClient(changes.get("url", self.cluster.member(member).api_url), member=member,
                             ca_file=changes.get("ca_file", str(self.cluster.etcd.certs.ca_file)),
                             username=API_USER, password=changes.get("password", API_PASSWORD))


@pytest.fixture(scope="module")
def local() -> Iterator[Local]:
    base = localpg.prepare_base(Path(tempfile.mkdtemp(prefix="pgcarve-patroni-test-")))
    cluster = LocalPatroniCluster(base, SCOPE, MEMBERS)
    try:
        config = cluster.start()
        with EtcdClient(config) as etcd:
            yield Local(cluster, etcd)
    finally:
        cluster.stop()
        for member in cluster.members:
            assert not member.running()
        shutil.rmtree(base, ignore_errors=True)


def test_the_view_shows_the_leader_and_its_synchronous_standby(local: Local) -> None:
    view = eventually("a leader with a synchronous standby", local.settled)
    (standby,) = view.synchronous_standbys
    assert {view.leader, standby} == set(MEMBERS)
    leader = view.leader_member
    assert leader is not None and leader.role == "primary" and view.timeline == 1
    assert view.member(standby).role == "replica"  # type: ignore[union-attr]
    assert view.settings is not None and view.settings.synchronous_mode == "on" and view.failsafe_mode
    # The same, from the fleet-wide read: one range request for every scope.
    requests: list[str] = []
    original = local.etcd._request

    def counted(endpoint: str, method: str, path: str, body: object = None) -> object:
        requests.append(path)
        return original(endpoint, method, path, body)  # type: ignore[arg-type]

    local.etcd._request = counted  # type: ignore[method-assign]
    try:
        fleet = read_all(local.etcd)
    finally:
        del local.etcd._request
    assert requests == ["/v3/kv/range"] and list(fleet) == [SCOPE]
    assert fleet[SCOPE].leader == view.leader
    # What the leader's Patroni says of itself matches.
    with local.rest(view.leader) as rest:  # type: ignore[arg-type]
        status = rest.status()
        assert status.role == "primary" and status.state == "running" and status.scope == SCOPE
        assert [(r.application_name, r.sync_state) for r in status.replication] == [(standby, "sync")]
        assert rest.cluster().leader == view.leader


def test_a_switchover_through_the_rest_api_is_followed_by_the_view(local: Local) -> None:
    before = eventually("a settled cluster", local.settled)
    old, (new,) = before.leader, before.synchronous_standbys
    assert old is not None
    started = time.monotonic()
    with local.rest(new) as rest:  # any member takes it: Patroni writes the request to etcd
        message = rest.switchover(old, new)
    assert new in message
    after = eventually(f"{new} leading with {old} as its synchronous standby", lambda: local.settled(new))
    print(f"switchover {old} -> {new}: answered and settled in {time.monotonic() - started:.1f} s")
    assert after.synchronous_standbys == (old,) and after.timeline == 2
    assert after.history[-1].new_leader == new
    # The same request again names a leader that no longer is: Patroni's refusal, in its words.
    with local.rest(new) as rest, pytest.raises(PatroniRefused, match=f"Patroni on {new} refused the switchover: "
                                                                      "leader name does not match"):
        rest.switchover(old, new)
    with local.rest(new) as rest, pytest.raises(PatroniRefused, match="refused the failover: candidate does not exist"):
        rest.failover("pgc-07-s9")
    with local.rest(new) as rest, pytest.raises(ConfigError, match="to itself"):
        rest.switchover(new, new)
    assert local.settled(new) is not None  # nothing moved


def test_bad_credentials_another_ca_and_no_listener_are_said_as_such(local: Local, tmp_path: Path) -> None:
    member = MEMBERS[0]
    with local.rest(member, password="wrong") as rest, pytest.raises(
            PatroniUnavailable, match=f"Patroni on {member} .* refused pgcarve's credentials .*HTTP 401"):
        rest.pause()
    other_ca = tmp_path / "other-ca.pem"
    other_ca.write_bytes(new_ca().cert_pem)
    with local.rest(member, ca_file=str(other_ca)) as rest, pytest.raises(PatroniUnavailable,
                                                                          match="cannot be reached"):
        rest.status()
    (port,) = localpg.free_ports(1)
    with local.rest(member, url=f"https://127.0.0.1:{port}") as rest, pytest.raises(PatroniUnavailable,
                                                                                   match="cannot be reached"):
        rest.status()
    with pytest.raises(ConfigError, match="must be https"):
        local.rest(member, url=f"http://127.0.0.1:{port}")
    view = local.view()
    assert view is not None and not view.paused  # the refused pause changed nothing


def test_pause_and_resume(local: Local) -> None:
    member = MEMBERS[1]
    with local.rest(member) as rest:
        assert rest.pause().get("pause") is True
        paused = eventually("every member paused", lambda: v if (v := local.view()) is not None and v.paused
                            and all(m.paused for m in v.members) else None)
        assert paused.leader is not None
        assert rest.status().paused
        assert "pause" not in rest.resume()
    eventually("no member paused", lambda: v if (v := local.view()) is not None and not v.paused
               and not any(m.paused for m in v.members) else None)


def test_a_forced_failover_through_the_rest_api_is_followed_by_the_view(local: Local) -> None:
    before = eventually("a settled cluster", local.settled)
    old, (new,) = before.leader, before.synchronous_standbys
    started = time.monotonic()
    with local.rest(old) as rest:  # type: ignore[arg-type]
        message = rest.failover(new)
    assert new in message
    after = eventually(f"{new} leading with {old} as its synchronous standby", lambda: local.settled(new))
    print(f"failover {old} -> {new}: answered and settled in {time.monotonic() - started:.1f} s")
    assert after.timeline == before.timeline + 1  # type: ignore[operator]


def test_a_fleet_of_1024_instances_is_read_in_one_request(local: Local) -> None:
    """Every key a settled instance has, for 1024 scopes, under a namespace of their own: one range
    answer of a few MB, within what etcd's gateway sends."""
    view = eventually("a settled cluster", local.settled)
    keys = local.etcd.range_prefix(f"/service/{SCOPE}/").kvs
    namespace = "/fleet-of-1024/"
    endpoint = local.cluster.etcd.endpoint
    per_txn = 128 // len(keys)  # etcd's --max-txn-ops default
    scopes = [f"pgc-{i:04d}" for i in range(1024)]
    for start in range(0, len(scopes), per_txn):
        puts = [{"requestPut": {"key": b64(kv.key.replace(f"/service/{SCOPE}/", f"{namespace}{scope}/")),
                                "value": b64(kv.value)}}
                for scope in scopes[start:start + per_txn] for kv in keys]
        local.etcd._post(endpoint, "/v3/kv/txn", {"success": puts})
    try:
        started = time.monotonic()
        fleet = read_all(local.etcd, namespace)
        took = time.monotonic() - started
        size = sum(len(kv.key) + len(kv.value) for kv in keys) * len(scopes)
        print(f"{len(fleet)} scopes ({len(keys)} keys each, {size / 1e6:.1f} MB of keys and values) read in "
              f"{took:.2f} s")
        assert list(fleet) == scopes
        assert {v.leader for v in fleet.values()} == {view.leader}
        assert all(v.synchronous_standbys == view.synchronous_standbys for v in fleet.values())
    finally:
        end = base64.b64encode(prefix_range_end(namespace.encode())).decode()
        deleted = local.etcd._post(endpoint, "/v3/kv/deleterange", {"key": b64(namespace), "range_end": end})
    assert int(deleted.get("deleted", 0)) == len(scopes) * len(keys)


def test_a_purge_removes_every_key_of_the_scope_and_nothing_else(local: Local) -> None:
    # Another scope's key beside it, whose name starts with this scope's, must survive.
    neighbour = "/service/pgc-07-x/leader"
    local.etcd._post(local.cluster.etcd.endpoint, "/v3/kv/put", {"key": b64(neighbour), "value": b64("someone")})
    for member in local.cluster.members:  # a running Patroni would write its keys again
        member.stop()
    assert local.view() is not None
    # A stopped leader hands over no lock: its key is deleted by Patroni on the way out, the rest stays.
    deleted = purge_cluster(local.etcd, SCOPE)
    assert deleted >= 4  # config, initialize, members, status, sync, failsafe... as many as were left
    assert local.view() is None and list(read_all(local.etcd)) == ["pgc-07-x"]
    assert purge_cluster(local.etcd, SCOPE) == 0  # again: nothing, no error

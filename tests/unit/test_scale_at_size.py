"""The control plane's cost at many instances (issue 32, item 8), pinned by counting what it does
rather than timing it (the times are the benchmark's: bench/control_plane.py).

A scale reads libvirt's whole fleet once for its decision; each instance it creates is read back
alone; every decision still sees every instance made before it; the API still lists every
instance. On libvirt's test driver with two simulated hosts: the real Fleet, Scaler, Provisioner
and API; no guest boots.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pgcarve.control.fleet import Fleet
from pgcarve.control.listing import Listing
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.scaler import Scaler
from pgcarve.control.service import ManagerService
from pgcarve.errors import CapacityError, NotFound
from pgcarve.guest.credentials import InstanceSecretStore
from pgcarve.naming import guest_of, index_of, instance_name
from pgcarve.planning import placement as placement_module
from pgcarve.planning.planner import HostPlan, PlannerConfig
from pgcarve.planning.topology import HostTopology, parse_capabilities
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import CREATING_NS
from pgcarve.virt.host import GuestInfo, LibvirtHost, domain_facts

from bench import simulated_hosts
from tests.support import testdriver as td
from tests.support.api import app_for

TOKEN = "scale-at-size-token-0123456789abcdef"
SIZE = 70  # more than one simulated host holds (62): both hosts take instances


def _fleet(tmp_path: Path, hosts: int = 2) -> Fleet:
    sim = simulated_hosts  # (the module: pytest would collect testdriver_* names as tests)
    td_file = sim.ensure_fixture(sim.TESTDRIVER_FILE, sim.testdriver_xml())
    caps = sim.ensure_fixture(sim.CAPABILITIES_FILE, sim.capabilities_xml()).read_text()
    config = sim.testdriver_config(hosts, f"test://{td_file.resolve()}")
    return td.testdriver_fleet(config, Paths(tmp_path / "state", image_dir=td.stand_in_image(tmp_path / "image")),
                               caps)


class Counting:
    """Counts, on one fleet, full listings (Fleet.guests() without a name filter), guests read
    from libvirt one by one (LibvirtHost._guest_info), and instances created, by index."""

    def __init__(self, fleet: Fleet, monkeypatch: pytest.MonkeyPatch):
        self.full_listings = 0
        self.guests_read = 0
        self.created: Counter[int] = Counter()
        self._lock = threading.Lock()
        listing = fleet.guests

        def guests(named: Callable[[str], bool] | None = None) -> list[GuestInfo]:
            if named is None:
                with self._lock:
                    self.full_listings += 1
            return listing(named)

        monkeypatch.setattr(fleet, "guests", guests)
        read = LibvirtHost._guest_info

        def guest_info(host: LibvirtHost, dom: object) -> GuestInfo | None:
            with self._lock:
                self.guests_read += 1
            return read(host, dom)

        monkeypatch.setattr(LibvirtHost, "_guest_info", guest_info)

    def reset(self) -> None:
        self.full_listings = self.guests_read = 0
        self.created.clear()


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = _fleet(tmp_path)
    yield f
    f.close()


class Scaled:
    """A fleet scaled 0 -> SIZE once for the module (each scale of it costs seconds), with what
    that scale did."""

    def __init__(self, fleet: Fleet, counting: Counting, plan_create: tuple[int, ...]):
        self.fleet, self.counting, self.plan_create = fleet, counting, plan_create
        self.full_listings, self.guests_read = counting.full_listings, counting.guests_read
        self.created = Counter(counting.created)


@pytest.fixture(scope="module")
def scaled(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Scaled]:
    fleet = _fleet(tmp_path_factory.mktemp("scaled"))
    with pytest.MonkeyPatch.context() as monkeypatch:
        counting = Counting(fleet, monkeypatch)
        plan = _scaler(fleet, counting).scale(SIZE)
        yield Scaled(fleet, counting, plan.create)
    fleet.close()


def _scaler(fleet: Fleet, counting: Counting) -> Scaler:
    provisioner = Provisioner(fleet, ready=td.accepts_sql_at_once(fleet))
    create = provisioner.create_instance

    def counted(index: int, *args: object, **kwargs: object) -> object:
        with counting._lock:
            counting.created[index] += 1
        return create(index, *args, **kwargs)  # type: ignore[arg-type]

    provisioner.create_instance = counted  # type: ignore[method-assign,assignment]
    return Scaler(fleet, provisioner=provisioner)


def test_a_scale_lists_the_fleet_once_and_creates_each_instance_once(scaled: Scaled) -> None:
    fleet = scaled.fleet
    assert scaled.plan_create == tuple(range(1, SIZE + 1))
    assert scaled.created == Counter(range(1, SIZE + 1)), "each instance created exactly once"
    # One listing for the capacity check and the decision together; each new instance is then
    # read back alone. Before, every creation listed the whole fleet again (cost ~ N squared).
    assert scaled.full_listings == 1
    # Each guest read once where it is made ready and once when its instance is read back, plus
    # the guests the one listing reads (none: the fleet was empty).
    assert scaled.guests_read <= 2 * SIZE
    observed = fleet.observe(with_endpoints=False)
    assert [i.index for i in observed] == list(range(1, SIZE + 1))
    assert {i.primary.info.host for i in observed if i.primary} == {"db1", "db2"}
    assert not any(i.primary.info.creating for i in observed if i.primary), "every instance finished"


def test_every_decision_sees_the_instances_made_before_it(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = Counting(fleet, monkeypatch)
    scaler = _scaler(fleet, counting)
    assert scaler.scale(5).create == (1, 2, 3, 4, 5)
    assert scaler.scale(9).create == (6, 7, 8, 9), "the first scale's instances are seen"
    # One made outside this scaler (another path of the manager) is seen by the next decision too.
    Provisioner(fleet, ready=td.accepts_sql_at_once(fleet)).create_instance(12)
    counting.reset()
    plan = scaler.scale(12)
    assert plan.create == (10, 11) and counting.created == Counter({10: 1, 11: 1})
    assert scaler.scale(12).create == () and counting.created == Counter({10: 1, 11: 1}), "nothing made twice"
    plan = scaler.scale(7)
    assert plan.retire == (12, 11, 10, 9, 8)
    assert [i.index for i in fleet.observe(with_endpoints=False)] == list(range(1, 8))
    assert scaler.scale(9).revive == (8, 9), "retired instances come back, not new ones"


def test_an_instance_is_read_alone(scaled: Scaled) -> None:
    """Fleet.instance / instance_at read only the instance's own guests, whatever the fleet's size,
    and create_instance returns what libvirt holds (read back, not remembered)."""
    fleet, counting = scaled.fleet, scaled.counting
    counting.reset()
    name = instance_name(fleet.config.fleet, 64)  # on the second host
    inst = fleet.instance(name)
    assert inst.name == name and inst.index == 64 and inst.primary is not None
    assert inst.primary.info == fleet.hosts["db2"].guest(name)
    assert counting.full_listings == 0 and counting.guests_read == 2, "its one guest, and the check's read"
    assert fleet.instance_at(SIZE + 1) is None
    for missing in (instance_name(fleet.config.fleet, SIZE + 1), f"{fleet.config.fleet}-7", "other-01", "pgcbench"):
        with pytest.raises(NotFound):
            fleet.instance(missing)
    returned = Provisioner(fleet, ready=td.accepts_sql_at_once(fleet)).create_instance(SIZE + 1)
    try:
        assert returned == fleet.instance_at(SIZE + 1) and returned.primary is not None
        assert not returned.primary.info.creating, "read after its creating mark was taken off"
    finally:
        _scaler(fleet, counting).scale(SIZE)  # the module's fleet as it was


def test_guest_names_of_an_instance() -> None:
    assert guest_of("pgc-01", "pgc-01") and guest_of("pgc-01", "pgc-01-s1") and guest_of("pgc-01", "pgc-01-s4")
    assert not guest_of("pgc-01", "pgc-010") and not guest_of("pgc-01", "pgc-01-s")
    assert not guest_of("pgc-01", "pgc-01-sx") and not guest_of("pgc-10", "pgc-100-s1")
    assert not guest_of("pgc-01", "pgc-02-s1") and not guest_of("pgc-01", "xpgc-01")
    assert index_of("pgc", "pgc-07") == 7 and index_of("pgc", "pgc-100") == 100 and index_of("pgc", "pgc-1024") == 1024
    for name in ("pgc-7", "pgc-", "pgc", "other-07", "pgc-07-s1", "pgc-0x"):
        assert index_of("pgc", name) is None, name


def test_listing_at_size_returns_every_instance(scaled: Scaled) -> None:
    fleet = scaled.fleet
    service = ManagerService(fleet.config, fleet.paths, collect=False, supervise=False)
    service.fleet = fleet
    service.refresh()
    with TestClient(app_for(service, token=TOKEN), base_url="http://127.0.0.1:8080") as client:
        first = client.get("/v1/instances")
        assert first.status_code == 200
        docs = first.json()
        assert [d["name"] for d in docs] == [instance_name(fleet.config.fleet, i) for i in range(1, SIZE + 1)]
        assert {d["host"] for d in docs} == {"db1", "db2"} and all(d["state"] == "running" for d in docs)
        assert client.get("/v1/instances").content == first.content, "served again from the same snapshot"
    service.operations.stop()


def test_placement_plans_each_host_once(fleet: Fleet, monkeypatch: pytest.MonkeyPatch) -> None:
    planned: Counter[int] = Counter()
    capacity = placement_module.capacity

    def counted(topology: object, config: object) -> int:
        planned[id(topology)] += 1
        return capacity(topology, config)  # type: ignore[arg-type]

    monkeypatch.setattr(placement_module, "capacity", counted)
    placement = fleet.placement
    assert fleet.placement is placement, "kept: the topologies and config it derives from do not change"
    hosts = [placement.hosts_for(i)[0].name for i in range(1, 125)]
    assert hosts == ["db1"] * 62 + ["db2"] * 62 and placement.capacity() == 124
    assert sum(planned.values()) == 2, "one capacity per host, not one per instance and host"
    plans: Counter[str] = Counter()
    plan_host = placement_module.plan_host

    def counted_plan(topology: HostTopology, config: PlannerConfig, instances: int) -> HostPlan:
        plans[str(instances)] += 1
        return plan_host(topology, config, instances)

    monkeypatch.setattr(placement_module, "plan_host", counted_plan)
    for index, host in enumerate(hosts, start=1):
        local = index - (62 if host == "db2" else 0)
        direct = plan_host(fleet.topology(host), placement.planner, local)
        assert placement.slot(host, index) == (direct, direct.slots[local - 1]), "as the planner plans it"
    assert plans == Counter({"62": 2}), "each host planned once, at its capacity"
    with pytest.raises(CapacityError):
        placement.slot("db1", 63 + 62)  # beyond the host: the planner's own refusal


def test_simulated_hosts_are_sized_from_the_count() -> None:
    topology = parse_capabilities(simulated_hosts.capabilities_xml())
    sizes = {n: simulated_hosts.hosts_for(n, topology) for n in (1, 62, 63, 256, 992, 993, 1024)}
    assert sizes == {1: 1, 62: 1, 63: 2, 256: 5, 992: 16, 993: 17, 1024: 17}


def test_instance_secrets_made_side_by_side_are_one_set(tmp_path: Path) -> None:
    """Made without a lock (a hard link appears whole or not at all): threads asking at once for
    one instance's passwords all get the same ones, written 0600, with no temporary file left."""
    store = InstanceSecretStore(tmp_path / "instances")
    with ThreadPoolExecutor(max_workers=8) as pool:
        got = list(pool.map(lambda _i: store.load_or_create("pgc-01"), range(32)))
    assert len(set(got)) == 1 and store.load("pgc-01") == got[0]
    assert sorted(p.name for p in (tmp_path / "instances").iterdir()) == ["pgc-01.json"]
    assert (tmp_path / "instances" / "pgc-01.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "instances").stat().st_mode & 0o777 == 0o700


def test_a_refresh_that_finds_nothing_new_keeps_the_listing(scaled: Scaled) -> None:
    """The documents (and so their encoding) are built again only when a refresh finds a change:
    in libvirt, or in the work holding an instance."""
    fleet = scaled.fleet
    service = ManagerService(fleet.config, fleet.paths, collect=False, supervise=False)
    service.fleet = fleet
    service.refresh()
    docs = service.instance_docs()
    assert len(docs) == SIZE
    service.refresh()
    assert service.instance_docs() is docs, "nothing changed: the same documents"
    with fleet.locks.exclusive(3, "reviving"):
        service.refresh()
        held = service.instance_docs()
        assert held is not docs and held[2]["state"] == "reviving" and held[2]["dsn"] is None
    service.refresh()
    again = service.instance_docs()
    assert again is not held and again[2]["state"] == "running"
    fleet.hosts["db1"].stop(instance_name(fleet.config.fleet, 5))
    try:
        service.refresh()
        assert service.instance_docs()[4]["state"] == "shut-off", "a change in libvirt is listed"
    finally:
        fleet.hosts["db1"].start(instance_name(fleet.config.fleet, 5))
    service.operations.stop()


def test_domain_facts_follow_the_xml_libvirt_gives() -> None:
    """Remembered by the answer's digest, so a changed domain (its creating mark gone, a new MAC)
    is read afresh, never from what an older answer said."""
    creating = (f'<domain><vcpu>2</vcpu><os><kernel>/k1</kernel></os><metadata><c:creating xmlns:c="{CREATING_NS}"/>'
                "</metadata><devices><interface><mac address='52:54:00:00:00:01'/></interface></devices></domain>")
    done = creating.replace(f'<c:creating xmlns:c="{CREATING_NS}"/>', "")
    assert domain_facts(creating) == (2, "52:54:00:00:00:01", True, "/k1")
    assert domain_facts(creating) == (2, "52:54:00:00:00:01", True, "/k1")
    assert domain_facts(done) == (2, "52:54:00:00:00:01", False, "/k1")
    assert domain_facts(done.replace(":01'", ":02'")) == (2, "52:54:00:00:00:02", False, "/k1")
    assert domain_facts("<domain/>") == (1, None, False, "")


def test_the_refresher_builds_only_listings_someone_reads() -> None:
    builds: list[bool] = []
    key = [0]

    def build(retired: bool) -> list[dict[str, object]]:
        builds.append(retired)
        return [{"retired": retired}]

    listing = Listing(lambda: (key[0],), build)
    listing.build_read()
    assert builds == [], "nobody read: nothing built"
    first = listing.get(False)
    assert builds == [False] and listing.get(False) is first
    key[0] = 1  # what they are built from changed
    listing.build_read()
    assert builds == [False, False], "read since: built again, off the request"
    assert listing.get(False) is not first and builds == [False, False], "the request found it built"
    key[0] = 2
    listing.build_read()
    listing.build_read()
    assert builds == [False, False, False], "built once for the one read; not again without a read"

"""`terraform apply` per host lays out the whole fleet: primaries, and their standbys on the
standby hosts, replicating with no manager step; the manager then sees, serves and repairs it.

In its own three-host sandbox (state in /var/tmp/pgcarve-it-terraform, or
PGCARVE_IT_TERRAFORM_STATE): `pgcarve plan --format tfvars` for one instance on each host, one
Terraform working directory (so one state) per host, applied standby hosts first. Then: the
primary streams to both standbys with the planned one synchronous; the API's contract (pinned
CPUs disjoint per host, a synchronous standby on another host); a writer through the rw endpoint
while the primary's QEMU is killed and the manager restarts it; `terraform destroy` of one
standby host while the writer goes on (the other standby becomes synchronous); every
acknowledged commit on the final primary; destroy of the rest leaving no guest and no volume;
the Terraform guest's libvirt XML equal to the manager's DomainSpec for it.

Needs root, the sandbox's tools, the guest image (PGCARVE_IMAGE_DIR, default
/var/lib/pgcarve/image) and Terraform from `make tools`. Booting under TCG takes 60-90 s.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from pgcarve.config import FleetConfig, load_fleet_config
from pgcarve.control.fleet import Fleet
from pgcarve.control.removal import leftovers, remove_instance
from pgcarve.errors import PgcarveError
from pgcarve.postgres.session import APP_DATABASE
from pgcarve.processes import stop_pid
from pgcarve.sandbox.faults import SandboxFaults
from pgcarve.sandbox.hosts import REQUIRED_TOOLS, Sandbox
from pgcarve.settings import Paths
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic
from psycopg.conninfo import make_conninfo

from tests.integration.conftest import clean_sandbox, free_port, wait_for
from tests.integration.writer import AckedWriter

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
TOOLS = Path(os.environ.get("PGCARVE_TOOLS", REPO / ".tools"))
TERRAFORM = TOOLS / "bin" / "terraform"
TERRAFORMRC = TOOLS / "terraformrc"
STATE_DIR = Path(os.environ.get("PGCARVE_IT_TERRAFORM_STATE", "/var/tmp/pgcarve-it-terraform"))
IMAGE_DIR = Path(os.environ.get("PGCARVE_IMAGE_DIR", "/var/lib/pgcarve/image"))
TERRAFORM_TIMEOUT_S = 600  # an apply (uploads the image)
TERRAFORM_READ_TIMEOUT_S = 60  # init, plan, output, destroy: 0.1-3 s normally (a hung provider is retried)
TERRAFORM_SILENCE_S = 90  # no output this long: the provider's known hang (killed, run once more)
TOKEN = "terraform-integration-token-" + "x" * 16
HOSTS = ("h0", "h1", "h2")
INSTANCE = "pgc-01"


def _why_not() -> str | None:
    if os.geteuid() != 0:
        return "needs root (network namespaces, libvirtd)"
    missing = [t for t in (*REQUIRED_TOOLS, "xsltproc", "mkisofs") if shutil.which(t) is None]
    if missing:
        return f"missing {', '.join(missing)}: run `make deps`"
    if not (IMAGE_DIR / "image.tag").exists():
        return f"no guest image in {IMAGE_DIR}: run `make image` or set PGCARVE_IMAGE_DIR"
    return None


if (_reason := _why_not()) is not None:  # pragma: no cover - depends on the machine
    pytest.skip(_reason, allow_module_level=True)


# terraform-provider-libvirt's message when its read-back of a just-uploaded ISO copies 0 bytes.
PROVIDER_ISO_READ_RACE = "error while retrieving remote ISO"


def log(message: str) -> None:
    print(f"[terraform-it {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class World:
    paths: Paths
    config: FleetConfig
    sandbox: Sandbox
    workdirs: dict[str, Path]  # per host, a copy of terraform/examples/sandbox: one state each
    env: dict[str, str]
    timings: dict[str, float]
    server: subprocess.Popen[bytes] | None = None
    url: str = ""
    applied: set[str] = field(default_factory=set)

    def terraform(self, host: str, *args: str, check: bool = True,
                  again: bool = True) -> subprocess.CompletedProcess[str]:
        started = time.monotonic()
        budget = TERRAFORM_TIMEOUT_S if args[0] == "apply" else TERRAFORM_READ_TIMEOUT_S
        # Its own session: a hung provider plugin is killed with Terraform, not left behind.
        child = subprocess.Popen([str(TERRAFORM), *args, "-no-color"], cwd=self.workdirs[host], env=self.env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
        out, err, why = _watched(child, budget)
        if why is not None:
            log(f"{host}: terraform {args[0]} {why} (last output: {out.strip().splitlines()[-1:] or 'none'}); killed")
            if not again:
                raise AssertionError(f"terraform {' '.join(args)} on {host} hung twice") from None
            # terraform-provider-libvirt 0.7.6 now and then never returns from reading a seed ISO
            # back (libvirt_cloudinit_disk's refresh); a second run goes through, as an operator's would.
            return self.terraform(host, *args, check=check, again=False)
        proc = subprocess.CompletedProcess(child.args, child.returncode, out, err)
        log(f"{host}: terraform {args[0]}: exit {proc.returncode} in {time.monotonic() - started:.1f} s")
        if again and args[0] == "apply" and proc.returncode != 0 and PROVIDER_ISO_READ_RACE in proc.stderr:
            # The libvirt provider reads a seed ISO back right after uploading it and, rarely,
            # gets 0 bytes (seen once in ~10 runs). Applying again converges, as an operator would.
            log("terraform apply: the provider's known ISO read-back failure; applying once more")
            return self.terraform(host, *args, check=check, again=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"terraform {' '.join(args)} on {host} failed:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def plan(self, host: str) -> dict[str, Any]:
        """`pgcarve plan --format tfvars` for one instance, saved in the host's working directory."""
        proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "--hosts-file", str(self.paths.sandbox_hosts_file),
                               "plan", "--host", host, "--instances", "1", "--format", "tfvars"],
                              env=self.env, capture_output=True, text=True, timeout=300, check=False)
        assert proc.returncode == 0, proc.stderr
        (self.workdirs[host] / "pgcarve.auto.tfvars.json").write_text(proc.stdout)
        return dict(json.loads(proc.stdout))

    def start_server(self) -> None:
        """The manager (`pgcarve serve`: API, collector, HA loop) on this sandbox, in the background."""
        port = free_port()
        env = dict(self.env, PGCARVE_HOSTS_FILE=str(self.paths.sandbox_hosts_file), PGCARVE_TOKEN=TOKEN,
                   PGCARVE_BOOT_TIMEOUT="1200")
        with (STATE_DIR / "server.log").open("ab") as out:
            self.server = subprocess.Popen([sys.executable, "-m", "pgcarve.cli", "serve", "--port", str(port)],
                                           env=env, stdout=out, stderr=out, start_new_session=True)
        self.url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while not _healthy(self.url):
            if self.server.poll() is not None:
                raise AssertionError(f"the API server exited ({self.server.returncode}): "
                                     f"see {STATE_DIR / 'server.log'}")
            if time.monotonic() > deadline:
                raise AssertionError("the API server did not answer /healthz in 60 s")
            time.sleep(0.2)

    def stop_server(self) -> None:
        if self.server is not None and self.server.poll() is None:
            stop_pid(self.server.pid, timeout_s=30)

    def api(self, path: str) -> Any:
        with httpx.Client(base_url=self.url, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=30) as client:
            resp = client.get(path)
            assert resp.status_code == 200, resp.text
            return resp.json()


def _watched(child: subprocess.Popen[str], budget_s: float) -> tuple[str, str, str | None]:
    """Its stdout and stderr once `child` ends, and None; or, killed with its session, what it
    printed and why: silent for TERRAFORM_SILENCE_S (Terraform reports a resource still being
    created every 10 s, so a silent one is the provider's known hang, not a slow upload), or over
    `budget_s` in all."""
    chunks: dict[str, list[str]] = {"out": [], "err": []}
    last_output = [time.monotonic()]

    def pump(name: str, stream: Any) -> None:
        for line in stream:
            chunks[name].append(line)
            last_output[0] = time.monotonic()

    pumps = [threading.Thread(target=pump, args=(name, stream), daemon=True)
             for name, stream in (("out", child.stdout), ("err", child.stderr))]
    for thread in pumps:
        thread.start()
    started, why = time.monotonic(), None
    while child.poll() is None:
        now = time.monotonic()
        if now - last_output[0] > TERRAFORM_SILENCE_S:
            why = f"printed nothing for {TERRAFORM_SILENCE_S} s"
        elif now - started > budget_s:
            why = f"still running after {budget_s} s"
        if why is not None:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
            break
        time.sleep(0.5)
    for thread in pumps:
        thread.join(10)
    return "".join(chunks["out"]), "".join(chunks["err"]), why


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/healthz", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def ensure_tools() -> None:
    """Terraform and its provider, as `make tools` builds them: a no-op when they are current, a
    wait while another process builds them (make test builds them beside the guest tests;
    install.sh holds a lock meanwhile), else a build."""
    subprocess.run([str(REPO / "terraform" / "tools" / "install.sh")], check=True, timeout=3600, stdout=sys.stderr)
    assert TERRAFORM.exists() and TERRAFORMRC.exists(), f"{TERRAFORM} is not built: run `make tools`"


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[World]:
    ensure_tools()
    # Start clean: a run killed half-way leaves its sandbox (ours alone: own state directory), and
    # an earlier run's synchronous-set records name guests that are gone.
    paths, sandbox = clean_sandbox(STATE_DIR)
    timings: dict[str, float] = {}
    started = time.monotonic()
    config = sandbox.up(3)
    timings["sandbox up"] = time.monotonic() - started
    base = tmp_path_factory.mktemp("tf")
    workdirs = {}
    for host in HOSTS:
        copy = base / host / "terraform"
        shutil.copytree(REPO / "terraform", copy,
                        ignore=shutil.ignore_patterns("tools", ".terraform", "*.tfstate*", ".terraform.lock.hcl",
                                                      "*.tfvars.json"))
        workdirs[host] = copy / "examples" / "sandbox"
    env = dict(os.environ, TF_CLI_CONFIG_FILE=str(TERRAFORMRC), CHECKPOINT_DISABLE="1", TF_IN_AUTOMATION="1",
               PGCARVE_STATE_DIR=str(STATE_DIR), PGCARVE_IMAGE_DIR=str(IMAGE_DIR))
    w = World(paths=paths, config=config, sandbox=sandbox, workdirs=workdirs, env=env, timings=timings)
    try:
        yield w
    finally:
        w.stop_server()
        for host in HOSTS:
            if (w.workdirs[host] / "terraform.tfstate").exists():
                try:
                    proc = w.terraform(host, "destroy", "-auto-approve", "-input=false", check=False)
                except AssertionError as exc:  # hung twice: the removals below still run
                    log(f"{host}: {exc}")
                    continue
                if proc.returncode != 0:
                    log(f"{host}: terraform destroy failed in the clean-up: {proc.stderr.strip()[-500:]}")
        fleet = Fleet(config, paths)
        with contextlib.suppress(PgcarveError):
            for inst in fleet.observe(with_endpoints=False):
                remove_instance(fleet, inst)
        fleet.close()
        started = time.monotonic()
        sandbox.down()
        timings["sandbox down"] = time.monotonic() - started
        log("timings: " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items()))
        assert sandbox.leftovers() == []


def manager_spec(doc: dict[str, Any], name: str, kernel: str, initrd: str) -> DomainSpec:
    """What the manager's provisioner (domain_spec) defines for this guest."""
    planned, pool = doc["instances"][name], doc["pool_name"]
    meta = planned["metadata"]
    return DomainSpec(
        name=name, domain_type=doc["domain_type"],
        metadata=InstanceMetadata(fleet=meta["fleet"], cluster=meta["cluster"], role=meta["role"],
                                  index=meta["index"], standby=meta["standby"], created_by=meta["created_by"],
                                  roles=meta["roles"]),
        memory_mib=planned["memory_mib"], vcpu_pins=tuple(planned["vcpu_pins"]),
        emulator_cpus=tuple(planned["emulator_cpus"]), numa_node=planned["numa_node"], hugepages=planned["hugepages"],
        kernel=kernel, initrd=initrd,
        disks=(Disk("vda", pool, f"{name}.qcow2"), Disk("vdb", pool, f"{name}-seed.iso", format="raw", readonly=True)),
        nics=(Nic(doc["network_name"], planned["mac"]),),
        console_log=f"/var/log/libvirt/qemu/{name}-console.log",
    )


def same_xml_as_the_managers(fleet: Fleet, host: str, doc: dict[str, Any], name: str, terraform_xml: str) -> None:
    """Define the manager's DomainSpec for `name` (its Terraform guest destroyed, the name free)
    and compare libvirt's XML of both, but for the UUID."""
    import libvirt

    os_el = re.search(r"<kernel>([^<]+)</kernel>\s*<initrd>([^<]+)</initrd>", terraform_xml)
    assert os_el, terraform_xml
    dom = fleet.hosts[host].conn.defineXML(manager_spec(doc, name, kernel=os_el[1], initrd=os_el[2]).to_xml())
    try:
        manager_xml = dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    finally:
        dom.undefine()

    def without_uuid(xml: str) -> str:
        return re.sub(r"\s*<uuid>[^<]*</uuid>", "", xml)

    assert without_uuid(terraform_xml) == without_uuid(manager_xml)


def test_three_hosts_with_standbys(world: World) -> None:
    import libvirt

    # -- plan: one instance; the primary on h0, its standbys on h1 and h2 --------------------
    docs = {host: world.plan(host) for host in HOSTS}
    assert list(docs["h0"]["instances"]) == [INSTANCE]
    assert list(docs["h1"]["instances"]) == [f"{INSTANCE}-s1"]
    assert list(docs["h2"]["instances"]) == [f"{INSTANCE}-s2"]
    addresses = {name: p["address"] for d in docs.values() for name, p in d["instances"].items()}
    # Each host has its own network (10.77.<host>.0/24): the last address of its DHCP range.
    assert addresses == {INSTANCE: "10.77.0.250", f"{INSTANCE}-s1": "10.77.1.250", f"{INSTANCE}-s2": "10.77.2.250"}

    # -- apply, standby hosts first: their standbys wait for a primary nobody applied yet ----
    for host in HOSTS:
        world.terraform(host, "init", "-input=false")
    started = time.monotonic()
    for host in ("h2", "h1", "h0"):
        world.terraform(host, "apply", "-auto-approve", "-input=false")
        world.applied.add(host)
    world.timings["terraform apply x3"] = time.monotonic() - started
    applied_at = time.monotonic()

    # -- replication set up by the seeds alone (no manager running yet) ----------------------
    fleet = Fleet(load_fleet_config(world.paths.sandbox_hosts_file), world.paths)

    def streaming() -> dict[str, str] | None:
        inst = next((i for i in fleet.observe() if i.name == INSTANCE), None)
        if inst is None or inst.primary is None or inst.primary.endpoint is None:
            return None
        try:
            with fleet.connect(inst.primary, timeout_s=5) as conn:
                # flush_lsn: PostgreSQL shows a walsender as 'async' until its standby's first
                # reply names a flush position, which under emulation can come after 'streaming'.
                rows = conn.execute("select application_name, sync_state from pg_stat_replication "
                                    "where state = 'streaming' and flush_lsn is not null").fetchall()
        except Exception:  # booting
            return None
        found = {str(r[0]): str(r[1]) for r in rows}
        return found if len(found) == 2 else None

    states = wait_for(streaming, "pgc-01 streaming to both standbys, set up by the seeds alone", 900)
    world.timings["last apply -> both standbys streaming"] = time.monotonic() - applied_at
    # The planned synchronous standby; pgcarve names exactly sync_count, so the other is async.
    assert states == {"pgc_01_s1": "sync", "pgc_01_s2": "async"}, states
    inst = fleet.instance(INSTANCE)
    assert inst.primary is not None
    assert {g.name: (g.info.host, g.info.metadata.role, g.info.metadata.created_by, g.address)
            for g in inst.guests} == {
        INSTANCE: ("h0", "primary", "terraform", "10.77.0.250"),
        f"{INSTANCE}-s1": ("h1", "standby", "terraform", "10.77.1.250"),
        f"{INSTANCE}-s2": ("h2", "standby", "terraform", "10.77.2.250")}
    for guest in inst.guests:  # pinning as libvirt applies it is the plan's
        planned = docs[guest.info.host]["instances"][guest.name]
        assert guest.info.vcpu_pins == tuple((cpu,) for cpu in planned["vcpu_pins"])
        assert guest.info.emulator_cpus == tuple(planned["emulator_cpus"])
    # Applying again changes nothing on any host: what the provider reads back is what was planned.
    for host in HOSTS:
        replan = world.terraform(host, "plan", "-detailed-exitcode", "-input=false", check=False)
        assert replan.returncode == 0, f"a second plan on {host} wants changes:\n{replan.stdout}\n{replan.stderr}"

    # -- the manager: the API's contract --------------------------------------------------------
    world.start_server()
    wait_for(lambda: all(h["watching_events"] for h in world.api("/v1/hosts")),
             "the manager to watch every host's lifecycle events", 60)

    def whole(standbys: int) -> dict[str, Any] | None:
        """The instance's document once it accepts writes with `standbys` streaming, one synchronous."""
        doc = world.api(f"/v1/instances/{INSTANCE}")
        live = [s for s in doc["standbys"] if s["state"] == "streaming"]
        synced = [s for s in live if s["sync_state"] == "sync"]
        return doc if doc["writes"] == "accepted" and len(live) == standbys and len(synced) == 1 else None

    def synchronous(doc: dict[str, Any]) -> dict[str, Any]:
        return next(s for s in doc["standbys"] if s["sync_state"] == "sync")

    doc = wait_for(lambda: whole(2), "the API to show pgc-01 writable with a synchronous standby", 300)
    listed = world.api("/v1/instances")
    assert [d["name"] for d in listed] == [INSTANCE]
    assert doc["host"] == "h0" and doc["vcpus"] == sorted(docs["h0"]["instances"][INSTANCE]["vcpu_pins"])
    assert {s["name"]: s["host"] for s in doc["standbys"]} == {f"{INSTANCE}-s1": "h1", f"{INSTANCE}-s2": "h2"}
    pins: dict[str, list[int]] = {}
    for host, d in docs.items():  # CPUs pinned on one host are never shared by two guests
        for p in d["instances"].values():
            assert not set(p["vcpu_pins"]) & set(pins.get(host, [])), host
            pins.setdefault(host, []).extend(p["vcpu_pins"])

    # -- a fault: the primary's QEMU killed under a writer; the manager restarts it -------------
    password = world.api(f"/v1/instances/{INSTANCE}/credentials")["password"]
    uri = make_conninfo(doc["endpoints"]["rw"], password=password)
    writer = AckedWriter(lambda: uri, ca_file=world.paths.tls_dir / "ca.pem")
    with writer:
        writer.wait_for_acks(50, 120, "writes before the fault")
        killed_at = time.time()
        SandboxFaults(world.sandbox).kill_guest("h0", INSTANCE)

        def recovered() -> dict[str, Any] | None:
            found = [i for i in world.api("/v1/incidents")
                     if i["guest"] == INSTANCE and i["detected_at"] >= killed_at - 1]
            return next((i for i in found if i["status"] == "recovered"), None)

        incident = wait_for(recovered, "the manager to repair pgc-01 (a Terraform guest)", 600)
        assert incident["action"] == "restart", incident
        log(f"recovered {incident['finished_at'] - killed_at:.1f} s after the kill: {incident['message']}")
        doc = wait_for(lambda: whole(2), "pgc-01 whole again", 600)
        writer.wait_for_acks(50, 300, "writes after the primary came back")

        # -- destroy the synchronous standby's host: the other one takes over, writes go on ----
        gone = synchronous(doc)
        world.terraform(gone["host"], "destroy", "-auto-approve", "-input=false")
        world.applied.discard(gone["host"])
        doc = wait_for(lambda: whole(1), f"the other standby synchronous after {gone['host']}'s destroy", 300)
        assert synchronous(doc)["name"] != gone["name"]
        writer.wait_for_acks(50, 300, f"writes after {gone['name']} was destroyed")
        log(f"after destroying {gone['host']}: writes {doc['writes']!r}, synchronous {synchronous(doc)['name']}")
        # The manager never builds a Terraform guest: the missing standby is reported, not rebuilt.
        missing = wait_for(lambda: [i for i in world.api("/v1/incidents")
                                    if i["what"] == "standby missing" and i["status"] == "reported"],
                           "the missing standby reported", 120)
        assert "terraform apply" in missing[0]["message"] and gone["host"] in missing[0]["message"], missing
        assert not fleet.hosts[gone["host"]].guests("pgc"), "the manager built a guest where Terraform destroyed one"
    with fleet.connect(fleet.instance(INSTANCE).primary, database=APP_DATABASE) as conn:  # type: ignore[arg-type]
        missing = writer.missing(conn)
    log(f"writer: {len(writer.acked)} commits acknowledged, {len(missing)} missing, {len(writer.errors)} failed tries")
    assert writer.acked and missing == [], f"acknowledged commits lost: {missing[:20]}"
    world.stop_server()

    # -- destroy the rest: no guest, no volume ---------------------------------------------------
    terraform_xml = fleet.hosts["h0"].conn.lookupByName(INSTANCE).XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE)
    for host in sorted(world.applied):
        world.terraform(host, "destroy", "-auto-approve", "-input=false")
        world.applied.discard(host)
    assert leftovers(fleet) == []
    for host in HOSTS:
        assert not [v for v in fleet.hosts[host].storage.volume_names() if v.startswith(("pgcarve-tf-", INSTANCE))]
    same_xml_as_the_managers(fleet, "h0", docs["h0"], INSTANCE, terraform_xml)
    fleet.close()

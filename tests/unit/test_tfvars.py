"""`pgcarve plan --format tfvars` and the Terraform module in terraform/.

The planning side runs on libvirt's test driver (test:///default: 16 CPUs on 2 NUMA nodes). The
module side needs the Terraform built by `make tools` (.tools/bin/terraform); those tests skip,
saying so, when it is missing. No test here talks to a real libvirtd: the module's stylesheet is
applied to the XML terraform-provider-libvirt 0.7.6 generates, rebuilt here from its source
(libvirt/domain.go, resourceLibvirtDomainCreate), and libvirt's test driver normalises both it
and DomainSpec.to_xml() for the comparison.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import pytest
from pgcarve.config import FleetConfig, HostConfig, InstanceSize, Replication
from pgcarve.control.fleet import Fleet
from pgcarve.errors import CapacityError, ConfigError, ImageMissing
from pgcarve.naming import instance_name, slot_name
from pgcarve.planning.planner import capacity
from pgcarve.settings import Paths
from pgcarve.statedir.layout import make_fleet_secrets
from pgcarve.tfvars import render_tfvars, tfvars_document
from pgcarve.virt.domain_xml import Disk, DomainSpec, InstanceMetadata, Nic, mac_for

REPO = Path(__file__).resolve().parents[2]
MODULE = REPO / "terraform"
EXAMPLE = MODULE / "examples" / "sandbox"
TOOLS = Path(os.environ.get("PGCARVE_TOOLS", REPO / ".tools"))
TERRAFORM = TOOLS / "bin" / "terraform"
TERRAFORMRC = TOOLS / "terraformrc"
IMAGE_HASH = hashlib.sha256(b"pgcarve unit test image").hexdigest()
IMAGE_TAG = hashlib.sha256(b"pgcarve unit test build").hexdigest()[:12]

TFLINT = TOOLS / "bin" / "tflint"
needs_tflint = pytest.mark.skipif(
    not TFLINT.exists(),
    reason=f"{TFLINT} is not built: `make tools` builds it when the go found is 1.26 or newer",
)
needs_terraform = pytest.mark.skipif(
    not (TERRAFORM.exists() and TERRAFORMRC.exists()),
    reason=f"{TERRAFORM} is not built: run `make tools` (terraform/tools/install.sh)",
)


# -- fixtures ----------------------------------------------------------------------------------


@pytest.fixture
def image_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for images/build.sh's output: small files, an inputs.sha256 and an image.tag."""
    directory = tmp_path / "image"
    directory.mkdir()
    for name in ("base.qcow2", "vmlinuz", "initrd.img"):
        (directory / name).write_bytes(b"not really " + name.encode())
    (directory / "inputs.sha256").write_text(IMAGE_HASH + "\n")
    (directory / "image.tag").write_text(IMAGE_TAG + "\n")
    return directory


def fleet_config(hosts: int = 1, vcpus: int = 2, memory_mib: int = 512, domain_type: str = "qemu",
                 standby_hosts: int = 0, network: str = "default") -> FleetConfig:
    """`hosts` primary hosts t0.. and `standby_hosts` standby hosts s0.. on the test driver, whose
    network "default" hands out 192.168.122.2-254; each instance gets a standby on every standby host."""
    host_configs = [HostConfig(name=f"t{i}", uri="test:///default", network=network)
                    for i in range(hosts)]
    host_configs += [HostConfig(name=f"s{i}", uri="test:///default", role="standby", network=network)
                     for i in range(standby_hosts)]
    return FleetConfig(
        fleet="tst",
        domain_type=domain_type,
        instance=InstanceSize(vcpus=vcpus, memory_mib=memory_mib, disk_gib=4),
        replication=Replication(standbys=standby_hosts),
        allowed_cidrs=["10.77.0.0/16", "10.76.0.0/24"],
        hosts=host_configs,
    )


def new_fleet(config: FleetConfig, paths: Paths) -> Fleet:
    """A fleet with the admin password and CA `plan --format tfvars` makes for a new fleet."""
    make_fleet_secrets(paths)
    return Fleet(config, paths)


@pytest.fixture
def fleet(tmp_path: Path, image_dir: Path) -> Any:
    f = new_fleet(fleet_config(), Paths(tmp_path / "state", image_dir))
    yield f
    f.close()


# -- the planned layout ------------------------------------------------------------------------


def test_pins_names_and_macs_are_the_planners(fleet: Fleet) -> None:
    cap = capacity(fleet.topology("t0"), fleet.placement.planner)
    assert cap >= 3, "the test driver's 16 CPUs should hold several 2-vCPU instances"
    for n in (1, 2, cap):
        doc = tfvars_document(fleet, "t0", n)
        assert list(doc["instances"]) == [instance_name("tst", i) for i in range(1, n + 1)]
        for i in range(1, n + 1):
            name = instance_name("tst", i)
            plan, slot = fleet.placement.slot("t0", i)
            planned = doc["instances"][name]
            assert planned["vcpu_pins"] == list(slot.host_cpus)
            assert planned["emulator_cpus"] == list(plan.emulator_cpus)
            assert planned["numa_node"] == slot.numa_node
            assert planned["memory_mib"] == slot.memory_mib == 512
            assert planned["mac"] == mac_for("tst", name)
            assert planned["disk_gib"] == 4
    # Instances never share a host CPU, and the host's housekeeping CPUs stay free.
    doc = tfvars_document(fleet, "t0", cap)
    pins = [c for inst in doc["instances"].values() for c in inst["vcpu_pins"]]
    assert len(pins) == len(set(pins))
    assert not set(pins) & set(doc["instances"]["tst-01"]["emulator_cpus"])


def test_metadata_is_what_the_manager_parses(fleet: Fleet) -> None:
    doc = tfvars_document(fleet, "t0", 2)
    for name, planned in doc["instances"].items():
        attrs = {k.replace("_", "-"): str(v) for k, v in planned["metadata"].items()}
        meta = InstanceMetadata.from_element(ET.Element("instance", attrs))
        assert meta == InstanceMetadata(fleet="tst", cluster=name, role="primary",
                                        index=int(name.rsplit("-", 1)[1]), standby=0, created_by="terraform")


def test_host_image_and_domain_type(fleet: Fleet, image_dir: Path) -> None:
    doc = tfvars_document(fleet, "t0", 1)
    assert doc["libvirt_uri"] == "test:///default"
    assert doc["pool_name"] == "pgcarve"
    assert doc["network_name"] == "default"
    assert doc["pool_path"] == "/var/lib/libvirt/pgcarve"
    assert doc["create_pool"] is False
    assert doc["domain_type"] == fleet.domain_types.of("t0") == "qemu"
    assert doc["kernel_cmdline"] == DomainSpec.cmdline
    assert doc["image"] == {
        "base_path": str(image_dir / "base.qcow2"),
        "kernel_path": str(image_dir / "vmlinuz"),
        "initrd_path": str(image_dir / "initrd.img"),
        "tag": IMAGE_TAG,
    }


def scram_matches(verifier: str, password: str) -> bool:
    match = re.fullmatch(r"SCRAM-SHA-256\$(\d+):([^$]+)\$([^:]+):(.+)", verifier)
    assert match, verifier
    iterations, salt, stored_key = int(match[1]), base64.b64decode(match[2]), base64.b64decode(match[3])
    salted = hashlib.pbkdf2_hmac("sha256", password.encode(), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    return hashlib.sha256(client_key).digest() == stored_key


def test_seeds_carry_the_fleets_verifiers_and_no_password(fleet: Fleet) -> None:
    """Each Terraform primary's seed carries the fleet's admin verifier and its own instance's
    application and replication verifiers (made by rendering, kept in the state directory), and
    no password."""
    text = render_tfvars(fleet, "t0", 2)
    creds = fleet.credentials
    doc = json.loads(text)
    owned = {name: fleet.instance_secrets(name) for name in doc["seeds"]}
    first, second = owned.values()
    assert first.replication_password != second.replication_password
    for secrets in owned.values():
        assert secrets.app_password not in text and secrets.replication_password not in text
    assert creds.admin_password not in text
    assert set(doc["seeds"]) == set(doc["instances"])
    for name, seed in doc["seeds"].items():
        header, body = seed["user_data"].split("\n", 1)
        assert header == "#cloud-config"
        # What images/rootfs/usr/local/sbin/pgcarve-guest-setup does with it:
        (entry,) = json.loads(body)["write_files"]
        assert entry["path"] == "/etc/pgcarve/instance.json"
        instance = json.loads(entry["content"])
        assert instance["name"] == name and instance["role"] == "primary"
        assert instance["synchronous_standby_names"] == ""
        assert instance["synchronous_commit"] == fleet.config.replication.synchronous_commit
        assert instance["allowed_cidrs"] == ["10.77.0.0/16", "10.76.0.0/24"]
        assert scram_matches(instance["admin_password_scram"], creds.admin_password)
        assert scram_matches(instance["replication_password_scram"], owned[name].replication_password)
        assert scram_matches(instance["app_password_scram"], owned[name].app_password)
        assert "replication_password" not in instance
        assert instance["tls_certificate"].startswith("-----BEGIN CERTIFICATE-----")
        assert instance["tls_ca"] == fleet.ca.certificate_pem().decode()
        assert json.loads(seed["meta_data"]) == {"instance-id": f"{name}-terraform", "local-hostname": name}


def test_second_primary_host_continues_the_numbering(tmp_path: Path, image_dir: Path) -> None:
    fleet = new_fleet(fleet_config(hosts=2), Paths(tmp_path / "state", image_dir))
    try:
        cap = capacity(fleet.topology("t0"), fleet.placement.planner)
        doc = tfvars_document(fleet, "t1", 2)
        assert list(doc["instances"]) == [instance_name("tst", cap + 1), instance_name("tst", cap + 2)]
        for k, name in enumerate(doc["instances"], start=cap + 1):
            assert fleet.placement.hosts_for(k)[0].name == "t1"
            assert doc["instances"][name]["vcpu_pins"] == list(fleet.placement.slot("t1", k)[1].host_cpus)
            assert doc["instances"][name]["metadata"]["index"] == k
        # Instance 1 of t1 is laid out on t1 exactly as instance 1 of t0 is on t0 (same topology).
        first = doc["instances"][instance_name("tst", cap + 1)]
        assert first["vcpu_pins"] == list(fleet.placement.slot("t0", 1)[1].host_cpus)
    finally:
        fleet.close()


def test_refusals(tmp_path: Path, image_dir: Path) -> None:
    fleet = new_fleet(fleet_config(standby_hosts=1), Paths(tmp_path / "state", image_dir))
    try:
        with pytest.raises(CapacityError, match="room for"):
            tfvars_document(fleet, "s0", capacity(fleet.topology("t0"), fleet.placement.planner) + 1)
        with pytest.raises(CapacityError, match="room for"):
            tfvars_document(fleet, "t0", capacity(fleet.topology("t0"), fleet.placement.planner) + 1)
        with pytest.raises(ConfigError, match="no host named"):
            tfvars_document(fleet, "nope", 1)
        (image_dir / "image.tag").unlink()
        with pytest.raises(ImageMissing, match="built before images had build tags"):
            tfvars_document(fleet, "t0", 1)
        (image_dir / "inputs.sha256").unlink()
        with pytest.raises(ImageMissing, match="no guest image"):
            tfvars_document(fleet, "t0", 1)
    finally:
        fleet.close()


def test_standby_hosts_get_the_standbys_with_everything_planned(tmp_path: Path, image_dir: Path) -> None:
    """No manager step runs between the applies: each standby's seed names its primary's reserved
    address and makes its own slot; each guest lets exactly the instance's other guests replicate;
    each primary names its first standby synchronous (FIRST 1), as `pgcarve up` records it."""
    fleet = new_fleet(fleet_config(standby_hosts=2), Paths(tmp_path / "state", image_dir))
    try:
        primaries = tfvars_document(fleet, "t0", 2)
        first, second = tfvars_document(fleet, "s0", 2), tfvars_document(fleet, "s1", 2)
        # Standby k of instance i goes to standby host (i + k - 2) mod 2: the placement's rotation.
        assert list(first["instances"]) == ["tst-01-s1", "tst-02-s2"]
        assert list(second["instances"]) == ["tst-01-s2", "tst-02-s1"]
        planned = {**primaries["instances"], **first["instances"], **second["instances"]}
        seeds = {**primaries["seeds"], **first["seeds"], **second["seeds"]}
        # Instance i has .254 - (i - 1) on every host (each host its own network in real life).
        assert {n: p["address"] for n, p in planned.items()} == {
            "tst-01": "192.168.122.254", "tst-01-s1": "192.168.122.254", "tst-01-s2": "192.168.122.254",
            "tst-02": "192.168.122.253", "tst-02-s1": "192.168.122.253", "tst-02-s2": "192.168.122.253"}

        def instance_json(name: str) -> dict[str, Any]:
            (entry,) = json.loads(seeds[name]["user_data"].split("\n", 1)[1])["write_files"]
            return dict(json.loads(entry["content"]))

        for name, p in first["instances"].items():
            index, number = p["metadata"]["index"], p["metadata"]["standby"]
            assert p["metadata"] == {"cluster": instance_name("tst", index), "created_by": "terraform", "fleet": "tst",
                                     "index": index, "role": "standby", "roles": "manager", "standby": number}
            assert p["vcpu_pins"] == list(fleet.placement.slot("s0", index)[1].host_cpus)
            seed = instance_json(name)
            assert seed["role"] == "standby" and seed["create_slot"] is True
            assert seed["primary_host"] == planned[instance_name("tst", index)]["address"]
            secrets = fleet.instance_secrets(instance_name("tst", index))
            assert seed["replication_password"] == secrets.replication_password
            assert seed["slot_name"] == slot_name(name)
        primary = instance_json("tst-01")
        assert primary["synchronous_standby_names"] == "FIRST 1 (tst_01_s1)"
        assert "create_slot" not in primary
        for name in ("tst-01", "tst-01-s1", "tst-01-s2"):
            # In the test driver every host shares one network, so all three have the same address.
            assert instance_json(name)["replication_peers"] == ["192.168.122.254", "192.168.122.254"]
    finally:
        fleet.close()


def test_a_dhcp_range_too_small_for_the_fleet_is_refused(tmp_path: Path, image_dir: Path) -> None:
    from pgcarve.virt.xml_specs import NetworkSpec

    fleet = new_fleet(fleet_config(standby_hosts=1, network="tiny"), Paths(tmp_path / "state", image_dir))
    try:
        fleet.hosts["t0"].ensure_network(NetworkSpec("tiny", "virbrtiny", "10.9.0.1", 24, "10.9.0.10", "10.9.0.11"))
        assert tfvars_document(fleet, "s0", 2)["instances"]["tst-02-s1"]["address"] == "10.9.0.10"
        with pytest.raises(ConfigError, match=r"10\.9\.0\.10-10\.9\.0\.11 \(2 addresses\): instance 3"):
            tfvars_document(fleet, "t0", 3)
        fleet.hosts["t0"].conn.networkLookupByName("tiny").destroy()
        fleet.hosts["t0"].conn.networkLookupByName("tiny").undefine()
        with pytest.raises(ConfigError, match="no libvirt network 'tiny'"):
            tfvars_document(fleet, "t0", 1)
    finally:
        fleet.close()


def test_cli_prints_the_tfvars_json(tmp_path: Path, image_dir: Path) -> None:
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(json.dumps(fleet_config().model_dump(mode="json")))  # JSON is YAML
    env = dict(os.environ, PGCARVE_STATE_DIR=str(tmp_path / "state"), PGCARVE_IMAGE_DIR=str(image_dir),
               COLUMNS="40")  # a narrow terminal must not wrap the JSON
    proc = subprocess.run([sys.executable, "-m", "pgcarve.cli", "--hosts-file", str(hosts_file), "plan",
                           "--host", "t0", "--instances", "2", "--format", "tfvars"],
                          capture_output=True, text=True, env=env, check=False)
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert list(doc["instances"]) == ["tst-01", "tst-02"]
    # Every variable written is one the example root module declares.
    declared = set(re.findall(r'^variable "(\w+)"', (EXAMPLE / "variables.tf").read_text(), re.M))
    assert set(doc) <= declared
    # ... and the root passes every one but the provider's URI on to the module.
    module_vars = set(re.findall(r'^variable "(\w+)"', (MODULE / "variables.tf").read_text(), re.M))
    assert set(doc) - {"libvirt_uri"} <= module_vars


# -- the Terraform module ----------------------------------------------------------------------


def terraform(*args: str, cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, TF_CLI_CONFIG_FILE=str(TERRAFORMRC), CHECKPOINT_DISABLE="1", TF_IN_AUTOMATION="1")
    env.pop("TF_LOG", None)
    return subprocess.run([str(TERRAFORM), *args], cwd=cwd, input=stdin, capture_output=True, text=True,
                          env=env, check=False, timeout=300)


def copy_module(tmp_path: Path) -> Path:
    """The module and its example outside the repository, so no .terraform/ lands in it."""
    dest = tmp_path / "terraform"
    shutil.copytree(MODULE, dest, ignore=shutil.ignore_patterns("tools", ".terraform", "*.tfstate*",
                                                                 ".terraform.lock.hcl", "*.tfvars.json"))
    return dest


@needs_terraform
def test_fmt_and_validate(tmp_path: Path) -> None:
    fmt = terraform("fmt", "-check", "-recursive", "-diff", "-no-color", str(MODULE), cwd=REPO)
    assert fmt.returncode == 0, f"terraform fmt would change:\n{fmt.stdout}{fmt.stderr}"
    module = copy_module(tmp_path)
    for directory in (module, module / "examples" / "sandbox"):
        init = terraform("init", "-backend=false", "-input=false", "-no-color", cwd=directory)
        assert init.returncode == 0, init.stdout + init.stderr
        validate = terraform("validate", "-no-color", cwd=directory)
        assert validate.returncode == 0, validate.stdout + validate.stderr


def module_console(module: Path, doc: dict[str, Any], expression: str) -> Any:
    """Evaluate `expression` (jsonencoded) in the module with the generated variables; the
    module's variable validation runs too."""
    doc = {k: v for k, v in doc.items() if k != "libvirt_uri"}  # the example root's, not the module's
    (module / "test.tfvars.json").write_text(json.dumps(doc))
    result = terraform("console", "-no-color", "-var-file=test.tfvars.json", cwd=module,
                       stdin=f"jsonencode({expression})\n")
    # console reports failed validation rules on stderr but still evaluates.
    assert result.returncode == 0 and "Error" not in result.stderr, result.stdout + result.stderr
    return json.loads(json.loads(result.stdout))


@pytest.fixture
def initialised_module(tmp_path: Path) -> Path:
    module = copy_module(tmp_path)
    init = terraform("init", "-backend=false", "-input=false", "-no-color", cwd=module)
    assert init.returncode == 0, init.stdout + init.stderr
    return module


@needs_terraform
def test_module_accepts_the_generated_variables(fleet: Fleet, initialised_module: Path) -> None:
    doc = tfvars_document(fleet, "t0", 3)
    got = module_console(initialised_module, doc, "{ cmdline = local.cmdline, names = keys(local.xslt) }")
    assert got["names"] == list(doc["instances"])
    # The maps the provider reads the command line back as, so a second plan shows no change.
    assert got["cmdline"] == [{"root": "/dev/vda", "console": "ttyS0", "systemd.show_status": "0"}, {"_": "rw quiet"}]
    # The module's validation rejects what the manager would never create.
    bad = json.loads(json.dumps(doc))
    bad["instances"]["tst-02"]["vcpu_pins"] = bad["instances"]["tst-01"]["vcpu_pins"]
    bad.pop("libvirt_uri")
    (initialised_module / "test.tfvars.json").write_text(json.dumps(bad))
    result = terraform("console", "-no-color", "-var-file=test.tfvars.json", cwd=initialised_module, stdin="1\n")
    assert "Invalid value for variable" in result.stderr and "only one vCPU of one instance" in result.stderr


def provider_xml(doc: dict[str, Any], name: str) -> str:
    """The domain XML terraform-provider-libvirt 0.7.6 generates for the module's libvirt_domain
    before the XSLT (its cmdline words sorted, MAC upper-cased, PAE, spice, no serial)."""
    planned = doc["instances"][name]
    pool, tag = doc["pool_name"], doc["image"]["tag"]
    cpu = '<cpu mode="host-passthrough"></cpu>' if doc["domain_type"] == "kvm" else "<cpu></cpu>"
    return f"""<domain type="{doc['domain_type']}">
  <name>{name}</name>
  <memory unit="MiB">{planned['memory_mib']}</memory>
  <vcpu>{len(planned['vcpu_pins'])}</vcpu>
  <os>
    <type arch="x86_64" machine="pc">hvm</type>
    <kernel>{doc['pool_path']}/pgcarve-tf-vmlinuz-{tag}</kernel>
    <initrd>{doc['pool_path']}/pgcarve-tf-initrd-{tag}</initrd>
    <cmdline>{' '.join(sorted(['console=ttyS0', 'root=/dev/vda', 'rw quiet', 'systemd.show_status=0']))}</cmdline>
  </os>
  <features><pae></pae><acpi></acpi><apic></apic></features>
  {cpu}
  <devices>
    <disk type="volume" device="disk">
      <driver name="qemu" type="qcow2"></driver>
      <source pool="{pool}" volume="{name}.qcow2"></source>
      <target dev="vda" bus="virtio"></target>
    </disk>
    <disk type="volume" device="disk">
      <driver name="qemu" type="raw"></driver>
      <source pool="{pool}" volume="{name}-seed.iso"></source>
      <target dev="vdb" bus="virtio"></target>
    </disk>
    <interface type="network">
      <mac address="{planned['mac'].upper()}"></mac>
      <source network="{doc['network_name']}"></source>
      <model type="virtio"></model>
    </interface>
    <channel type="unix"><target type="virtio" name="org.qemu.guest_agent.0"></target></channel>
    <graphics type="spice" autoport="yes"></graphics>
    <rng model="virtio"><backend model="random">/dev/urandom</backend></rng>
  </devices>
</domain>
"""


def manager_spec(doc: dict[str, Any], name: str) -> DomainSpec:
    """The DomainSpec the manager would define for the same guest (fleet.py, _create_guest)."""
    planned, pool, tag = doc["instances"][name], doc["pool_name"], doc["image"]["tag"]
    meta = planned["metadata"]
    return DomainSpec(
        name=name, domain_type=doc["domain_type"],
        metadata=InstanceMetadata(fleet=meta["fleet"], cluster=meta["cluster"], role=meta["role"],
                                  index=meta["index"], standby=meta["standby"], created_by=meta["created_by"],
                                  roles=meta["roles"]),
        memory_mib=planned["memory_mib"], vcpu_pins=tuple(planned["vcpu_pins"]),
        emulator_cpus=tuple(planned["emulator_cpus"]), numa_node=planned["numa_node"], hugepages=planned["hugepages"],
        kernel=f"{doc['pool_path']}/pgcarve-tf-vmlinuz-{tag}", initrd=f"{doc['pool_path']}/pgcarve-tf-initrd-{tag}",
        disks=(Disk("vda", pool, f"{name}.qcow2"), Disk("vdb", pool, f"{name}-seed.iso", format="raw", readonly=True)),
        nics=(Nic(doc["network_name"], planned["mac"]),),
        console_log=f"/var/log/libvirt/qemu/{name}-console.log",
    )


def libvirt_normalised(domain_xml: str) -> str:
    """The XML libvirt (test driver) stores for a definition, without its random UUID."""
    libvirt = pytest.importorskip("libvirt")
    conn = libvirt.open("test:///default")
    try:
        dom = conn.defineXML(domain_xml)
        try:
            return re.sub(r"<uuid>[^<]*</uuid>", "", dom.XMLDesc(libvirt.VIR_DOMAIN_XML_INACTIVE))
        finally:
            dom.undefine()
    finally:
        conn.close()


@needs_terraform
@pytest.mark.skipif(shutil.which("xsltproc") is None, reason="xsltproc is missing (the provider needs it too)")
@pytest.mark.parametrize("variant", ["qemu", "kvm-hugepages"])
def test_xslt_turns_provider_xml_into_the_managers(fleet: Fleet, initialised_module: Path, tmp_path: Path,
                                                   variant: str) -> None:
    # Every slot of the host, so guests on both NUMA nodes are covered.
    doc = tfvars_document(fleet, "t0", capacity(fleet.topology("t0"), fleet.placement.planner))
    assert {planned["numa_node"] for planned in doc["instances"].values()} == {0, 1}
    if variant == "kvm-hugepages":
        doc["domain_type"] = "kvm"
        for planned in doc["instances"].values():
            planned["hugepages"] = True
    stylesheets = module_console(initialised_module, doc, "local.xslt")
    for name in doc["instances"]:
        (tmp_path / "domain.xsl").write_text(stylesheets[name])
        (tmp_path / "provider.xml").write_text(provider_xml(doc, name))
        transformed = subprocess.run(
            ["xsltproc", "--nonet", str(tmp_path / "domain.xsl"), str(tmp_path / "provider.xml")],
            capture_output=True, text=True, check=True,
        ).stdout
        expected = manager_spec(doc, name).to_xml()
        normalised = libvirt_normalised(transformed)
        assert normalised == libvirt_normalised(expected)
        root = ET.fromstring(normalised)
        assert root.get("type") == doc["domain_type"]
        assert (root.find("memoryBacking/hugepages") is not None) == (variant == "kvm-hugepages")
        assert [p.get("cpuset") for p in root.findall("cputune/vcpupin")] == [
            str(c) for c in doc["instances"][name]["vcpu_pins"]]


@needs_tflint
def test_tflint_finds_nothing() -> None:
    """TFLint with every rule of its bundled terraform ruleset, on the module and on the example
    root module that calls it."""
    for directory in (MODULE, EXAMPLE):
        proc = subprocess.run([str(TFLINT), f"--chdir={directory}", f"--config={MODULE / '.tflint.hcl'}",
                               "--format=compact"], capture_output=True, text=True, timeout=120, check=False)
        assert proc.returncode == 0, f"tflint in {directory}:\n{proc.stdout}{proc.stderr}"

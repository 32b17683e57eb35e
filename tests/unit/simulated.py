"""One simulated host for unit tests: the real Fleet and Scaler over a libvirt test-driver host
(bench/simulated_hosts.py's 128-CPU machine), where no guest boots and every guest counts as
accepting SQL at once."""

from __future__ import annotations

from pathlib import Path

from pgcarve.control.fleet import Fleet
from pgcarve.control.provisioning import Provisioner
from pgcarve.control.scaler import Scaler
from pgcarve.settings import Paths

from bench import simulated_hosts
from tests.support import testdriver as td


def one_host_fleet(tmp_path: Path) -> Fleet:
    """A fleet of one test-driver host, its state in tmp_path/state (a test:///FILE connection is
    a host of its own, state and all: close the fleet to drop it)."""
    hosts = simulated_hosts  # (the module, not its names: pytest would collect testdriver_* as tests)
    td_file = hosts.ensure_fixture(hosts.TESTDRIVER_FILE, hosts.testdriver_xml())
    caps = hosts.ensure_fixture(hosts.CAPABILITIES_FILE, hosts.capabilities_xml()).read_text()
    config = hosts.testdriver_config(1, f"test://{td_file.resolve()}")
    paths = Paths(tmp_path / "state", image_dir=td.stand_in_image(tmp_path / "image"))
    return td.testdriver_fleet(config, paths, caps)


def scaler_of(fleet: Fleet) -> Scaler:
    """The real Scaler, with guests taken as ready the moment libvirt lists them."""
    return Scaler(fleet, provisioner=Provisioner(fleet, ready=td.accepts_sql_at_once(fleet)))

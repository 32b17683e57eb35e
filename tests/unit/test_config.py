from pathlib import Path

import pytest
from pgcarve.config import load_fleet_config
from pgcarve.errors import ConfigError

SAMPLE = Path(__file__).resolve().parents[2] / "hosts.sample.yaml"


def test_sample_hosts_file_is_valid() -> None:
    config = load_fleet_config(SAMPLE)
    assert config.primary_hosts and len(config.standby_hosts) >= config.replication.standbys


@pytest.mark.parametrize("text, problem", [
    ("hosts: []", "at least one host"),
    ("hosts: [{name: a, uri: 'qemu:///system'}, {name: a, uri: 'qemu:///system'}]", "unique"),
    ("hosts: [{name: a, uri: 'not a uri'}]", "libvirt URI"),
    ("replication: {standbys: 2}\nhosts: [{name: a, uri: 'qemu:///system'}]", "standbys is 2"),
    ("instance: {vcpus: 0}\nhosts: [{name: a, uri: 'qemu:///system'}]", "instance.vcpus"),
    ("hosts: [{name: a, uri: 'qemu:///system', colour: red}]", "colour"),
    ("hosts: [a: b: c", "not valid YAML"),
])
def test_bad_hosts_files_name_the_problem(tmp_path: Path, text: str, problem: str) -> None:
    path = tmp_path / "hosts.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=problem):
        load_fleet_config(path)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_fleet_config(tmp_path / "nope.yaml")

"""The guest side of replication.roles: patroni: the seed's Patroni section, what
pgcarve-guest-setup makes of it (Patroni's configuration, the data directory Patroni starts
from), and the hosts file's rules for it."""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from pgcarve.config import FleetConfig
from pgcarve.errors import ConfigError
from pgcarve.guest.credentials import InstanceSecrets
from pgcarve.guest.seed import PatroniSeed, patroni_seed

from tests.support.seeds import guest_seed
from tests.unit.test_guest_setup import booted  # noqa: F401  (the fixture)

PATRONI = PatroniSeed(scope="pgc-01", etcd_hosts=("10.76.0.1:2379", "10.76.0.2:2379", "10.76.0.3:2379"),
                      rest_password="Rest1" + "r" * 20)
SECRETS = InstanceSecrets(app_password="App1" + "a" * 20, replication_password="Repl1" + "y" * 20,
                          patroni_password="Rest1" + "r" * 20)
ETCD = {"endpoints": ["https://127.0.0.1:4001"], "guest_endpoints": ["https://10.76.0.1:2379"],
        "ca_file": "/s/ca.pem", "cert_file": "/s/c.pem", "key_file": "/s/c.key"}


def fleet(**replication: Any) -> dict[str, Any]:
    return {"replication": {"roles": "patroni", **replication}, "etcd": ETCD,
            "hosts": [{"name": "h0", "uri": "test:///default", "role": "primary"},
                      {"name": "h1", "uri": "test:///default", "role": "standby"},
                      {"name": "h2", "uri": "test:///default", "role": "standby"}]}


def test_first_and_any_map_to_patronis_synchronous_and_quorum_modes() -> None:
    first = patroni_seed(FleetConfig.model_validate(fleet()), "pgc-01", SECRETS)
    assert first is not None and first.synchronous_mode == "on" and first.synchronous_node_count == 1
    assert first.etcd_hosts == ("10.76.0.1:2379",), "guests reach etcd on the wire, not the manager's forwards"
    quorum = patroni_seed(FleetConfig.model_validate(fleet(sync_mode="ANY")), "pgc-01", SECRETS)
    assert quorum is not None and quorum.synchronous_mode == "quorum"
    local = patroni_seed(FleetConfig.model_validate(fleet(synchronous_commit="local")), "pgc-01", SECRETS)
    assert local is not None and local.synchronous_mode == "off"
    manager = FleetConfig.model_validate({**fleet(), "replication": {"roles": "manager"}})
    assert patroni_seed(manager, "pgc-01", SECRETS) is None


def test_an_instance_without_a_patroni_password_is_refused_by_name() -> None:
    old = InstanceSecrets(app_password="App1" + "a" * 20, replication_password="Repl1" + "y" * 20)
    with pytest.raises(ConfigError, match="pgc-03 was made before Patroni"):
        patroni_seed(FleetConfig.model_validate(fleet()), "pgc-03", old)


@pytest.mark.parametrize(("change", "words"), [
    ({"etcd": None}, "needs the etcd section"),
    ({"instance": {"clusters": 2}}, "one PostgreSQL cluster per guest"),
    ({"replication": {"roles": "patroni", "patroni_ttl_s": 12}}, "must be at least"),
])
def test_the_hosts_file_refuses_what_patroni_cannot_do(change: dict[str, Any], words: str) -> None:
    with pytest.raises(ValueError, match=words):
        FleetConfig.model_validate({**fleet(), **change})


def test_patronis_configuration_holds_the_promises(booted: dict[str, Any], tmp_path: Path,  # noqa: F811
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    setup: ModuleType = booted["module"]
    monkeypatch.setattr(setup, "own_address", lambda: "10.77.1.5")
    booted["boot"](guest_seed("pgc-01-s1", "standby", patroni=PATRONI), "pgc-01-s1-1")
    config = json.loads(setup.PATRONI_CONFIG.read_text())
    dcs = config["bootstrap"]["dcs"]
    assert dcs["synchronous_mode"] is True and dcs["synchronous_mode_strict"] is True and dcs["failsafe_mode"]
    assert dcs["postgresql"]["use_pg_rewind"] and dcs["postgresql"]["use_slots"]
    assert config["watchdog"]["mode"] == "required"
    assert config["name"] == "pgc_01_s1", "members are named as their application_name"
    assert config["etcd3"]["hosts"] == list(PATRONI.etcd_hosts) and config["etcd3"]["protocol"] == "https"
    assert config["postgresql"]["connect_address"] == "10.77.1.5:5432"
    assert config["restapi"]["authentication"]["password"] == PATRONI.rest_password
    # Patroni never writes pg_hba.conf: the manager's replication rules stay.
    assert "pg_hba" not in config["postgresql"] and config["postgresql"]["parameters"]["hba_file"].endswith(
        "pg_hba.conf")
    # Patroni reads its replica's own timeline over a local replication connection, through the
    # socket: pg_hba lets the replication role in there (with its password) and nowhere else local.
    assert config["postgresql"]["use_unix_socket_repl"] is True
    hba = (setup.CONF_DIR / "pg_hba.conf").read_text().splitlines()
    assert "local replication replicator scram-sha-256" in hba, hba
    replication = (setup.CONF_DIR / "conf.d" / "56-pgcarve-replication.conf").read_text()
    assert "synchronous_standby_names" not in replication, "Patroni sets the synchronous set, not the seed"
    assert setup.PATRONI_CONFIG.stat().st_mode & 0o077 == 0, "Patroni's configuration holds passwords"


def test_a_new_primary_parks_the_image_data_for_patronis_bootstrap(booted: dict[str, Any],  # noqa: F811
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    setup: ModuleType = booted["module"]
    monkeypatch.setattr(setup, "own_address", lambda: "10.77.0.5")
    monkeypatch.setattr(setup, "image_data_untouched", lambda: True)
    monkeypatch.setattr(setup, "IMAGE_DATA", setup.DATA_DIR.with_name("image-data"))  # beside it, as in a guest
    booted["boot"](guest_seed("pgc-01", "primary", patroni=PATRONI), "pgc-01-1")
    assert not setup.DATA_DIR.exists() and setup.IMAGE_DATA.is_dir()
    assert "CREATE DATABASE" in (setup.STATE_DIR / "first-boot.sql").read_text()
    assert setup.patroni_bootstrap() == 0 and setup.DATA_DIR.is_dir()
    assert setup.patroni_bootstrap() == 1, "a second bootstrap on the same disk has nothing to start from"


def test_a_standby_not_from_the_image_starts_empty_for_patroni_to_clone(booted: dict[str, Any],  # noqa: F811
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    setup: ModuleType = booted["module"]
    monkeypatch.setattr(setup, "own_address", lambda: "10.77.2.5")
    monkeypatch.setattr(setup, "image_data_untouched", lambda: True)
    booted["boot"](guest_seed("pgc-01-s2", "standby", patroni=PATRONI), "pgc-01-s2-1")
    assert not setup.DATA_DIR.exists()
    (setup.DATA_DIR).mkdir(parents=True)  # Patroni cloned it
    booted["boot"](guest_seed("pgc-01-s2", "standby", patroni=PATRONI), "pgc-01-s2-2")
    assert setup.DATA_DIR.is_dir(), "a later boot never touches the data directory again"
    assert booted["calls"] == [], "pgcarve clones nothing itself under Patroni"

"""`pgcarve state export` / `import` (issue 32, item 2): the state only the state directory holds, in
one archive encrypted with the fleet key. A round trip restores a manager that runs the fleet; a
wrong key, a changed byte, or another fleet's state in the way: an error, and nothing written. On
libvirt's test driver."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from pgcarve.cli import state_commands
from pgcarve.cli.main import main as cli_main
from pgcarve.config import EtcdConfig, FleetConfig
from pgcarve.control.fleet import Fleet
from pgcarve.control.state_check import check_state, prepare_state
from pgcarve.errors import ConfigError, Conflict
from pgcarve.guest.credentials import load_credentials
from pgcarve.settings import Paths
from pgcarve.statedir import archive as archive_format
from pgcarve.statedir import backup, layout
from pgcarve.statedir.archive import ArchiveUnreadable, read_fleet_key
from pgcarve.statedir.layout import make_fleet_secrets

from tests.unit.simulated import one_host_fleet, scaler_of

KEY = b"0123456789abcdef-fleet-key-for-tests"


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    f = one_host_fleet(tmp_path)
    scaler_of(f).scale(2)
    (f.paths.state_dir / "operations.json").write_text(json.dumps([{"id": "op-1", "kind": "scale",
                                                                    "status": "succeeded"}]))
    fd = os.open(f.paths.token_file, os.O_WRONLY | os.O_CREAT, 0o600)
    os.write(fd, b"t" * 43)
    os.close(fd)
    yield f
    f.close()


def _tree(root: Path) -> dict[str, tuple[bytes, int]]:
    return {str(p.relative_to(root)): (p.read_bytes(), p.stat().st_mode & 0o777)
            for p in sorted(root.rglob("*")) if p.is_file()} if root.exists() else {}


def _kept(paths: Paths) -> dict[str, tuple[bytes, int]]:
    return {f.relative: ((paths.state_dir / f.relative).read_bytes(),
                         (paths.state_dir / f.relative).stat().st_mode & 0o777) for f in layout.kept_files(paths)}


def test_a_round_trip_restores_a_manager_that_runs_the_fleet(fleet: Fleet, tmp_path: Path) -> None:
    archive = tmp_path / "backup" / "fleet.state"
    old = os.umask(0)
    try:
        bundle = backup.export_state(fleet.paths, fleet.config, archive, KEY)
    finally:
        os.umask(old)
    assert archive.stat().st_mode & 0o777 == 0o600, "0600 whatever the umask"
    kept = {e.path for e in bundle.entries}
    assert {"secrets.json", "tls/ca.key", "tls/ca.pem", "instances/pgcbench-01.json", "instances/pgcbench-02.json",
            "api-token", "operations.json", "topology/db1.xml"} <= kept, kept
    assert not any(p.startswith(("image", "sandbox", "servers", "manager.lock")) for p in kept)
    sealed = archive.read_bytes()
    for secret in (load_credentials(fleet.paths.secrets_file).admin_password.encode(), fleet.ca.load().key_pem[30:60]):
        assert secret not in sealed, "the archive is encrypted"

    # A fresh machine: an empty state directory, the same hosts.
    fresh = Paths(tmp_path / "fresh-state", image_dir=fleet.paths.image_dir)
    restored = Fleet(fleet.config, fresh, hosts=fleet.hosts)
    with pytest.raises(ConfigError, match="pgcarve state import"):
        check_state(restored)  # before the import: refused, nothing made
    assert not fresh.secrets_file.exists()
    old = os.umask(0)
    try:
        plan = backup.plan_import(fresh, backup.read_archive(archive, KEY))
        written = backup.apply_import(fresh, plan, force=False)
    finally:
        os.umask(old)
    assert len(written) == len(bundle.entries) and _kept(fresh) == _kept(fleet.paths)
    assert fresh.secrets_file.stat().st_mode & 0o777 == 0o600
    assert fresh.instance_secrets_dir.stat().st_mode & 0o777 == 0o700
    assert prepare_state(restored) == [], "nothing new made: the fleet's own secrets are back"
    assert restored.credentials == fleet.credentials and restored.ca.load() == fleet.ca.load()
    scaler_of(restored).scale(3)  # seeds a new instance with the fleet's admin password and CA
    assert sorted(i.name for i in restored.observe(with_endpoints=False)) == [
        "pgcbench-01", "pgcbench-02", "pgcbench-03"]
    assert restored.instance_secrets("pgcbench-01") == fleet.instance_secrets("pgcbench-01")

    again = backup.plan_import(fresh, backup.read_archive(archive, KEY))
    assert again.different == () and len(again.same) >= len(bundle.entries) - 2, "a second import: the same files"


def test_a_wrong_key_or_a_changed_byte_writes_nothing(fleet: Fleet, tmp_path: Path) -> None:
    archive = tmp_path / "fleet.state"
    backup.export_state(fleet.paths, fleet.config, archive, KEY)
    sealed = archive.read_bytes()
    fresh = Paths(tmp_path / "fresh")
    with pytest.raises(ArchiveUnreadable, match="the fleet key does not open"):
        backup.read_archive(archive, b"another-key-of-enough-length")
    for at in (len(archive_format.MAGIC) + 3, len(sealed) // 2, len(sealed) - 1):  # salt, payload, tag
        changed = bytearray(sealed)
        changed[at] ^= 0x01
        archive.write_bytes(bytes(changed))
        with pytest.raises(ArchiveUnreadable, match="changed or damaged"):
            backup.read_archive(archive, KEY)
    archive.write_bytes(sealed[:40])
    with pytest.raises(ArchiveUnreadable, match="cut short"):
        backup.read_archive(archive, KEY)
    archive.write_bytes(b"PK\x03\x04 not ours")
    with pytest.raises(ArchiveUnreadable, match="not a pgcarve state archive"):
        backup.read_archive(archive, KEY)
    assert not fresh.state_dir.exists()


def test_an_archive_holding_a_file_pgcarve_does_not_keep_is_refused(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "state")
    make_fleet_secrets(paths)
    bundle = backup.collect(paths, None)
    evil = backup.Bundle(None, 0.0, "", (*bundle.entries, backup.Entry("../../etc/cron.d/x", "x", 0o644, b"boom")))
    archive = tmp_path / "evil.state"
    archive.write_bytes(archive_format.seal(backup._payload(evil), KEY))
    with pytest.raises(ArchiveUnreadable, match="no file of a state directory pgcarve keeps"):
        backup.read_archive(archive, KEY)


def test_import_over_another_fleet_is_refused_and_says_what_differs(fleet: Fleet, tmp_path: Path) -> None:
    archive = tmp_path / "fleet.state"
    backup.export_state(fleet.paths, fleet.config, archive, KEY)
    other = Paths(tmp_path / "other-state")
    make_fleet_secrets(other)  # another fleet's admin password and CA
    before = _tree(other.state_dir)
    plan = backup.plan_import(other, backup.read_archive(archive, KEY))
    with pytest.raises(Conflict) as refused:
        backup.apply_import(other, plan, force=False)
    message = str(refused.value)
    assert "nothing imported" in message and "--force" in message
    assert f"{other.secrets_file} (the fleet's admin password)" in message
    assert f"{other.tls_dir / 'ca.key'} (the fleet CA's private key)" in message
    assert _tree(other.state_dir) == before, "refused: nothing written, not even the files that were missing"
    backup.apply_import(other, plan, force=True)
    assert _kept(other) == _kept(fleet.paths)
    with pytest.raises(Conflict, match="fleet 'pgcbench', but the hosts file names fleet 'prod'"):
        backup.check_fleet_name(backup.read_archive(archive, KEY),
                                fleet.config.model_copy(update={"fleet": "prod"}), str(archive))


def test_etcd_client_files_kept_elsewhere_travel_too(tmp_path: Path) -> None:
    paths = Paths(tmp_path / "state")
    make_fleet_secrets(paths)
    etcd_dir = tmp_path / "etc-pgcarve-etcd"
    etcd_dir.mkdir()
    files = {name: etcd_dir / name for name in ("ca.pem", "manager.pem", "manager.key")}
    for name, path in files.items():
        path.write_bytes(f"pem of {name}".encode())
    config = FleetConfig.model_validate({
        "fleet": "pgc", "hosts": [{"name": "h1", "uri": "test:///default", "role": "primary"}],
        "replication": {"standbys": 0},
        "etcd": EtcdConfig(endpoints=["https://127.0.0.1:2379"], ca_file=str(files["ca.pem"]),
                           cert_file=str(files["manager.pem"]), key_file=str(files["manager.key"])).model_dump()})
    archive = tmp_path / "fleet.state"
    backup.export_state(paths, config, archive, KEY)
    for path in files.values():
        path.unlink()
    fresh = Paths(tmp_path / "fresh")
    written = backup.apply_import(fresh, backup.plan_import(fresh, backup.read_archive(archive, KEY)), force=False)
    assert {str(p) for p in files.values()} <= {e.path for e in written}
    assert files["manager.key"].read_bytes() == b"pem of manager.key"
    assert files["manager.key"].stat().st_mode & 0o777 == 0o600


def test_the_fleet_key_file_is_checked(tmp_path: Path) -> None:
    key = tmp_path / "fleet.key"
    with pytest.raises(ConfigError, match="does not exist"):
        read_fleet_key(key)
    key.write_bytes(b"short\n")
    key.chmod(0o600)
    with pytest.raises(ConfigError, match="5 bytes long: it must be 16 to 4096"):
        read_fleet_key(key)
    key.write_bytes(KEY + b"\n")
    key.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        read_fleet_key(key)
    key.chmod(0o600)
    assert read_fleet_key(key) == KEY


def test_the_commands(fleet: Fleet, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                      capsys: pytest.CaptureFixture[str]) -> None:
    hosts_file = tmp_path / "hosts.yaml"
    hosts_file.write_text(yaml.safe_dump(fleet.config.model_dump(mode="json")))
    key = tmp_path / "fleet.key"
    key.write_bytes(KEY)
    key.chmod(0o600)
    archive = tmp_path / "fleet.state"
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fleet.paths.state_dir))
    monkeypatch.delenv("PGCARVE_FLEET_KEY_FILE", raising=False)
    base = ["--hosts-file", str(hosts_file), "state"]
    assert cli_main([*base, "export", str(archive)]) == 2
    assert "no fleet key: give --key-file FILE or set PGCARVE_FLEET_KEY_FILE" in capsys.readouterr().err
    assert not archive.exists()
    assert cli_main([*base, "export", str(archive), "--key-file", str(key)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "2 x an instance's passwords" in printed and "(fleet pgcbench)" in printed and "mode 0600" in printed

    fresh = tmp_path / "fresh"
    monkeypatch.setenv("PGCARVE_STATE_DIR", str(fresh))
    monkeypatch.setenv("PGCARVE_FLEET_KEY_FILE", str(key))
    wrong = tmp_path / "wrong.key"
    wrong.write_bytes(b"w" * 32)
    wrong.chmod(0o600)
    assert cli_main([*base, "import", str(archive), "--key-file", str(wrong)]) == 2
    assert "the fleet key does not open" in " ".join(capsys.readouterr().err.split())
    assert not fresh.exists()
    assert cli_main([*base, "import", str(archive)]) == 0
    printed = " ".join(capsys.readouterr().out.split())
    assert "file(s) written, 0 already the same" in printed
    assert _kept(Paths(fresh)) == _kept(fleet.paths)
    monkeypatch.setattr(state_commands, "read_server", lambda _paths: {"pid": 4242, "url": "http://127.0.0.1:9"})
    assert cli_main([*base, "import", str(archive)]) == 7
    assert "a pgcarve server (pid 4242" in " ".join(capsys.readouterr().err.split())

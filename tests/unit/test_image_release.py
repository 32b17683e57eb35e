"""The guest image's Debian release: images/build.sh takes it (trixie by default, bookworm for
comparisons), it is part of the image's cache key, and nothing the guest runs or the manager tells
a guest names a PostgreSQL major version (the image records its own in
/usr/share/pgcarve/postgresql-major)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from types import ModuleType

from pgcarve.guest.image import LocalImage
from pgcarve.postgres.conninfo import GUEST_CA_FILE

from tests.support.guest_script import load_guest_script

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "images" / "build.sh"
ROOTFS = REPO / "images" / "rootfs"
# A path or unit name that names a major: /etc/postgresql/15/main, postgresql@17-main, postgresql-15.
MAJOR_IN_NAME = re.compile(r"postgresql[/@-]1[0-9]\b|/1[0-9]/main\b|\b1[0-9]-main\b")


def build(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(BUILD), *args], capture_output=True, text=True, timeout=60)


def test_no_guest_file_names_a_postgresql_major() -> None:
    named = [f"{path.relative_to(REPO)}:{n}: {line.strip()}"
             for path in sorted(ROOTFS.rglob("*")) if path.is_file()
             for n, line in enumerate(path.read_text().splitlines(), 1) if MAJOR_IN_NAME.search(line)]
    assert named == []
    assert not any(part.isdigit() for path in ROOTFS.rglob("*") for part in path.relative_to(ROOTFS).parts)


def test_guest_programs_read_the_major_the_image_records() -> None:
    finish = (ROOTFS / "usr" / "local" / "sbin" / "pgcarve-image-finish").read_text()
    assert 'echo "$major" > /usr/share/pgcarve/postgresql-major' in finish
    for name in ("pgcarve-guest-setup", "pgcarve-clusters", "pgcarve-watchdog"):
        script = load_guest_script(name)
        assert str(script.MAJOR_FILE) == "/usr/share/pgcarve/postgresql-major", name


def test_the_manager_names_the_ca_where_the_guest_writes_it() -> None:
    setup: ModuleType = load_guest_script("pgcarve-guest-setup")
    clusters: ModuleType = load_guest_script("pgcarve-clusters")
    assert str(setup.TLS_CA) == str(clusters.TLS_CA) == GUEST_CA_FILE == "/etc/pgcarve/tls/ca.pem"
    # Not under the PostgreSQL configuration directory, whose path names the major.
    assert not str(setup.TLS_CA).startswith("/etc/postgresql")


def test_every_cluster_waits_for_the_guest_setup_whatever_its_version() -> None:
    system = ROOTFS / "etc" / "systemd" / "system"
    dropin = (system / "postgresql@.service.d" / "50-pgcarve.conf").read_text()
    assert "Requires=pgcarve-guest-setup.service" in dropin and "After=pgcarve-guest-setup.service" in dropin
    setup = (system / "pgcarve-guest-setup.service").read_text()
    assert "Before=postgresql.service" in setup
    passwords = (system / "pgcarve-guest-passwords.service").read_text()
    assert "After=postgresql.service" in passwords and "Requires=postgresql.service" in passwords


def test_the_release_is_part_of_the_image_cache_key() -> None:
    default, trixie, bookworm = (build(*args, "--inputs-hash") for args in ((), ("--release", "trixie"),
                                                                          ("--release", "bookworm")))
    assert default.returncode == trixie.returncode == bookworm.returncode == 0, default.stderr
    assert re.fullmatch(r"[0-9a-f]{64}\n", default.stdout)
    assert default.stdout == trixie.stdout != bookworm.stdout


def test_an_unknown_release_is_refused_naming_the_known_ones(tmp_path: Path) -> None:
    out = tmp_path / "image"
    result = build("--release", "sid", str(out))
    assert result.returncode == 2
    assert "release 'sid'" in result.stderr and "trixie" in result.stderr and "bookworm" in result.stderr
    assert not out.exists()
    assert build("--release").returncode == 2
    assert build(str(out), "extra").returncode == 2


def test_versions_env_is_read_as_the_build_wrote_it(tmp_path: Path) -> None:
    assert LocalImage(tmp_path).versions() == {}
    (tmp_path / "versions.env").write_text(
        "release=trixie\nkernel=6.12.118+deb13-cloud-amd64\npostgresql_major=17\npostgresql=17.12-0+deb13u1\n"
        "patroni=4.0.7-3~deb13u1\npgbackrest=2.55.1-1\n")
    versions = LocalImage(tmp_path).versions()
    assert versions["release"] == "trixie" and versions["postgresql_major"] == "17"
    assert versions["kernel"] == "6.12.118+deb13-cloud-amd64" and versions["patroni"] == "4.0.7-3~deb13u1"
    # The build records every one of these (bench and status name them).
    script = BUILD.read_text()
    for key in ("release", "kernel", "postgresql_major", "postgresql", "patroni", "pgbackrest"):
        assert f'echo "{key}=' in script, key

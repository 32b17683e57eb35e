"""The guest image's boot path: the initramfs' fast /init and the units and generators masked.

The fast init itself runs in every guest the integration tests boot; what can be checked without
booting is that the scripts parse, that the hook keeps initramfs-tools' init as the fallback,
and that every way the fast init gives up leads to that fallback.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOTFS = Path(__file__).resolve().parents[2] / "images" / "rootfs"
FAST_INIT = ROOTFS / "usr" / "share" / "pgcarve" / "fast-init"
HOOK = ROOTFS / "etc" / "initramfs-tools" / "hooks" / "pgcarve-fast-init"
FINISH = ROOTFS / "usr" / "local" / "sbin" / "pgcarve-image-finish"


@pytest.mark.parametrize("script", [FAST_INIT, HOOK, FINISH], ids=lambda p: p.name)
def test_boot_scripts_parse_as_posix_sh(script: Path) -> None:
    dash = shutil.which("dash") or shutil.which("sh")
    assert dash is not None
    result = subprocess.run([dash, "-n", str(script)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_hook_keeps_initramfs_tools_init_beside_the_fast_one() -> None:
    hook = HOOK.read_text()
    assert 'mv "$DESTDIR/init" "$DESTDIR/init.initramfs-tools"' in hook
    assert 'install -m 0755 /usr/share/pgcarve/fast-init "$DESTDIR/init"' in hook
    finish = FINISH.read_text()
    assert "/usr/share/pgcarve/fast-init /etc/initramfs-tools/hooks/pgcarve-fast-init" in finish
    # The hook must be in place before the initramfs is made.
    assert finish.index("pgcarve-fast-init") < finish.index("update-initramfs")


def test_every_way_the_fast_init_gives_up_boots_with_initramfs_tools() -> None:
    init = FAST_INIT.read_text()
    body = init[init.index("full_init() {"):]
    fallback = body[:body.index("\n}\n")]
    assert 'exec /init.initramfs-tools "$@"' in fallback
    # What it mounted is undone first, so initramfs-tools' init starts from a clean slate.
    assert [m for m in ("/sys", "/proc", "/dev") if f"umount {m}" in fallback] == ["/sys", "/proc", "/dev"]
    gives_up = re.findall(r'full_init "([^"]+)" "\$@"', init)
    assert len(gives_up) == 4, gives_up  # root not a device, no driver, no disk, no mount
    # The directories it mounts on are made first: an initramfs has none of them.
    assert init.index("mkdir -p /dev /proc /sys /root") < init.index("mount -t devtmpfs")
    assert 'exec run-init /root "$init" "$@"' in init


def test_masked_generators_and_units_leave_what_a_guest_needs() -> None:
    finish = FINISH.read_text()
    generators = re.search(r"for generator in (.*?); do", finish, re.S)
    assert generators is not None
    masked = set(generators.group(1).replace("\\", " ").split())
    assert masked and not masked & {"systemd-fstab-generator", "systemd-getty-generator", "postgresql-generator"}
    units = re.search(r"systemctl mask systemd-binfmt.service(.*?)\n(?!  )", finish, re.S)
    assert units is not None
    for needed in ("systemd-networkd", "systemd-udevd", "systemd-journald", "postgresql", "qemu-guest-agent",
                   "dbus", "dev-hugepages"):
        assert needed not in units.group(0), f"{needed} must not be masked"

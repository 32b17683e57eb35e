"""What a report names: this machine's kernel, pgbench, PostgreSQL and QEMU versions, and the
guest image's (its versions.env, written when the image is built)."""

from __future__ import annotations

import contextlib
import glob
import platform
import shutil
import subprocess
from pathlib import Path

from pgcarve.postgres.pgbench import pgbench_path


def host_versions() -> dict[str, str]:
    """The host kernel (release and /proc/version), pgbench, a local PostgreSQL server, QEMU."""
    versions = {"kernel": platform.release(), "proc_version": Path("/proc/version").read_text().strip()}
    with contextlib.suppress(Exception):
        versions["pgbench"] = subprocess.run([pgbench_path(), "--version"], capture_output=True, text=True,
                                             check=False).stdout.strip()
    for server in sorted(glob.glob("/usr/lib/postgresql/*/bin/postgres")):
        with contextlib.suppress(Exception):
            versions["postgresql_server"] = subprocess.run([server, "--version"], capture_output=True, text=True,
                                                           check=False).stdout.strip()
    qemu = shutil.which("qemu-system-x86_64")
    if qemu:
        with contextlib.suppress(Exception):
            versions["qemu"] = subprocess.run([qemu, "--version"], capture_output=True, text=True,
                                              check=False).stdout.splitlines()[0]
    return versions

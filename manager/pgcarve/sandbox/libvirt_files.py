"""The files a sandbox host's libvirtd and virtlogd start with, and the script that starts them."""

from __future__ import annotations

from pathlib import Path

# Runs inside `ip netns exec NS unshare --mount`: make the libvirt paths private, then start the
# daemons. Values arrive as positional arguments, never pasted into the script.
START_DAEMONS = r"""
set -eu
host_dir=$1
mount --make-rprivate /
mount -t tmpfs -o mode=0755 pgcarve-run /run
mkdir -p /run/libvirt /run/lock
for d in etc:/etc/libvirt lib:/var/lib/libvirt log:/var/log/libvirt cache:/var/cache/libvirt; do
  mkdir -p "$host_dir/${d%%:*}" "${d#*:}"
  mount --bind "$host_dir/${d%%:*}" "${d#*:}"
done
# What runs on the host over ssh (virt-ssh-helper) looks for libvirtd's socket where it would be.
ln -s "$2/libvirt-sock" /run/libvirt/libvirt-sock
virtlogd -d -p "$host_dir/pids/virtlogd.pid" -f /etc/libvirt/virtlogd.conf
libvirtd -d -p "$host_dir/pids/libvirtd.pid" -f /etc/libvirt/libvirtd.conf
if [ -n "$3" ]; then mkdir -p /run/sshd && /usr/sbin/sshd -f "$3"; fi
"""


def write_libvirt_config(host_dir: Path, socket_dir: Path) -> None:
    etc = host_dir / "etc"
    log = "/var/log/libvirt"
    (etc / "libvirtd.conf").write_text(
        "# pgcarve sandbox host: unix socket only, in a directory outside the private /run\n"
        f'unix_sock_dir = "{socket_dir}"\n'
        'unix_sock_rw_perms = "0700"\n'
        'auth_unix_rw = "none"\n'
        'auth_unix_ro = "none"\n'
        f'log_outputs = "3:file:{log}/libvirtd.log"\n'
    )
    (etc / "virtlogd.conf").write_text(f'log_outputs = "3:file:{log}/virtlogd.log"\n')
    (etc / "qemu.conf").write_text(
        "# Guests run as root inside the sandbox; no MAC security driver in a namespace.\n"
        'user = "root"\ngroup = "root"\nsecurity_driver = "none"\nremember_owner = 0\n'
    )
    for name in ("network.conf",):
        (etc / name).write_text("")

#!/usr/bin/env bash
# Build the pgcarve guest image from Debian's own packages (no cloud image download).
#
#   images/build.sh OUT_DIR
#
# Produces OUT_DIR/{base.qcow2,vmlinuz,initrd.img,inputs.sha256,image.tag}. The build is skipped
# when OUT_DIR/inputs.sha256 matches the hash of this script and images/rootfs/ (content hash).
# image.tag names this build, not only its inputs: two builds of the same inputs differ (each
# initdb makes a new system identifier), and a standby that starts from the image's own data
# directory must boot the very build its primary does (see pgcarve-guest-setup, from_image).
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
out=${1:?usage: build.sh OUT_DIR}
disk_size=${PGCARVE_IMAGE_SIZE:-4G}
packages=(
  systemd-sysv udev dbus linux-image-cloud-amd64 initramfs-tools
  postgresql-15 postgresql-client-15 cloud-init qemu-guest-agent
  iproute2 netbase procps python3
)

inputs_hash() {
  (cd "$here" && { sha256sum build.sh; find rootfs -type f -print0 | sort -z | xargs -0 sha256sum; } \
    | sha256sum | cut -d' ' -f1)
}

want=$(inputs_hash)
if [[ -f "$out/inputs.sha256" && "$(cat "$out/inputs.sha256")" == "$want" \
      && -f "$out/base.qcow2" && -f "$out/vmlinuz" && -f "$out/initrd.img" && -f "$out/image.tag" ]]; then
  echo "image: up to date ($out, inputs $want)"
  exit 0
fi

# Use the same Debian mirror as the build machine's apt configuration.
sources=/etc/apt/sources.list.d/debian.sources
[[ -f $sources ]] || sources=/etc/apt/sources.list
[[ -f $sources ]] || { echo "image: no apt sources found on this machine" >&2; exit 1; }

mkdir -p "$out"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root

echo "image: bootstrapping Debian 12 root (mmdebstrap) into $root"
mmdebstrap --variant=apt --mode=root --quiet \
  --include="$(IFS=,; echo "${packages[*]}")" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --customize-hook="sync-in '$here/rootfs' /" \
  --customize-hook='chroot "$1" /usr/local/sbin/pgcarve-image-finish' \
  bookworm "$root" "$sources"

echo "image: copying kernel and initrd for direct boot"
cp "$(ls -1 "$root"/boot/vmlinuz-* | sort -V | tail -n1)" "$work/vmlinuz"
cp "$(ls -1 "$root"/boot/initrd.img-* | sort -V | tail -n1)" "$work/initrd.img"

echo "image: making ext4 filesystem ($disk_size) and qcow2"
truncate -s "$disk_size" "$work/root.raw"
mkfs.ext4 -q -L pgcarve-root -d "$root" "$work/root.raw"
qemu-img convert -f raw -O qcow2 -c "$work/root.raw" "$work/base.qcow2"

# Record versions so benchmarks and status can report what runs inside the guests.
{
  echo "kernel=$(basename "$(ls -1 "$root"/boot/vmlinuz-* | sort -V | tail -n1)" | sed 's/^vmlinuz-//')"
  echo "postgresql=$(chroot "$root" dpkg-query -W -f='${Version}' postgresql-15)"
  echo "cloud_init=$(chroot "$root" dpkg-query -W -f='${Version}' cloud-init)"
} > "$work/versions.env"

# The tag: the inputs' hash and the data directory's identity (system identifier and checkpoint,
# written by pgcarve-image-finish), hashed to 12 hex digits for volume names.
[[ -s "$root/usr/share/pgcarve/image-checkpoint" ]] || { echo "image: no image-checkpoint in the root" >&2; exit 1; }
printf '%s %s\n' "$want" "$(cat "$root/usr/share/pgcarve/image-checkpoint")" | sha256sum | cut -c1-12 > "$work/image.tag"

mv -f "$work/base.qcow2" "$work/vmlinuz" "$work/initrd.img" "$work/versions.env" "$work/image.tag" "$out/"
echo "$want" > "$out/inputs.sha256"
echo "image: built $out/base.qcow2 ($(du -h "$out/base.qcow2" | cut -f1)), inputs $want, tag $(cat "$out/image.tag")"

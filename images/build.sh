#!/usr/bin/env bash
# Build the pgcarve guest image from Debian's own packages (no cloud image download).
#
#   images/build.sh [--release trixie|bookworm] OUT_DIR
#   images/build.sh [--release trixie|bookworm] --inputs-hash    (prints the cache key, builds nothing)
#
# --release picks the Debian release (default trixie, Debian 13: PostgreSQL 17, kernel 6.12);
# bookworm (Debian 12: PostgreSQL 15, kernel 6.1) stays buildable for comparisons, into its own
# OUT_DIR (`make image RELEASE=bookworm` uses $(STATE)/image-bookworm).
#
# Produces OUT_DIR/{base.qcow2,vmlinuz,initrd.img,versions.env,inputs.sha256,image.tag}. The build
# is skipped when OUT_DIR/inputs.sha256 matches the hash of the release, this script and
# images/rootfs/ (content hash). image.tag names this build, not only its inputs: two builds of the
# same inputs differ (each initdb makes a new system identifier), and a standby that starts from
# the image's own data directory must boot the very build its primary does (see
# pgcarve-guest-setup, from_image).
set -euo pipefail

usage() { echo "usage: build.sh [--release trixie|bookworm] OUT_DIR | --inputs-hash" >&2; exit 2; }

release=trixie
print_hash=
while [[ $# -gt 0 ]]; do
  case $1 in
    --release) [[ $# -ge 2 ]] || usage; release=$2; shift 2 ;;
    --release=*) release=${1#--release=}; shift ;;
    --inputs-hash) print_hash=1; shift ;;
    -*) usage ;;
    *) break ;;
  esac
done
[[ -n $print_hash && $# -eq 0 || -z $print_hash && $# -eq 1 ]] || usage
out=${1:-}

# Each release's PostgreSQL major: Debian ships one per release. The guest programs read it from
# /usr/share/pgcarve/postgresql-major (written by pgcarve-image-finish), never a fixed number.
declare -A pg_major=([bookworm]=15 [trixie]=17)
[[ -n ${pg_major[$release]:-} ]] || {
  echo "image: release '$release' is not one this build knows (known: ${!pg_major[*]})" >&2; exit 2; }
major=${pg_major[$release]}

here=$(cd "$(dirname "$0")" && pwd)
disk_size=${PGCARVE_IMAGE_SIZE:-4G}
packages=(
  systemd-sysv udev dbus linux-image-cloud-amd64 initramfs-tools
  "postgresql-$major" "postgresql-client-$major" qemu-guest-agent
  iproute2 netbase procps python3
  # Patroni runs from pgcarve-patroni.service under replication.roles: patroni; its etcd3 client
  # needs python3-etcd, which Debian only recommends. pgBackRest is installed, not started yet.
  patroni python3-etcd pgbackrest
)

inputs_hash() {
  (cd "$here" && { echo "release $release"; sha256sum build.sh; find rootfs -type f -print0 | sort -z | xargs -0 sha256sum; } \
    | sha256sum | cut -d' ' -f1)
}

want=$(inputs_hash)
[[ -z $print_hash ]] || { echo "$want"; exit 0; }
if [[ -f "$out/inputs.sha256" && "$(cat "$out/inputs.sha256")" == "$want" \
      && -f "$out/base.qcow2" && -f "$out/vmlinuz" && -f "$out/initrd.img" && -f "$out/image.tag" ]]; then
  echo "image: up to date ($out, Debian $release, inputs $want)"
  exit 0
fi

# The build machine's apt sources name the mirror. For its own release they are used as they are;
# for another release the same entries get that release's suites (bookworm-updates becomes
# trixie-updates), signed by Debian's archive keyring, which must carry the release's key.
host_sources=/etc/apt/sources.list.d/debian.sources
[[ -f $host_sources ]] || host_sources=/etc/apt/sources.list
[[ -f $host_sources ]] || { echo "image: no apt sources found on this machine" >&2; exit 1; }
host_release=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")
keyring=/usr/share/keyrings/debian-archive-keyring.gpg

mkdir -p "$out"
work=$(mktemp -d "$out/.build.XXXXXX")
trap 'rm -rf "$work"' EXIT
root=$work/root

if [[ $release == "$host_release" ]]; then
  sources=$host_sources
else
  [[ $host_sources == *.sources ]] || {
    echo "image: deriving $release sources needs deb822 sources ($host_sources is not)" >&2; exit 1; }
  [[ -n $host_release ]] || { echo "image: /etc/os-release names no VERSION_CODENAME" >&2; exit 1; }
  [[ -f /usr/share/keyrings/debian-archive-$release-stable.gpg && -f $keyring ]] || {
    echo "image: Debian's archive keyring has no $release key (install a newer debian-archive-keyring)" >&2; exit 1; }
  sources=$work/$release.sources
  awk -v from="$host_release" -v to="$release" -v keyring="$keyring" '
    /^Suites:/ { line = "Suites:"
                 for (i = 2; i <= NF; i++) { s = $i; if (index(s, from) == 1) s = to substr(s, length(from) + 1); line = line " " s }
                 print line; next }
    /^Signed-By:/ { print "Signed-By: " keyring; next }
    { print }' "$host_sources" > "$sources"
  grep -q "^Suites:.*\b$release\b" "$sources" || {
    echo "image: $host_sources lists no $host_release suite to derive $release from" >&2; exit 1; }
fi

echo "image: bootstrapping Debian $release root (PostgreSQL $major, mmdebstrap) into $root"
mmdebstrap --variant=apt --mode=root --quiet \
  --include="$(IFS=,; echo "${packages[*]}")" \
  --dpkgopt='path-exclude=/usr/share/man/*' \
  --dpkgopt='path-exclude=/usr/share/doc/*' \
  --dpkgopt='path-exclude=/usr/share/locale/*' \
  --dpkgopt='path-include=/usr/share/locale/locale.alias' \
  --customize-hook="sync-in '$here/rootfs' /" \
  --customize-hook="chroot \"\$1\" env PGCARVE_POSTGRESQL_MAJOR=$major /usr/local/sbin/pgcarve-image-finish" \
  "$release" "$root" "$sources"

echo "image: copying kernel and initrd for direct boot"
cp "$(ls -1 "$root"/boot/vmlinuz-* | sort -V | tail -n1)" "$work/vmlinuz"
cp "$(ls -1 "$root"/boot/initrd.img-* | sort -V | tail -n1)" "$work/initrd.img"

# Record versions so benchmarks and status can report what runs inside the guests (read by
# manager/pgcarve/guest/image.py).
version_of() { chroot "$root" dpkg-query -W -f='${Version}' "$1"; }
{
  echo "release=$release"
  echo "debian=$(cat "$root/etc/debian_version")"
  echo "kernel=$(basename "$(ls -1 "$root"/boot/vmlinuz-* | sort -V | tail -n1)" | sed 's/^vmlinuz-//')"
  echo "postgresql_major=$major"
  echo "postgresql=$(version_of "postgresql-$major")"
  echo "patroni=$(version_of patroni)"
  echo "pgbackrest=$(version_of pgbackrest)"
} > "$work/versions.env"

echo "image: making ext4 filesystem ($disk_size) and qcow2"
truncate -s "$disk_size" "$work/root.raw"
mkfs.ext4 -q -L pgcarve-root -d "$root" "$work/root.raw"
qemu-img convert -f raw -O qcow2 -c "$work/root.raw" "$work/base.qcow2"

# The tag: the inputs' hash and the data directory's identity (system identifier and checkpoint,
# written by pgcarve-image-finish), hashed to 12 hex digits for volume names.
[[ -s "$root/usr/share/pgcarve/image-checkpoint" ]] || { echo "image: no image-checkpoint in the root" >&2; exit 1; }
printf '%s %s\n' "$want" "$(cat "$root/usr/share/pgcarve/image-checkpoint")" | sha256sum | cut -c1-12 > "$work/image.tag"

mv -f "$work/base.qcow2" "$work/vmlinuz" "$work/initrd.img" "$work/versions.env" "$work/image.tag" "$out/"
echo "$want" > "$out/inputs.sha256"
echo "image: built $out/base.qcow2 ($(du -h "$out/base.qcow2" | cut -f1)), Debian $release, inputs $want, tag $(cat "$out/image.tag")"

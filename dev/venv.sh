#!/usr/bin/env bash
# dev/venv.sh VENV - make the project's virtualenv: every package at its constraints.txt version,
# installed from a wheel cache outside the clone, so a fresh clone on a machine that built the
# wheels once installs them without the network (~15 s) instead of downloading and compiling
# (libvirt-python builds from source).
#
# The cache is $PGCARVE_CACHE/wheels/<key>, the key a hash of constraints.txt and pyproject.toml:
# a change to either makes a new cache. Each cache lists the sha256 of every wheel it holds,
# checked before use; a cache that fails the check, or from which pip cannot install, is built
# again from the package index. PGCARVE_CACHE defaults to /var/cache/pgcarve as root, else
# ~/.cache/pgcarve.
set -euo pipefail

venv=${1:?usage: dev/venv.sh VENV}
python=${PYTHON:-python3}
repo=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")/.." && pwd -P)
cd "$repo"
if [[ -z ${PGCARVE_CACHE:-} ]]; then
  if [[ $(id -u) == 0 ]]; then PGCARVE_CACHE=/var/cache/pgcarve; else PGCARVE_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pgcarve; fi
fi
key=$(cat constraints.txt pyproject.toml | sha256sum | cut -c1-16)
wheels=$PGCARVE_CACHE/wheels/$key
export PIP_CACHE_DIR=$PGCARVE_CACHE/pip   # downloads and built wheels, for a cache being (re)built
export PIP_DISABLE_PIP_VERSION_CHECK=1

"$python" -c 'import sys; assert sys.version_info >= (3, 11), "pgcarve needs Python 3.11+"'
[[ -x $venv/bin/python ]] || "$python" -m venv "$venv"
py=$venv/bin/python

intact() { [[ -f $wheels/SHA256SUMS ]] && (cd "$wheels" && sha256sum --check --quiet --strict SHA256SUMS); }

install_from_cache() {
  "$py" -m pip install -q --no-index --find-links "$wheels" -c constraints.txt pip \
  && "$py" -m pip install -q --no-index --find-links "$wheels" -c constraints.txt -e '.[dev]'
}

build_cache() {
  echo "venv: building the wheel cache $wheels (once per constraints.txt)"
  local tmp=$wheels.tmp.$$
  rm -rf -- "$tmp"
  mkdir -p "$tmp"
  "$py" -m pip install -q -c constraints.txt --upgrade pip
  # pip itself, the build backend an editable install needs, and every dependency; not pgcarve.
  "$py" -m pip download -q --no-deps -c constraints.txt -d "$tmp" pip
  "$py" -m pip wheel -q -c constraints.txt -w "$tmp" 'setuptools>=68' '.[dev]'
  rm -f -- "$tmp"/pgcarve-*.whl
  (cd "$tmp" && sha256sum -- * >SHA256SUMS)
  rm -rf -- "$wheels"
  mv -- "$tmp" "$wheels"
}

mkdir -p "$PGCARVE_CACHE/wheels"
exec 9>"$PGCARVE_CACHE/wheels/.lock"   # one clone builds a cache at a time; the others wait for it
flock 9
if intact && install_from_cache; then
  echo "venv: installed from the wheel cache $wheels"
  exit 0
fi
[[ -d $wheels ]] && echo "venv: the wheel cache $wheels failed its checksums or its install; building it again"
build_cache
install_from_cache || { echo "venv: installing from the freshly built wheel cache $wheels failed" >&2; exit 1; }
echo "venv: installed from the wheel cache $wheels"

#!/usr/bin/env bash
# Build the dashboard's third-party assets into static/vendor/ (gitignored).
#
# uPlot comes from the npm registry at the exact version pinned in package.json; `npm ci`
# installs exactly what package-lock.json lists and checks each tarball against the lockfile's
# integrity hash. Only two files are copied out, so the page loads nothing from elsewhere:
#   vendor/uPlot.iife.min.js  vendor/uPlot.min.css
#
# npm runs in a temporary directory (removed on exit), so nothing but vendor/ lands here.
# Idempotent: a stamp holding the lockfile's sha256 makes a re-run with an unchanged lockfile
# a no-op (no npm call). --force rebuilds anyway. Needs node + npm (Debian: apt-get install npm).
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
vendor="$here/vendor"
stamp="$vendor/.package-lock.sha256"
files=(uPlot.iife.min.js uPlot.min.css)

force=0
case "${1:-}" in
  --force) force=1 ;;
  "") ;;
  *) echo "usage: $0 [--force]" >&2; exit 2 ;;
esac

want="$(sha256sum "$here/package-lock.json" | cut -d' ' -f1)"
if [[ $force -eq 0 && -f "$stamp" && "$(cat "$stamp")" == "$want" ]]; then
  all=1
  for f in "${files[@]}"; do [[ -s "$vendor/$f" ]] || all=0; done
  if [[ $all -eq 1 ]]; then
    echo "vendor/ is up to date (uPlot per package-lock.json)"
    exit 0
  fi
fi

command -v npm >/dev/null || { echo "build-vendor.sh: npm is missing (apt-get install -y npm)" >&2; exit 1; }

# Install in a throwaway directory, not under static/: StaticFiles serves static/ as it is,
# and setuptools packages static/**, so a node_modules/ here would be served and shipped.
work="$(mktemp -d "${TMPDIR:-/tmp}/pgcarve-vendor.XXXXXX")"
trap 'rm -rf "$work"' EXIT
cp "$here/package.json" "$here/package-lock.json" "$work/"
# --ignore-scripts: nothing from the package runs here; we only copy its dist files.
(cd "$work" && npm ci --ignore-scripts --no-audit --no-fund --loglevel=error)

dist="$work/node_modules/uplot/dist"
mkdir -p "$vendor"
for f in "${files[@]}"; do
  [[ -s "$dist/$f" ]] || { echo "build-vendor.sh: $dist/$f is missing after npm ci" >&2; exit 1; }
  install -m 0644 "$dist/$f" "$vendor/$f.tmp"
  mv -f "$vendor/$f.tmp" "$vendor/$f"
done
install -m 0644 "$work/node_modules/uplot/LICENSE" "$vendor/uPlot.LICENSE"
echo "$want" >"$stamp"
echo "vendor/: uPlot $(node -p 'require(process.argv[1]).version' "$work/node_modules/uplot/package.json") -> ${files[*]}"

#!/usr/bin/env bash
# terraform/tools/install.sh - build Terraform and terraform-provider-libvirt from source
# through the Go module proxy, so that nothing is fetched from HashiCorp's release site or
# the Terraform registry (neither is reachable from this project's machines).
#
# Usage:
#   terraform/tools/install.sh            install; a no-op taking well under a second when done
#   terraform/tools/install.sh --rebuild  rebuild both binaries even if they are up to date
#   terraform/tools/install.sh --repin    maintainers: regenerate terraform/tools/pins/
# Environment:
#   PGCARVE_TOOLS          output directory (default: $PGCARVE_CACHE/tools, linked from <repo>/.tools)
#   PGCARVE_CACHE          build caches shared by every clone on this machine (default:
#                          /var/cache/pgcarve as root, else ~/.cache/pgcarve)
#   PGCARVE_GO             a go binary to use instead of searching PATH
#   PGCARVE_GO_TOOLCHAIN=1 build with the pinned fallback toolchain even if a usable go exists
#
# Result (everything under $PGCARVE_TOOLS):
#   bin/terraform                      Terraform v1.5.7
#   terraform-mirror/registry.terraform.io/dmacvicar/libvirt/0.7.6/<os>_<arch>/
#                                      terraform-provider-libvirt_v0.7.6 (filesystem mirror)
#   bin/tflint                         TFLint v0.64.0 (its bundled terraform ruleset), when the go
#                                      found is 1.26 or newer; skipped otherwise, with a line saying so
#   terraformrc                        CLI config: use it with TF_CLI_CONFIG_FILE=$PGCARVE_TOOLS/terraformrc
#   go/                                isolated GOPATH, GOMODCACHE (kept), GOCACHE (removed after a build)
#   src/                               the generated local Go modules that are built
#
# Why built this way:
# * `go install github.com/hashicorp/terraform@v1.5.7` would work (v1.5.7 has no replace
#   directives), but the provider's go.mod has replace directives that `go install pkg@ver`
#   refuses. Both are therefore built the same way: from a small local Go module
#   ($PGCARVE_TOOLS/src/<name>-build) whose go.mod requires the upstream module at the
#   pinned version and, for the provider, repeats the provider's own replace lines.
#   The provider v0.7.x talks to libvirt over its RPC protocol through
#   github.com/digitalocean/go-libvirt (pure Go), so both binaries build with CGO_ENABLED=0:
#   no C compiler and no libvirt-dev are needed to build. (At run time the provider's
#   `xml { xslt }` needs the xsltproc program.)
#
# * Go toolchain. Any go >= 1.19 is used as found (verified: Debian 12's golang-go 1.19.8 and
#   go 1.26.8 both build Terraform 1.5.7 and the provider; Terraform's go.mod says `go 1.18`,
#   upstream releases used go 1.20.7). If there is no go at all and we are root on Debian,
#   Debian's `golang-go` is installed with apt-get (1.19 on Debian 12). Only if the go found is
#   older than 1.19 (or PGCARVE_GO_TOOLCHAIN=1) do we use the pinned fallback toolchain
#   go1.20.14: it is the module golang.org/toolchain@v0.0.1-go1.20.14.linux-amd64 on the Go
#   module proxy (the same module that GOTOOLCHAIN=go1.x downloads in go >= 1.21). We fetch it
#   with `go mod download`, which works with any module-aware go, check its h1: hash against
#   pins/toolchain.go.sum, and unpack it under $PGCARVE_TOOLS/go/toolchain. GOTOOLCHAIN itself
#   is not used because go 1.19 does not know it; every go run here has GOTOOLCHAIN=local.
#
# * Checksums. The checksum database (GOSUMDB, default sum.golang.org) is reachable here
#   through the module proxy, but installs do not depend on it: pins/*.go.sum hold the h1:
#   hashes of every module in both dependency graphs (captured by --repin, which verified them
#   against the checksum database) and are copied as the local modules' go.sum; pins/*.go.mod
#   are the matching go.mod files. Builds run with GOFLAGS=-mod=readonly, so a module missing
#   from the pinned go.sum is an error (never looked up and added), and a module whose content
#   differs from its pinned hash fails with Go's "SECURITY ERROR" checksum mismatch. Before
#   building, `go mod verify` re-hashes whatever is already in the module cache against the
#   same go.sum. Variables that would weaken verification (GONOSUMDB, GOINSECURE, GOPRIVATE,
#   GOFLAGS=-insecure, ...) are cleared; verification is never turned off. The provider's
#   replace lines are read from its own (hash-verified) go.mod in the module cache, by --repin
#   to write pins/provider-build.go.mod and on every build to check that the pins still match.
#   The built binaries are checksummed after their build (the stamp), to detect a cache that
#   was damaged since; they are not compared with any upstream release.
#
# Idempotence: each binary has a stamp (version + hash of its pins + the sha256 of the binary
# built); when the binary and its stamp are current nothing is rebuilt and go is not even looked
# for. The tools live in a cache outside the clone, so a fresh clone on a machine that built them
# once finds them: a stamp whose key differs (new pins, new recipe) means a rebuild, and so does a
# binary whose sha256 is not the one recorded when it was built (a corrupt or replaced file).
# The terraformrc is rewritten only when its content changes. Concurrent runs serialise on a lock file.
set -euo pipefail

TF_MODULE=github.com/hashicorp/terraform
TF_VERSION=1.5.7
PROVIDER_MODULE=github.com/dmacvicar/terraform-provider-libvirt
PROVIDER_VERSION=0.7.6
PROVIDER_ADDR=registry.terraform.io/dmacvicar/libvirt
TFLINT_MODULE=github.com/terraform-linters/tflint
TFLINT_VERSION=0.64.0
TFLINT_GO_MINOR=26          # its go.mod says go 1.26.3: built only with a go that new, else skipped
GO_MIN_MINOR=19             # oldest go 1.x verified to build both
FALLBACK_GO=go1.20.14       # pinned fallback toolchain (hash in pins/toolchain.go.sum)
BUILD_RECIPE=1              # bump when the build commands below change, to force a rebuild

here=$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd -P)
repo=$(cd -- "$here/../.." && pwd -P)
pins=$here/pins

log() { printf '%s\n' "$*"; }
die() { printf 'install.sh: error: %s\n' "$*" >&2; exit 1; }

mode=install
case "${1:-}" in
  "") ;;
  --rebuild) mode=rebuild ;;
  --repin) mode=repin ;;
  -h|--help) sed -n '2,/^set -euo/{/^set -euo/d;s/^# \{0,1\}//;p}' "${BASH_SOURCE[0]}"; exit 0 ;;
  *) die "unknown argument: $1 (try --help)" ;;
esac

if [[ -n ${PGCARVE_TOOLS:-} ]]; then
  T=$PGCARVE_TOOLS
else
  if [[ -z ${PGCARVE_CACHE:-} ]]; then
    if [[ $(id -u) == 0 ]]; then PGCARVE_CACHE=/var/cache/pgcarve; else PGCARVE_CACHE=${XDG_CACHE_HOME:-$HOME/.cache}/pgcarve; fi
  fi
  T=$PGCARVE_CACHE/tools
fi
mkdir -p "$T"
T=$(cd -- "$T" && pwd -P)
# <repo>/.tools names the cache, so README's paths and the tests find the tools in every clone.
if [[ -z ${PGCARVE_TOOLS:-} && $T != "$repo/.tools" ]]; then
  if [[ -L $repo/.tools || ! -e $repo/.tools ]]; then
    ln -sfn -- "$T" "$repo/.tools"
  else
    log "note: $repo/.tools is a directory of an older build; the tools are now in $T"
  fi
fi

if command -v flock >/dev/null 2>&1; then
  exec 9>"$T/.install.lock"
  flock 9
fi

case "$(uname -s)/$(uname -m)" in
  Linux/x86_64) platform=linux_amd64 ;;
  Linux/aarch64|Linux/arm64) platform=linux_arm64 ;;
  *) die "unsupported platform $(uname -s)/$(uname -m)" ;;
esac

tf_bin=$T/bin/terraform
tflint_bin=$T/bin/tflint
mirror=$T/terraform-mirror
provider_bin=$mirror/$PROVIDER_ADDR/$PROVIDER_VERSION/$platform/terraform-provider-libvirt_v$PROVIDER_VERSION
rc=$T/terraformrc
stamps=$T/stamps

pins_hash() { cat "$@" | sha256sum | cut -c1-16; }
tf_key=         # set once the pins are known to exist
provider_key=

binary_sum() { sha256sum -- "$1" | cut -d' ' -f1; }

is_current() { # binary stamp-file key: built from these pins, and the very file that was built
  [[ -x $1 && -f $2 ]] || return 1
  local stamp
  stamp=$(cat -- "$2")
  [[ $stamp == "$3 sha256 "* ]] || return 1
  if [[ ${stamp##* sha256 } != "$(binary_sum "$1")" ]]; then
    log "$(basename -- "$1"): the cached binary does not match the checksum recorded when it was built; rebuilding"
    return 1
  fi
}

# ---------------------------------------------------------------------------------------
# Go environment: isolated from the user's settings, except the proxy they may need.
# ---------------------------------------------------------------------------------------
GO=
setup_go_env() {
  unset GOFLAGS GONOSUMDB GONOSUMCHECK GONOVERIFY GOINSECURE GOPRIVATE GONOPROXY GOSUMDB \
        GOROOT GOBIN GOOS GOARCH GOEXPERIMENT GOWORK GO111MODULE GOCACHEPROG GOAUTH \
        CGO_CFLAGS CGO_LDFLAGS CC CXX
  # GOPROXY is kept if the caller set it (a proxy may be the only way out); otherwise Go's
  # default applies. GOSUMDB is left at Go's default (sum.golang.org) for --repin.
  export GOENV=off                      # ignore ~/.config/go/env
  export GOPATH=$T/go
  export GOMODCACHE=$T/go/pkg/mod
  export GOCACHE=$T/go/cache
  export GOTOOLCHAIN=local              # never switch toolchains behind our back
  export GOWORK=off
  export GO111MODULE=on
  export CGO_ENABLED=0
  export GOFLAGS=-modcacherw            # cache deletable without chmod; `go mod verify` guards it
}

go_() { XDG_CONFIG_HOME=$T/go/config "$GO" "$@"; }   # keeps go's telemetry dir out of $HOME

go_minor() { # print the minor version of go binary $1 (999 for a devel build)
  local v
  v=$(GOTOOLCHAIN=local GOENV=off "$1" version 2>/dev/null) || return 1
  case "$v" in
    "go version devel"*) echo 999 ;;
    "go version go1."*) v=${v#go version go1.}; echo "${v%%[!0-9]*}" ;;
    *) return 1 ;;
  esac
}

find_go() {
  local c
  for c in "${PGCARVE_GO:-}" "$(command -v go 2>/dev/null || true)" /usr/local/go/bin/go /usr/lib/go/bin/go; do
    if [[ -n $c && -x $c ]] && go_minor "$c" >/dev/null; then
      echo "$c"
      return 0
    fi
  done
  return 1
}

json_field() { # json_field NAME <<<"$json": value of a top-level string field of `go ... -json`
  sed -n "s/^[[:space:]]*\"$1\": \"\\(.*\\)\",\\{0,1\\}\$/\\1/p"
}

fetch_toolchain() { # fetch_toolchain HOST_GO: unpack the pinned toolchain, set GO to it
  local host=$1 dest=$T/go/toolchain/$FALLBACK_GO
  if [[ -x $dest/bin/go ]] && [[ "$(GOENV=off "$dest/bin/go" version 2>/dev/null)" == "go version $FALLBACK_GO "* ]]; then
    GO=$dest/bin/go
    return
  fi
  [[ $platform == linux_amd64 ]] || die "the fallback toolchain is pinned for linux_amd64 only; install go >= 1.$GO_MIN_MINOR"
  local mod=golang.org/toolchain ver=v0.0.1-$FALLBACK_GO.linux-amd64
  local want d json sum dir
  want=$(awk -v m="$mod" -v v="$ver" '$1 == m && $2 == v { print $3 }' "$pins/toolchain.go.sum")
  [[ -n $want ]] || die "no pinned hash for $mod@$ver in pins/toolchain.go.sum"
  log "go: fetching toolchain $FALLBACK_GO as module $mod@$ver (once, ~10 s)"
  d=$T/src/toolchain-fetch
  rm -rf -- "$d"
  mkdir -p "$d"
  printf 'module pgcarve.local/toolchain-fetch\n\ngo 1.18\n' >"$d/go.mod"
  cp -- "$pins/toolchain.go.sum" "$d/go.sum"   # go checks the download against these lines
  # Only -modcacherw here: a go older than 1.18 would reject -buildvcs in GOFLAGS.
  json=$(cd "$d" && XDG_CONFIG_HOME=$T/go/config "$host" mod download -json "$mod@$ver") \
    || die "downloading $mod@$ver failed"
  sum=$(json_field Sum <<<"$json")
  dir=$(json_field Dir <<<"$json")
  [[ $sum == "$want" ]] || die "$mod@$ver: hash $sum does not match pinned $want"
  [[ -x $dir/bin/go || -f $dir/bin/go ]] || die "$mod@$ver: no bin/go in $dir"
  rm -rf -- "$dest" "$dest.tmp"
  mkdir -p "$(dirname -- "$dest")"
  cp -R -- "$dir" "$dest.tmp"
  chmod -R u+w -- "$dest.tmp"
  # Module zips carry no file modes: make the toolchain's programs executable again
  # (the same thing go >= 1.21 does when GOTOOLCHAIN switches to such a module).
  chmod +x -- "$dest.tmp"/bin/* "$dest.tmp"/pkg/tool/*/*
  mv -- "$dest.tmp" "$dest"
  GO=$dest/bin/go
}

pick_go() {
  [[ -n $GO ]] && return
  setup_go_env
  local host minor
  if ! host=$(find_go); then
    if [[ $(id -u) == 0 ]] && command -v apt-get >/dev/null 2>&1; then
      log "go: not found; installing Debian's golang-go with apt-get"
      export DEBIAN_FRONTEND=noninteractive
      if ! apt-get install -y -q --no-install-recommends golang-go >"$T/apt-golang.log" 2>&1; then
        apt-get update -q >>"$T/apt-golang.log" 2>&1 || true
        apt-get install -y -q --no-install-recommends golang-go >>"$T/apt-golang.log" 2>&1 \
          || die "apt-get install golang-go failed, see $T/apt-golang.log"
      fi
      host=$(find_go) || die "golang-go installed but no go binary found"
    else
      die "no go found: install Go >= 1.$GO_MIN_MINOR (Debian: apt-get install golang-go) or set PGCARVE_GO"
    fi
  fi
  minor=$(go_minor "$host")
  if [[ ${PGCARVE_GO_TOOLCHAIN:-} == 1 ]]; then
    log "go: PGCARVE_GO_TOOLCHAIN=1, using the pinned toolchain $FALLBACK_GO"
    fetch_toolchain "$host"
  elif (( minor < GO_MIN_MINOR )); then
    log "go: $host is go1.$minor, older than go1.$GO_MIN_MINOR; using the pinned toolchain $FALLBACK_GO"
    fetch_toolchain "$host"
  else
    GO=$host
  fi
  export GOFLAGS="-modcacherw -buildvcs=false -mod=readonly"
  log "go: using $(go_ version) ($GO)"
}

# ---------------------------------------------------------------------------------------
# Replace directives of a go.mod file, one per line, as `old[@ver]=new[@ver]`, sorted.
# ---------------------------------------------------------------------------------------
replaces_of() {
  awk '
    function trim(s) { gsub(/^[ \t]+|[ \t]+$/, "", s); return s }
    function at(s,   p, n) { n = split(trim(s), p, /[ \t]+/); return n == 2 ? p[1] "@" p[2] : p[1] }
    function rep(s,   i) { i = index(s, "=>"); if (i) print at(substr(s, 1, i - 1)) "=" at(substr(s, i + 2)) }
    { line = $0; sub(/\/\/.*/, "", line) }
    blk && line ~ /^[ \t]*\)/ { blk = 0; next }
    blk { if (trim(line) != "") rep(line); next }
    line ~ /^[ \t]*replace[ \t]*\([ \t]*$/ { blk = 1; next }
    line ~ /^[ \t]*replace[ \t]/ { sub(/^[ \t]*replace[ \t]+/, "", line); rep(line) }
  ' "$1" | LC_ALL=C sort
}

write_tools_go() { # write_tools_go DIR IMPORT: keeps the upstream module required when tidying
  printf '//go:build tools\n\npackage tools\n\nimport _ "%s"\n' "$2" >"$1/tools.go"
}

new_build_module() { # new_build_module NAME IMPORT: fresh $T/src/NAME-build from the pins
  local d=$T/src/$1-build
  rm -rf -- "$d"
  mkdir -p "$d"
  cp -- "$pins/$1-build.go.mod" "$d/go.mod"
  cp -- "$pins/$1-build.go.sum" "$d/go.sum"
  write_tools_go "$d" "$2"
  echo "$d"
}

verify_modules() { # verify_modules DIR: re-hash what is already cached against the pinned go.sum
  (cd "$1" && go_ mod verify >/dev/null) || die "go mod verify failed in $1: module cache does not match the pins"
}

build_pinned() { # build_pinned NAME MODULE BINARY KEY: the module's main package, from pins/NAME-build.*
  local d
  d=$(new_build_module "$1" "$2")
  verify_modules "$d"
  mkdir -p "$(dirname -- "$3")" "$stamps"
  (cd "$d" && go_ build -trimpath -ldflags='-s -w' -o "$3.tmp" "$2") || die "building $1 failed"
  mv -f -- "$3.tmp" "$3"
  printf '%s sha256 %s\n' "$4" "$(binary_sum "$3")" >"$stamps/$1"
}

build_terraform() {
  log "terraform: building v$TF_VERSION from source (first time ~5 min on 2 cores)"
  build_pinned terraform "$TF_MODULE" "$tf_bin" "$tf_key"
}

build_tflint() {
  log "tflint: building v$TFLINT_VERSION from source (first time ~3 min on 2 cores)"
  build_pinned tflint "$TFLINT_MODULE" "$tflint_bin" "$tflint_key"
}

build_provider() {
  log "provider: building terraform-provider-libvirt v$PROVIDER_VERSION (first time ~1 min)"
  local d json gomod
  d=$(new_build_module provider "$PROVIDER_MODULE")
  # Fetch (checked against the pinned go.sum) and read the provider's own go.mod: its replace
  # lines must be exactly the ones repeated in pins/provider-build.go.mod.
  json=$(cd "$d" && go_ mod download -json "$PROVIDER_MODULE") || die "downloading $PROVIDER_MODULE failed"
  gomod=$(json_field GoMod <<<"$json")
  [[ -f $gomod ]] || die "no go.mod for $PROVIDER_MODULE in the module cache"
  if [[ "$(replaces_of "$gomod")" != "$(replaces_of "$d/go.mod")" ]]; then
    die "replace lines of $PROVIDER_MODULE@v$PROVIDER_VERSION differ from pins/provider-build.go.mod; run --repin"
  fi
  verify_modules "$d"
  mkdir -p "$(dirname -- "$provider_bin")" "$stamps"
  (cd "$d" && go_ build -trimpath \
      -ldflags="-s -w -X $PROVIDER_MODULE/version.ProviderVersion=v$PROVIDER_VERSION" \
      -o "$provider_bin.tmp" "$PROVIDER_MODULE") || die "building the provider failed"
  mv -f -- "$provider_bin.tmp" "$provider_bin"
  printf '%s sha256 %s\n' "$provider_key" "$(binary_sum "$provider_bin")" >"$stamps/provider"
}

write_terraformrc() {
  local want
  want=$(cat <<EOF
# Generated by terraform/tools/install.sh; use with TF_CLI_CONFIG_FILE=$rc
# Providers come only from the local filesystem mirror; no registry is ever contacted.
disable_checkpoint = true

provider_installation {
  filesystem_mirror {
    path    = "$mirror"
    include = ["$PROVIDER_ADDR"]
  }
  direct {
    exclude = ["registry.terraform.io/*/*"]
  }
}
EOF
)
  if [[ ! -f $rc || "$(cat -- "$rc")" != "$want" ]]; then
    printf '%s\n' "$want" >"$rc.tmp"
    mv -f -- "$rc.tmp" "$rc"
    log "terraformrc: wrote $rc"
  fi
}

# ---------------------------------------------------------------------------------------
# --repin: regenerate pins/ from the upstream modules (verified by the checksum database).
# ---------------------------------------------------------------------------------------
repin_plain() { # repin_plain NAME MODULE VERSION GO: pins/NAME-build.* for a module without replace lines
  local d=$T/src/repin-$1
  log "repin: $1 v$3"
  rm -rf -- "$d"; mkdir -p "$d"
  printf 'module pgcarve.local/%s-build\n\ngo %s\n\nrequire %s v%s\n' "$1" "$4" "$2" "$3" >"$d/go.mod"
  write_tools_go "$d" "$2"
  (cd "$d" && go_ mod tidy)
  cp -- "$d/go.mod" "$pins/$1-build.go.mod"
  cp -- "$d/go.sum" "$pins/$1-build.go.sum"
}

repin() {
  pick_go
  export GOFLAGS="-modcacherw -buildvcs=false"   # tidy must be allowed to write go.mod/go.sum
  mkdir -p "$pins"
  local d json gomod r args=()

  repin_plain terraform "$TF_MODULE" "$TF_VERSION" 1.18

  log "repin: terraform-provider-libvirt v$PROVIDER_VERSION"
  d=$T/src/repin-provider
  rm -rf -- "$d"; mkdir -p "$d"
  printf 'module pgcarve.local/provider-build\n\ngo 1.18\n\nrequire %s v%s\n' "$PROVIDER_MODULE" "$PROVIDER_VERSION" >"$d/go.mod"
  write_tools_go "$d" "$PROVIDER_MODULE"
  json=$(cd "$d" && go_ mod download -json "$PROVIDER_MODULE@v$PROVIDER_VERSION")
  gomod=$(json_field GoMod <<<"$json")
  while IFS= read -r r; do
    [[ -n $r ]] || continue
    [[ ${r#*=} == *@* ]] || die "replace $r points at a local directory; cannot be reproduced"
    args+=("-replace=$r")
    log "repin:   replace ${r%%=*} => ${r#*=}"
  done < <(replaces_of "$gomod")
  if (( ${#args[@]} )); then (cd "$d" && go_ mod edit "${args[@]}"); fi
  (cd "$d" && go_ mod tidy)
  cp -- "$d/go.mod" "$pins/provider-build.go.mod"
  cp -- "$d/go.sum" "$pins/provider-build.go.sum"

  repin_plain tflint "$TFLINT_MODULE" "$TFLINT_VERSION" 1.26.3

  log "repin: toolchain $FALLBACK_GO"
  local mod=golang.org/toolchain v
  d=$T/src/repin-toolchain
  rm -rf -- "$d"; mkdir -p "$d"
  printf 'module pgcarve.local/toolchain-fetch\n\ngo 1.18\n' >"$d/go.mod"
  v=v0.0.1-$FALLBACK_GO.linux-amd64
  json=$(cd "$d" && go_ mod download -json "$mod@$v")
  printf '%s %s %s\n%s %s/go.mod %s\n' "$mod" "$v" "$(json_field Sum <<<"$json")" \
    "$mod" "$v" "$(json_field GoModSum <<<"$json")" >"$pins/toolchain.go.sum.tmp"
  mv -f -- "$pins/toolchain.go.sum.tmp" "$pins/toolchain.go.sum"
  log "repin: wrote $pins (review and commit it)"
}

# ---------------------------------------------------------------------------------------
if [[ $mode == repin ]]; then
  repin
  exit 0
fi

for f in terraform-build.go.mod terraform-build.go.sum provider-build.go.mod provider-build.go.sum \
         tflint-build.go.mod tflint-build.go.sum toolchain.go.sum; do
  [[ -f $pins/$f ]] || die "missing $pins/$f (run --repin)"
done
tf_key="terraform v$TF_VERSION recipe $BUILD_RECIPE pins $(pins_hash "$pins/terraform-build.go.mod" "$pins/terraform-build.go.sum")"
provider_key="provider v$PROVIDER_VERSION $platform recipe $BUILD_RECIPE pins $(pins_hash "$pins/provider-build.go.mod" "$pins/provider-build.go.sum")"
tflint_key="tflint v$TFLINT_VERSION recipe $BUILD_RECIPE pins $(pins_hash "$pins/tflint-build.go.mod" "$pins/tflint-build.go.sum")"

built=0
if [[ $mode == rebuild ]] || ! is_current "$tf_bin" "$stamps/terraform" "$tf_key"; then
  pick_go
  build_terraform
  built=1
else
  log "terraform: v$TF_VERSION up to date ($tf_bin)"
fi
if [[ $mode == rebuild ]] || ! is_current "$provider_bin" "$stamps/provider" "$provider_key"; then
  pick_go
  build_provider
  built=1
else
  log "provider: v$PROVIDER_VERSION up to date (filesystem mirror $mirror)"
fi
if [[ $mode == rebuild ]] || ! is_current "$tflint_bin" "$stamps/tflint" "$tflint_key"; then
  pick_go
  if (( $(go_minor "$GO") >= TFLINT_GO_MINOR )); then
    build_tflint
    built=1
  else
    # A linter is a check, not a dependency: without it the Terraform tests that need it skip.
    log "tflint: skipped: v$TFLINT_VERSION needs go >= 1.$TFLINT_GO_MINOR, and $(go_ version) was found"
  fi
else
  log "tflint: v$TFLINT_VERSION up to date ($tflint_bin)"
fi
if (( built )); then
  rm -rf -- "$T/go/cache"   # ~1 GB of compiler output, useless until the pins change
fi
write_terraformrc

log "terraform: use TF_CLI_CONFIG_FILE=$rc"
TF_CLI_CONFIG_FILE=$rc CHECKPOINT_DISABLE=1 "$tf_bin" version

#!/usr/bin/env bash
# What a release ships, under target/release-artifacts/ (`make release
# VERSION=x.y.z`): the images as OCI archives with their digests, the chart
# packaged for `helm push` to an OCI registry, the CRDs, the kubectl plugin
# for each platform this machine can build it for (with a krew manifest
# carrying their sha256), release notes from the commits since the last tag,
# and SHA256SUMS over it all. Then scripts/check-release.py checks what was
# built against itself.
#
# The version is the workspace's (Cargo.toml), the one place it lives: the
# binaries' --version, the images' tag and labels and the chart's version
# and appVersion all come from it (make lint checks the chart's). VERSION,
# when given, must be it: `make set-version VERSION=x.y.z` changes it.
#
# --smoke (`make release-smoke`, part of `make test`): the same from the dev
# profile, with the plugin for this machine's platform alone.
set -euo pipefail
cd "$(dirname "$0")/.."
smoke=0
[[ "${1:-}" == --smoke ]] && smoke=1
log() { echo "[release] $*" >&2; }
fail() { log "$*"; exit 1; }

version=$(python3 -c 'import tomllib; print(tomllib.load(open("Cargo.toml", "rb"))["workspace"]["package"]["version"])')
if [[ -n "${VERSION:-}" && "${VERSION#v}" != "$version" ]]; then
  fail "VERSION=$VERSION, but the workspace's version is $version: run make set-version VERSION=${VERSION#v}, commit, then make release"
fi
out=target/release-artifacts
rm -rf "$out"
mkdir -p "$out/images" "$out/crds" "$out/plugin"
target_dir=${CARGO_TARGET_DIR:-$PWD/target}
if ((smoke)); then profile=dev bin_dir=$target_dir/debug; else profile=release bin_dir=$target_dir/release; fi

log "gpuhealth $version: building ($profile)"
cargo build --profile "$profile" -p gpuhealth-operator -p gpuhealth-agent -p kubectl-gpuhealth
for binary in gpuhealth-operator gpuhealth-agent kubectl-gpuhealth; do
  said=$("$bin_dir/$binary" --version)
  [[ "$said" == "$binary $version" ]] || fail "$binary --version says '$said', not $version"
done

python3 images/pack.py --bin-dir "$bin_dir" --out "$out/images" images/*.Dockerfile
scripts/helm.sh package charts/gpuhealth --destination "$out" 2>&1 | grep -v 'symbolic link' >&2
cp crds/gpuhealth.io_*.yaml "$out/crds/"

# The plugin, per krew platform. Each that cannot be built here is named,
# with why, in the release notes.
host=$(rustc -vV | sed -n 's/^host: //p')
declare -A targets=(
  [linux/amd64]=x86_64-unknown-linux-gnu
  [linux/arm64]=aarch64-unknown-linux-gnu
  [darwin/amd64]=x86_64-apple-darwin
  [darwin/arm64]=aarch64-apple-darwin
)
built=() missing=()
for platform in linux/amd64 linux/arm64 darwin/amd64 darwin/arm64; do
  target=${targets[$platform]}
  binary=
  if [[ "$target" == "$host" ]]; then
    binary=$bin_dir/kubectl-gpuhealth
  elif ((smoke)); then
    missing+=("$platform: a smoke run builds this machine's platform alone")
    continue
  elif [[ "$target" == *-apple-darwin ]]; then
    missing+=("$platform: no macOS SDK or linker on this machine")
    continue
  elif ! rustup target list --installed 2>/dev/null | grep -qx "$target"; then
    missing+=("$platform: the Rust target $target is not installed (rustup target add $target)")
    continue
  elif ! command -v aarch64-linux-gnu-gcc >/dev/null; then
    missing+=("$platform: no aarch64-linux-gnu-gcc for ring's C code (Debian's gcc-aarch64-linux-gnu)")
    continue
  else
    CARGO_TARGET_AARCH64_UNKNOWN_LINUX_GNU_LINKER=aarch64-linux-gnu-gcc \
      cargo build --release --target "$target" -p kubectl-gpuhealth
    binary=$target_dir/$target/release/kubectl-gpuhealth
  fi
  name="kubectl-gpuhealth_${version}_${platform/\//_}"
  staging=$(mktemp -d)
  cp "$binary" "$staging/kubectl-gpuhealth"
  tar -czf "$out/plugin/$name.tar.gz" --owner=0 --group=0 --mtime=@0 -C "$staging" kubectl-gpuhealth
  rm -rf "$staging"
  built+=("$platform=$name.tar.gz")
done
python3 scripts/krew-manifest.py --version "$version" --dir "$out/plugin" "${built[@]}" >"$out/plugin/gpuhealth.yaml"

# Release notes: the commits since the last tag (every commit before the first).
last_tag=$(git describe --tags --abbrev=0 2>/dev/null || true)
{
  echo "# gpuhealth $version"
  echo
  echo "## Artifacts"
  echo
  for ref in "$out"/images/*.ref; do echo "- image \`$(cat "$ref")\`"; done
  echo "- chart \`gpuhealth-$version.tgz\` (\`helm push gpuhealth-$version.tgz oci://<registry>/charts\`)"
  echo "- CRDs in \`crds/\`"
  for platform in "${built[@]}"; do echo "- kubectl plugin \`plugin/${platform#*=}\` (${platform%%=*})"; done
  echo "- krew manifest \`plugin/gpuhealth.yaml\`"
  for reason in "${missing[@]}"; do echo "- not built: $reason"; done
  echo
  echo "## Changes${last_tag:+ since $last_tag}"
  echo
  git log --no-merges --format='- %s' ${last_tag:+"$last_tag..HEAD"}
} >"$out/RELEASE-NOTES.md"

(cd "$out" && find . -type f ! -name SHA256SUMS | sort | xargs sha256sum >SHA256SUMS)
python3 scripts/check-release.py "$out" "$version"
log "done: $out"

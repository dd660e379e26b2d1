#!/usr/bin/env bash
# The fuzz corpus, kept as one archive a target (fuzz/corpus/<target>.tar.gz)
# rather than thousands of files in the tree: the inputs that together
# reach every edge the whole corpus reached (libFuzzer's set-cover merge,
# edges alone, hit counts left out).
#
#   scripts/fuzz-corpus.sh unpack TARGET DIR   the archive's inputs into DIR (emptied first)
#   scripts/fuzz-corpus.sh pack TARGET DIR     DIR minimised into the archive, after `make fuzz`
#   scripts/fuzz-corpus.sh edges TARGET DIR    the edges DIR's inputs reach (libFuzzer's `cov`)
#
# pack and edges run the target built by `cargo fuzz build -O` (fuzz/target);
# pack refuses to write an archive that reaches fewer edges than DIR did,
# beyond the few that differ from run to run of the same inputs (randomly
# seeded hashing: up to 4 edges of 2,750 here).
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
what=${1:?unpack, pack or edges}
target=${2:?a fuzz target}
dir=${3:?a directory}
archive="$root/fuzz/corpus/$target.tar.gz"

binary() {
  local host
  host=$(rustc +nightly -vV | sed -n 's/^host: //p')
  echo "$root/fuzz/target/$host/release/$target"
}

# libFuzzer's coverage of DIR's inputs, run once each.
edges() {
  "$(binary)" -runs=0 -rss_limit_mb=1024 "$1" 2>&1 | sed -n 's/.*\(INITED\|DONE\).* cov: \([0-9]*\).*/\2/p' | tail -1
}

case "$what" in
  unpack)
    rm -rf "$dir" && mkdir -p "$dir"
    tar -xzf "$archive" -C "$dir"
    ;;
  pack)
    before=$(edges "$dir")
    minimal=$(mktemp -d)
    trap 'rm -rf "$minimal"' EXIT
    "$(binary)" -set_cover_merge=1 -use_counters=0 -rss_limit_mb=1024 "$minimal" "$dir" >/dev/null 2>&1
    after=$(edges "$minimal")
    noise=$(( before / 200 > 5 ? before / 200 : 5 ))
    if [ -z "$after" ] || [ "$after" -lt $(( before - noise )) ]; then
      echo "fuzz-corpus: $target: the minimised corpus reaches ${after:-no} edges, the whole $before; the archive is left as it was" >&2
      exit 1
    fi
    # Byte for byte the same archive for the same inputs.
    tar --sort=name --mtime=@0 --owner=0 --group=0 --numeric-owner -C "$minimal" -cf - . | gzip -n -9 >"$archive"
    echo "fuzz-corpus: $target: $(ls "$minimal" | wc -l) inputs, $after edges (the whole corpus: $before)"
    ;;
  edges)
    edges "$dir"
    ;;
  *)
    echo "fuzz-corpus: unpack, pack or edges, not $what" >&2
    exit 2
    ;;
esac

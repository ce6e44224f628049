#!/usr/bin/env bash
# Prints the path of a Jaeger v2 binary (github.com/jaegertracing/jaeger
# v1.76.0, the version tools/jaeger/go.mod pins), building it from source
# with the Go toolchain when the cache does not hold it yet.
#
# The cache lives outside the clone, so that every clone and every CI run on
# a machine shares one build:
#   ${QUOTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/quota}/jaeger-v1.76.0
# The build takes a few minutes. It writes to a temporary name in the same
# directory and renames it into place, so an interrupted build never leaves
# a broken binary under the cached name. Progress goes to stderr; stdout
# carries the path only:
#   JAEGER=$(scripts/jaeger.sh) && "$JAEGER"
set -euo pipefail

version=v1.76.0
root=$(cd "$(dirname "$0")/.." && pwd)
cache=${QUOTA_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/quota}
bin=$cache/jaeger-$version

if [ -x "$bin" ]; then
  echo "$bin"
  exit 0
fi

command -v "${GO:-go}" >/dev/null 2>&1 || {
  echo "quota: building Jaeger needs the Go toolchain on PATH (or GO=/path/to/go)" >&2
  exit 1
}

mkdir -p "$cache"
tmp=$(mktemp "$cache/.jaeger-$version.XXXXXX")
trap 'rm -f "$tmp"' EXIT

echo "quota: building Jaeger $version into $bin (a few minutes, once per machine)" >&2
(
  cd "$root/tools/jaeger"
  # -mod=readonly: go.sum is the record of what is built; never rewrite it.
  "${GO:-go}" build -mod=readonly -o "$tmp" github.com/jaegertracing/jaeger/cmd/jaeger
)
chmod 0755 "$tmp"
"$tmp" --help >/dev/null 2>&1 || {
  echo "quota: the Jaeger build at $tmp does not run" >&2
  exit 1
}
mv -f "$tmp" "$bin"
trap - EXIT
echo "quota: Jaeger $version is at $bin" >&2
echo "$bin"

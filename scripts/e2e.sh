#!/usr/bin/env bash
# Runs the end-to-end test of examples/jaeger: the example program against a
# real Jaeger and a real redis-server that the test starts on loopback
# ports, its traces read back from Jaeger's query API. Builds Jaeger once
# per machine (scripts/jaeger.sh) and installs redis-server when missing
# (scripts/need.sh redis). Lints the example module first.
#
#   scripts/e2e.sh            # extra arguments go to go test, e.g. -run TestJaeger
set -euo pipefail

root=$(cd "$(dirname "$0")/.." && pwd)
go=${GO:-go}
staticcheck=${STATICCHECK:-honnef.co/go/tools/cmd/staticcheck@v0.8.2}

"$root/scripts/need.sh" redis
jaeger=$("$root/scripts/jaeger.sh")

cd "$root/examples/jaeger"
unformatted=$(gofmt -l .)
if [ -n "$unformatted" ]; then
  echo "gofmt would change: $unformatted" >&2
  exit 1
fi
"$go" vet ./...
"$go" run "$staticcheck" ./...
QUOTA_E2E=1 QUOTA_REQUIRE_REDIS=1 QUOTA_JAEGER_BIN=$jaeger \
  "$go" test -race -count=1 -timeout 5m -v ./... "$@"

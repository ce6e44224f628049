#!/usr/bin/env bash
# Prints the figures of concurrency slots, measured side by side in one
# run, without the race detector:
#   - BenchmarkRoundTrip: the median ns/op of a Transport with and without
#     WithConcurrency over 8 interleaved runs, and their ratio;
#   - the script calls a request costs in a fleet of 4 processes x 30
#     goroutines holding 8 slots (TestConcurrencyAcrossProcesses);
#   - the hand-off from a request's end to the next one's arrival from
#     another process, p50 and p90 (TestSlotHandOffAcrossProcesses).
#
#   scripts/slot-figures.sh    # make bench runs it
set -euo pipefail
cd "$(dirname "$0")/.."
go=${GO:-go}

out=$(QUOTA_REQUIRE_REDIS=1 "$go" test -run '^$' -bench '^BenchmarkRoundTrip$/^(Transport|TransportWithConcurrency)$' -count 8 .)
echo "$out" | awk '
  /^BenchmarkRoundTrip\/Transport-/                { a[++na] = $3 }
  /^BenchmarkRoundTrip\/TransportWithConcurrency-/ { b[++nb] = $3 }
  function median(v, n,   i, j, t) {
    for (i = 2; i <= n; i++) for (j = i; j > 1 && v[j-1] > v[j]; j--) { t = v[j]; v[j] = v[j-1]; v[j-1] = t }
    return n % 2 ? v[(n+1)/2] : (v[n/2] + v[n/2+1]) / 2
  }
  END {
    if (!na || !nb) { print "slot-figures: no BenchmarkRoundTrip results" > "/dev/stderr"; exit 1 }
    ma = median(a, na); mb = median(b, nb)
    printf "BenchmarkRoundTrip, median of %d: Transport %.1f us, TransportWithConcurrency %.1f us: %.2fx\n", na, ma/1000, mb/1000, mb/ma
  }'
QUOTA_REQUIRE_REDIS=1 "$go" test -count=1 -v -run '^(TestConcurrencyAcrossProcesses|TestSlotHandOffAcrossProcesses)$' . |
  grep -E 'in flight|script calls|hand-offs across' | sed -E 's/^ +[a-z_]+\.go:[0-9]+: //'

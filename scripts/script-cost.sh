#!/usr/bin/env bash
# Prints what one take of quota's costs Redis, beside redis_rate's script:
# the median usec_per_call of EVALSHA (INFO commandstats) over interleaved
# rounds of redis-benchmark, pipelined so that the figure is the script's
# work and not the network's. Both take one token from a bucket of a
# million a second, which writes the key each time; quota's take reads the
# bucket's control record too, as every take does.
#
#   scripts/script-cost.sh [rounds]    # make script-cost; 8 rounds by default
set -euo pipefail
cd "$(dirname "$0")/.."

rounds=${1:-8}
for cmd in redis-server redis-cli redis-benchmark; do
  command -v "$cmd" >/dev/null || { echo "script-cost: $cmd not found; install redis-server and redis-tools" >&2; exit 1; }
done

rr_dir=$(go -C bench list -m -f '{{.Dir}}' github.com/go-redis/redis_rate/v10)
tmp=$(mktemp -d)
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
redis-server --port "$port" --bind 127.0.0.1 --save '' --appendonly no --dir "$tmp" >"$tmp/log" 2>&1 &
server=$!
trap 'kill $server 2>/dev/null; wait $server 2>/dev/null; rm -rf "$tmp"' EXIT
cli=(redis-cli -p "$port")
for _ in $(seq 50); do "${cli[@]}" PING >/dev/null 2>&1 && break; sleep 0.1; done

# redis_rate keeps its script in a Go string; take the allowN one.
awk '/^var allowN = redis.NewScript\(`/{on=1; next} on && /^`\)/{exit} on' "$rr_dir/lua.go" >"$tmp/rr.lua"

# The take's script runs after the prelude every script of the library has;
# its parts are joined in internal/store's order (takeParts).
parts=$(sed -n 's/^[[:space:]]*takeParts *= \[\]string{\(.*\)}$/\1/p' internal/store/scripts.go | tr -d '",')
[ -n "$parts" ] || { echo "script-cost: no takeParts in internal/store/scripts.go" >&2; exit 1; }
quota_sha=$("${cli[@]}" SCRIPT LOAD "$(cat internal/redisx/prelude.lua $(for p in $parts; do echo "internal/store/$p"; done))")
rr_sha=$("${cli[@]}" SCRIPT LOAD "$(cat "$tmp/rr.lua")")

# cost SHA ARGS... runs one round and prints EVALSHA's usec_per_call.
cost() {
  "${cli[@]}" CONFIG RESETSTAT >/dev/null
  redis-benchmark -p "$port" -n 100000 -c 2 -P 32 -q EVALSHA "$@" >/dev/null 2>&1
  "${cli[@]}" INFO commandstats | tr -d '\r' | sed -n 's/^cmdstat_evalsha:.*usec_per_call=\([0-9.]*\).*/\1/p'
}

median() { sort -n | awk '{v[NR]=$1} END {if (NR%2) print v[(NR+1)/2]; else printf "%.2f\n", (v[NR/2]+v[NR/2+1])/2}'; }

: >"$tmp/quota" >"$tmp/rr"
for _ in $(seq "$rounds"); do
  # quota (script.lua): the layer's key and the control record's; a take,
  # the server's clock, plain, no channel; wait at most 5 s, take 1 token;
  # 1e6/s burst 1e9.
  cost "$quota_sha" 2 'quota:{cost}' 'quota:{cost}:ctl' take '' plain '' 5000000 1 1000000 1000000000 >>"$tmp/quota"
  # redis_rate: burst, rate, period (s), cost.
  cost "$rr_sha" 1 'rate:cost' 1000000000 1000000 1 1 >>"$tmp/rr"
done

echo "EVALSHA usec_per_call, median of $rounds rounds ($(redis-server --version | awk '{print $3}'))"
printf '  quota script       %s us\n' "$(median <"$tmp/quota")"
printf '  redis_rate script  %s us\n' "$(median <"$tmp/rr")"

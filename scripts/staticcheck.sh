#!/usr/bin/env bash
# Runs staticcheck on the modules in the directories given, two at a time:
# a fresh clone has no staticcheck cache, and each module's dependencies
# load on one core while the other checks the next module.
#
#   STATICCHECK=honnef.co/go/tools/cmd/staticcheck@v0.8.2 scripts/staticcheck.sh . demo bench
set -uo pipefail
cd "$(dirname "$0")/.."
go=${GO:-go}
tool=${STATICCHECK:?STATICCHECK names the staticcheck module to run}
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT

check() { # module directory, log file
	(cd "$1" && "$go" run "$tool" ./...) >"$2" 2>&1
	echo $? >"$2.rc"
}
i=0
for m in "$@"; do
	check "$m" "$dir/$i" &
	i=$((i + 1))
	if ((i % 2 == 0)); then wait; fi
done
wait
status=0
i=0
for m in "$@"; do
	echo "staticcheck $m"
	cat "$dir/$i"
	if [ "$(cat "$dir/$i.rc")" != 0 ]; then status=1; fi
	i=$((i + 1))
done
exit $status

#!/usr/bin/env bash
# Makes sure redis-server, redis-cli and redis-sentinel are on PATH: the
# tests start their own servers from them. Installs them with apt-get where
# that is possible, and otherwise says what to install.
set -euo pipefail

missing=()
for cmd in redis-server redis-cli redis-sentinel; do
  command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
[ ${#missing[@]} -eq 0 ] && exit 0

echo "quota: ${missing[*]} not found; the tests need Redis 7 or later." >&2
if command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "quota: run as root, or install them: apt-get install redis-server redis-tools redis-sentinel" >&2
      exit 1
    fi
  fi
  echo "quota: installing redis-server redis-tools redis-sentinel with apt-get" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq redis-server redis-tools redis-sentinel >/dev/null
  # The packages start system services; the tests start their own servers.
  if command -v service >/dev/null 2>&1; then
    $sudo service redis-server stop >/dev/null 2>&1 || true
    $sudo service redis-sentinel stop >/dev/null 2>&1 || true
  fi
  exit 0
fi

cat >&2 <<'HINT'
quota: install Redis 7 or later so that redis-server, redis-cli and
redis-sentinel are on PATH, then run make test again:
  Debian/Ubuntu:  apt-get install redis-server redis-tools redis-sentinel
  Fedora/RHEL:    dnf install redis
  macOS:          brew install redis
HINT
exit 1

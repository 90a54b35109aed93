#!/usr/bin/env bash
# Proxy throughput and added latency: kvroute-router vs nginx as a round-robin reverse proxy,
# both in front of the same fast local backend, everything on 127.0.0.1.
#
# Backend: nginx (one worker) listening on BACKENDS ports, answering every POST with a fixed
# OpenAI completion JSON (`return 200`), `/health` with 200 and `/metrics` with a vLLM-style
# queue gauge. It is the same process for every run, so the runs differ only in the proxy.
#
# Runs (wrk, keep-alive, one POST /v1/completions body, fixed threads/connections/duration;
# then each target again with one connection, for the latency a proxy adds):
#   direct       wrk -> backend port 1
#   nginx        wrk -> nginx (worker_processes auto, upstream of the backend ports, keepalive)
#   floor        wrk -> router/examples/bare_forwarder: kvroute-router's accept loop and
#                upstream pool with nothing between them (no decision, accounting, metrics)
#   kvroute-rr   wrk -> kvroute-router --policy round-robin
#   kvroute-ca   wrk -> kvroute-router --policy cache-aware
# kvroute's replicas are the backend ports with engine kvroute and event endpoints on a
# closed port: no events ever arrive, so after `fallback` they are FALLBACK and routed on
# load alone (the decision path still parses, tokenizes, hashes and looks up every request).
#
# Measured on the 2-core shared dev machine, where run-to-run noise is about ±10%: wrk, both
# backends and the proxy share the two cores, so throughput follows each proxy's CPU time
# per request (read from /proc over a run: nginx's two workers 14-18 µs, kvroute 20-24 µs).
#   Throughput, kvroute / nginx: 0.63-0.90x over six runs of this script (nginx 54.8-67.1 k
#   requests/s), 0.68-0.82x over four more paired runs; p99 under load 2.5-4.3 ms for
#   kvroute, 3.1-4.7 ms for nginx.
#   Added latency, one connection at a time (p50): nginx +22 to +34 µs, kvroute +30 to +52 µs.
#   Three-round runs of this version of the script: medians 0.65-0.71x (rounds 0.64-0.87x),
#   added latency nginx +27 to +36 µs, kvroute +54 to +74 µs, in a slower spell of the
#   machine (single connections were slower for every build then).
#   Paired with the build this work started from, three rounds against the same nginx:
#   0.54-0.59x and 27-35 µs of CPU a request before, 0.68-0.81x and 21.6-22.6 µs after.
#   One connection at a time, a half-second tick on each thread took ~10 µs off each request
#   (tokio woke its own driver whenever a request's timers were the soonest).
#   Later (a leaner decision path; the proxy itself unchanged): medians 0.79-0.81x (rounds
#   0.75-0.83x), added latency nginx +18 µs, kvroute +36 to +39 µs; CPU a request from
#   /proc, user + system: kvroute 9.1-9.6 + 12.4-12.8 µs, nginx's two workers 2.5-2.7 +
#   11.7-12.2 µs.
#   Then (HTTP/1.1 to the replicas on the request's own task instead of hyper's client
#   connection; one listening socket per HTTP thread): kvroute's user CPU a request 7.0-7.3 µs
#   against 8.5-9.1 for the build before, three paired runs (system 12.6-15.0 against
#   11.9-13.5, noisy); nginx 2.6-2.7 + 11.3-12.0. Three-round runs of the script: 0.86x
#   (rounds 0.73-0.94, nginx 57.3 k requests/s) and 0.74-0.78x (rounds 0.73-0.94, nginx 62.6 k);
#   added latency nginx +18 to +23 µs, kvroute +25 to +34 µs. kvroute ran at 47.9-50.0 k
#   requests/s in every run; nginx's figure moves with the machine's spell. Before the socket
#   per thread, a burst of wrk's 64 connections all landed on one thread (99% of a core,
#   the other at 0.2%). A fast path of our own for plain HTTP/1.1 requests in front of
#   hyper's server (scratch, not kept) took another ~0.7 µs of user CPU a request and no
#   visible throughput.
#   2026-11-22/23, three runs while the response stall watch and the client send timeout
#   landed (the first with every response's state behind a lock, the last with an HTTP/1
#   response's state inline): kvroute 47.1-49.9 k requests/s, nginx 56.6-67.3 k; medians
#   0.74-0.85x; added latency nginx +18 to +28 µs, kvroute +24 to +64 µs (the
#   single-connection runs are the noisiest).
#   2026-11-27, a slow spell (nginx at 26.3 µs of CPU a request): nginx 39.0 k requests/s, floor
#   0.92x (29.8 µs), kvroute cache-aware 0.64x (45.0 µs), round-robin 0.63x; added latency
#   p50 nginx +29 µs, floor +22, kvroute +31 to +35. A flat profile of kvroute under this load
#   (perf, cpu-clock): no symbol of its own above 2%; kernel wake-ups and sends lead.
#   2026-11-27, a later session (credits withdrawn on error answers, reports' own share):
#   nginx 59.6 k requests/s (17.3 µs of CPU a request), floor 0.94x (18.9 µs), kvroute
#   cache-aware 0.64x (30.0 µs, rounds 0.61-0.68), round-robin 0.67x (29.4 µs); added latency
#   p50 nginx +27 µs, floor +28, kvroute +38/+39. A call-graph profile of cache-aware under
#   this load (perf, DWARF): the decision is 9.4% of the process's samples (parse 3.1%,
#   tokenize 2.3%, the member list 1.1%), forwarding (write and read the replica's head) 34%,
#   almost all of it kernel sends; no router function over 2% of its own.
#   2026-11-27, the next session (reported-usage counters, a first-request deadline per
#   connection, probes not counted): nginx 61.8 k requests/s (16.5 µs of CPU a request), floor
#   0.84x (20.3 µs), kvroute cache-aware 0.61x (31.5 µs, rounds 0.57-0.63), round-robin 0.62x
#   (31.0 µs); added latency p50 nginx +27 µs, floor +27, kvroute +36. A paired A/B against the
#   build of 2026-11-23 that measured 0.87x (59f6bb1, built with this release profile), four
#   rounds of cache-aware by hand: this build 36.6 µs of CPU a request against that one's
#   35.3 (user 19.8 against 17.9): most of the fall since then is the machine's (the floor
#   used 20-22 µs a request in the same spell, 15.5-16.0 then).
#   2026-11-27, later (requests' sequences counted): nginx 52.8 k requests/s (19.2 µs of CPU a
#   request), floor 0.91x (22.3 µs), kvroute cache-aware 0.66x (31.8 µs, rounds 0.58-0.77),
#   round-robin 0.58x (34.1 µs); added latency p50 nginx +28 µs, floor +28, kvroute +37/+38.
#   2026-11-27, a later session (health checks with their own timeout and threshold, a
#   client that leaves mid-body counted as such): nginx 63.7 k requests/s (15.9 µs of CPU a
#   request), floor 0.89x (18.8 µs), kvroute cache-aware 0.60x (30.0 µs, rounds 0.59-0.65),
#   round-robin 0.61x (30.0 µs); added latency p50 nginx +26 µs, floor +28, kvroute +37.
#   After every response's body was wrapped to count the connection's open requests (idle
#   HTTP/2 connections closed): nginx 62.1 k (16.5 µs), floor 0.84x (20.4 µs), kvroute
#   cache-aware 0.62x (31.3 µs, rounds 0.56-0.64), round-robin 0.63x (31.0 µs); added p50 as
#   before.
#   2026-11-27, a faster machine (nginx 95.8 k requests/s at 10.3 µs of CPU a request): floor
#   0.75x (14.3 µs), kvroute cache-aware 0.55x (21.5 µs, rounds 0.50-0.55), round-robin 0.56x
#   (20.8 µs); added latency p50 nginx +12 µs, floor +17, kvroute +21. Instructions a proxied
#   request under callgrind (repeatable, unlike the CPU times above): kvroute cache-aware
#   57.4 k before a replica's request URL was put together from its parsed authority and the
#   request id and content-length were written without fmt, 55.1 k after; the floor 34.6 k.
#   System calls a request (perf): the floor and kvroute about 4.1 each, nginx 5.1.
#   2026-11-27, the next session (WebSocket upgrades served, each request's peer address in
#   its extensions): nginx 85.4 k requests/s (11.4 µs of CPU a request), floor 0.76x (15.6
#   µs), kvroute cache-aware 0.59x (22.0 µs, rounds 0.56-0.65), round-robin 0.55x (22.8 µs);
#   added latency p50 nginx +14 µs, floor +18, kvroute +20/+22. Callgrind, the same script
#   for both builds (not the one above): 56.3 k instructions a request for the session's
#   first build, 56.4 k for its last.
#   2026-11-27, the twenty-ninth session (data-parallel ranks; a client's rank header taken
#   off): nginx 99.9 k requests/s (9.8 µs of CPU a request), floor 0.76x (13.4 µs), kvroute
#   cache-aware 0.57x (19.8 µs, rounds 0.56-0.57), round-robin 0.57x (19.6 µs); added latency
#   p50 nginx +21 µs, floor +21, kvroute +28. Earlier the same session (before the rank load
#   terms): nginx 88.8 k, floor 0.67x, cache-aware 0.55x, round-robin 0.57x.
#   2026-11-28, the thirty-fourth session (at 24522c2): nginx 87.5 k requests/s (11.0 µs of
#   CPU a request), floor 0.78x (15.4 µs), kvroute cache-aware 0.58x (22.6 µs, rounds
#   0.53-0.59), round-robin 0.56x (23.1 µs); added latency p50 nginx +19 µs, floor +21,
#   kvroute +30/+33.
#   2026-11-29, the forty-third session (live reload, TLS on the listener, plaintext here), a
#   slow spell (nginx 31.7 k requests/s at 32.6 µs of CPU a request): floor 0.70x (48.3 µs),
#   kvroute cache-aware 0.57x (72.0 µs, rounds 0.50-0.67), round-robin 0.51x (79.1 µs); added
#   latency p50 nginx +57 µs, floor +49, kvroute +56/+62. Instructions a proxied request under
#   callgrind (one keep-alive connection, 3000 requests): cache-aware 64.7 k at the session's
#   start, 66.1 k at its end, the floor 37.3 k and 38.7 k (same-build runs differ by up to
#   0.8 k, in how often the runtime parks between requests).
# Where the difference is: kernel time is about the same for both (loopback sends and the
# wake-ups they cause, ~12-13 µs); user time is ~3 µs for nginx and ~9 µs for kvroute. An
# early bare forwarder on the same accept loop (hyper server, hyper-util client, no decision,
# no metrics; not kept) used 20-23 µs a request: hyper's client machinery was most of it,
# kvroute's own work (decision, load accounting, usage sniffing) 2-3 µs. Steps taken:
# one single-threaded runtime per core and mimalloc (0.58-0.62x before), then a per-thread
# upstream pool that returns connections when the body ends (~1.5 µs less a request, +7%
# requests/s over eight paired runs).
#   2026-11-23, with the `floor` (router/examples/bare_forwarder, in this script since):
#   two runs (medians): nginx 65.0 k and 61.4 k requests/s at 14.3 and 15.2 µs of CPU a
#   request; floor 0.93x and 0.94x (rounds 0.80-1.06) at 17.9 and 16.8 µs; kvroute
#   cache-aware 0.81x and 0.73x (rounds 0.73-0.94) at 20.1 and 20.5 µs, round-robin 0.72x
#   and 0.79x at 22.1 and 20.4 µs (the first run's router was built with tokio's
#   `test-util`, see the build step). So the floor is at 0.93x of nginx, and kvroute's
#   routing work takes it to about 0.75-0.8x: about a third of the gap is the router's
#   plumbing (hyper's server, the accept loop's limits and timers, the pool), two thirds
#   its routing work. A scratch forwarder (not kept) on hyper's server with a fixed
#   upstream connection for each client connection and no timers matched nginx: 60-65 k,
#   14.3-14.7 µs (user 3.0 against the floor's 4.0-4.7): hyper's server alone is not what
#   keeps kvroute below nginx. The routing work a request, user CPU from profiles: the
#   decision ~1.3 µs (`kvroute_router_decision_seconds`: mean 1.29 µs under this load),
#   parsing the replica's response head into a HeaderMap ~0.35 µs (httparse itself 0.05),
#   timers and clock reads ~0.5 µs before this version's changes (bodies' idle timers armed
#   only while waiting; forwarding futures boxed, 4.5 KB copied into hyper a request before).
#   2026-11-23, after the replica's headers were prepared once per request (moved, not
#   cloned) and the metric-family, pool-key and hop-by-hop work was trimmed (profiles: those
#   parts went from ~8.5% to ~3.3% of the proxy's user CPU): one run, nginx 67.8 k requests/s
#   at 13.7 µs of CPU a request; floor 0.90x (rounds 0.86-0.93) at 16.7 µs; kvroute
#   cache-aware 0.82x (0.75-0.93) at 18.1 µs, round-robin 0.79x at 19.4 µs; added latency
#   nginx +20 µs, kvroute +36 to +43 µs. Paired A/B rounds of the two builds stayed inside
#   the machine's noise (user CPU a request 6.2-7.0 against 6.3-8.0 µs).
#   2026-11-23, after the passive-health, in-flight-slot and decision changes (a plan's
#   order as indices, no per-request clone of each replica's entry): one run, nginx 64.7 k
#   requests/s at 14.3 µs of CPU a request; floor 0.94x (0.92-0.98) at 16.0 µs; kvroute
#   cache-aware 0.87x (0.82-0.87) at 18.0 µs, round-robin 0.83x at 18.8 µs; added latency
#   nginx +18 µs, kvroute +26 to +28 µs. Three paired rounds against the build the day
#   started from: user CPU a request 6.4-7.0 against 7.4-7.6 µs, +6% requests/s. One HTTP
#   thread instead of two gives the same CPU a request (user 6.2-6.9 µs, three paired
#   rounds): no cross-core contention to win back; the gap is instructions a request.
#   2026-11-23, later (pins stamped per request, LoRA eligibility in the decision): one run,
#   nginx 65.8 k requests/s at 14.2 µs of CPU a request; floor 0.95x (0.87-1.03) at 15.5 µs;
#   kvroute cache-aware 0.79x (0.74-0.82) at 20.1 µs, round-robin 0.80x at 20.6 µs; added
#   latency nginx +22 µs, floor +20, kvroute +24 to +27 µs. Paired rounds against the day's
#   first build: inside the noise (0.79-0.84x both).
#   2026-11-26, on a slower machine of the same kind (nginx 50.7 k requests/s at 20.3 µs of
#   CPU a request; single decisions 2.4x slower than on the machine above): one run, floor
#   0.82x (rounds 0.73-0.83) at 25.3 µs, kvroute cache-aware 0.57x (0.52-0.62) at 36.9 µs,
#   round-robin 0.58x at 35.7 µs; added latency nginx +30 µs, floor +30, kvroute +38 to +40.
#   User time a request there: kvroute 16.6-18.4 µs, nginx 6.4-6.8; system 14.9-16.5 against
#   11.5-12.3. Then the release profile's whole-program optimization (lto = "fat", one
#   codegen unit) against the same code without it, paired rounds by hand (6 s each, user +
#   system CPU a request): three rounds 32.3-34.6 µs against 37.4-43.8 (nginx 18.5-18.9), then
#   eight more in a noisier spell, 2-21% less (user time 7-32% less); thin LTO fell between.
#   In this script, the same builds (`compare` the one without LTO): 0.57x against 0.53x,
#   then 0.56x (40.2 µs) against 0.51x (45.3 µs).
#   Later the same day, in a slower spell still (nginx 31.3 k requests/s at 33.1 µs), with the
#   Responses API in the router (a frame watch on every response's first data): floor 0.88x
#   (0.77-0.91) at 40.8 µs, kvroute cache-aware 0.68x (0.62-0.72) at 57.4 µs, round-robin
#   0.62x at 61.2 µs; added latency nginx +41 µs, floor +41, kvroute +59 to +66.
#   2026-11-26, night (vLLM's chat flags, truncate_prompt_tokens): one run 0.55x cache-aware
#   (floor 0.88x, nginx 58.8 k at 17.5 µs, kvroute 34.9 µs); then paired with the build the
#   work started from (COMPARE, same rounds): this build 0.66x (0.58-0.70) at 37.0 µs, that
#   one 0.61x (0.58-0.62) at 42.2 µs, floor 0.84x, nginx 48.8 k: no cost from the change, and
#   the machine's spell moves the ratio by a tenth.
#
# Usage: router/benches/proxy_vs_nginx.sh
#   (env: DURATION=10s ROUNDS=3 CONNECTIONS=64 THREADS=1 BACKENDS=2; about 4.5 minutes)
#   COMPARE=path/to/another/kvroute-router adds `kvroute-compare`, that build with the
#   cache-aware policy, to every round: a paired A/B of two builds against the same nginx.
# Needs root or sudo for `apt-get install -y nginx wrk` when they are missing.
set -euo pipefail

DURATION=${DURATION:-10s}
ROUNDS=${ROUNDS:-3}
CONNECTIONS=${CONNECTIONS:-64}
THREADS=${THREADS:-1}
BACKENDS=${BACKENDS:-2}
BASE_PORT=${BASE_PORT:-18100}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)

need() { command -v "$1" >/dev/null 2>&1 || [ -x "/usr/sbin/$1" ]; }
if ! need nginx || ! need wrk; then
    SUDO=""
    [ "$(id -u)" -ne 0 ] && SUDO=sudo
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq nginx wrk >/dev/null
fi
NGINX=$(command -v nginx || echo /usr/sbin/nginx)

# Two builds: an example gets the dev-dependencies, whose features (tokio's `test-util`)
# would otherwise be built into the router too.
(cd "$ROOT" && cargo build --release -q -p kvroute-router --bin kvroute-router)
(cd "$ROOT" && cargo build --release -q -p kvroute-router --example bare_forwarder)
ROUTER="${CARGO_TARGET_DIR:-$ROOT/target}/release/kvroute-router"
FLOOR="${CARGO_TARGET_DIR:-$ROOT/target}/release/examples/bare_forwarder"

WORK=$(mktemp -d)
PIDS=()
cleanup() {
    for pid in "${PIDS[@]}"; do kill "$pid" 2>/dev/null || true; done
    for conf in "$WORK"/*.conf; do
        [ -f "$conf" ] && "$NGINX" -c "$conf" -p "$WORK" -s quit 2>/dev/null || true
    done
    wait 2>/dev/null || true
    rm -rf "$WORK"
}
trap cleanup EXIT

port_of_backend() { echo $((BASE_PORT + $1)); }
NGINX_PORT=$((BASE_PORT + 50))
KVROUTE_PORT=$((BASE_PORT + 51))

COMPLETION='{"id":"cmpl-bench","object":"text_completion","created":1700000000,"model":"kvroute-sim","choices":[{"index":0,"text":" a fixed answer of a few words","logprobs":null,"finish_reason":"length"}],"usage":{"prompt_tokens":12,"completion_tokens":8,"total_tokens":20,"prompt_tokens_details":{"cached_tokens":0}}}'

{
    echo "worker_processes 1; daemon on; pid $WORK/backend.pid; error_log $WORK/backend.err warn;"
    echo "events { worker_connections 4096; }"
    echo "http { access_log off; keepalive_requests 1000000;"
    for i in $(seq 1 "$BACKENDS"); do
        echo "  server { listen 127.0.0.1:$(port_of_backend "$i") reuseport;"
        echo "    location = /health { return 200 ''; }"
        echo "    location = /metrics { default_type text/plain; return 200 'vllm:num_requests_waiting 0\n'; }"
        echo "    location / { default_type application/json; return 200 '$COMPLETION'; } }"
    done
    echo "}"
} >"$WORK/backend.conf"

{
    echo "worker_processes auto; daemon on; pid $WORK/proxy.pid; error_log $WORK/proxy.err warn;"
    echo "events { worker_connections 4096; }"
    echo "http { access_log off; keepalive_requests 1000000;"
    echo "  upstream backends {"
    for i in $(seq 1 "$BACKENDS"); do echo "    server 127.0.0.1:$(port_of_backend "$i");"; done
    echo "    keepalive 256; keepalive_requests 1000000; }"
    echo "  server { listen 127.0.0.1:$NGINX_PORT reuseport;"
    echo "    location / { proxy_pass http://backends; proxy_http_version 1.1;"
    echo "      proxy_set_header Connection ''; proxy_buffering off; } }"
    echo "}"
} >"$WORK/proxy.conf"

cat >"$WORK/post.lua" <<'EOF'
wrk.method = "POST"
wrk.headers["Content-Type"] = "application/json"
wrk.body = '{"model":"kvroute-sim","prompt":"You are a helpful assistant. Summarise the following short note in one line.","max_tokens":8}'
done = function(summary, latency, requests)
    local s = summary.duration / 1e6
    local bad = summary.errors.status + summary.errors.connect + summary.errors.read
        + summary.errors.write + summary.errors.timeout
    io.write(string.format("RESULT %.0f %.1f %.1f %d %d\n", summary.requests / s,
        latency:percentile(50), latency:percentile(99), summary.requests, bad))
end
EOF

wait_http() {
    for _ in $(seq 1 100); do
        curl -sf -o /dev/null "$1" && return 0
        sleep 0.1
    done
    echo "no answer from $1" >&2
    return 1
}

"$NGINX" -c "$WORK/backend.conf" -p "$WORK"
"$NGINX" -c "$WORK/proxy.conf" -p "$WORK"
wait_http "http://127.0.0.1:$(port_of_backend 1)/health"
wait_http "http://127.0.0.1:$NGINX_PORT/health"

# Each target is measured ROUNDS times, the targets taking turns, so that a slow spell of the
# machine falls on all of them; the table shows medians, and each round's kvroute/nginx ratio
# is taken within the round.
declare -A RPS P50 P99 BAD RATIO CPU ONE_P50 ONE_P99 PROCS
TARGETS=(direct nginx floor kvroute-round-robin kvroute-cache-aware)
[ -n "${COMPARE:-}" ] && TARGETS+=(kvroute-compare)
declare -A URL=(
    [direct]="http://127.0.0.1:$(port_of_backend 1)/v1/completions"
    [nginx]="http://127.0.0.1:$NGINX_PORT/v1/completions"
    [floor]="http://127.0.0.1:$((KVROUTE_PORT + 2))/v1/completions"
    [kvroute-round-robin]="http://127.0.0.1:$KVROUTE_PORT/v1/completions"
    [kvroute-cache-aware]="http://127.0.0.1:$((KVROUTE_PORT + 1))/v1/completions"
    [kvroute-compare]="http://127.0.0.1:$((KVROUTE_PORT + 3))/v1/completions"
)

# CPU time (user + system, clock ticks) used so far by the processes given.
ticks() {
    local total=0 pid
    for pid in "$@"; do
        total=$((total + $(awk '{ print $14 + $15 }' "/proc/$pid/stat")))
    done
    echo "$total"
}

# One throughput run of target $1: appends its requests/s, p50, p99, errors and the CPU
# time its proxy processes took a request (for `direct`, the backend's).
measure() {
    local name=$1 line rps p50 p99 requests bad before after
    wrk -t"$THREADS" -c"$CONNECTIONS" -d2s -s "$WORK/post.lua" "${URL[$name]}" >/dev/null # warm-up
    # shellcheck disable=SC2086 # PROCS holds a list of pids
    before=$(ticks ${PROCS[$name]})
    line=$(wrk -t"$THREADS" -c"$CONNECTIONS" -d"$DURATION" -s "$WORK/post.lua" "${URL[$name]}" | grep '^RESULT')
    # shellcheck disable=SC2086
    after=$(ticks ${PROCS[$name]})
    read -r _ rps p50 p99 requests bad <<<"$line"
    CPU[$name]+="$(awk -v t=$((after - before)) -v hz="$(getconf CLK_TCK)" -v n="$requests" \
        'BEGIN { printf "%.1f", t * 1e6 / hz / n }') "
    RPS[$name]+="$rps "
    P50[$name]+="$p50 "
    P99[$name]+="$p99 "
    BAD[$name]=$((${BAD[$name]:-0} + bad))
}

# Added latency of target $1: one connection, one request at a time, nothing queued.
latency() {
    local line
    line=$(wrk -t1 -c1 -d"$DURATION" -s "$WORK/post.lua" "${URL[$1]}" | grep '^RESULT')
    read -r _ _ ONE_P50[$1] ONE_P99[$1] _ _ <<<"$line"
}

median() { tr ' ' '\n' | grep . | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
range() { tr ' ' '\n' | grep . | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf "%s-%s", lo, hi }'; }

router() {
    local policy=$1 port=$2 name=${3:-kvroute-$1} binary=${4:-$ROUTER} replicas=()
    # No backend publishes events: port 0 is never connected to (nor one replica's stream, which
    # two replicas may not share), and the replicas are routed on load alone (FALLBACK).
    for i in $(seq 1 "$BACKENDS"); do
        replicas+=(--replica "name=b$i,http=http://127.0.0.1:$(port_of_backend "$i"),events=tcp://127.0.0.1:0,engine=kvroute")
    done
    RUST_LOG=warn "$binary" --listen "127.0.0.1:$port" --admin-listen 127.0.0.1:0 \
        --policy "$policy" "${replicas[@]}" >"$WORK/router-$name.log" 2>&1 &
    PIDS+=("$!")
    PROCS[$name]=$!
    wait_http "http://127.0.0.1:$port/health"
}

router round-robin "$KVROUTE_PORT"
router cache-aware "$((KVROUTE_PORT + 1))"
[ -n "${COMPARE:-}" ] && router cache-aware "$((KVROUTE_PORT + 3))" kvroute-compare "$COMPARE"
# The floor: the router's accept loop and upstream pool with nothing between them.
backend_urls=()
for i in $(seq 1 "$BACKENDS"); do backend_urls+=("http://127.0.0.1:$(port_of_backend "$i")"); done
"$FLOOR" "127.0.0.1:$((KVROUTE_PORT + 2))" "$(nproc)" "${backend_urls[@]}" >"$WORK/floor.log" 2>&1 &
PIDS+=("$!")
PROCS[floor]=$!
wait_http "http://127.0.0.1:$((KVROUTE_PORT + 2))/health"
PROCS[nginx]=$(pgrep -P "$(cat "$WORK/proxy.pid")" | tr '\n' ' ')
PROCS[direct]=$(pgrep -P "$(cat "$WORK/backend.pid")" | tr '\n' ' ')
for round in $(seq 1 "$ROUNDS"); do
    for name in "${TARGETS[@]}"; do
        measure "$name"
    done
    nginx_rps=$(echo "${RPS[nginx]}" | awk '{ print $NF }')
    for name in "${TARGETS[@]}"; do
        RATIO[$name]+="$(echo "${RPS[$name]}" | awk -v n="$nginx_rps" '{ printf "%.2f", $NF / n }') "
    done
done
for name in "${TARGETS[@]}"; do
    latency "$name"
done

echo
echo "POST /v1/completions, wrk -t$THREADS -c$CONNECTIONS -d$DURATION, $ROUNDS rounds, $BACKENDS backend ports, $(nproc) cores"
printf '%-22s %12s %16s %10s %10s %8s %10s %12s %12s\n' run "requests/s" "range" "p50 µs" "p99 µs" errors \
    "vs nginx" "range" "CPU µs/req"
for name in "${TARGETS[@]}"; do
    printf '%-22s %12.0f %16s %10.0f %10.0f %8s %9.2fx %12s %12s\n' "$name" "$(median <<<"${RPS[$name]}")" \
        "$(range <<<"${RPS[$name]}")" "$(median <<<"${P50[$name]}")" "$(median <<<"${P99[$name]}")" \
        "${BAD[$name]}" "$(median <<<"${RATIO[$name]}")" "$(range <<<"${RATIO[$name]}")" \
        "$(median <<<"${CPU[$name]}")"
done
echo "(CPU µs/req: user + system time of the proxy's processes a request; for direct, the backend's)"
echo
echo "one connection, one request at a time (latency a proxy adds, µs):"
printf '%-22s %10s %10s %14s\n' run "p50 µs" "p99 µs" "added p50 µs"
for name in "${TARGETS[@]}"; do
    printf '%-22s %10s %10s %14s\n' "$name" "${ONE_P50[$name]}" "${ONE_P99[$name]}" \
        "$(awk "BEGIN { print ${ONE_P50[$name]} - ${ONE_P50[direct]} }")"
done

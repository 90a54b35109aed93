#!/usr/bin/env bash
# Fleet hit rate, load skew and latency: kvroute-router's cache-aware policy against SGLang's
# own router (PyPI `sglang-router`, its `cache_aware` and `round_robin` policies), each in
# front of the same simulated fleet, everything on 127.0.0.1.
#
# Fleet: 4 kvroute replica agents as the demo builds them (2048 blocks of 16 tokens each, LRU,
# time scale 6: every simulated latency divided by 6, the trace's arrivals too), started
# afresh for every run so that each router meets cold caches. They answer OpenAI completions
# as vLLM and SGLang do (`usage.prompt_tokens_details.cached_tokens`), which is what the hit
# rate is read from: the same counters whichever router sent the requests.
#
# Routers:
#   kvroute            kvroute-router, cache-aware (the default), following the agents' KV
#                      events (their token blocks, exactly)
#   sglang-cache-aware sglang-router --policy cache_aware, with its defaults: an approximate
#                      radix tree of the prompts' text it sent where, and its balance
#                      thresholds (it sees no events)
#   sglang-round-robin sglang-router --policy round_robin: the baseline
#
# Workloads (`kvroute-loadgen live`, text prompts: a word a token, which every router reads as
# text and the agents tokenize):
#   chat  the demo's: 500 conversations of 2-8 turns behind 8 system prompts of 2048 tokens
#   rag   2000 questions over a pool of 200 documents (Zipf 1.1, 3 a question) behind one
#         system prompt of 1024 tokens that every request shares
#
# Usage: bash loadgen/benches/vs_sglang_router.sh [chat|rag ...]   (default: chat rag)
# Env: SGLANG_ROUTER (default 0.3.2, installed into target/bench/sglang-router-venv from PyPI),
#      BASE_PORT (default 18000: agents BASE..BASE+3, gRPC +100, events +200, replay +300,
#      routers +400/+500), OUT (default target/bench/vs-sglang-router).
#
# 2026-11-29, sglang-router 0.3.2, on the 2-core dev machine (times are the agents' sped-up
# ones, at time scale 6):
#   | workload | router             | hit rate | load skew | TTFT p50 / p99 ms | e2e p99 ms |
#   | chat     | kvroute            | 82.3%    | 1.13      | 7.5 / 41.8        | 175.3      |
#   | chat     | sglang-cache-aware | 77.1%    | 2.66      | 43.8 / 804.1      | 1117.6     |
#   | chat     | sglang-round-robin | 65.3%    | 1.01      | 32.7 / 71.9       | 331.8      |
#   | rag      | kvroute            | 33.8%    | 1.01      | 52.9 / 95.3       | 678.7      |
#   | rag      | sglang-cache-aware | 34.4%    | 1.18      | 58.1 / 244.3      | 800.2      |
#   | rag      | sglang-round-robin | 25.9%    | 1.01      | 58.4 / 84.8       | 684.6      |
# No errors in any run. In chat, SGLang's tree sends each system prompt's conversations
# to one replica until its balance thresholds trip: a third of the fleet's load on one
# replica, and its queue in the TTFT tail. In rag both are at the pooled reference (one cache
# of the fleet's size: 34.2% offline, `kvroute-loadgen simulate`), which separate caches can
# pass by a little; kvroute keeps the load even there too.
set -euo pipefail
cd "$(dirname "$0")/../.."

version=${SGLANG_ROUTER:-0.3.2}
base=${BASE_PORT:-18000}
out=${OUT:-target/bench/vs-sglang-router}
venv=target/bench/sglang-router-venv
workloads=("$@")
[ ${#workloads[@]} -gt 0 ] || workloads=(chat rag)
mkdir -p "$out"

if ! "$venv/bin/python" -c "import importlib.metadata as m; assert m.version('sglang-router') == '$version'" 2>/dev/null; then
  python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "sglang-router==$version"
fi
cargo build --release -q -p kvroute-replica-agent -p kvroute-router -p kvroute-loadgen
bin=target/release

pids=()
stop() {
  for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null || true; done
  for pid in "${pids[@]}"; do wait "$pid" 2>/dev/null || true; done
  pids=()
}
trap stop EXIT

# Waits until `$1` answers 200 (up to 30 s).
wait_for() {
  for _ in $(seq 300); do
    if [ "$(curl -s -o /dev/null -w '%{http_code}' "$1")" = 200 ]; then return 0; fi
    sleep 0.1
  done
  echo "$1 did not come up" >&2
  return 1
}

agents() {
  for i in 0 1 2 3; do
    "$bin/kvroute-agent" --name "agent-$i" --model kvroute-sim \
      --http-addr "127.0.0.1:$((base + i))" --grpc-addr "127.0.0.1:$((base + 100 + i))" \
      --events-endpoint "tcp://127.0.0.1:$((base + 200 + i))" \
      --replay-endpoint "tcp://127.0.0.1:$((base + 300 + i))" \
      --capacity-blocks 2048 --block-size 16 --time-scale 6 >"$out/agent-$i.log" 2>&1 &
    pids+=($!)
  done
  for i in 0 1 2 3; do wait_for "http://127.0.0.1:$((base + i))/health"; done
}

# Starts router `$1` in front of the agents and sets `target` to its URL.
router() {
  case "$1" in
    kvroute)
      local replicas=()
      for i in 0 1 2 3; do
        replicas+=(--replica "name=agent-$i,http=http://127.0.0.1:$((base + i)),events=tcp://127.0.0.1:$((base + 200 + i)),replay=tcp://127.0.0.1:$((base + 300 + i)),grpc=http://127.0.0.1:$((base + 100 + i))")
      done
      "$bin/kvroute-router" --listen "127.0.0.1:$((base + 500))" --admin-listen 127.0.0.1:0 \
        --model kvroute-sim --block-size 16 "${replicas[@]}" >"$out/router-$1.log" 2>&1 &
      pids+=($!)
      wait_for "http://127.0.0.1:$((base + 500))/ready"
      target="http://127.0.0.1:$((base + 500))"
      ;;
    sglang-*)
      local workers=()
      for i in 0 1 2 3; do workers+=("http://127.0.0.1:$((base + i))"); done
      local policy=${1#sglang-}
      "$venv/bin/python" -m sglang_router.launch_router --host 127.0.0.1 --port $((base + 400)) \
        --policy "${policy//-/_}" --worker-urls "${workers[@]}" >"$out/router-$1.log" 2>&1 &
      pids+=($!)
      wait_for "http://127.0.0.1:$((base + 400))/v1/models"
      target="http://127.0.0.1:$((base + 400))"
      ;;
  esac
}

workload() {
  case "$1" in
    chat) echo chat --conversations 500 --system-prompts 8 --system-prompt-tokens 2048 --min-turns 2 \
      --max-turns 8 --user-tokens 256 --output-tokens 48 --conversation-rate 4 --think-time 10s ;;
    rag) echo rag ;;
  esac
}

for w in "${workloads[@]}"; do
  for r in kvroute sglang-cache-aware sglang-round-robin; do
    agents
    router "$r"
    replicas=()
    for i in 0 1 2 3; do replicas+=(--replica-url "http://127.0.0.1:$((base + i))"); done
    # shellcheck disable=SC2046
    "$bin/kvroute-loadgen" live --target "$target" "${replicas[@]}" --mode trace --speedup 6 \
      --prompt-format text --no-progress --json "$out/$w-$r.json" $(workload "$w") \
      >"$out/$w-$r.txt" 2>"$out/$w-$r.err"
    stop
  done
done

python3 - "$out" "${workloads[@]}" <<'EOF'
import json, sys
out, workloads = sys.argv[1], sys.argv[2:]
print("| workload | router | hit rate | load skew | TTFT p50 / p99 ms | e2e p99 ms | errors |")
print("|---|---|---|---|---|---|---|")
for w in workloads:
    for r in ["kvroute", "sglang-cache-aware", "sglang-round-robin"]:
        d = json.load(open(f"{out}/{w}-{r}.json"))
        print(f"| {w} | {r} | {100 * d['fleet_hit_rate']:.1f}% | {d['load_skew']:.2f} | "
              f"{d['ttft']['p50_ms']:.1f} / {d['ttft']['p99_ms']:.1f} | {d['e2e']['p99_ms']:.1f} | "
              f"{d['requests'] - d['succeeded']} |")
EOF

#!/usr/bin/env bash
# Decode speed with and without a grammar constraint, through `deltafin serve`.
#
# Usage: bench/structured-output.sh [MODEL_DIR] [ROUNDS]
#   MODEL_DIR: a deltafin model directory (default: `deltafin synth --preset demo` in a temp dir)
#   ROUNDS:    requests of each kind, alternating (default 5)
# Env: DELTAFIN_BIN (default target/release/deltafin), SPECULATE (passed to --speculate, default
# auto), MAX_TOKENS (default 200).
#
# Each request generates MAX_TOKENS tokens greedily from the same prompt: plain (`ignore_eos`),
# or under `response_format` json_schema `{"text": string}` (a random-weight model stays inside
# the unbounded string, so it also runs to MAX_TOKENS). Prints the median decode rate of each and
# the difference per token, which is the mask's cost (plus the other constrained-path work).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
BIN="${DELTAFIN_BIN:-$ROOT/target/release/deltafin}"
ROUNDS="${2:-5}"
WORK="$(mktemp -d "${TMPDIR:-/tmp}/deltafin-structured.XXXXXX")"
PID=""
cleanup() {
    if [ -n "$PID" ]; then kill "$PID" 2>/dev/null || true; wait "$PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
MODEL="${1:-}"
if [ -z "$MODEL" ]; then
    MODEL="$WORK/demo"
    "$BIN" synth --preset demo --out "$MODEL" 2>/dev/null
fi
PORT="$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
"$BIN" serve --model "$MODEL" --host 127.0.0.1 --port "$PORT" --speculate "${SPECULATE:-auto}" \
    > "$WORK/server.log" 2>&1 &
PID=$!
for _ in $(seq 300); do
    python3 -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null && break
    sleep 0.1
done
PORT="$PORT" ROUNDS="$ROUNDS" MAX_TOKENS="${MAX_TOKENS:-200}" python3 - <<'EOF'
import json, os, statistics, time, urllib.request

port, rounds, n = os.environ["PORT"], int(os.environ["ROUNDS"]), int(os.environ["MAX_TOKENS"])
url = f"http://127.0.0.1:{port}/v1/chat/completions"
base = {"model": "x", "messages": [{"role": "user", "content": "Describe the weather."}],
        "max_tokens": n, "ignore_eos": True}
schema = {"type": "json_schema", "json_schema": {"name": "t", "schema": {
    "type": "object", "properties": {"text": {"type": "string"}}, "required": ["text"]}}}
models = json.load(urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models"))
base["model"] = models["data"][0]["id"]

def run(body):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t = time.perf_counter()
    r = json.load(urllib.request.urlopen(req, timeout=600))
    dt = time.perf_counter() - t
    return r["usage"]["completion_tokens"] / dt, r["usage"]["completion_tokens"]

run(base); run({**base, "response_format": schema})  # warm-up (and the vocabulary trie)
plain, constrained = [], []
for _ in range(rounds):
    plain.append(run(base))
    constrained.append(run({**base, "response_format": schema}))
p = statistics.median(x for x, _ in plain)
c = statistics.median(x for x, _ in constrained)
print(f"plain:       {p:8.1f} tokens/s  ({plain[0][1]} tokens per request, median of {rounds})")
print(f"json_schema: {c:8.1f} tokens/s  ({constrained[0][1]} tokens per request, median of {rounds})")
print(f"difference:  {(1 / c - 1 / p) * 1e6:8.0f} µs per token")
EOF

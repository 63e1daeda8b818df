#!/usr/bin/env bash
# Python suite for `deltafin serve` with the official openai and anthropic SDKs.
#
# Creates a venv (target/py-venv, or $DELTAFIN_PY_VENV), installs requirements.txt, builds the
# release binary (or uses $DELTAFIN_BIN), converts two fixtures and starts a server on each on a
# free loopback port with an API key: dsv3_a (random weights, test_server.py) and
# scripted/qwen_tools (greedy output is a fixed reasoning + content + tool call chain,
# test_scripted.py). Waits for /health, runs pytest, and always stops the servers. Extra
# arguments go to pytest (e.g. `-k stream`).
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
HERE="$ROOT/tests/python"
VENV="${DELTAFIN_PY_VENV:-$ROOT/target/py-venv}"
PYTHON="${PYTHON:-python3}"

log() { echo "[tests/python] $*" >&2; }

# 1. venv + pinned SDKs (skipped when already satisfied)
if [ ! -x "$VENV/bin/python" ]; then
    log "creating venv at $VENV"
    "$PYTHON" -m venv "$VENV"
fi
STAMP="$VENV/.deltafin-requirements"
if ! cmp -s "$HERE/requirements.txt" "$STAMP" 2>/dev/null; then
    log "installing tests/python/requirements.txt into $VENV"
    timeout 300 "$VENV/bin/python" -m pip install --disable-pip-version-check -q -r "$HERE/requirements.txt"
    cp "$HERE/requirements.txt" "$STAMP"
fi

# 2. binary and fixture model
if [ -n "${DELTAFIN_BIN:-}" ]; then
    BIN="$DELTAFIN_BIN"
else
    log "building deltafin (release)"
    (cd "$ROOT" && cargo build --release -q -p deltafin)
    BIN="$ROOT/target/release/deltafin"
fi
WORK="$(mktemp -d "${TMPDIR:-/tmp}/deltafin-pytest.XXXXXX")"
SERVER_PIDS=()
cleanup() {
    for pid in "${SERVER_PIDS[@]}"; do
        if kill -0 "$pid" 2>/dev/null; then
            kill "$pid" 2>/dev/null || true
            for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
            kill -9 "$pid" 2>/dev/null || true
        fi
    done
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
for fixture in deepseek_v3/dsv3_a scripted/qwen_tools; do
    name="$(basename "$fixture")"
    "$BIN" convert "$ROOT/tests/fixtures/$fixture" "$WORK/$name" 2> "$WORK/convert-$name.log" \
        || { cat "$WORK/convert-$name.log" >&2; exit 1; }
done

# 3. servers on free ports: the random-weight fixture (test_server.py) and the scripted model
#    whose greedy output is a fixed tool call (test_scripted.py)
KEY="test-key-$$"
free_port() {
    "$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}
# start_server MODEL_DIR PORT LOG [serve flags...]: starts it in the background, records its pid.
start_server() {
    local model="$1" port="$2" logf="$3"
    shift 3
    "$BIN" serve --model "$model" --host 127.0.0.1 --port "$port" --api-key "$KEY" "$@" > "$logf" 2>&1 &
    SERVER_PIDS+=("$!")
}
# wait_healthy PORT LOG PID
wait_healthy() {
    for i in $(seq 300); do
        if "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$1/health', timeout=1)" 2>/dev/null; then
            log "server up on port $1"
            return 0
        fi
        if ! kill -0 "$3" 2>/dev/null; then
            log "server exited early:"; cat "$2" >&2; exit 1
        fi
        [ "$i" = 300 ] && { log "server not healthy after 30 s"; cat "$2" >&2; exit 1; }
        sleep 0.1
    done
}
PORT="$(free_port)"
start_server "$WORK/dsv3_a" "$PORT" "$WORK/server.log" \
    --max-request-bytes 1MiB --max-queue 2 --debug-step-delay-ms 20
SCRIPTED_PORT="$(free_port)"
start_server "$WORK/qwen_tools" "$SCRIPTED_PORT" "$WORK/server-scripted.log"
wait_healthy "$PORT" "$WORK/server.log" "${SERVER_PIDS[0]}"
wait_healthy "$SCRIPTED_PORT" "$WORK/server-scripted.log" "${SERVER_PIDS[1]}"

# 4. the suite
set +e
DELTAFIN_BASE_URL="http://127.0.0.1:$PORT" DELTAFIN_MODEL="dsv3_a" DELTAFIN_API_KEY="$KEY" \
    DELTAFIN_SCRIPTED_BASE_URL="http://127.0.0.1:$SCRIPTED_PORT" DELTAFIN_SCRIPTED_MODEL="qwen_tools" \
    timeout 300 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$HERE/test_server.py" "$HERE/test_scripted.py" "$@"
RC=$?
set -e
if [ "$RC" != 0 ]; then
    log "server log (dsv3_a):"; tail -n 50 "$WORK/server.log" >&2
    log "server log (qwen_tools):"; tail -n 50 "$WORK/server-scripted.log" >&2
fi
exit "$RC"

#!/usr/bin/env bash
# Python suite for `deltafin serve` with the official openai and anthropic SDKs.
#
# Creates a venv (target/py-venv, or $DELTAFIN_PY_VENV), installs requirements.txt, builds the
# release binary (or uses $DELTAFIN_BIN), converts the dsv3_a fixture, starts the server on a
# free loopback port with an API key, waits for /health, runs pytest, and always stops the
# server. Extra arguments go to pytest (e.g. `-k stream`).
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
SERVER_PID=""
cleanup() {
    if [ -n "$SERVER_PID" ] && kill -0 "$SERVER_PID" 2>/dev/null; then
        kill "$SERVER_PID" 2>/dev/null || true
        for _ in $(seq 50); do kill -0 "$SERVER_PID" 2>/dev/null || break; sleep 0.1; done
        kill -9 "$SERVER_PID" 2>/dev/null || true
    fi
    rm -rf "$WORK"
}
trap cleanup EXIT INT TERM
"$BIN" convert "$ROOT/tests/fixtures/deepseek_v3/dsv3_a" "$WORK/dsv3-a" 2> "$WORK/convert.log" \
    || { cat "$WORK/convert.log" >&2; exit 1; }

# 3. server on a free port
PORT="$("$VENV/bin/python" -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')"
KEY="test-key-$$"
"$BIN" serve --model "$WORK/dsv3-a" --host 127.0.0.1 --port "$PORT" --api-key "$KEY" \
    --max-request-bytes 1MiB --max-queue 2 --debug-step-delay-ms 20 > "$WORK/server.log" 2>&1 &
SERVER_PID=$!
for i in $(seq 300); do
    if "$VENV/bin/python" -c "import urllib.request,sys; urllib.request.urlopen('http://127.0.0.1:$PORT/health', timeout=1)" 2>/dev/null; then
        break
    fi
    if ! kill -0 "$SERVER_PID" 2>/dev/null; then
        log "server exited early:"; cat "$WORK/server.log" >&2; exit 1
    fi
    [ "$i" = 300 ] && { log "server not healthy after 30 s"; cat "$WORK/server.log" >&2; exit 1; }
    sleep 0.1
done
log "server up on port $PORT"

# 4. the suite
set +e
DELTAFIN_BASE_URL="http://127.0.0.1:$PORT" DELTAFIN_MODEL="dsv3-a" DELTAFIN_API_KEY="$KEY" \
    timeout 300 "$VENV/bin/python" -m pytest -q -p no:cacheprovider "$HERE/test_server.py" "$@"
RC=$?
set -e
if [ "$RC" != 0 ]; then
    log "server log:"; tail -n 50 "$WORK/server.log" >&2
fi
exit "$RC"

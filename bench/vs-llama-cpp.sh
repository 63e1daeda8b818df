#!/usr/bin/env bash
# deltafin vs llama.cpp, side by side on the same synthetic weights, under the same memory limit
# (issue 4, target 4: deltafin's steady decode tok/s >= 3x llama.cpp's).
#
#   bench/vs-llama-cpp.sh MODEL_DIR [MEMORY_LIMIT] [NEW_TOKENS]
#
#   MODEL_DIR      a deltafin model directory (e.g. /work/bench-models/bench from
#                  `deltafin synth --preset bench`)
#   MEMORY_LIMIT   memory cgroup limit for each run, page cache included (default 4G)
#   NEW_TOKENS     tokens generated per run, greedy, EOS ignored (default 32)
#
# Steps: (1) converts MODEL_DIR to GGUF with bench/deltafin_to_gguf.py (cached next to the model
# directory, redone when the manifest or the converter changes); (2) runs deltafin and llama.cpp
# alternately A B B A ..., each a fresh process inside `bench/with-memory-limit.sh LIMIT` after
# `sync; echo 3 > /proc/sys/vm/drop_caches`; (3) checks every run of one engine produced the same
# ids, compares the two engines' ids, and prints both median steady decode rates and the ratio.
#
# Steady decode, both engines: tokens 3..N of N generated (the first token comes from prefill,
# the first decode step is excluded), as deltafin's --stats-json `steady_decode_tokens_per_s`.
# llama.cpp runs through llama-cpp-python's bindings (greedy argmax over the logits, weights
# mmap'd as llama.cpp does by default, not mlocked).
#
# Environment:
#   VENV=/work/venv-llama      Python venv with gguf, numpy, llama-cpp-python (created and
#                              installed when missing: the llama.cpp compile takes ~25 min on
#                              2 cores; see bench/requirements-llama.txt)
#   DELTAFIN=PATH              deltafin binary (default: target/release/deltafin, built if missing)
#   GGUF=PATH                  GGUF file to use/write (default: <model dir>.<backbone>.gguf)
#   BACKBONE=q8_0|f16|f32      GGUF backbone type (default q8_0; deltafin's backbone is int8)
#   PROMPT_IDS=1,2,...         prompt token ids (default 1,2,3,4,5,6,7,8)
#   PAIRS=2                    A B pairs (2 -> A B B A)
#   THREADS=2                  llama.cpp threads (deltafin uses all cores, 2 here)
#   REPACK=0                   1: keep llama.cpp's CPU weight repacking (use_extra_bufts), which
#                              copies MXFP4 experts into anonymous memory at load (OOM when the
#                              pack exceeds the limit); 0 (default): weights stay mmap'd
#   MARGIN=512MiB-in-bytes     deltafin --ram-budget = LIMIT - backbone - MARGIN (bytes)
#   OUT=DIR                    where per-run JSON goes (default /tmp/vs-llama-cpp.<pid>)
#   SKIP_DROP_CACHES=1         do not drop the page cache before runs (not a cold-cache result)
set -euo pipefail

die() {
	echo "vs-llama-cpp: error: $*" >&2
	exit 2
}
say() { echo "vs-llama-cpp: $*" >&2; }

[[ $# -ge 1 && $# -le 3 ]] || die "usage: $0 MODEL_DIR [MEMORY_LIMIT=4G] [NEW_TOKENS=32]"
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/.." && pwd)
model=$(cd "$1" && pwd) || die "no such model directory: $1"
limit=${2:-4G}
ntok=${3:-32}
[[ -f $model/manifest.json ]] || die "$model has no manifest.json (not a deltafin model directory)"
((ntok >= 3)) || die "NEW_TOKENS must be >= 3 (steady decode excludes the first two tokens)"

VENV=${VENV:-/work/venv-llama}
BACKBONE=${BACKBONE:-q8_0}
PROMPT_IDS=${PROMPT_IDS:-1,2,3,4,5,6,7,8}
PAIRS=${PAIRS:-2}
THREADS=${THREADS:-2}
REPACK=${REPACK:-0}
MARGIN=${MARGIN:-$((512 << 20))}
OUT=${OUT:-/tmp/vs-llama-cpp.$$}
GGUF=${GGUF:-${model%/}.$BACKBONE.gguf}
mkdir -p "$OUT"

parse_size() {
	local s=$1 num unit
	[[ $s =~ ^([0-9]+)([KkMmGgTt]?)(i?[Bb])?$ ]] || return 1
	num=${BASH_REMATCH[1]}
	unit=${BASH_REMATCH[2]^^}
	case $unit in
	"") echo "$num" ;;
	K) echo $((num << 10)) ;;
	M) echo $((num << 20)) ;;
	G) echo $((num << 30)) ;;
	T) echo $((num << 40)) ;;
	esac
}
limit_bytes=$(parse_size "$limit") || die "cannot parse MEMORY_LIMIT '$limit'"

# --- Python environment (outside the repo) -------------------------------------------------
py=$VENV/bin/python
if [[ ! -x $py ]]; then
	say "creating $VENV"
	python3 -m venv "$VENV"
fi
if ! "$py" -c 'import gguf, numpy' 2>/dev/null; then
	"$py" -m pip install -q -r "$here/requirements-llama.txt"
fi
if ! "$py" -c 'import llama_cpp' 2>/dev/null; then
	say "installing llama-cpp-python (compiles llama.cpp: ~25 min on 2 cores)"
	"$py" -m pip install -q cmake ninja scikit-build-core
	CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-2} \
		CMAKE_ARGS=${CMAKE_ARGS:-"-DGGML_NATIVE=ON -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF"} \
		nice -n 10 "$py" -m pip install --no-build-isolation llama-cpp-python==0.3.36
fi
llama_version=$("$py" -c 'import llama_cpp; print(llama_cpp.__version__)')

# --- deltafin binary -------------------------------------------------------------------------
if [[ -z ${DELTAFIN:-} ]]; then
	DELTAFIN=$repo/target/release/deltafin
	if [[ ! -x $DELTAFIN ]]; then
		say "building deltafin (release)"
		(cd "$repo" && cargo build --release -p deltafin)
	fi
fi
[[ -x $DELTAFIN ]] || die "deltafin binary $DELTAFIN not found"

# --- GGUF (cached) ---------------------------------------------------------------------------
stamp=$(cat "$model/manifest.json" "$here/deltafin_to_gguf.py" | sha256sum | cut -c1-16)-$BACKBONE
if [[ -f $GGUF && -f $GGUF.stamp && $(cat "$GGUF.stamp") == "$stamp" ]]; then
	say "using cached $GGUF"
else
	say "converting $model -> $GGUF (backbone $BACKBONE)"
	rm -f "$GGUF.stamp"
	nice -n 10 "$py" "$here/deltafin_to_gguf.py" "$model" "$GGUF" --backbone "$BACKBONE"
	echo "$stamp" >"$GGUF.stamp"
fi

backbone_bytes=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["backbone"]["bytes"])' "$model/manifest.json")
pack_bytes=$("$py" -c 'import json,sys; print(json.load(open(sys.argv[1]))["experts"]["bytes"])' "$model/manifest.json")
budget=$((limit_bytes - backbone_bytes - MARGIN))
((budget > 0)) || die "limit $limit leaves no expert cache budget after the backbone ($backbone_bytes B) and margin ($MARGIN B)"

# --- the llama.cpp runner (greedy, ids in, JSON out) ---------------------------------------
runner=$OUT/llama_run.py
cat >"$runner" <<'PYEOF'
import json, sys, time
import numpy as np
import llama_cpp
import llama_cpp.llama_cpp as C
from llama_cpp import Llama

gguf, prompt_s, ntok, threads, out, repack = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5], sys.argv[6] == "1"
# llama.cpp's CPU "repack" buffers (use_extra_bufts, on by default; `--no-repack` on its CLI) copy
# every MXFP4 expert tensor into anonymous memory at load on AVX2 machines, so a model larger than
# the memory limit is OOM-killed before the first token. Off by default here: the weights then
# stay mmap'd and are paged in from the GGUF on demand, which is how llama.cpp runs such models.
_default_params = C.llama_model_default_params


def _params():
    p = _default_params()
    p.use_extra_bufts = repack
    return p


C.llama_model_default_params = _params
prompt = [int(x) for x in prompt_s.split(",") if x]
t_load = time.perf_counter()
llm = Llama(model_path=gguf, n_ctx=len(prompt) + ntok + 16, n_batch=512, n_threads=threads,
            n_threads_batch=threads, use_mmap=True, use_mlock=False, logits_all=False, verbose=False)
load_s = time.perf_counter() - t_load
n_vocab = llm.n_vocab()


def argmax_last():
    # llama-cpp-python 0.3.x no longer copies logits into llm.scores unless logits_all
    return int(np.argmax(np.ctypeslib.as_array(llm._ctx.get_logits_ith(-1), shape=(n_vocab,))))


def read_bytes():
    # bytes this process caused to be read from storage (mmap page faults included)
    for line in open("/proc/self/io"):
        if line.startswith("read_bytes:"):
            return int(line.split()[1])
    return 0


steps = []
rb = [read_bytes()]
t0 = time.perf_counter()
llm.eval(prompt)
tok = argmax_last()
ttft = time.perf_counter() - t0
ids = [tok]
rb.append(read_bytes())
steps.append({"kind": "prefill", "seconds": ttft})
while len(ids) < ntok:
    t = time.perf_counter()
    llm.eval([tok])
    tok = argmax_last()
    steps.append({"kind": "decode", "seconds": time.perf_counter() - t})
    rb.append(read_bytes())
    ids.append(tok)
dec = [s["seconds"] for s in steps if s["kind"] == "decode"][1:]
rate = len(dec) / sum(dec) if dec and sum(dec) > 0 else 0.0
# storage bytes per steady decode step (steps 2..): rb[k] is after step k (0 = prefill)
steady_read = (rb[-1] - rb[2]) / len(dec) if len(dec) > 0 and len(rb) > 2 else 0.0
peak = 0
for line in open("/proc/self/status"):
    if line.startswith("VmHWM:"):
        peak = int(line.split()[1]) * 1024
json.dump({"engine": "llama.cpp", "llama_cpp_python": llama_cpp.__version__, "repack": repack, "generated_ids": ids,
           "prompt_tokens": len(prompt), "load_s": load_s, "ttft_s": ttft,
           "steady_decode_tokens_per_s": rate, "steady_decode_steps": len(dec),
           "storage_bytes_per_steady_step": steady_read,
           "peak_rss_bytes": peak, "steps": steps}, open(out, "w"))
print(f"llama.cpp: load {load_s:.2f} s, ttft {ttft:.3f} s, steady decode {rate:.3f} tok/s ({len(dec)} steps), "
      f"{steady_read / 2**20:.1f} MiB read from storage per steady step, ids {ids}")
PYEOF

drop() {
	sync
	if [[ ${SKIP_DROP_CACHES:-0} != 1 ]]; then
		echo 3 >/proc/sys/vm/drop_caches
	fi
}

run_deltafin() {
	local i=$1
	drop
	WITH_MEMORY_LIMIT_REPORT=$OUT/deltafin.$i.cgroup.json "$here/with-memory-limit.sh" "$limit" \
		"$DELTAFIN" run --model "$model" --prompt-ids "$PROMPT_IDS" --max-new-tokens "$ntok" --ignore-eos \
		--ram-budget "$budget" --stats-json "$OUT/deltafin.$i.json" >"$OUT/deltafin.$i.log" 2>&1 ||
		{ tail -n 20 "$OUT/deltafin.$i.log" >&2; die "deltafin run $i failed"; }
	"$py" -c 'import json,sys; d=json.load(open(sys.argv[1])); print("deltafin run %s: steady decode %.3f tok/s, ttft %.3f s, hit rate %.3f" % (sys.argv[2], d["steady_decode_tokens_per_s"], d["ttft_s"], d["hit_rate"]))' "$OUT/deltafin.$i.json" "$i"
}

run_llama() {
	local i=$1
	drop
	WITH_MEMORY_LIMIT_REPORT=$OUT/llama.$i.cgroup.json "$here/with-memory-limit.sh" "$limit" \
		"$py" "$runner" "$GGUF" "$PROMPT_IDS" "$ntok" "$THREADS" "$OUT/llama.$i.json" "$REPACK" >"$OUT/llama.$i.log" 2>&1 ||
		{ tail -n 20 "$OUT/llama.$i.log" >&2; die "llama.cpp run $i failed"; }
	echo "llama.cpp run $i: $(grep "^llama.cpp: " "$OUT/llama.$i.log" | tail -n 1 | sed "s/, ids.*//; s/^llama.cpp: //")"
}

say "model $model: backbone $backbone_bytes B, expert pack $pack_bytes B; limit $limit ($limit_bytes B, $(awk -v l="$limit_bytes" -v p="$pack_bytes" 'BEGIN { printf "%.2f", l / p }') x pack); deltafin --ram-budget $budget B"
say "deltafin $DELTAFIN ($("$DELTAFIN" --version)); llama-cpp-python $llama_version; GGUF $GGUF; prompt ids $PROMPT_IDS; $ntok new tokens; output in $OUT"
for ((p = 0; p < PAIRS; p++)); do
	if ((p % 2 == 0)); then
		run_deltafin $p
		run_llama $p
	else
		run_llama $p
		run_deltafin $p
	fi
done

"$py" - "$OUT" "$PAIRS" "$limit" "$ntok" <<'PYEOF'
import json, statistics, sys
out, pairs, limit, ntok = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
res = {}
for eng in ("deltafin", "llama"):
    runs = [json.load(open(f"{out}/{eng}.{i}.json")) for i in range(pairs)]
    cg = [json.load(open(f"{out}/{eng}.{i}.cgroup.json")) for i in range(pairs)]
    rates = [r["steady_decode_tokens_per_s"] for r in runs]
    ids = [r["generated_ids"] for r in runs]
    same = all(x == ids[0] for x in ids)
    res[eng] = {"rates": rates, "median": statistics.median(rates), "min": min(rates), "max": max(rates),
                "ttft_median": statistics.median(r["ttft_s"] for r in runs), "ids": ids[0], "ids_identical_across_runs": same,
                "cgroup_peak_bytes": max(c["peak_bytes"] for c in cg), "oom_kills": sum(c["oom_kills"] for c in cg)}
d, l = res["deltafin"], res["llama"]
common = 0
for a, b in zip(d["ids"], l["ids"]):
    if a != b:
        break
    common += 1
ratio = d["median"] / l["median"] if l["median"] > 0 else float("inf")
summary = {"limit": limit, "new_tokens": ntok, "pairs": pairs, "deltafin": d, "llama_cpp": l,
           "ratio_deltafin_over_llama": ratio, "common_prefix_ids": common}
json.dump(summary, open(f"{out}/summary.json", "w"), indent=1)
for name, r in (("deltafin", d), ("llama.cpp", l)):
    print(f"{name:9s} steady decode median {r['median']:.3f} tok/s [min {r['min']:.3f} - max {r['max']:.3f}] "
          f"over {pairs} runs, ttft {r['ttft_median']:.3f} s, ids identical across runs: {r['ids_identical_across_runs']}, "
          f"cgroup peak {r['cgroup_peak_bytes'] / 2**20:.0f} MiB, OOM kills {r['oom_kills']}")
print(f"generated ids agree on the first {common} of {ntok} tokens (backbones are quantized differently)")
print(f"ratio deltafin / llama.cpp = {ratio:.2f}x (target >= 3x)")
print(f"summary: {out}/summary.json")
PYEOF

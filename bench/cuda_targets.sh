#!/usr/bin/env bash
# Issue 16's targets for `--device cuda`, measured in one call on a GPU machine (bench/NOTES.md,
# "--device cuda" sections, records what each run gave, with the machine and the commit).
#
#   bash bench/cuda_targets.sh DELTAFIN_BINARY [WORK_DIR]
#
# Needs: an NVIDIA GPU with ~14 GiB free, ~14 GB of disk in WORK_DIR (default /tmp), python3.
# Prints one summary line per measurement; nothing else is written outside WORK_DIR.
#   1. decode, experts preloaded on the GPU, 10-token prompt, 200 tokens (twice), and the same on
#      the CPU: tok/s and how many greedy ids the two devices share (target 5 is the CPU row); the
#      CPU again with its portable kernels (`--simd portable`: a multiply and an add a term where
#      the SIMD kernels fuse them), whose ids can part from the SIMD kernels' at a near tie;
#   2. prefill of 1,000 and 2,000-token prompts (and decode after them), ids against the CPU for
#      the 1,000-token prompt; the 2,000-token prompt again with `--batch-form fast` (MLA in the
#      decompressed form);
#   3. cold: GPU budget 4,300 MiB (a third of the 12.8 GiB pack), host cache 64 MiB, page cache
#      dropped where allowed; the disk's O_DIRECT rate measured before and after with dd; the
#      floor is the demand bytes per decode step divided by that rate;
#   4. the MXFP4 matrix-vector kernel against a device-to-device copy is
#      `cargo build --release -p deltafin-cuda --example gemv_bench` (run it beside this script).
set -uo pipefail
D=${1:?usage: cuda_targets.sh DELTAFIN_BINARY [WORK_DIR]}
W=${2:-/tmp}
M="$W/bench"
[ -f "$M/manifest.json" ] || "$D" synth --preset bench --out "$M" >/dev/null || exit 1
S="--max-new-tokens 200 --ignore-eos --ram-budget 16GiB"
P10="--prompt-ids 1,2,3,4,5,6,7,8,9,10"
"$D" run --model "$M" $P10 $S --device cuda --gpu-preload --stats-json "$W/t1a.json" >/dev/null 2>&1
"$D" run --model "$M" $P10 $S --device cuda --gpu-preload --stats-json "$W/t1b.json" >/dev/null 2>&1
"$D" run --model "$M" $P10 $S --device cpu --stats-json "$W/t1c.json" >/dev/null 2>&1
"$D" run --model "$M" $P10 $S --device cpu --simd portable --stats-json "$W/t1p.json" >/dev/null 2>&1
P1=$(python3 -c "print(','.join(str(1 + (i * 7919) % 311) for i in range(1000)))")
P2=$(python3 -c "print(','.join(str(1 + (i * 7919) % 311) for i in range(2000)))")
L="--max-new-tokens 24 --ignore-eos --ram-budget 16GiB"
"$D" run --model "$M" --prompt-ids "$P1" $L --device cuda --gpu-preload --stats-json "$W/t2a.json" >/dev/null 2>&1
"$D" run --model "$M" --prompt-ids "$P1" $L --device cpu --stats-json "$W/t2c.json" >/dev/null 2>&1
"$D" run --model "$M" --prompt-ids "$P2" $L --allow-context-overflow --device cuda --gpu-preload \
    --stats-json "$W/t2b.json" >/dev/null 2>&1
"$D" run --model "$M" --prompt-ids "$P2" $L --allow-context-overflow --device cuda --gpu-preload \
    --batch-form fast --stats-json "$W/t2f.json" >/dev/null 2>&1
sync
echo 3 >/proc/sys/vm/drop_caches 2>/dev/null || echo "(page cache not dropped: not allowed here)"
DD1=$(dd if="$M/experts.pack" of=/dev/null bs=4M count=1500 iflag=direct 2>&1 | tail -1)
"$D" run --model "$M" $P10 --max-new-tokens 200 --ignore-eos --ram-budget 64MiB --device cuda \
    --gpu-budget 4300MiB --stats-json "$W/t3.json" >/dev/null 2>&1
DD2=$(dd if="$M/experts.pack" of=/dev/null bs=4M count=1500 skip=1500 iflag=direct 2>&1 | tail -1)
python3 - "$W" "$DD1" "$DD2" <<'PY'
import json, re, sys
w, dd1, dd2 = sys.argv[1:4]
r = lambda n: json.load(open(f"{w}/{n}.json"))
same = lambda a, b: sum(x == y for x, y in zip(a["generated_ids"], b["generated_ids"]))
a, b, c, cp = r("t1a"), r("t1b"), r("t1c"), r("t1p")
print(f"1 decode, preloaded: cuda {a['steady_decode_tokens_per_s']:.1f} / {b['steady_decode_tokens_per_s']:.1f} tok/s, "
      f"cpu {c['steady_decode_tokens_per_s']:.1f} tok/s; ids cuda = cpu {same(a, c)}/{len(c['generated_ids'])}, "
      f"cuda = cuda {same(a, b)}")
print(f"1 ids, cpu --simd portable ({cp['steady_decode_tokens_per_s']:.1f} tok/s): = cuda {same(a, cp)}/{len(cp['generated_ids'])}, "
      f"= cpu {same(c, cp)}")
p1, p1c, p2, p2f = r("t2a"), r("t2c"), r("t2b"), r("t2f")
for name, x in (("1,000", p1), ("2,000", p2), ("2,000, --batch-form fast", p2f)):
    print(f"2 prompt {name}: prefill {x['prefill_tokens_per_s']:.0f} tok/s (ttft {x['ttft_s']:.3f} s), "
          f"decode after it {x['steady_decode_tokens_per_s']:.1f} tok/s")
print(f"2 1,000-token prompt: ids cuda = cpu {same(p1, p1c)}/{len(p1c['generated_ids'])}")
t = r("t3")
rates = [float(m.group(1)) for m in (re.search(r"([0-9.]+) GB/s", s) for s in (dd1, dd2)) if m]
steps = t["steady_decode_steps"] + 1
per_tok = (t["expert_bytes_read_demand"] - t["prefill_expert_bytes"]) / steps
s_tok = 1 / t["steady_decode_tokens_per_s"]
print(f"3 cold: {t['steady_decode_tokens_per_s']:.2f} tok/s = {s_tok:.3f} s/token, demand {per_tok / 1e6:.1f} MB/token; "
      f"disk {rates} GB/s (dd before/after)")
dec = [x for x in t["steps"] if x["kind"] == "decode"][1:]
if dec:
    n = len(dec)
    mean = lambda k: sum(x[k] for x in dec) / n
    gc = t.get("gpu_expert_cache") or {}
    print(f"3   per decode step: {mean('seconds') * 1e3:.1f} ms = io wait {mean('io_wait_s') * 1e3:.1f} + experts "
          f"{mean('expert_compute_s') * 1e3:.1f} + attention {mean('attention_s') * 1e3:.1f} + other "
          f"{mean('other_s') * 1e3:.1f} ms; {mean('expert_bytes_read') / 1e6:.1f} MB read; GPU cache uploads "
          f"{gc.get('upload_s', 0):.2f} s for {gc.get('bytes_uploaded', 0) / 1e9:.2f} GB in the run")
for g in rates:
    floor = per_tok / (g * 1e9)
    print(f"3   at {g} GB/s: floor {floor:.3f} s/token, measured/floor {s_tok / floor:.2f} (target <= 1.1); "
          f"TTFT {t['ttft_s']:.2f} s vs {t['prefill_unique_expert_bytes'] / (g * 1e9):.2f} s for the prompt's unique experts")
PY

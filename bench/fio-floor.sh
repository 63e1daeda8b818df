#!/usr/bin/env bash
# The storage floor's bandwidth: random O_DIRECT reads of whole expert records from the expert
# pack, at the queue depth the engine can issue per MoE layer (top_k), as the issue's target 1
# defines it (REFERENCES.md §7).
#
#   bench/fio-floor.sh FILE [QD] [BS]
#
# FILE: a model directory or its experts.pack (manifest.json must sit beside the pack).
# QD:   queue depth, default the model's num_experts_per_tok (top_k).
# BS:   block size in bytes, default one record stride (records are contiguous and
#       4096-aligned, so fio's bs-aligned random offsets are exactly record starts).
#
# Environment: FIO_RUNTIME (seconds, default 20), FIO_ENGINE (default libaio),
#              FIO_FLOOR_OUT (JSON output, default ./fio-floor.json).
# Prints GB/s (1e9 bytes/s) and writes {"file","bs","iodepth","engine","runtime_s",
# "read_bytes","bandwidth_bytes_per_s","bandwidth_gbps","iops","clat_mean_ms","clat_p99_ms"}.
# Installs fio with apt-get when it is missing. The page cache plays no part (O_DIRECT).
set -euo pipefail

die() {
	echo "fio-floor: error: $*" >&2
	exit 2
}

[[ $# -ge 1 && $# -le 3 ]] || die "usage: $0 FILE [QD] [BS]"
target=$1
if [[ -d $target ]]; then
	dir=$(realpath "$target")
	pack=$dir/experts.pack
else
	pack=$(realpath "$target")
	dir=$(dirname "$pack")
fi
manifest=$dir/manifest.json
[[ -f $pack ]] || die "$pack: no such file"
[[ -f $manifest ]] || die "$manifest not found (FILE must be a deltafin model directory or its experts.pack)"

read -r stride topk < <(python3 - "$manifest" <<'EOF'
import json, sys
m = json.load(open(sys.argv[1]))
e = m["experts"]
align = e["record_align"]
length = e["records"][0]["length"]
stride = -(-length // align) * align
# The config is tagged by family ({"deepseek_v3": {...}}); each family names top-k its own way.
(cfg,) = m["config"].values()
topk = next(cfg[k] for k in ("num_experts_per_tok", "num_experts_per_token") if k in cfg)
print(stride, topk)
EOF
)
qd=${2:-$topk}
bs=${3:-$stride}
[[ $qd =~ ^[0-9]+$ && $qd -ge 1 ]] || die "QD must be a positive integer, got '$qd'"
[[ $bs =~ ^[0-9]+$ ]] || die "BS must be bytes, got '$bs'"
((bs % 4096 == 0)) || die "BS $bs is not a multiple of 4096 (O_DIRECT)"

if ! command -v fio >/dev/null; then
	echo "fio-floor: installing fio (apt-get)" >&2
	apt-get install -y fio >/dev/null 2>&1 || { apt-get update >/dev/null && apt-get install -y fio >/dev/null; } ||
		die "could not install fio"
fi

runtime=${FIO_RUNTIME:-20}
engine=${FIO_ENGINE:-libaio}
out=${FIO_FLOOR_OUT:-fio-floor.json}
size=$(stat -c %s "$pack")
raw=$(mktemp)
trap 'rm -f "$raw"' EXIT

fio --name=floor --filename="$pack" --readonly --rw=randread --direct=1 \
	--ioengine="$engine" --iodepth="$qd" --bs="$bs" --size="$size" \
	--time_based --runtime="$runtime" --ramp_time=2 --randrepeat=0 --norandommap \
	--group_reporting --output-format=json >"$raw" || die "fio failed"

python3 - "$raw" "$out" "$pack" "$bs" "$qd" "$engine" "$runtime" <<'EOF'
import json, sys
raw, out, pack, bs, qd, engine, runtime = sys.argv[1:]
j = json.load(open(raw))
r = j["jobs"][0]["read"]
clat = r.get("clat_ns", {})
pct = clat.get("percentile", {})
res = {
    "file": pack,
    "bs": int(bs),
    "iodepth": int(qd),
    "engine": engine,
    "runtime_s": int(runtime),
    "read_bytes": r["io_bytes"],
    "bandwidth_bytes_per_s": r["bw_bytes"],
    "bandwidth_gbps": r["bw_bytes"] / 1e9,
    "iops": r["iops"],
    "clat_mean_ms": clat.get("mean", 0) / 1e6,
    "clat_p99_ms": pct.get("99.000000", 0) / 1e6,
    "fio_version": j.get("fio version"),
}
json.dump(res, open(out, "w"), indent=1)
print(f"fio floor: {res['bandwidth_gbps']:.3f} GB/s ({res['iops']:.0f} records/s of {int(bs)} bytes, "
      f"QD {qd}, {engine}, O_DIRECT, mean latency {res['clat_mean_ms']:.1f} ms) -> {out}")
EOF

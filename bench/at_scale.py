#!/usr/bin/env python3
"""Realistic routing at scale (issue 18 part 4): the trained demo model's routing replayed on the
12.8 GiB `bench` expert pack (or the 11.5 GiB `k3-bench` one) through the real expert store,
cache policies and O_DIRECT I/O engine (`deltafin replay --map-experts`), cold start, cache
budget 1/3 of the pack. The "At scale" subsections of bench/NOTES.md. Standard library only.

    deltafin synth --preset bench --out /tmp/bench
    python3 bench/at_scale.py --deltafin target/release/deltafin \
        --demo crates/deltafin/demo-model --bench /tmp/bench --work /tmp/at-scale \
        --json bench/at-scale.json --svg bench/at-scale.svg

1. Records router traces and next-layer predictions (`run --trace-routes --trace-predictions`)
   of the demo model on the workloads of bench/realistic_routing.py (prose, code, chat, switch).
2. Replays each on the bench pack at 1/3 of the pack: `lru`, `lfu`, `pinned` (half the budget
   from *another* workload's trace, filled in the background as `run` does, and warmed in idle
   time before the first token with `--warm-idle`), and `lru` with the predictions, prefetch off
   and on, with a stand-in pause for expert compute per layer (`--compute-us`) so speculative
   reads get disk time as in a run.
3. A pinned-fraction sweep on one pair (code pinned from chat, warmed in idle time).

`--configs lru,lfu` runs only those replays (the k3-bench measurement); `--svg` is then not
written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realistic_routing as rr  # noqa: E402  (the workloads' prompts)
from bench_common import arg_parser, sh, write_json, write_svg  # noqa: E402
from realistic_routing import OTHER  # noqa: E402
# Expert compute + attention per MoE layer of a `bench` decode step on this machine:
# (0.018 + 0.009) s/token over 16 MoE layers (NOTES, "Verification efficiency", plain).
COMPUTE_US = 1700


def record(exe: str, demo: str, work: Path) -> dict:
    t = {}
    for w in ("prose", "code", "chat", "switch"):
        t[w] = (work / f"{w}.routes", work / f"{w}.pred")
        for p in t[w]:
            p.unlink(missing_ok=True)

    def run(w: str, args: list[str]) -> None:
        r, p = t[w]
        rr.run(exe, demo, [*args, "--ignore-eos", "--trace-routes", str(r), "--trace-predictions", str(p)])

    run("prose", ["--prompt", rr.PROSE, "--max-new-tokens", str(rr.NEW)])
    run("code", ["--prompt", rr.CODE, "--max-new-tokens", str(rr.NEW)])
    for q in rr.QUESTIONS:
        run("chat", ["--chat", "--prompt", q, "--max-new-tokens", str(rr.CHAT_NEW)])
    for args in (["--prompt", rr.PROSE], ["--prompt", rr.CODE], ["--chat", "--prompt", rr.QUESTIONS[0]]):
        run("switch", [*args, "--max-new-tokens", "85"])
    return t


def replay(exe: str, bench: str, work: Path, name: str, args: list[str]) -> dict:
    sj = work / f"{name}.json"
    sh([exe, "replay", "--model", bench, "--map-experts", *args, "--stats-json", str(sj)])
    d = json.loads(sj.read_text())
    d.pop("steps", None)
    d["args"] = args
    print(f"{name:32s} demand/need {d['demand_over_need']:.3f} all/need {d['all_over_need']:.3f} "
          f"hit {100 * d['hit_rate']:.1f} % recall {100 * d['prefetch_recall']:.1f} % "
          f"s/token {d['seconds_per_token']:.3f}", flush=True)
    return d


def svg_chart(res: dict, path: Path) -> None:
    """Grouped bars: demand bytes per token ÷ no-cache need, per workload and configuration."""
    configs = ["lru", "lfu", "pinned", "pinned_warm", "prefetch_off", "prefetch_on"]
    labels = {"lru": "LRU", "lfu": "LFU-DA", "pinned": "pinned (other)", "pinned_warm": "pinned, idle warm-up",
              "prefetch_off": "LRU + compute pause", "prefetch_on": "+ prefetch (demand only)"}
    colors = ["#4477aa", "#66ccee", "#228833", "#ccbb44", "#aa3377", "#ee6677"]
    wls = list(res["workloads"])
    W, H, left, top, bottom = 760, 340, 60, 30, 60
    gw = (W - left - 20) / len(wls)
    bw = gw / (len(configs) + 1)
    y = lambda v: top + (H - top - bottom) * (1 - v / 0.8)  # noqa: E731
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H + 40}" font-family="sans-serif" font-size="11">',
           f'<text x="{left}" y="16" font-size="13">bench pack (12.8 GiB), cache 1/3 of the pack, cold start: '
           f'demand bytes per token ÷ no-cache need</text>']
    for v in (0.0, 0.2, 0.4, 0.5, 0.6, 0.8):
        out.append(f'<line x1="{left}" x2="{W - 20}" y1="{y(v):.1f}" y2="{y(v):.1f}" stroke="{"#c00" if v == 0.5 else "#ddd"}"/>')
        out.append(f'<text x="{left - 6}" y="{y(v) + 4:.1f}" text-anchor="end">{v:.1f}</text>')
    for i, w in enumerate(wls):
        x0 = left + i * gw + bw / 2
        for j, c in enumerate(configs):
            v = res["workloads"][w][c]["demand_over_need"]
            x = x0 + j * bw
            out.append(f'<rect x="{x:.1f}" y="{y(v):.1f}" width="{bw * 0.9:.1f}" height="{y(0) - y(v):.1f}" fill="{colors[j]}"/>')
        out.append(f'<text x="{x0 + len(configs) * bw / 2:.1f}" y="{H - bottom + 16}" text-anchor="middle">{w}</text>')
    for j, c in enumerate(configs):
        x = left + (j % 3) * 230
        yy = H - 8 + (j // 3) * 16
        out.append(f'<rect x="{x}" y="{yy - 9}" width="10" height="10" fill="{colors[j]}"/>')
        out.append(f'<text x="{x + 14}" y="{yy}">{labels[c]}</text>')
    write_svg(path, out)


def main() -> None:
    ap = arg_parser(__doc__, ["demo", "bench"], ["work", "json", "svg"])
    ap.add_argument("--workloads", default="prose,code,chat,switch")
    ap.add_argument("--configs", default="lru,lfu,pinned,pinned_warm,prefetch_off,prefetch_on,sweep",
                    help="which replays to run (the chart needs all but sweep)")
    a = ap.parse_args()
    configs = set(a.configs.split(","))
    a.work.mkdir(parents=True, exist_ok=True)
    exe = a.deltafin
    t = record(exe, a.demo, a.work)
    pack = json.loads((Path(a.bench) / "manifest.json").read_text())["experts"]["bytes"]
    budget = str(pack // 3)
    res: dict = {"bench": a.bench, "pack_bytes": pack, "ram_budget": int(budget), "compute_us": COMPUTE_US,
                 "workloads": {}}
    for w in a.workloads.split(","):
        routes, pred = (str(p) for p in t[w])
        other = str(t[OTHER[w]][0])
        base = ["--trace", routes, "--ram-budget", budget]
        pin = ["--cache-policy", "pinned", "--pin-from", other]
        pf = ["--cache-policy", "lru", "--predictions", pred, "--compute-us", str(COMPUTE_US)]
        row = {"pinned_from": OTHER[w]}
        runs = {
            "lru": [*base, "--cache-policy", "lru", "--predictions", pred],
            "lfu": [*base, "--cache-policy", "lfu"],
            "pinned": [*base, *pin],
            "pinned_warm": [*base, *pin, "--warm-idle"],
            "prefetch_off": [*base, *pf],
            "prefetch_on": [*base, *pf, "--prefetch", "on"],
        }
        for c, args in runs.items():
            if c in configs:
                row[c] = replay(exe, a.bench, a.work, f"{w}-{c.replace('_', '-')}", args)
        res["workloads"][w] = row
        write_json(a.json, res)
    if "code" in res["workloads"] and "sweep" in configs:
        sweep = {}
        routes = str(t["code"][0])
        for f in ("0.25", "0.75"):
            sweep[f] = replay(exe, a.bench, a.work, f"code-pinned-warm-{f}",
                              ["--trace", routes, "--ram-budget", budget, "--cache-policy", "pinned",
                               "--pin-from", str(t["chat"][0]), "--pinned-fraction", f, "--warm-idle"])
        res["pinned_fraction_sweep_code_from_chat"] = sweep
    write_json(a.json, res)
    if len(res["workloads"]) == 4 and all(c in configs for c in ("lru", "lfu", "pinned", "pinned_warm",
                                                                "prefetch_off", "prefetch_on")):
        svg_chart(res, a.svg)


if __name__ == "__main__":
    main()

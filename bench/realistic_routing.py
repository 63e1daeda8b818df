#!/usr/bin/env python3
"""Routing of the trained demo model on real text (issue 18 part 3): the "Realistic routing"
section of bench/NOTES.md. Standard library only.

    python3 bench/realistic_routing.py --deltafin target/release/deltafin \
        --model crates/deltafin/demo-model --work /tmp/rr --json bench/realistic-routing.json \
        --svg bench/realistic-routing.svg

1. Records router traces (`deltafin run --trace-routes`, greedy, `--ignore-eos`) of four
   workloads: prose, code, chat (four questions through the chat template, one request each)
   and a switch (the prose, code and chat requests one after another into one trace).
2. Replays each trace through a simulated expert cache of 1/16 ... 1/1 of the expert pack's
   records, token by token, each token's MoE layers in order: LRU, LFU (with dynamic aging, as
   the engine's `lfu`) and pinned (half the budget holds the hottest (layer, expert) records of
   *another* workload's trace, the rest LRU). A hit is a request found cached; hit rate = hits /
   requests.
3. Runs `deltafin run` itself at a budget of 1/3 of the pack for: prefetch (recall, wasted
   bytes), speculation (`lookup`, `self`, `auto`: tokens per pass, acceptance, decode rate vs
   `off`), and the fast batched MLA form (`DELTAFIN_BATCH_FORM=fast` vs `exact`: does any greedy
   token change).
   The same traces also go through the engine's own cache with `deltafin replay` at 1/3 of the
   pack (hit rate = 1 - bytes read / bytes requested), a check of the simulation.
4. Expert reuse across consecutive requests: the share of the (layer, expert) set used by one
   chat request that the previous request also used.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections import OrderedDict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_common import arg_parser, sh, write_json, write_svg  # noqa: E402

PROSE = (
    "The borrow checker compares the scopes of references with the lifetimes of the values they "
    "point to. When a function takes a reference as a parameter, the caller keeps ownership of the "
    "value, and the function can read it without taking it away. "
)
CODE = (
    "import os\nimport sys\n\n\ndef find_files(root, suffix):\n    \"\"\"Return the paths below root "
    "that end with suffix.\"\"\"\n    found = []\n    for dirpath, dirnames, filenames in os.walk(root):\n"
)
QUESTIONS = [
    "What does json.dumps do?",
    "What is the heapq module?",
    "What does shutil.copyfile do?",
    "Explain closures in Rust.",
]
FRACTIONS = [1 / 16, 1 / 8, 1 / 4, 1 / 3, 1 / 2, 3 / 4, 1.0]
NEW = 256
CHAT_NEW = 64
# The workload whose hottest records a workload's `pinned` cache holds.
OTHER = {"prose": "code", "code": "chat", "chat": "prose", "switch": "prose"}


def run(exe: str, model: str, args: list[str], env: dict | None = None) -> subprocess.CompletedProcess:
    return sh([exe, "run", "--model", model, *args], env, what=f"deltafin run {' '.join(args)}")


def read_trace(path: Path):
    b = path.read_bytes()
    magic, n_layers, first, n_exp, k = struct.unpack("<8s4I", b[:24])
    assert magic == b"DFROUTE1", path
    n_moe = n_layers - first
    rb = 4 + 2 * n_moe * k
    toks = []
    for off in range(24, len(b) - rb + 1, rb):
        ids = struct.unpack(f"<{n_moe * k}H", b[off + 4 : off + rb])
        toks.append([ids[l * k : (l + 1) * k] for l in range(n_moe)])
    return {"n_moe": n_moe, "n_experts": n_exp, "top_k": k, "tokens": toks}


def requests(trace):
    for tok in trace["tokens"]:
        for l, ids in enumerate(tok):
            for e in ids:
                yield (l, e)


def heat(trace) -> list:
    c: dict = {}
    for r in requests(trace):
        c[r] = c.get(r, 0) + 1
    return sorted(c, key=lambda r: (-c[r], r))


def simulate(trace, capacity: int, policy: str, pinned: list | None = None) -> float:
    if policy == "lfu":
        return simulate_lfu_da(trace, capacity)
    hits = total = 0
    lru: OrderedDict = OrderedDict()
    pin = set()
    cap = capacity
    if policy == "pinned":
        pin = set(pinned[: capacity // 2])
        cap = capacity - len(pin)
    for r in requests(trace):
        total += 1
        if r in pin:
            hits += 1
            continue
        if r in lru:
            hits += 1
            lru.move_to_end(r)
            continue
        if cap <= 0:
            continue
        if len(lru) >= cap:
            lru.popitem(last=False)
        lru[r] = True
    return hits / max(1, total)


def simulate_lfu_da(trace, capacity: int) -> float:
    """LFU with dynamic aging as the engine's `lfu` (crates/deltafin-engine/src/experts/cache.rs):
    priority = age + uses since insertion, evict the lowest (priority, last use), then
    age = max(age, victim's priority)."""
    hits = total = tick = age = 0
    uses: dict = {}
    rank: dict = {}
    for r in requests(trace):
        total += 1
        tick += 1
        if r in rank:
            hits += 1
            uses[r] += 1
            rank[r] = (age + uses[r], tick)
            continue
        if len(rank) >= capacity:
            victim = min(rank, key=rank.get)
            age = max(age, rank[victim][0])
            del rank[victim], uses[victim]
        uses[r] = 1
        rank[r] = (age + 1, tick)
    return hits / max(1, total)


def stats(exe, model, args, budget, env=None, work=None, name="s"):
    sj = Path(work) / f"{name}.stats.json"
    # LRU explicitly: these numbers were measured when it was the default (now `lfu`).
    r = run(exe, model, [*args, "--cache-policy", "lru", "--ram-budget", str(budget), "--stats-json", str(sj)], env)
    return json.loads(sj.read_text()), r.stdout


def svg_chart(results: dict, path: Path) -> None:
    """Small-multiples line chart: one panel per workload, hit rate vs budget per policy."""
    wl = list(results)
    W, H, pad = 230, 200, 40
    colors = {"lru": "#1f77b4", "lfu": "#ff7f0e", "pinned": "#2ca02c"}
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * len(wl) + 20}" height="{H + 70}" '
           'font-family="sans-serif" font-size="11">']
    for i, w in enumerate(wl):
        x0 = 10 + i * W
        out.append(f'<text x="{x0 + W / 2}" y="14" text-anchor="middle" font-weight="bold">{w}</text>')
        px = lambda f: x0 + pad + f * (W - pad - 10)  # noqa: E731
        py = lambda h: 20 + (1 - h) * (H - 30)  # noqa: E731
        out.append(f'<rect x="{px(0)}" y="{py(1)}" width="{px(1) - px(0)}" height="{py(0) - py(1)}" fill="none" stroke="#999"/>')
        for t in (0, 0.25, 0.5, 0.75, 1):
            out.append(f'<text x="{px(0) - 4}" y="{py(t) + 4}" text-anchor="end">{int(t * 100)}%</text>')
        for f in (0.25, 0.5, 0.75, 1.0):
            out.append(f'<text x="{px(f)}" y="{py(0) + 14}" text-anchor="middle">{f:g}</text>')
        for pol, col in colors.items():
            pts = results[w].get(pol)
            if not pts:
                continue
            d = " ".join(f"{px(p['fraction']):.1f},{py(p['hit_rate']):.1f}" for p in pts)
            out.append(f'<polyline points="{d}" fill="none" stroke="{col}" stroke-width="2"/>')
    y = H + 30
    out.append(f'<text x="10" y="{y}">x: cache budget / expert pack; y: hit rate (simulated, token at a time)</text>')
    for j, (pol, col) in enumerate(colors.items()):
        out.append(f'<rect x="{10 + j * 150}" y="{y + 12}" width="14" height="4" fill="{col}"/>'
                   f'<text x="{28 + j * 150}" y="{y + 18}">{pol}{" (from another workload)" if pol == "pinned" else ""}</text>')
    write_svg(path, out)


def main() -> None:
    a = arg_parser(__doc__, ["model"], ["work", "json", "svg"]).parse_args()
    a.work.mkdir(parents=True, exist_ok=True)
    exe, model = a.deltafin, a.model
    manifest = json.loads((Path(model) / "manifest.json").read_text())
    pack = manifest["experts"]["bytes"]
    budget = (pack // 3) & ~((1 << 20) - 1)
    for f in a.work.glob("*.routes"):
        f.unlink()
    t = {w: a.work / f"{w}.routes" for w in ("prose", "code", "chat", "switch")}
    run(exe, model, ["--prompt", PROSE, "--max-new-tokens", str(NEW), "--ignore-eos", "--trace-routes", str(t["prose"])])
    run(exe, model, ["--prompt", CODE, "--max-new-tokens", str(NEW), "--ignore-eos", "--trace-routes", str(t["code"])])
    chat_sets = []
    for i, q in enumerate(QUESTIONS):
        p = a.work / f"chat{i}.routes"
        if p.exists():
            p.unlink()
        args = ["--chat", "--prompt", q, "--max-new-tokens", str(CHAT_NEW), "--ignore-eos"]
        run(exe, model, [*args, "--trace-routes", str(t["chat"])])
        run(exe, model, [*args, "--trace-routes", str(p)])
        chat_sets.append(set(requests(read_trace(p))))
    for args in (["--prompt", PROSE, "--max-new-tokens", "85"], ["--prompt", CODE, "--max-new-tokens", "85"],
                 ["--chat", "--prompt", QUESTIONS[0], "--max-new-tokens", "85"]):
        run(exe, model, [*args, "--ignore-eos", "--trace-routes", str(t["switch"])])
    traces = {w: read_trace(p) for w, p in t.items()}
    n_records = traces["prose"]["n_moe"] * traces["prose"]["n_experts"]
    res: dict = {"model": model, "pack_bytes": pack, "records": n_records, "workloads": {}}
    curves = {}
    for w, tr in traces.items():
        pin = heat(traces[OTHER[w]])
        pts = {}
        for pol in ("lru", "lfu", "pinned"):
            pts[pol] = [
                {"fraction": f, "hit_rate": simulate(tr, max(1, round(f * n_records)), pol, pin)} for f in FRACTIONS
            ]
        curves[w] = pts
        distinct = len(set(requests(tr)))
        res["workloads"][w] = {"tokens": len(tr["tokens"]), "distinct_layer_experts": distinct,
                               "pinned_from": OTHER[w], "hit_rate": pts}
    # the engine's own cache on the same traces (`deltafin replay`, reads without computing)
    record = pack // n_records  # records are equal-sized and aligned
    res["engine_replay_one_third"] = {}
    for w in ("prose", "code", "chat", "switch"):
        row = {}
        for pol in ("lru", "lfu", "pinned"):
            sj = a.work / f"replay-{w}-{pol}.json"
            extra = ["--pin-from", str(t[OTHER[w]])] if pol == "pinned" else []
            cap = round(n_records / 3)
            sh([exe, "replay", "--model", model, "--trace", str(t[w]), "--ram-budget", str(cap * record),
                "--cache-policy", pol, *extra, "--stats-json", str(sj)], what="deltafin replay")
            d = json.loads(sj.read_text())
            need = d["tokens"] * traces[w]["n_moe"] * traces[w]["top_k"] * record
            row[pol] = 1 - d["expert_bytes_read_demand"] / need
        res["engine_replay_one_third"][w] = row
    reuse = []
    for i in range(1, len(chat_sets)):
        reuse.append(len(chat_sets[i] & chat_sets[i - 1]) / len(chat_sets[i]))
    res["chat_consecutive_reuse"] = reuse

    # engine measurements at a budget of 1/3 of the pack
    eng = {}
    for w, args in (("prose", ["--prompt", PROSE]), ("code", ["--prompt", CODE]),
                    ("chat", ["--chat", "--prompt", QUESTIONS[1]])):
        base = [*args, "--max-new-tokens", str(NEW), "--ignore-eos"]
        off, out_off = stats(exe, model, base, budget, work=a.work, name=f"{w}-off")
        pre, _ = stats(exe, model, [*base, "--prefetch", "on"], budget, work=a.work, name=f"{w}-prefetch")
        e = {"lru_hit_rate": off["hit_rate"], "decode_tok_s_off": off["steady_decode_tokens_per_s"],
             "prefetch_recall": pre["prefetch_recall"], "prefetch_wasted_bytes": pre["prefetch_wasted_bytes"],
             "prefetch_speculative_bytes": pre["expert_bytes_read_speculative"],
             "demand_bytes_off": off["expert_bytes_read_demand"], "demand_bytes_prefetch": pre["expert_bytes_read_demand"]}
        for mode in ("lookup", "self", "auto"):
            s, out = stats(exe, model, [*base, "--speculate", mode], budget, work=a.work, name=f"{w}-{mode}")
            assert out == out_off, f"{w}: --speculate {mode} changed the greedy output"
            sp = s["speculation"]
            e[f"spec_{mode}"] = {"tokens_per_pass": sp["tokens_per_pass"], "acceptance_lookup": sp["acceptance_lookup"],
                                 "acceptance_self": sp["acceptance_self"], "passes": sp["stats"]["passes"],
                                 "decode_tok_s": s["steady_decode_tokens_per_s"]}
        envf = dict(os.environ, DELTAFIN_BATCH_FORM="fast")
        fast = run(exe, model, [*base, "--logits-out", str(a.work / f"{w}-fast.json"), "--ram-budget", str(budget)], envf)
        exact = run(exe, model, [*base, "--logits-out", str(a.work / f"{w}-exact.json"), "--ram-budget", str(budget)])
        fi = json.loads((a.work / f"{w}-fast.json").read_text())["generated_ids"]
        xi = json.loads((a.work / f"{w}-exact.json").read_text())["generated_ids"]
        first = next((i for i, (p, q) in enumerate(zip(fi, xi)) if p != q), None)
        e["fast_batch_form_first_changed_token"] = first
        e["prompt_tokens"] = off["prompt_tokens"]
        eng[w] = e
        del fast, exact
    res["engine_at_one_third_pack"] = {"ram_budget": budget, **eng}
    write_json(a.json, res)
    svg_chart(curves, a.svg)
    print(json.dumps({w: {p: [round(x["hit_rate"], 3) for x in v] for p, v in c.items()} for w, c in curves.items()}, indent=1))
    print(json.dumps(res["chat_consecutive_reuse"]))
    print(json.dumps(res["engine_replay_one_third"], indent=1))
    print(json.dumps(eng, indent=1))


if __name__ == "__main__":
    main()

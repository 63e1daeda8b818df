#!/usr/bin/env python3
"""Streaming install warm-up order (issue 18 part 5): does `deltafin warm`'s order (missing
records, hottest in the given router traces first) leave fewer expert records to fetch on demand
than the order it falls back to without traces ((layer, expert), the pack's file order)?
The "Streaming install: warm-up order" subsection of bench/NOTES.md. Standard library only.

    python3 bench/warm_order.py --deltafin target/release/deltafin \
        --demo crates/deltafin/demo-model --traces /tmp/at-scale --work /tmp/warm-order \
        --json bench/warm-order.json

The demo model's directory (a full install) is served as a mirror by nginx on 127.0.0.1
(`python3 -m http.server` ignores `Range`, which a streaming install needs), installed once with `pull --stream --flat`; then for each
budget (a fraction of the expert pack) and order, a fresh copy of that install is warmed
(`warm --budget B`, with `--traces` of the same workload (an oracle), of *another* workload
(bench/at_scale.py's pairing, what a server would have from earlier traffic), or no traces) and
a workload is run on it with `--allow-network`, for 1 new token (the prompt's prefill) and for
its full length: the records it still fetched on demand (its stderr line `fetched N expert
records on demand`), the distinct records it used, and the time to first token. `--traces DIR`
holds the `<workload>.routes` files bench/at_scale.py records.
"""

from __future__ import annotations

import json
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import realistic_routing as rr  # noqa: E402  (the workloads' prompts)
from bench_common import arg_parser, sh, write_json  # noqa: E402
from realistic_routing import OTHER  # noqa: E402

# A workload's prompt and its full length of new tokens; each is also run for 1 new token (the
# prompt's prefill: what stands between a user and the first token).
ARGS = {
    "prose": (["--prompt", rr.PROSE], rr.NEW),
    "code": (["--prompt", rr.CODE], rr.NEW),
    "chat": (["--chat", "--prompt", rr.QUESTIONS[0]], rr.CHAT_NEW),
}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    ap = arg_parser(__doc__, ["demo"], ["traces", "work", "json"])
    ap.add_argument("--fractions", default="0.125,0.25,0.333,0.5")
    ap.add_argument("--workloads", default="prose,code,chat")
    ap.add_argument("--nginx", default="nginx")
    a = ap.parse_args()
    exe = a.deltafin
    a.work.mkdir(parents=True, exist_ok=True)
    port = free_port()
    conf = a.work / "nginx.conf"
    conf.write_text(f"""daemon off; worker_processes 1; pid {a.work}/nginx.pid; error_log {a.work}/nginx.err;
events {{ worker_connections 64; }}
http {{ access_log off; sendfile on;
  client_body_temp_path {a.work}/nginx-tmp; proxy_temp_path {a.work}/nginx-tmp;
  fastcgi_temp_path {a.work}/nginx-tmp; uwsgi_temp_path {a.work}/nginx-tmp; scgi_temp_path {a.work}/nginx-tmp;
  server {{ listen 127.0.0.1:{port}; root {Path(a.demo).resolve()}; }} }}
""")
    server = subprocess.Popen([a.nginx, "-c", str(conf), "-p", str(a.work)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        time.sleep(1.0)
        base = a.work / "base"
        shutil.rmtree(base, ignore_errors=True)
        sh([exe, "pull", f"http://127.0.0.1:{port}", str(base), "--stream", "--flat"])
        pack = json.loads((Path(a.demo) / "manifest.json").read_text())["experts"]["bytes"]
        res: dict = {"demo": a.demo, "pack_bytes": pack, "rows": []}
        for w in a.workloads.split(","):
            for f in a.fractions.split(","):
                budget = int(pack * float(f))
                orders = {"file": [], "other": ["--traces", str(a.traces / f"{OTHER[w]}.routes")],
                          "same": ["--traces", str(a.traces / f"{w}.routes")]}
                prompt, full = ARGS[w]
                for order, traces in orders.items():
                    for new in (1, full):
                        inst = a.work / "inst"
                        shutil.rmtree(inst, ignore_errors=True)
                        shutil.copytree(base, inst)
                        r = sh([exe, "warm", str(inst), "--budget", str(budget), "--allow-network", *traces])
                        warmed = int(re.search(r"fetched (\d+) expert records", r.stderr).group(1))
                        sj = a.work / "run.json"
                        r = sh([exe, "run", "--model", str(inst), "--allow-network", "--ignore-eos", *prompt,
                                "--max-new-tokens", str(new), "--stats-json", str(sj)])
                        m = re.search(r"fetched (\d+) expert records on demand", r.stderr)
                        st = json.loads(sj.read_text())
                        row = {"workload": w, "fraction": float(f), "budget": budget, "order": order,
                               "new_tokens": new, "warmed_records": warmed,
                               "demand_records": int(m.group(1)) if m else 0,
                               "distinct_records": st["expert_misses"], "ttft_s": st["ttft_s"]}
                        print(json.dumps(row), flush=True)
                        res["rows"].append(row)
                        write_json(a.json, res)
    finally:
        server.terminate()
        server.wait()


if __name__ == "__main__":
    main()

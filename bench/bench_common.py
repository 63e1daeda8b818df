"""Pieces the bench scripts share (realistic_routing.py, at_scale.py, warm_order.py). Standard library only.

- `arg_parser`: the scripts' command line: the deltafin binary and the inputs as required options, then
  the required output paths;
- `sh`: one command run to completion, its output captured; a failure ends the script with its stderr;
- `write_json` / `write_svg`: the result files.
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path


def arg_parser(doc: str, inputs: list[str], paths: list[str]) -> argparse.ArgumentParser:
    """`--deltafin` and each of `inputs` as a required string, then each of `paths` as a required Path."""
    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ["deltafin", *inputs]:
        ap.add_argument(f"--{name}", required=True)
    for name in paths:
        ap.add_argument(f"--{name}", type=Path, required=True)
    return ap


def sh(cmd: list[str], env: dict | None = None, what: str | None = None) -> subprocess.CompletedProcess:
    """Runs `cmd`; if it fails, exits with "<what (default: the command line)> failed: <its stderr>"."""
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        raise SystemExit(f"{what or ' '.join(cmd)} failed: {r.stderr}")
    return r


def write_json(path: Path, obj) -> None:
    path.write_text(json.dumps(obj, indent=1) + "\n")


def write_svg(path: Path, out: list[str]) -> None:
    """The SVG elements of `out` (the opening <svg ...> first), closed, one a line."""
    out.append("</svg>")
    path.write_text("\n".join(out) + "\n")

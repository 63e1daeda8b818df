#!/usr/bin/env python3
"""Corpus recipe of deltafin's trained demo model (issue 18). Nothing is downloaded.

Sources, all freely licensed and already on a Debian machine with Python 3 and a Rust toolchain
installed by rustup (the `rust-docs` component is part of rustup's default profile):

  python   CPython's standard library sources, `/usr/lib/python3.X/**/*.py` without the test
           suites, idlelib, site-/dist-packages (PSF License 2.0).
  rustdoc  The Rust books shipped by rustup's `rust-docs` component (The Rust Programming
           Language, Rust by Example, the Reference, the Rustonomicon, the Cargo book, the
           Edition Guide; English pages only), HTML reduced to text with code blocks kept (MIT OR Apache-2.0).
  crates   Rust sources of the crates this workspace depends on, as `cargo fetch` leaves them in
           `~/.cargo/registry/src`, only crates whose Cargo.toml `license` names MIT or
           Apache-2.0, at most 150 KB per crate and 14 MB in all, no `*-sys`/`windows*` bindings.
  chat     Question/answer pairs made mechanically from the standard library's docstrings
           ("What does json.dumps do?" -> the docstring's first paragraph), from the Rust books'
           section headings ("Explain <heading> in Rust." -> the section's first paragraph), in
           the chat template of `tokenizer_config.json`.

Output (one document per line is NOT assumed; documents are separated by a NUL byte):
    <out>/corpus.txt   plain documents (python, rustdoc, crates)
    <out>/chat.txt     chat documents, already rendered with the template's special tokens
    <out>/sources.json per-source document and byte counts, licences

    python train/demo_model/corpus.py --out DIR [--seed 18]
"""

from __future__ import annotations

import argparse
import ast
import html
import json
import random
import re
import sys
import tomllib
from html.parser import HTMLParser
from pathlib import Path

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"

RUSTDOC_BOOKS = ["book", "rust-by-example", "reference", "nomicon", "cargo", "edition-guide"]
CRATE_CAP = 150_000
CRATES_TOTAL = 14_000_000
MAX_ANSWER = 600


def stdlib_dir() -> Path:
    return Path(f"/usr/lib/python{sys.version_info.major}.{sys.version_info.minor}")


def stdlib_files() -> list[Path]:
    root = stdlib_dir()
    skip = {"test", "tests", "idlelib", "site-packages", "dist-packages", "__pycache__", "lib2to3", "turtledemo"}
    out = []
    for p in sorted(root.rglob("*.py")):
        rel = p.relative_to(root).parts
        if any(part in skip or part.startswith("test_") for part in rel):
            continue
        out.append(p)
    return out


def rust_docs_dir() -> Path | None:
    for tc in sorted(Path.home().glob(".rustup/toolchains/*/share/doc/rust/html")):
        if (tc / "book").is_dir():
            return tc
    return None


class MainText(HTMLParser):
    """Text of an mdBook page's <main>: paragraphs and headings as lines, <pre> kept verbatim."""

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.depth_main = 0
        self.in_pre = 0
        self.skip = 0
        self.parts: list[str] = []
        self.blocks: list[tuple[str, str]] = []  # (kind, text) kind in h, p, pre
        self.cur_kind = None
        self.cur: list[str] = []

    def flush(self) -> None:
        if self.cur_kind is not None:
            t = "".join(self.cur)
            if self.cur_kind != "pre":
                t = re.sub(r"\s+", " ", t).strip()
            else:
                t = t.strip("\n")
            if t:
                self.blocks.append((self.cur_kind, t))
        self.cur_kind, self.cur = None, []

    def handle_starttag(self, tag, attrs):
        if tag == "main":
            self.depth_main += 1
        if not self.depth_main:
            return
        if tag in ("script", "style", "button"):
            self.skip += 1
        elif tag in ("h1", "h2", "h3", "h4"):
            self.flush()
            self.cur_kind = "h"
        elif tag in ("p", "li", "dd", "dt", "td", "blockquote"):
            if not self.in_pre:
                self.flush()
                self.cur_kind = "p"
        elif tag == "pre":
            self.flush()
            self.in_pre += 1
            self.cur_kind = "pre"

    def handle_endtag(self, tag):
        if tag == "main":
            self.flush()
            self.depth_main = max(0, self.depth_main - 1)
        if not self.depth_main:
            return
        if tag in ("script", "style", "button"):
            self.skip = max(0, self.skip - 1)
        elif tag == "pre":
            self.flush()
            self.in_pre = max(0, self.in_pre - 1)
        elif tag in ("h1", "h2", "h3", "h4", "p", "li", "dd", "dt", "td", "blockquote") and not self.in_pre:
            self.flush()

    def handle_data(self, data):
        if self.depth_main and not self.skip:
            if self.cur_kind is None:
                self.cur_kind = "p"
            self.cur.append(data)


def rustdoc_pages(root: Path) -> list[tuple[str, list[tuple[str, str]]]]:
    pages = []
    for book in RUSTDOC_BOOKS:
        d = root / book
        if not d.is_dir():
            continue
        for p in sorted(d.rglob("*.html")):
            rel = p.relative_to(d).parts
            if p.name in ("print.html", "404.html", "toc.html") or "searchindex" in p.name:
                continue
            if any(x in ("2018-edition", "first-edition", "second-edition", "ja", "ko", "es", "zh") for x in rel):
                continue
            parser = MainText()
            parser.feed(p.read_text(encoding="utf-8", errors="replace"))
            parser.flush()
            # the Reference tags each rule with an id such as "[lex.keywords.strict.intro]"
            blocks = [(k, re.sub(r"\[[a-z0-9_.-]+\]\s*", "", t) if k != "pre" else t) for k, t in parser.blocks]
            blocks = [(k, t) for k, t in blocks if t and not t.startswith("Press ")]
            if sum(len(t) for _, t in blocks) > 200:
                pages.append((f"{book}/{p.relative_to(d)}", blocks))
    return pages


def page_text(blocks: list[tuple[str, str]]) -> str:
    out = []
    for k, t in blocks:
        if k == "h":
            out.append("# " + t)
        elif k == "pre":
            out.append("```\n" + t + "\n```")
        else:
            out.append(t)
    return "\n\n".join(out)


def crate_sources() -> list[tuple[str, str]]:
    docs = []
    total = 0
    for reg in sorted(Path.home().glob(".cargo/registry/src/*")):
        for crate in sorted(reg.iterdir()):
            name = crate.name
            if name.startswith("windows") or re.match(r".*-sys-\d", name) or name.startswith("winapi"):
                continue
            try:
                meta = tomllib.loads((crate / "Cargo.toml").read_text(encoding="utf-8"))
            except Exception:
                continue
            lic = str(meta.get("package", {}).get("license", ""))
            if "MIT" not in lic and "Apache-2.0" not in lic:
                continue
            used = 0
            for p in sorted(crate.rglob("*.rs")):
                if "/tests/" in str(p) or "/benches/" in str(p):
                    continue
                t = p.read_text(encoding="utf-8", errors="replace")
                if len(t) > 100_000 or used + len(t) > CRATE_CAP:
                    continue
                if total + len(t) > CRATES_TOTAL:
                    return docs
                used += len(t)
                total += len(t)
                docs.append((f"{name}/{p.relative_to(crate)}", t))
    return docs


def first_paragraph(doc: str) -> str:
    para = re.split(r"\n\s*\n", doc.strip(), maxsplit=1)[0]
    para = re.sub(r"\s+", " ", para).strip()
    return para


def clean_answer(t: str) -> str | None:
    if len(t) < 20 or not re.match(r"[A-Z][a-z]+ ", t) or ">>>" in t or "no longer distributed" in t:
        return None
    if len(t) > MAX_ANSWER:
        cut = t[:MAX_ANSWER]
        end = cut.rfind(". ")
        if end < 40:
            return None
        t = cut[: end + 1]
    return t


def docstring_qa(files: list[Path], rng: random.Random) -> list[tuple[str, str]]:
    root = stdlib_dir()
    qa = []
    for p in files:
        rel = p.relative_to(root).with_suffix("")
        parts = list(rel.parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        if not parts or any(x.startswith("_") for x in parts):
            continue
        mod = ".".join(parts)
        try:
            tree = ast.parse(p.read_text(encoding="utf-8"))
        except Exception:
            continue
        md = ast.get_docstring(tree)
        if md and (a := clean_answer(first_paragraph(md))):
            q = rng.choice([f"What is the {mod} module?", f"What does the {mod} module do?", f"Tell me about {mod}."])
            qa.append((q, a))
        for node in tree.body:
            items = [(node, node.name)] if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) else []
            if isinstance(node, ast.ClassDef):
                items += [
                    (m, f"{node.name}.{m.name}")
                    for m in node.body
                    if isinstance(m, (ast.FunctionDef, ast.AsyncFunctionDef))
                ]
            for n, qual in items:
                if any(x.startswith("_") for x in qual.split(".")):
                    continue
                d = ast.get_docstring(n)
                if not d or not (a := clean_answer(first_paragraph(d))):
                    continue
                name = f"{mod}.{qual}"
                kind = "class" if isinstance(n, ast.ClassDef) else "function"
                q = rng.choice(
                    [
                        f"What does {name} do?",
                        f"What is {name}?",
                        f"Explain {name}.",
                        f"What is {name} used for?",
                        f"Describe the {kind} {name}.",
                    ]
                )
                qa.append((q, a))
    return qa


def rustdoc_qa(pages, rng: random.Random) -> list[tuple[str, str]]:
    qa = []
    for _, blocks in pages:
        for i, (k, t) in enumerate(blocks):
            if k != "h" or i + 1 >= len(blocks) or blocks[i + 1][0] != "p":
                continue
            a = clean_answer(blocks[i + 1][1])
            if not a or len(t) > 80:
                continue
            q = rng.choice([f"Explain {t} in Rust.", f"What is {t}?", f"Tell me about {t} in Rust."])
            qa.append((q, a))
    return qa


def render_chat(q: str, a: str) -> str:
    return f"{BOS}{USER}{q}{ASSISTANT}{a}{EOS}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    args.out.mkdir(parents=True, exist_ok=True)

    docs: list[tuple[str, str, str]] = []  # (source, name, text)
    py = stdlib_files()
    for p in py:
        t = p.read_text(encoding="utf-8", errors="replace")
        if t.strip():
            docs.append(("python", str(p.relative_to(stdlib_dir())), t))
    rd = rust_docs_dir()
    pages = rustdoc_pages(rd) if rd else []
    for name, blocks in pages:
        docs.append(("rustdoc", name, page_text(blocks)))
    for name, t in crate_sources():
        docs.append(("crates", name, t))
    rng.shuffle(docs)

    qa = docstring_qa(py, rng) + rustdoc_qa(pages, rng)
    rng.shuffle(qa)
    chats = [render_chat(q, a) for q, a in qa]

    with open(args.out / "corpus.txt", "w", encoding="utf-8") as f:
        f.write("\0".join(t.replace("\0", "") for _, _, t in docs))
    with open(args.out / "chat.txt", "w", encoding="utf-8") as f:
        f.write("\0".join(chats))
    stats: dict = {"seed": args.seed, "python": sys.version.split()[0], "rust_docs": str(rd), "sources": {}}
    lic = {
        "python": "PSF-2.0 (CPython standard library)",
        "rustdoc": "MIT OR Apache-2.0 (rustup rust-docs component)",
        "crates": "MIT and/or Apache-2.0 (each crate's Cargo.toml license)",
    }
    for src in lic:
        sel = [t for s, _, t in docs if s == src]
        stats["sources"][src] = {"documents": len(sel), "bytes": sum(len(t.encode()) for t in sel), "licence": lic[src]}
    stats["sources"]["chat"] = {
        "documents": len(chats),
        "bytes": sum(len(c.encode()) for c in chats),
        "licence": "derived from the python and rustdoc sources above",
    }
    (args.out / "sources.json").write_text(json.dumps(stats, indent=2))
    print(json.dumps(stats, indent=2))
    for q, a in qa[:5]:
        print(f"Q: {q}\nA: {a}\n")


if __name__ == "__main__":
    main()

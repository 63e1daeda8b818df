#!/usr/bin/env python3
"""Tokenizes the corpus (corpus.py) with the trained tokenizer (tokenizer.py) into the token
stream train.py reads.

    python train/demo_model/prepare.py --corpus DIR --tokenizer HF_DIR --out TOKENS.npz \
        [--chat-repeat 3] [--seed 18]

Plain documents become `bos + text + eos`; chat documents are already rendered with the chat
template's special tokens and are encoded without adding any. Chat documents are repeated
`--chat-repeat` times (the demo answers questions). Documents are shuffled (seeded) and
concatenated; every 100th document goes to the validation stream. Ids are uint16.
"""

from __future__ import annotations

import argparse
import random
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--chat-repeat", type=int, default=3)
    ap.add_argument("--seed", type=int, default=18)
    args = ap.parse_args()
    tok = Tokenizer.from_file(str(args.tokenizer / "tokenizer.json"))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    assert vocab < 65536
    plain = (args.corpus / "corpus.txt").read_text(encoding="utf-8").split("\0")
    chat = (args.corpus / "chat.txt").read_text(encoding="utf-8").split("\0")
    enc_plain = tok.encode_batch(plain, add_special_tokens=True)  # the post-processor adds bos
    enc_chat = tok.encode_batch(chat, add_special_tokens=False)
    docs = [e.ids + [1] for e in enc_plain] + [e.ids for e in enc_chat]
    rng = random.Random(args.seed)
    idx = list(range(len(docs)))
    rng.shuffle(idx)
    val = [docs[i] for n, i in enumerate(idx) if n % 100 == 0]
    train = [docs[i] for n, i in enumerate(idx) if n % 100 != 0]
    n_plain = len(enc_plain)
    train_chat = [docs[i] for n, i in enumerate(idx) if n % 100 != 0 and i >= n_plain]
    train = train + train_chat * (args.chat_repeat - 1)
    rng.shuffle(train)
    tr = np.fromiter((t for d in train for t in d), dtype=np.uint16)
    va = np.fromiter((t for d in val for t in d), dtype=np.uint16)
    np.savez_compressed(args.out, train=tr, val=va, vocab=np.int64(vocab))
    n_text = sum(len(e.ids) for e in enc_plain)
    n_chat = sum(len(e.ids) for e in enc_chat)
    print(f"plain docs {len(plain)} ({n_text:,} tokens), chat docs {len(chat)} ({n_chat:,} tokens); "
          f"train stream {len(tr):,}, val stream {len(va):,}; vocab {vocab}")


if __name__ == "__main__":
    main()

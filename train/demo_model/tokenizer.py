#!/usr/bin/env python3
"""Byte-level BPE tokenizer of deltafin's trained demo model (the `tokenizers` library).

    python train/demo_model/tokenizer.py --corpus DIR --out HF_DIR [--vocab 8192]

Trains on `DIR/corpus.txt` + `DIR/chat.txt` (written by corpus.py) and writes `tokenizer.json`
and `tokenizer_config.json` (with the chat template) into HF_DIR.

Ids: 0 `<｜begin▁of▁sentence｜>` (bos), 1 `<｜end▁of▁sentence｜>` (eos), 2 `<｜▁pad▁｜>`, then the
256 byte tokens and merges, then the special `<｜User｜>` and `<｜Assistant｜>` (DeepSeek-V3's
names). Pre-tokenizer as DeepSeek-V3's family: digits split in runs of at most 3, then GPT-2
byte-level splitting. The template: bos, the system prompt, `<｜User｜>` / `<｜Assistant｜>`
turns, assistant turns closed by eos.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<｜begin▁of▁sentence｜>"
EOS = "<｜end▁of▁sentence｜>"
PAD = "<｜▁pad▁｜>"
USER = "<｜User｜>"
ASSISTANT = "<｜Assistant｜>"
TRAINER_SPECIALS = [BOS, EOS, PAD]
ADDED_SPECIALS = [USER, ASSISTANT]

CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}"
    "{%- if ns.system -%}{%- set ns.system = ns.system + '\\n\\n' -%}{%- endif -%}"
    "{%- set ns.system = ns.system + message['content'] -%}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{{- bos_token -}}{{- ns.system -}}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'user' -%}"
    "{{- '<｜User｜>' + message['content'] -}}"
    "{%- elif message['role'] == 'assistant' -%}"
    "{{- '<｜Assistant｜>' + message['content'] + eos_token -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<｜Assistant｜>' -}}{%- endif -%}"
)


def documents(corpus: Path):
    for name in ("corpus.txt", "chat.txt"):
        text = (corpus / name).read_text(encoding="utf-8")
        for doc in text.split("\0"):
            for s in (BOS, EOS, USER, ASSISTANT):
                doc = doc.replace(s, "\n")
            yield doc


def build(corpus: Path, vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False, fuse_unk=False))
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(r"\p{N}{1,3}"), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(ADDED_SPECIALS),
        min_frequency=2,
        special_tokens=[AddedToken(t, special=True, normalized=False) for t in TRAINER_SPECIALS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(documents(corpus), trainer=trainer)
    assert tok.token_to_id(BOS) == 0 and tok.token_to_id(EOS) == 1 and tok.token_to_id(PAD) == 2
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in ADDED_SPECIALS])
    got = tok.get_vocab_size(with_added_tokens=True)
    assert got == vocab_size, f"vocabulary {got}, wanted {vocab_size}"
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS}:0 $A:0", pair=f"{BOS}:0 $A:0 {BOS}:1 $B:1", special_tokens=[(BOS, 0)]
    )
    return tok


def entry(content: str) -> dict:
    return {"content": content, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False, "special": True}


def write(tok: Tokenizer, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    cfg = {
        "add_bos_token": True,
        "add_eos_token": False,
        "added_tokens_decoder": {str(tok.token_to_id(t)): entry(t) for t in TRAINER_SPECIALS + ADDED_SPECIALS},
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--corpus", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--vocab", type=int, default=8192)
    args = ap.parse_args()
    tok = build(args.corpus, args.vocab)
    write(tok, args.out)
    sample = "def dumps(obj):\n    return json.dumps(obj, indent=4)  # 2024"
    print(tok.encode(sample).tokens)


if __name__ == "__main__":
    main()

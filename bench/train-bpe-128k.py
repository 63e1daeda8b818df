# Trains a byte-level BPE tokenizer with a vocabulary the size of real MoE models' (~128k) on
# local text (the cargo registry's Rust sources and docs), for timing the grammar mask at that
# vocabulary size (bench/NOTES.md, "Constrained decoding"). Needs `pip install tokenizers`.
# Usage: python3 bench/train-bpe-128k.py OUT_DIR
import glob, os, sys
from tokenizers import Tokenizer, models, pre_tokenizers, decoders, trainers
out = sys.argv[1]
files = []
for pat in ["/root/.cargo/registry/src/*/*/src/**/*.rs", "/root/.cargo/registry/src/*/*/*.md", "/usr/share/doc/**/*.txt"]:
    files += glob.glob(pat, recursive=True)
files = [f for f in files if os.path.isfile(f)][:20000]
tok = Tokenizer(models.BPE())
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
tok.decoder = decoders.ByteLevel()
specials = ["<|bos|>", "<|eos|>", "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>",
            "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"]
trainer = trainers.BpeTrainer(vocab_size=128000, special_tokens=specials, min_frequency=2,
                              initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
tok.train(files, trainer)
os.makedirs(out, exist_ok=True)
tok.save(os.path.join(out, "tokenizer.json"))
import json
json.dump({"bos_token": "<|bos|>", "eos_token": "<|eos|>", "chat_template": "{% for m in messages %}{{ m['content'] }}{% endfor %}"},
          open(os.path.join(out, "tokenizer_config.json"), "w"))
print(len(files), "files; vocab", tok.get_vocab_size())

#!/usr/bin/env python3
"""Turns train.py's codes into a float32 Hugging Face checkpoint and writes the goldens.

    python train/demo_model/export.py --codes TRAIN_OUT --tokenizer HF_TOK_DIR --out HF_DIR \
        --golden tests/fixtures/demo_model/expected.json

HF_DIR gets `model.safetensors` (float32; every backbone matrix equal to `q * scale` of its
int8 row codes, every routed expert the decoded value of its MXFP4 codes, so `deltafin convert`
maps each weight back onto the same codes), `config.json`, `generation_config.json` and the
tokenizer files. It is loaded back with `DeepseekV3ForCausalLM.from_pretrained` (experts fused
by transformers from the per-expert names) and the reference is computed as in
tests/fixtures/deepseek_v3/make_fixtures.py: eager attention, eager experts, float32, CPU,
parameters copied out of the memory map, greedy with transformers' KV cache.

The golden file holds, per prompt: `prompt_ids`, `generated_ids` (N_NEW greedy tokens),
`step_logits` (the float32 logits that chose each of them) and the routed experts of every
MoE layer at every position (`routing`), plus the smallest top-1/top-2 logit gap and routing margins (k-th vs (k+1)-th expert score,
kept vs first dropped group score); candidates closer to a tie than 1e-2 / 1e-4 are skipped.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

import transformers
from transformers import AutoTokenizer, DeepseekV3ForCausalLM

E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
N_NEW = 8

# (kind, text): "chat" prompts go through the chat template with add_generation_prompt. The
# goldens take the first N_PROMPTS candidates whose greedy steps and routing are far from ties
# (an f32 summation order elsewhere must not be able to flip a token, an expert or a group).
CANDIDATES = [
    ("chat", "What does json.dumps do?"),
    ("text", "def read_config(path):\n    "),
    ("chat", "Explain ownership in Rust."),
    ("chat", "What is the heapq module?"),
    ("text", "fn main() {\n    let v: Vec<u32> = Vec::new();"),
    ("chat", "What does shutil.copyfile do?"),
    ("text", "The borrow checker compares the scopes of references"),
    ("chat", "Explain closures in Rust."),
    ("text", "import os\nimport sys\n\n\ndef main(argv):\n    "),
    ("chat", "What does os.path.join do?"),
]
N_PROMPTS = 3
TOP2_GAP_MIN = 1e-2
ROUTE_MARGIN_MIN = 1e-4


def dequant_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = blocks.shape[0]
    code = torch.stack([(blocks & 0x0F).long(), (blocks >> 4).long()], dim=-1).reshape(rows, -1)
    sc = torch.ldexp(torch.ones(scales.shape), scales.int() - 127)
    return (E2M1[code].reshape(rows, -1, 32) * sc[..., None]).reshape(rows, -1)


def build_checkpoint(codes: Path, tok_dir: Path, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    back = load_file(str(codes / "codes_backbone.safetensors"))
    exp = {}
    for p in sorted(codes.glob("codes_experts_*.safetensors")):
        exp.update(load_file(str(p)))
    sd = {}
    for name, t in back.items():
        if name.endswith(".scale"):
            continue
        if name.endswith(".q"):
            base = name[:-2]
            sd[base] = (t.float() * back[base + ".scale"][:, None]).contiguous()
        else:
            sd[name] = t.float().contiguous()
    for name in exp:
        if name.endswith(".blocks"):
            base = name[: -len(".blocks")]
            sd[base] = dequant_mxfp4(exp[name], exp[base + ".scales"]).contiguous()
    save_file(sd, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((codes / "config.json").read_text())
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["torch_dtype"] = "float32"
    for k in ("_attn_implementation", "_experts_implementation"):
        cfg.pop(k, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    gen = {"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tok_dir / f, out / f)


def load_reference(hf: Path) -> DeepseekV3ForCausalLM:
    model = DeepseekV3ForCausalLM.from_pretrained(
        str(hf), dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    )
    model.eval()
    with torch.no_grad():  # out of the memory map (see the fixtures' README, numerics notes)
        for p in model.parameters():
            p.data = p.data.clone()
        for b in model.buffers():
            b.data = b.data.clone()
    return model


def goldens(hf: Path) -> dict:
    torch.set_num_threads(1)
    torch.use_deterministic_algorithms(True)
    tok = AutoTokenizer.from_pretrained(str(hf))
    model = load_reference(hf)
    cfg = model.config
    moe_layers = [i for i, l in enumerate(model.model.layers) if hasattr(l.mlp, "gate")]
    captured: dict[int, list] = {}

    def hook(i):
        def f(module, args, output):
            captured.setdefault(i, []).append(output[2].detach().sort(dim=-1).values.tolist())

        return f

    margins: list[tuple[float, float]] = []

    def margin_hook(mod, args, output):
        # k-th vs (k+1)-th biased score among the kept groups; topk_group-th vs next group score
        b = torch.sigmoid(args[0].view(-1, mod.hidden_dim).float() @ mod.weight.float().t()) + mod.e_score_correction_bias
        gs = b.view(-1, mod.num_group, mod.num_experts // mod.num_group).topk(2, -1)[0].sum(-1)
        gsort = gs.sort(-1, descending=True).values
        keep = torch.zeros_like(gs).scatter_(1, gs.topk(mod.topk_group, -1)[1], 1).bool()
        keep = keep.unsqueeze(-1).expand(-1, mod.num_group, mod.num_experts // mod.num_group).reshape(-1, mod.num_experts)
        bs = b.masked_fill(~keep, float("-inf")).sort(-1, descending=True).values
        margins.append((float((bs[:, mod.top_k - 1] - bs[:, mod.top_k]).min()),
                        float((gsort[:, mod.topk_group - 1] - gsort[:, mod.topk_group]).min())))

    for i in moe_layers:
        model.model.layers[i].mlp.gate.register_forward_hook(hook(i))
        model.model.layers[i].mlp.gate.register_forward_hook(margin_hook)
    out = {"prompts": [], "versions": {"torch": torch.__version__, "transformers": transformers.__version__}}
    min_gap = float("inf")
    min_route = (float("inf"), float("inf"))
    for kind, text in CANDIDATES:
        if len(out["prompts"]) == N_PROMPTS:
            break
        if kind == "chat":
            rendered = tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True)
            ids = tok(rendered, add_special_tokens=False)["input_ids"]
        else:
            ids = tok(text, add_special_tokens=True)["input_ids"]
        captured.clear()
        with torch.no_grad():
            o = model.generate(
                torch.tensor([ids]), max_new_tokens=N_NEW, do_sample=False, output_logits=True,
                return_dict_in_generate=True, eos_token_id=None, pad_token_id=2, min_new_tokens=N_NEW,
            )
        gen = o.sequences[0, len(ids):].tolist()
        logits = [l[0].float() for l in o.logits]
        gap = min(float(l.topk(2).values[0] - l.topk(2).values[1]) for l in logits)
        # routing margins over the whole sequence in one no-cache pass (the generate pass's
        # hooks above recorded the expert ids)
        routed = {i: list(captured[i]) for i in moe_layers}
        margins.clear()
        with torch.no_grad():
            model(torch.tensor([ids + gen[:-1]]))
        e_m, g_m = min(m[0] for m in margins), min(m[1] for m in margins)
        if gap < TOP2_GAP_MIN or e_m < ROUTE_MARGIN_MIN or g_m < ROUTE_MARGIN_MIN:
            print(f"skipped {text!r}: top-2 gap {gap:.3g}, expert margin {e_m:.3g}, group margin {g_m:.3g}")
            continue
        min_gap = min(min_gap, gap)
        min_route = (min(min_route[0], e_m), min(min_route[1], g_m))
        captured.clear()
        captured.update(routed)
        # routing: prefill gives all prompt positions, then one position per step
        routing = {}
        for i in moe_layers:
            rows = []
            for call in captured[i]:
                rows.extend(call)
            routing[str(i)] = rows[: len(ids) + N_NEW - 1]
        out["prompts"].append({
            "kind": kind, "text": text, "prompt_ids": ids, "generated_ids": gen,
            "generated_text": tok.decode(gen), "step_logits": [[float(f"{v:.9g}") for v in l.tolist()] for l in logits],
            "routing": routing,
        })
        print(f"{kind}: {text!r} -> {tok.decode(gen)!r}")
    assert len(out["prompts"]) == N_PROMPTS, "too few candidates far from ties"
    out["min_top2_logit_gap"] = min_gap
    out["min_expert_score_margin"] = min_route[0]
    out["min_group_score_margin"] = min_route[1]
    out["note"] = ("transformers DeepseekV3ForCausalLM, eager attention and experts, float32, CPU, greedy with KV cache; "
                   "step_logits[k] chose generated_ids[k]; routing[layer][p] = ascending expert ids at position p of "
                   "prompt_ids + generated_ids[:-1]. Made by train/demo_model/export.py.")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--codes", type=Path, required=True)
    ap.add_argument("--tokenizer", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--golden", type=Path)
    args = ap.parse_args()
    build_checkpoint(args.codes, args.tokenizer, args.out)
    if args.golden:
        g = goldens(args.out)
        args.golden.parent.mkdir(parents=True, exist_ok=True)
        args.golden.write_text(json.dumps(g) + "\n")
        print(f"min top-1/top-2 logit gap {g['min_top2_logit_gap']:.4g}")
        longer = ("Sample of longer greedy output (not part of the goldens):")
        tok = AutoTokenizer.from_pretrained(str(args.out))
        model = load_reference(args.out)
        for q in ("What does os.path.join do?", "What is a closure in Rust?"):
            r = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
            ids = tok(r, add_special_tokens=False)["input_ids"]
            with torch.no_grad():
                s = model.generate(torch.tensor([ids]), max_new_tokens=60, do_sample=False, pad_token_id=2)
            print(longer, repr(q), "->", repr(tok.decode(s[0, len(ids):], skip_special_tokens=True)))


if __name__ == "__main__":
    main()

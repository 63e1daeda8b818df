#!/usr/bin/env python3
"""Trains deltafin's demo model: a small DeepSeek-V3-architecture MoE (issue 18).

The module is transformers' own `DeepseekV3ForCausalLM` (so parameter names and math are the
reference's); only the routed experts' training forward is replaced by a grouped product over
tokens sorted by expert (bf16, same math), and the router's selections are recorded by a hook to
keep the experts balanced with DeepSeek-V3's auxiliary-loss-free bias update (arXiv 2412.19437
§2.1.2: after each step `b_i += u * sign(mean load - load_i)`) plus a small sequence-wise
balance loss (same section, eq. 17-20, alpha below).

At the end (and every `--save-every` seconds, so a timeout still leaves a model) the weights are
rounded onto the exact grids of `deltafin convert`'s default layout and written as codes:
backbone matrices as int8 rows with one f32 scale per row (crates/deltafin-kernels/src/int8.rs;
each scale first rounded to 17 significant bits so that `127 * scale` is exact and convert gives
back the same codes and scales), routed experts as MXFP4 (crates/deltafin-kernels/src/mxfp4.rs),
norms / router / bias as f32. `export.py` turns the codes back into an exact float32 Hugging
Face checkpoint.

    python train/demo_model/train.py --data TOKENS.npz --tokenizer HF_DIR --out OUT \
        [--seconds 400] [--tiny] [--seed 18]

Writes OUT/codes_backbone.safetensors, OUT/codes_experts_{0,1}.safetensors, OUT/config.json,
OUT/train_log.json (loss curve, expert load, settings, versions) and prints progress.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
import types
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

import transformers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

SEQ_ALPHA = 1e-4  # sequence-wise balance loss weight (DeepSeek-V3 uses a small alpha)
BIAS_U = 1e-3  # bias update speed u (DeepSeek-V3: 0.001)


def model_config(vocab: int, tiny: bool) -> DeepseekV3Config:
    if tiny:
        dims = dict(hidden_size=64, num_hidden_layers=3, intermediate_size=128, moe_intermediate_size=32,
                    n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2, num_attention_heads=2,
                    q_lora_rank=32, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
    else:
        dims = dict(hidden_size=256, num_hidden_layers=8, intermediate_size=768, moe_intermediate_size=128,
                    n_routed_experts=64, num_experts_per_tok=6, n_group=8, topk_group=4, num_attention_heads=4,
                    q_lora_rank=96, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32)
    return DeepseekV3Config(
        vocab_size=vocab,
        num_key_value_heads=dims["num_attention_heads"],
        n_shared_experts=1,
        first_k_dense_replace=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        max_position_embeddings=1024,
        rope_theta=10000.0,
        rope_interleave=True,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
        attention_bias=False,
        initializer_range=0.02,
        **dims,
    )


def grouped_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' sum `sum_k w_k * down(silu(gate(x)) * up(x))`, tokens sorted by expert and each
    expert's rows multiplied in one grouped product (bf16 weights cast from the f32 masters)."""
    T, K = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=self.num_experts)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    x = hidden_states[tok].to(torch.bfloat16)
    w1 = self.gate_up_proj.to(torch.bfloat16).transpose(1, 2)  # [E, H, 2I]
    w2 = self.down_proj.to(torch.bfloat16).transpose(1, 2)  # [E, I, H]
    h = torch._grouped_mm(x, w1, offs=offs)
    g, u = h.chunk(2, dim=-1)
    y = torch._grouped_mm(F.silu(g) * u, w2, offs=offs)
    y = y.float() * top_k_weights.reshape(-1)[order, None].float()
    out = torch.zeros(T, hidden_states.shape[-1], device=y.device, dtype=torch.float32)
    out.index_add_(0, tok, y)
    return out.to(hidden_states.dtype)


def loop_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Same sum as `grouped_experts_forward`, one matrix product per expert (fallback)."""
    T, K = top_k_index.shape
    flat = top_k_index.reshape(-1)
    order = torch.argsort(flat, stable=True)
    tok = order // K
    counts = torch.bincount(flat, minlength=self.num_experts).tolist()
    out = torch.zeros(T, hidden_states.shape[-1], device=hidden_states.device, dtype=torch.float32)
    start = 0
    wts = top_k_weights.reshape(-1)[order]
    for e, c in enumerate(counts):
        if c == 0:
            continue
        sl = slice(start, start + c)
        start += c
        x = hidden_states[tok[sl]]
        g, u = F.linear(x, self.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(F.silu(g) * u, self.down_proj[e])
        out.index_add_(0, tok[sl], y.float() * wts[sl, None].float())
    return out.to(hidden_states.dtype)


def init_weights(model: DeepseekV3ForCausalLM, cfg: DeepseekV3Config, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    std = cfg.initializer_range
    out_std = std / math.sqrt(2 * cfg.num_hidden_layers)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name.endswith("norm.weight"):
                p.fill_(1.0)
            elif name.endswith("o_proj.weight") or "down_proj" in name:
                p.copy_(torch.randn(p.shape, generator=g) * out_std)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * std)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.zero_()


class Routing:
    """Collects each MoE layer's router output during a forward pass."""

    def __init__(self, model):
        self.layers = []
        self.current = {}
        for i, layer in enumerate(model.model.layers):
            if hasattr(layer.mlp, "gate"):
                self.layers.append(i)
                layer.mlp.gate.register_forward_hook(self.hook(i))

    def hook(self, i):
        def f(module, args, output):
            logits, _, idx = output
            self.current[i] = (logits, idx)

        return f


def seq_balance_loss(routing: Routing, batch: int, seq: int, n_exp: int, k: int) -> torch.Tensor:
    """DeepSeek-V3 eq. 17-20: sum_i f_i P_i per sequence, averaged over sequences and layers."""
    total = 0.0
    for logits, idx in routing.current.values():
        s = logits.float().sigmoid().view(batch, seq, n_exp)
        p = (s / s.sum(-1, keepdim=True)).mean(1)  # [B, E]
        onehot = torch.zeros(batch, seq * k, n_exp, device=s.device)
        onehot.scatter_(2, idx.view(batch, seq * k, 1), 1.0)
        f = onehot.sum(1) * (n_exp / (k * seq))  # [B, E]
        total = total + (f * p).sum(-1).mean()
    return total / max(1, len(routing.current))


def round_int8_rows(w: torch.Tensor):
    """int8 rows as deltafin's int8::quantize, with each scale on a 17-bit mantissa grid so the
    rounding is a fixed point of that function. Returns (codes int8, scales f32)."""
    w = w.float()
    amax = w.abs().amax(dim=1)
    scale = amax / 127.0
    m, e = torch.frexp(scale)
    scale = torch.ldexp(torch.round(m * 2**17) / 2**17, e)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None])  # torch.round is half-to-even; ties are measure-zero here
    q = torch.where(scale[:, None] > 0, q, torch.zeros_like(q)).clamp(-127, 127).to(torch.int8)
    # the row's largest code must be 127 exactly, so that re-quantizing gives the same scale
    return q, scale


E2M1 = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])


def round_mxfp4(w: torch.Tensor):
    """MXFP4 as deltafin's mxfp4::quantize (OCP MX v1.0 §6.3, ties to even, saturating).
    `w: [rows, cols]`, cols a multiple of 32. Returns (packed uint8 [rows, cols/2], scales uint8
    [rows, cols/32])."""
    rows, cols = w.shape
    b = w.float().reshape(rows, cols // 32, 32)
    amax = b.abs().amax(-1)
    bits = amax.view(torch.int32)
    biased = (bits >> 23) & 0xFF
    floor_log2 = torch.where(biased == 0, torch.full_like(biased, -127), biased - 127)
    shared = (floor_log2 - 2).clamp(-127, 127)
    s = (shared + 127).to(torch.int32)
    s = torch.where(amax == 0, torch.zeros_like(s), s)
    scale = torch.ldexp(torch.ones_like(amax), shared)
    v = (b / scale[..., None]).abs()
    m = torch.zeros_like(v, dtype=torch.int32)
    # thresholds: <=0.25 ->0, <0.75 ->1, <=1.25 ->2, <1.75 ->3, <=2.5 ->4, <3.5 ->5, <=5 ->6, else 7
    m = m + (v > 0.25).int() + (v >= 0.75).int() + (v > 1.25).int() + (v >= 1.75).int()
    m = m + (v > 2.5).int() + (v >= 3.5).int() + (v > 5.0).int()
    neg = (b < 0) | ((b == 0) & torch.signbit(b))
    code = torch.where((m != 0) & neg, m | 8, m)
    code = code.reshape(rows, cols)
    packed = (code[:, 0::2] | (code[:, 1::2] << 4)).to(torch.uint8)
    return packed, s.to(torch.uint8)


def dequant_mxfp4(packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    rows = packed.shape[0]
    lo = (packed & 0x0F).long()
    hi = (packed >> 4).long()
    code = torch.stack([lo, hi], dim=-1).reshape(rows, -1)
    vals = E2M1.to(packed.device)[code]
    sc = torch.ldexp(torch.ones(scales.shape, device=packed.device), scales.int() - 127)
    return (vals.reshape(rows, -1, 32) * sc[..., None]).reshape(rows, -1)


def quantized_state(model) -> tuple[dict, dict]:
    """Codes of the whole model: (backbone tensors, expert tensors), names as the HF checkpoint
    (experts un-fused per expert: `mlp.experts.{e}.{gate,up,down}_proj`) plus suffixes
    `.q`/`.scale` (int8) and `.blocks`/`.scales` (MXFP4)."""
    back, exp = {}, {}
    for name, p in model.state_dict().items():
        p = p.detach()
        if name.endswith("experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            E, I2, H = p.shape
            for e in range(E):
                for part, w in (("gate_proj", p[e, : I2 // 2]), ("up_proj", p[e, I2 // 2 :])):
                    bl, sc = round_mxfp4(w)
                    exp[f"{base}{e}.{part}.weight.blocks"] = bl.cpu()
                    exp[f"{base}{e}.{part}.weight.scales"] = sc.cpu()
        elif name.endswith("experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(p.shape[0]):
                bl, sc = round_mxfp4(p[e])
                exp[f"{base}{e}.down_proj.weight.blocks"] = bl.cpu()
                exp[f"{base}{e}.down_proj.weight.scales"] = sc.cpu()
        elif p.dim() == 2 and not name.endswith("mlp.gate.weight"):
            q, s = round_int8_rows(p)
            back[name + ".q"] = q.cpu()
            back[name + ".scale"] = s.cpu()
        else:
            back[name] = p.float().cpu().contiguous()
    return back, exp


def dequantize_into(model, back: dict, exp: dict) -> None:
    """Loads the rounded weights back into the (f32) model, for evaluating the shipped grid."""
    sd = model.state_dict()
    with torch.no_grad():
        for name, p in sd.items():
            if name.endswith("experts.gate_up_proj"):
                base = name[: -len("gate_up_proj")]
                for e in range(p.shape[0]):
                    g = dequant_mxfp4(exp[f"{base}{e}.gate_proj.weight.blocks"], exp[f"{base}{e}.gate_proj.weight.scales"])
                    u = dequant_mxfp4(exp[f"{base}{e}.up_proj.weight.blocks"], exp[f"{base}{e}.up_proj.weight.scales"])
                    p[e].copy_(torch.cat([g, u], 0))
            elif name.endswith("experts.down_proj"):
                base = name[: -len("down_proj")]
                for e in range(p.shape[0]):
                    p[e].copy_(dequant_mxfp4(exp[f"{base}{e}.down_proj.weight.blocks"], exp[f"{base}{e}.down_proj.weight.scales"]))
            elif name + ".q" in back:
                p.copy_(back[name + ".q"].float() * back[name + ".scale"][:, None])
            else:
                p.copy_(back[name])


def save_codes(model, cfg, out: Path) -> None:
    from safetensors.torch import save_file

    back, exp = quantized_state(model)
    save_file(back, str(out / "codes_backbone.safetensors"))
    names = sorted(exp)
    half = len(names) // 2
    for i, part in enumerate((names[:half], names[half:])):
        save_file({n: exp[n].contiguous() for n in part}, str(out / f"codes_experts_{i}.safetensors"))
    cfg.to_json_file(str(out / "config.json"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seconds", type=float, default=400.0)
    ap.add_argument("--save-every", type=float, default=120.0)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--seed", type=int, default=18)
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--max-steps", type=int, default=0)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    t_start = time.time()
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    versions = {"torch": torch.__version__, "transformers": transformers.__version__,
                "device": torch.cuda.get_device_name(0) if dev == "cuda" else "cpu"}
    print("versions", versions, flush=True)
    if dev == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True

    data = np.load(args.data)
    train_ids = torch.from_numpy(data["train"].astype(np.int64))
    val_ids = torch.from_numpy(data["val"].astype(np.int64))
    vocab = int(data["vocab"])
    print(f"tokens: train {len(train_ids):,} val {len(val_ids):,} vocab {vocab}", flush=True)

    cfg = model_config(vocab, args.tiny)
    cfg._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(cfg)
    init_weights(model, cfg, args.seed)
    model.to(dev)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"parameters: {n_params:,}", flush=True)
    routing = Routing(model)
    experts = [l.mlp.experts for l in model.model.layers if hasattr(l.mlp, "gate")]

    # choose the experts' training forward: grouped product if it agrees with the loop
    impl = "loop"
    if dev == "cuda" and hasattr(torch, "_grouped_mm"):
        try:
            ex = experts[0]
            x = torch.randn(512, cfg.hidden_size, device=dev, requires_grad=True)
            idx = torch.randint(0, cfg.n_routed_experts, (512, cfg.num_experts_per_tok), device=dev)
            w = torch.rand(512, cfg.num_experts_per_tok, device=dev)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                a = grouped_experts_forward(ex, x, idx, w)
                b = loop_experts_forward(ex, x, idx, w)
            ga = torch.autograd.grad(a.float().square().sum(), [x, ex.gate_up_proj])
            gb = torch.autograd.grad(b.float().square().sum(), [x, ex.gate_up_proj])
            err = max(float((a - b).abs().max() / b.abs().max()), float((ga[1] - gb[1]).abs().max() / gb[1].abs().max()))
            print(f"grouped_mm vs loop: rel err {err:.2e}", flush=True)
            if err < 5e-2:
                impl = "grouped_mm"
        except Exception as e:  # noqa: BLE001 - any failure means: use the loop
            print(f"grouped_mm unavailable: {e}", flush=True)
    fwd = grouped_experts_forward if impl == "grouped_mm" else loop_experts_forward
    for ex in experts:
        ex.forward = types.MethodType(fwd, ex)
    print("experts forward:", impl, flush=True)

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "mlp.gate.weight" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "mlp.gate.weight" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=dev == "cuda")
    B, S = args.batch, args.seq
    gen = torch.Generator().manual_seed(args.seed)

    def batch_from(ids: torch.Tensor, n: int, g) -> tuple[torch.Tensor, torch.Tensor]:
        starts = torch.randint(0, len(ids) - S - 1, (n,), generator=g)
        w = torch.stack([ids[s : s + S + 1] for s in starts.tolist()])
        return w[:, :-1].to(dev, non_blocking=True), w[:, 1:].to(dev, non_blocking=True)

    val_gen = torch.Generator().manual_seed(args.seed + 1)
    val_batches = [batch_from(val_ids, min(B, 64), val_gen) for _ in range(4)]

    def evaluate() -> float:
        model.eval()
        tot = 0.0
        with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            for x, y in val_batches:
                logits = model(input_ids=x, use_cache=False).logits
                tot += float(F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1)))
        model.train()
        return tot / len(val_batches)

    n_moe = len(routing.layers)
    E, K = cfg.n_routed_experts, cfg.num_experts_per_tok
    load_total = torch.zeros(n_moe, E, device=dev)
    log = {"versions": versions, "args": {k: str(v) for k, v in vars(args).items()}, "experts_forward": impl,
           "parameters": n_params, "steps": [], "val": []}
    t0 = time.time()
    last_save = t0
    step = 0
    warm = 0.03
    model.train()
    while True:
        el = time.time() - t0
        frac = el / args.seconds
        if frac >= 1.0 or (args.max_steps and step >= args.max_steps):
            break
        lr = args.lr * (frac / warm if frac < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - warm) / (1 - warm))))
        for gp in opt.param_groups:
            gp["lr"] = lr
        x, y = batch_from(train_ids, B, gen)
        routing.current.clear()
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
            logits = model(input_ids=x, use_cache=False).logits
            ce = F.cross_entropy(logits.float().view(-1, vocab), y.reshape(-1))
            bal = seq_balance_loss(routing, B, S, E, K)
            loss = ce + SEQ_ALPHA * bal
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        with torch.no_grad():  # auxiliary-loss-free balancing
            for j, li in enumerate(routing.layers):
                idx = routing.current[li][1]
                load = torch.bincount(idx.reshape(-1), minlength=E).float()
                load_total[j] += load
                bias = model.model.layers[li].mlp.gate.e_score_correction_bias
                bias += BIAS_U * torch.sign(load.mean() - load)
        step += 1
        if step % 25 == 0 or step == 1:
            loads = load_total / load_total.sum(1, keepdim=True).clamp(min=1)
            mx = float(loads.max(1).values.mean() * E)
            rec = {"step": step, "t": round(time.time() - t0, 1), "lr": lr, "loss": float(ce), "balance": float(bal),
                   "grad_norm": float(gn), "max_load_over_mean": mx, "tokens": step * B * S}
            log["steps"].append(rec)
            print(json.dumps(rec), flush=True)
            load_total.zero_()
        if time.time() - last_save > args.save_every:
            log["val"].append({"step": step, "val_loss": evaluate()})
            print("val", log["val"][-1], flush=True)
            save_codes(model, cfg, args.out)
            (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
            last_save = time.time()

    log["train_seconds"] = time.time() - t0
    log["final_steps"] = step
    log["val_loss_f32"] = evaluate()
    # expert load over a fixed evaluation set, per layer
    routing.current.clear()
    loads = []
    model.eval()
    with torch.no_grad(), torch.autocast(dev, dtype=torch.bfloat16, enabled=dev == "cuda"):
        for xb, _ in val_batches:
            routing.current.clear()
            model(input_ids=xb, use_cache=False)
            loads.append(torch.stack([torch.bincount(routing.current[li][1].reshape(-1), minlength=E).float() for li in routing.layers]))
    ld = torch.stack(loads).sum(0)
    ld = ld / ld.sum(1, keepdim=True)
    log["expert_load_val"] = {
        "per_layer_max_over_mean": [float(v) for v in (ld.max(1).values * E)],
        "per_layer_min_over_mean": [float(v) for v in (ld.min(1).values * E)],
        "per_layer_cv": [float(v) for v in (ld.std(1) / ld.mean(1))],
        "load": ld.cpu().tolist(),
    }
    save_codes(model, cfg, args.out)
    from safetensors.torch import load_file

    back = load_file(str(args.out / "codes_backbone.safetensors"))
    exp = {}
    for i in range(2):
        exp.update(load_file(str(args.out / f"codes_experts_{i}.safetensors")))
    dequantize_into(model, {k: v.to(dev) for k, v in back.items()}, {k: v.to(dev) for k, v in exp.items()})
    log["val_loss_rounded"] = evaluate()
    log["total_seconds"] = time.time() - t_start
    (args.out / "train_log.json").write_text(json.dumps(log, indent=1))
    print(json.dumps({k: log[k] for k in ("final_steps", "train_seconds", "val_loss_f32", "val_loss_rounded", "total_seconds")}), flush=True)
    print("expert load max/mean per layer", log["expert_load_val"]["per_layer_max_over_mean"], flush=True)


if __name__ == "__main__":
    main()

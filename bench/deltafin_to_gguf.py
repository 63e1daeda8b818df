#!/usr/bin/env python3
"""Write a deltafin model directory as a GGUF file for llama.cpp's `deepseek2` architecture.

    bench/deltafin_to_gguf.py MODEL_DIR OUT.gguf [--backbone q8_0|f16|f32]

Used by bench/vs-llama-cpp.sh to run llama.cpp on exactly the synthetic weights deltafin runs.
Needs the `gguf` and `numpy` packages from PyPI (bench/requirements-llama.txt).

What is written (the names and conventions of llama.cpp's convert_hf_to_gguf.py, DeepseekV2Model,
read from llama-cpp-python 0.3.36's vendored llama.cpp):

* Routed experts: the OCP/Hugging Face MXFP4 records of experts.pack are repacked, losslessly,
  into ggml `block_mxfp4` (per 32 values: 1 E8M0 byte, then 16 bytes where byte j holds element
  j in its low nibble and element j+16 in its high nibble; the source holds element 2i low and
  2i+1 high). The 4-bit codes and the E8M0 byte are copied unchanged: ggml's table
  `kvalues_mxfp4` is twice the E2M1 value and `GGML_E8M0_TO_FP32_HALF` is half of 2^(e-127), so
  the product is the same number. Stacked per MoE layer as blk.N.ffn_{gate,up,down}_exps.
* Backbone matrices: deltafin stores int8 with one f32 scale per row. GGUF has no such type, so
  they are dequantized and re-quantized to Q8_0 (default: 32-value blocks with an f16 scale,
  1.0625 bytes per weight vs deltafin's 1 + 4/cols, i.e. +6 % backbone bytes per token; values
  re-rounded, so the logits differ slightly), or written F16 (2 bytes per weight: ~2x the
  backbone bytes per token) or F32 (4x; exact). Norms, the router (ffn_gate_inp) and its bias
  (exp_probs_b) stay F32, as in deltafin.
* MLA: kv_b_proj split into attn_k_b (transposed) and attn_v_b, as the current loader expects;
  key_length_mla / value_length_mla set so llama.cpp takes its MLA (absorbed) path.
* Routing: sigmoid gating, expert_weights_norm, expert_weights_scale = routed_scaling_factor,
  expert_group_count / expert_group_used_count (n_group / topk_group), e_score_correction_bias.
* RoPE: YaRN factor / original context / beta_fast / beta_slow, yarn_log_multiplier =
  0.1 * mscale_all_dim (the convert script's convention), freq_base = theta. HF's interleaved
  DeepSeek RoPE is ggml's NORM mode (adjacent pairs), so no permutation.
* Tokenizer: gpt2-style byte-level BPE from the model's tokenizer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

try:
    import gguf
    from gguf import GGMLQuantizationType as QT
except ImportError:  # pragma: no cover
    sys.exit("deltafin_to_gguf: the `gguf` package is missing: pip install -r bench/requirements-llama.txt")

QK = 32


def log(msg: str) -> None:
    print(f"deltafin_to_gguf: {msg}", file=sys.stderr, flush=True)


class Model:
    def __init__(self, d: Path):
        self.dir = d
        self.m = json.loads((d / "manifest.json").read_text())
        if self.m.get("format") != "deltafin-model":
            sys.exit(f"deltafin_to_gguf: {d}/manifest.json is not a deltafin model manifest")
        # Format v2 tags the config by family; this writer handles DeepSeek-V3 only.
        cfg = self.m["config"]
        if "deepseek_v3" not in cfg:
            sys.exit(f"deltafin_to_gguf: {d} is a {', '.join(cfg)} model; only deepseek_v3 is supported")
        self.cfg = cfg["deepseek_v3"]
        self.bb = np.memmap(d / self.m["backbone"]["file"], dtype=np.uint8, mode="r")
        self.pack_path = d / self.m["experts"]["file"]
        self.tensors = self.m["backbone"]["tensors"]

    def has(self, name: str) -> bool:
        return name in self.tensors

    def f32(self, name: str) -> np.ndarray:
        """Any backbone tensor, dequantized to f32, in its source shape."""
        t = self.tensors[name]
        shape = t["shape"]
        off = t["offset"]
        dt = t["dtype"]
        n = int(np.prod(shape))
        if dt == "f32":
            return np.frombuffer(self.bb, dtype="<f4", count=n, offset=off).reshape(shape).copy()
        if dt == "bf16":
            u = np.frombuffer(self.bb, dtype="<u2", count=n, offset=off).astype(np.uint32) << 16
            return u.view(np.float32).reshape(shape)
        if dt == "int8":
            rows, cols = shape
            q = np.frombuffer(self.bb, dtype=np.int8, count=n, offset=off).reshape(rows, cols)
            s = np.frombuffer(self.bb, dtype="<f4", count=rows, offset=t["scales_offset"])
            return q.astype(np.float32) * s[:, None]
        raise SystemExit(f"deltafin_to_gguf: backbone tensor {name} has unsupported dtype {dt}")


def ocp_to_ggml_mxfp4(vals: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """vals uint8 [..., rows, nb*16] (OCP: element 2i low nibble), scales uint8 [..., rows, nb]
    -> ggml block_mxfp4 bytes [..., rows, nb*17] (e, then qs[j] = elem j | elem j+16 << 4)."""
    lead = vals.shape[:-1]
    nb = scales.shape[-1]
    src = vals.reshape(*lead, nb, 16)
    lo = src & 0x0F  # elements 0, 2, ..., 30
    hi = src >> 4  # elements 1, 3, ..., 31
    el = np.stack((lo, hi), axis=-1).reshape(*lead, nb, 32)
    qs = el[..., :16] | (el[..., 16:] << 4)
    out = np.empty((*lead, nb, 17), dtype=np.uint8)
    out[..., 0] = scales
    out[..., 1:] = qs
    return out.reshape(*lead, nb * 17)


def self_test() -> None:
    """The OCP example of REFERENCES.md (byte 0x2F, scale 128 -> [-12, +2]) through the repack
    and ggml's dequantization rule (kvalues doubled, scale halved)."""
    kvalues = np.array([0, 1, 2, 3, 4, 6, 8, 12, 0, -1, -2, -3, -4, -6, -8, -12], dtype=np.float32)
    e2m1 = kvalues / 2
    rng = np.random.default_rng(1)
    vals = rng.integers(0, 256, size=(3, 2 * 16), dtype=np.uint8)
    vals[0, 0] = 0x2F
    scales = rng.integers(100, 140, size=(3, 2), dtype=np.uint8)
    scales[0, 0] = 128
    # OCP reference decode
    codes = np.stack((vals & 0xF, vals >> 4), axis=-1).reshape(3, 64)
    ref = e2m1[codes] * np.exp2(np.repeat(scales.astype(np.float64), 32, axis=1) - 127)
    assert ref[0, 0] == -12.0 and ref[0, 1] == 2.0, ref[0, :2]
    # ggml decode of the repacked bytes
    g = ocp_to_ggml_mxfp4(vals, scales).reshape(3, 2, 17)
    d = np.exp2(g[..., 0].astype(np.float64) - 127) * 0.5
    qs = g[..., 1:]
    y = np.concatenate((kvalues[qs & 0xF], kvalues[qs >> 4]), axis=-1) * d[..., None]
    assert np.array_equal(y.reshape(3, 64), ref), "MXFP4 repack mismatch"


def quant(arr: np.ndarray, kind: str) -> tuple[np.ndarray, QT]:
    """A 2-D/3-D f32 matrix in the chosen backbone type (falls back to F16 when the row length
    is not a multiple of 32)."""
    arr = np.ascontiguousarray(arr, dtype=np.float32)
    if kind == "f32":
        return arr, QT.F32
    if kind == "q8_0" and arr.shape[-1] % QK == 0:
        return gguf.quants.quantize(arr, QT.Q8_0), QT.Q8_0
    return arr.astype(np.float16), QT.F16


def build_tokenizer(w: gguf.GGUFWriter, d: Path, cfg: dict) -> None:
    tj = json.loads((d / "tokenizer.json").read_text())
    model = tj["model"]
    if model.get("type") != "BPE":
        sys.exit("deltafin_to_gguf: only byte-level BPE tokenizer.json is supported")
    vocab: dict[str, int] = dict(model["vocab"])
    special = set()
    for a in tj.get("added_tokens", []):
        vocab[a["content"]] = a["id"]
        if a.get("special"):
            special.add(a["id"])
    n = cfg["vocab_size"]
    rev = {i: t for t, i in vocab.items()}
    tokens, types = [], []
    for i in range(n):
        if i in rev:
            tokens.append(rev[i])
            types.append(gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    bos = cfg.get("bos_token_id")
    eos = cfg.get("eos_token_id")
    if isinstance(eos, list):
        eos = eos[0] if eos else None
    if bos is not None:
        w.add_bos_token_id(int(bos))
    if eos is not None:
        w.add_eos_token_id(int(eos))
    w.add_add_bos_token(False)  # the benchmark feeds token ids, as deltafin's --prompt-ids


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--backbone", choices=["q8_0", "f16", "f32"], default="q8_0")
    args = ap.parse_args()
    self_test()
    t0 = time.time()
    m = Model(args.model_dir)
    cfg = m.cfg
    L = cfg["num_hidden_layers"]
    E = cfg["n_routed_experts"]
    H = cfg["num_attention_heads"]
    nope, rope_d, vdim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora = cfg["kv_lora_rank"]
    q_lora = cfg.get("q_lora_rank")
    dense = cfg["first_k_dense_replace"]
    if cfg.get("model_type") not in ("deepseek_v3", "deepseek_v2", "kimi_k2"):
        log(f"warning: model_type {cfg.get('model_type')} written as deepseek2")

    tmp = args.out.with_name(args.out.name + ".partial")
    w = gguf.GGUFWriter(tmp, arch="deepseek2")
    arch = "deepseek2"
    w.add_name(f"deltafin {args.model_dir.name}")
    w.add_file_type({"q8_0": gguf.LlamaFileType.MOSTLY_Q8_0, "f16": gguf.LlamaFileType.MOSTLY_F16,
                     "f32": gguf.LlamaFileType.ALL_F32}[args.backbone])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    w.add_block_count(L)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(H)
    w.add_head_count_kv(1)  # MLA as MQA with the latent as the single KV head
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_leading_dense_block_count(dense)
    if q_lora:
        w.add_q_lora_rank(q_lora)
    w.add_kv_lora_rank(kv_lora)
    w.add_key_length(kv_lora + rope_d)
    w.add_value_length(kv_lora)
    w.add_key_length_mla(nope + rope_d)
    w.add_value_length_mla(vdim)
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_count(E)
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_shared_count(cfg.get("n_shared_experts") or 0)
    if cfg.get("n_group"):
        w.add_expert_group_count(cfg["n_group"])
        w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_weights_scale(float(cfg["routed_scaling_factor"]))
    if cfg.get("norm_topk_prob"):
        w.add_expert_weights_norm(True)
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_rope_dimension_count(rope_d)
    rope = cfg.get("rope") or {}
    w.add_rope_freq_base(float(rope.get("theta", 10000.0)))
    if rope.get("rope_type") == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(rope["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(rope["original_max_position_embeddings"]))
        if rope.get("attention_factor") is not None:
            w.add_rope_scaling_yarn_attn_factor(float(rope["attention_factor"]))
        w.add_rope_scaling_yarn_beta_fast(float(rope.get("beta_fast", 32.0)))
        w.add_rope_scaling_yarn_beta_slow(float(rope.get("beta_slow", 1.0)))
        if rope.get("mscale_all_dim") is not None:
            # [TAG_DEEPSEEK2_YARN_LOG_MUL_FIX]: the loader divides by 0.1 again
            w.add_rope_scaling_yarn_log_mul(0.1 * float(rope["mscale_all_dim"]))
    elif rope.get("rope_type") not in (None, "default"):
        log(f"warning: rope type {rope.get('rope_type')} not mapped; written without scaling")
    build_tokenizer(w, args.model_dir, cfg)

    bk = args.backbone
    # (gguf name, numpy shape/dtype/nbytes known up front, producer) -- producers run in order.
    plan: list[tuple[str, object]] = []

    def mat(src: str):
        return lambda: quant(m.f32(src), bk)

    def vec(src: str):
        return lambda: (m.f32(src).astype(np.float32), QT.F32)

    plan.append(("token_embd.weight", mat("model.embed_tokens.weight")))
    plan.append(("output_norm.weight", vec("model.norm.weight")))
    if m.has("lm_head.weight"):
        plan.append(("output.weight", mat("lm_head.weight")))

    layout = {l["name"]: l for l in m.m["experts"]["layout"]}
    records = {(r["layer"], r["expert"]): r for r in m.m["experts"]["records"]}
    for name, l in layout.items():
        if l["dtype"] != "mxfp4":
            sys.exit(f"deltafin_to_gguf: expert tensor {name} is {l['dtype']}, expected mxfp4")
        if l["cols"] % QK:
            sys.exit(f"deltafin_to_gguf: expert tensor {name} has {l['cols']} columns, not a multiple of 32")

    pack_fd = os.open(m.pack_path, os.O_RDONLY)

    def experts(layer: int, proj: str):
        def produce():
            l = layout[proj]
            rows, cols = l["rows"], l["cols"]
            nb = cols // QK
            vb, sb = rows * nb * 16, rows * nb
            vals = np.empty((E, rows, nb * 16), dtype=np.uint8)
            scales = np.empty((E, rows, nb), dtype=np.uint8)
            for e in range(E):
                r = records[(layer, e)]
                buf = os.pread(pack_fd, l["bytes"], r["offset"] + l["offset"])
                so = l["scales_offset"] - l["offset"]
                vals[e] = np.frombuffer(buf, dtype=np.uint8, count=vb).reshape(rows, nb * 16)
                scales[e] = np.frombuffer(buf, dtype=np.uint8, count=sb, offset=so).reshape(rows, nb)
            return ocp_to_ggml_mxfp4(vals, scales), QT.MXFP4
        return produce

    def kv_b_split(layer: int):
        src = f"model.layers.{layer}.self_attn.kv_b_proj.weight"
        cache: dict[str, np.ndarray] = {}

        def split():
            if not cache:
                kv_b = m.f32(src).reshape(H, nope + vdim, kv_lora)
                cache["k"] = np.ascontiguousarray(kv_b[:, :nope, :].transpose(0, 2, 1))  # [H, kv_lora, nope]
                cache["v"] = np.ascontiguousarray(kv_b[:, nope:, :])  # [H, v, kv_lora]
            return cache

        def k():
            return quant(split()["k"], bk)

        def v():
            d = split()
            out = quant(d["v"], bk)
            d.clear()
            return out

        return k, v

    for i in range(L):
        p = f"model.layers.{i}."
        b = f"blk.{i}."
        plan.append((b + "attn_norm.weight", vec(p + "input_layernorm.weight")))
        if q_lora:
            plan.append((b + "attn_q_a_norm.weight", vec(p + "self_attn.q_a_layernorm.weight")))
            plan.append((b + "attn_q_a.weight", mat(p + "self_attn.q_a_proj.weight")))
            plan.append((b + "attn_q_b.weight", mat(p + "self_attn.q_b_proj.weight")))
        else:
            plan.append((b + "attn_q.weight", mat(p + "self_attn.q_proj.weight")))
        plan.append((b + "attn_kv_a_norm.weight", vec(p + "self_attn.kv_a_layernorm.weight")))
        plan.append((b + "attn_kv_a_mqa.weight", mat(p + "self_attn.kv_a_proj_with_mqa.weight")))
        kb, vb_ = kv_b_split(i)
        plan.append((b + "attn_k_b.weight", kb))
        plan.append((b + "attn_v_b.weight", vb_))
        plan.append((b + "attn_output.weight", mat(p + "self_attn.o_proj.weight")))
        plan.append((b + "ffn_norm.weight", vec(p + "post_attention_layernorm.weight")))
        if i < dense:
            for g, s in (("ffn_gate", "gate_proj"), ("ffn_up", "up_proj"), ("ffn_down", "down_proj")):
                plan.append((b + g + ".weight", mat(p + f"mlp.{s}.weight")))
        else:
            plan.append((b + "ffn_gate_inp.weight", vec(p + "mlp.gate.weight")))
            if m.has(p + "mlp.gate.e_score_correction_bias"):
                plan.append((b + "exp_probs_b.bias", vec(p + "mlp.gate.e_score_correction_bias")))
            for g, s in (("ffn_gate_exps", "gate_proj"), ("ffn_up_exps", "up_proj"), ("ffn_down_exps", "down_proj")):
                plan.append((b + g + ".weight", experts(i, s)))
            for g, s in (("ffn_gate_shexp", "gate_proj"), ("ffn_up_shexp", "up_proj"), ("ffn_down_shexp", "down_proj")):
                plan.append((b + g + ".weight", mat(p + f"mlp.shared_experts.{s}.weight")))

    # Shapes and sizes up front (GGUF puts the tensor index before the data).
    infos: list[tuple[str, tuple[int, ...], QT, int]] = []
    for gname, _ in plan:
        infos.append((gname, *shape_of(gname, m, cfg, bk, layout)))
    for gname, shape, qt, nbytes in infos:
        # add_tensor_info takes the byte shape for quantized types ([..., row bytes])
        if qt in (QT.F32, QT.F16):
            w.add_tensor_info(gname, shape, np.dtype(np.float32 if qt == QT.F32 else np.float16), nbytes)
        else:
            bs, ts = gguf.GGML_QUANT_SIZES[qt]
            bshape = (*shape[:-1], shape[-1] // bs * ts)
            w.add_tensor_info(gname, bshape, np.dtype(np.uint8), nbytes, raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    total = 0
    for (gname, produce), (_, shape, qt, nbytes) in zip(plan, infos):
        data, got = produce()
        if got != qt or data.nbytes != nbytes:
            sys.exit(f"deltafin_to_gguf: internal error: {gname} produced {got.name} {data.nbytes} B, planned {qt.name} {nbytes} B")
        w.write_tensor_data(data)
        total += nbytes
        if gname.endswith("_exps.weight"):
            log(f"{gname}: {data.nbytes / 2**20:.1f} MiB MXFP4 ({time.time() - t0:.0f} s)")
    w.close()
    os.close(pack_fd)
    os.replace(tmp, args.out)
    log(f"wrote {args.out}: {len(plan)} tensors, {total / 2**30:.2f} GiB of tensor data, backbone {bk}, "
        f"{time.time() - t0:.1f} s")


def shape_of(gname: str, m: Model, cfg: dict, bk: str, layout: dict) -> tuple[tuple[int, ...], QT, int]:
    """(numpy shape in elements, type, bytes) of a planned tensor, mirroring the producers."""
    H = cfg["num_attention_heads"]
    nope, vdim, kv_lora = cfg["qk_nope_head_dim"], cfg["v_head_dim"], cfg["kv_lora_rank"]
    E = cfg["n_routed_experts"]

    def sized(shape: tuple[int, ...], qt: QT) -> tuple[tuple[int, ...], QT, int]:
        bs, ts = gguf.GGML_QUANT_SIZES[qt]
        return shape, qt, int(np.prod(shape)) // bs * ts

    def mat_type(shape: tuple[int, ...]) -> QT:
        if bk == "f32":
            return QT.F32
        if bk == "q8_0" and shape[-1] % QK == 0:
            return QT.Q8_0
        return QT.F16

    if gname.endswith("_exps.weight"):
        proj = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj", "ffn_down_exps": "down_proj"}[gname.split(".")[2]]
        l = layout[proj]
        return sized((E, l["rows"], l["cols"]), QT.MXFP4)
    if gname.endswith("attn_k_b.weight"):
        s = (H, kv_lora, nope)
        return sized(s, mat_type(s))
    if gname.endswith("attn_v_b.weight"):
        s = (H, vdim, kv_lora)
        return sized(s, mat_type(s))
    src = src_of(gname)
    t = m.tensors[src]
    s = tuple(t["shape"])
    if len(s) == 1 or src.endswith("mlp.gate.weight"):
        return sized(s, QT.F32)
    return sized(s, mat_type(s))


def src_of(gname: str) -> str:
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if gname in top:
        return top[gname]
    _, i, rest = gname.split(".", 2)
    p = f"model.layers.{i}."
    names = {
        "attn_norm.weight": "input_layernorm.weight",
        "attn_q_a_norm.weight": "self_attn.q_a_layernorm.weight",
        "attn_q_a.weight": "self_attn.q_a_proj.weight",
        "attn_q_b.weight": "self_attn.q_b_proj.weight",
        "attn_q.weight": "self_attn.q_proj.weight",
        "attn_kv_a_norm.weight": "self_attn.kv_a_layernorm.weight",
        "attn_kv_a_mqa.weight": "self_attn.kv_a_proj_with_mqa.weight",
        "attn_output.weight": "self_attn.o_proj.weight",
        "ffn_norm.weight": "post_attention_layernorm.weight",
        "ffn_gate.weight": "mlp.gate_proj.weight",
        "ffn_up.weight": "mlp.up_proj.weight",
        "ffn_down.weight": "mlp.down_proj.weight",
        "ffn_gate_inp.weight": "mlp.gate.weight",
        "exp_probs_b.bias": "mlp.gate.e_score_correction_bias",
        "ffn_gate_shexp.weight": "mlp.shared_experts.gate_proj.weight",
        "ffn_up_shexp.weight": "mlp.shared_experts.up_proj.weight",
        "ffn_down_shexp.weight": "mlp.shared_experts.down_proj.weight",
    }
    return p + names[rest]


if __name__ == "__main__":
    main()

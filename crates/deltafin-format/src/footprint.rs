//! What a model costs deltafin, computed from its config alone (`deltafin info`): resident
//! backbone bytes, expert record and pack bytes, expert bytes a decode token reads when nothing
//! is cached, and decode-state bytes per token of context. The numbers follow the converter's
//! storage rules exactly ([`crate::convert`]: int8 matrices with an f32 scale per row, or bf16;
//! f32 norms and routers; MXFP4 records padded to [`RECORD_ALIGN`]) and the engine's f32 caches.

use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
use crate::arch::ModelConfig;
use crate::family::TensorRole;
use crate::kimi_linear::MixerKind;
use crate::manifest::StoredDtype;
use crate::manifest::{matrix_dims, record_layout};

/// Sizes of one model, bytes unless stated.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Footprint {
    /// Resident backbone with int8 matrices (the default `--backbone int8`).
    pub backbone_int8: u64,
    /// Resident backbone with bf16 matrices (`--backbone bf16`).
    pub backbone_bf16: u64,
    /// One MXFP4 expert record before padding (values and E8M0 scales of all its matrices).
    pub expert_record: u64,
    /// One record's stride in `experts.pack` (padded to 4096 bytes; what an O_DIRECT read moves).
    pub expert_stride: u64,
    /// Routed-expert records (MoE layers × routed experts).
    pub expert_records: u64,
    /// `experts.pack` size.
    pub expert_pack: u64,
    /// MoE layers.
    pub moe_layers: usize,
    /// Routed experts per token per MoE layer (the model's top-k).
    pub top_k: usize,
    /// Expert bytes one decode token reads from storage with an empty cache:
    /// `moe_layers × top_k × expert_stride`.
    pub expert_bytes_per_token: u64,
    /// Decode state that grows with the context, per token (KV / latent caches, f32).
    pub state_per_token: u64,
    /// Decode state of fixed size per sequence (recurrent and convolution states, f32).
    pub state_fixed: u64,
}

impl Footprint {
    /// Computes the footprint of `cfg`.
    pub fn of(cfg: &ModelConfig) -> Footprint {
        // backbone.bin: each tensor starts TENSOR_ALIGN-aligned after the previous one.
        let (mut int8, mut bf16) = (0u64, 0u64);
        let place = |pos: u64, bytes: u64| pos.div_ceil(TENSOR_ALIGN) * TENSOR_ALIGN + bytes;
        for t in cfg.backbone_tensors() {
            let (rows, cols) = matrix_dims(&t.shape);
            let n = (rows * cols) as u64;
            match t.role {
                TensorRole::F32 => {
                    int8 = place(int8, 4 * n);
                    bf16 = place(bf16, 4 * n);
                }
                TensorRole::Matrix => {
                    int8 = place(int8, n + 4 * rows as u64);
                    bf16 = place(bf16, 2 * n);
                }
            }
        }
        let (_, record) = record_layout(&cfg.expert_matrices(), StoredDtype::Mxfp4);
        let stride = record.div_ceil(RECORD_ALIGN) * RECORD_ALIGN;
        let moe_layers = cfg.moe_layers().count();
        let records = (moe_layers * cfg.n_routed_experts()) as u64;
        let top_k = cfg.num_experts_per_tok();
        let (state_per_token, state_fixed) = state_bytes(cfg);
        Footprint {
            backbone_int8: int8,
            backbone_bf16: bf16,
            expert_record: record,
            expert_stride: stride,
            expert_records: records,
            expert_pack: records * stride,
            moe_layers,
            top_k,
            expert_bytes_per_token: (moe_layers * top_k) as u64 * stride,
            state_per_token,
            state_fixed,
        }
    }

    /// Predicted decode seconds per token when every chosen expert comes from storage at
    /// `bandwidth` bytes per second and compute hides under the reads (the storage floor).
    pub fn seconds_per_token(&self, bandwidth: f64) -> f64 {
        self.expert_bytes_per_token as f64 / bandwidth
    }
}

/// (per token of context, fixed per sequence) decode-state bytes, as the engine stores them
/// (f32): MLA keeps `kv_lora_rank + qk_rope_head_dim` values per token per MLA layer; GQA keeps
/// keys and values `2 × n_kv_heads × head_dim`; KDA keeps a `[heads, d, d]` state and
/// `K - 1` rows of `3P` convolution inputs per layer, whatever the context. Expert biases
/// (gpt-oss) count in the record as f32.
fn state_bytes(cfg: &ModelConfig) -> (u64, u64) {
    match cfg {
        ModelConfig::DeepseekV3(c) => (
            (c.num_hidden_layers * (c.kv_lora_rank + c.qk_rope_head_dim) * 4) as u64,
            0,
        ),
        ModelConfig::KimiLinear(c) => {
            let mla = c.mixers.iter().filter(|m| **m == MixerKind::Mla).count();
            let kda = c.mixers.len() - mla;
            let per_kda =
                c.kda_num_heads * c.kda_head_dim * c.kda_head_dim + (c.short_conv_kernel_size - 1) * 3 * c.kda_width();
            (
                (mla * (c.kv_lora_rank + c.qk_rope_head_dim) * 4) as u64,
                (kda * per_kda * 4) as u64,
            )
        }
        ModelConfig::Qwen3Moe(c) => (
            (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4) as u64,
            0,
        ),
        ModelConfig::Mixtral(c) => (
            (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4) as u64,
            0,
        ),
        // The GQA cache keeps every position, sliding-window layers included (the window limits
        // what attention reads, not what is stored).
        ModelConfig::GptOss(c) => (
            (c.num_hidden_layers * 2 * c.num_key_value_heads * c.head_dim * 4) as u64,
            0,
        ),
        // Full-attention layers keep keys and values per token; each gated DeltaNet layer keeps
        // a `[v_heads, d_k, d_v]` recurrent state and `K - 1` convolution input rows.
        ModelConfig::Qwen3Next(c) => {
            use crate::qwen3_next::Qwen3NextMixer;
            let attn = c.mixers.iter().filter(|m| **m == Qwen3NextMixer::Attention).count();
            let lin = c.mixers.len() - attn;
            let per_lin = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
                + (c.linear_conv_kernel_dim - 1) * c.conv_dim();
            (
                (attn * 2 * c.num_key_value_heads * c.head_dim * 4) as u64,
                (lin * per_lin * 4) as u64,
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;
    use std::path::Path;

    #[test]
    fn hand_computed_tiny_deepseek() {
        // 2 layers (1 dense, 1 MoE), hidden 64, 4 experts of 64 -> 32, top-2, no q_lora.
        let raw = json!({"model_type": "deepseek_v3", "vocab_size": 100, "hidden_size": 64,
            "intermediate_size": 128, "moe_intermediate_size": 32, "num_hidden_layers": 2,
            "first_k_dense_replace": 1, "num_attention_heads": 2, "q_lora_rank": null,
            "kv_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 2, "n_shared_experts": 0, "n_group": 1,
            "topk_group": 1});
        let f = Footprint::of(&ModelConfig::from_value(&raw, Path::new("c")).unwrap());
        // gate/up [32, 64]: 32 rows × (2 blocks × 16 B + 2 scale B) = 1088 B each, 64-aligned
        // (1088 → 1088 is 17×64); down [64, 32]: 64 × (16 + 1) = 1088. Total 3264.
        assert_eq!(f.expert_record, 3264);
        assert_eq!(f.expert_stride, 4096);
        assert_eq!((f.moe_layers, f.expert_records, f.expert_pack), (1, 4, 16384));
        assert_eq!(f.expert_bytes_per_token, 2 * 4096);
        assert_eq!(f.state_per_token, 2 * (16 + 8) * 4);
        assert!(f.backbone_bf16 > f.backbone_int8);
        assert!((f.seconds_per_token(8192.0) - 1.0).abs() < 1e-12);
    }
}

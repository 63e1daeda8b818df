//! One MLA layer's weights on the device, as DeepSeek-V3 / Kimi K2 and the MLA layers of Kimi
//! Linear / K3 run them on CUDA, uploaded once from the checkpoint names of `blocks/mla.rs`
//! ([`MlaTensorNames`]). Source: DeepSeek-V2 §2.1 (MLA); transformers' `DeepseekV3Attention`.

use deltafin_cuda::{GpuBuf, GpuMat};

use crate::blocks::mla::MlaTensorNames;
use crate::models::gpu_fetch::Upload;
use crate::EngineError;

/// The query projection: q-LoRA (`q_a_proj`, `q_a_layernorm`, `q_b_proj`) or `q_proj` alone.
pub(crate) enum QProj {
    Lora {
        q_a_proj: GpuMat,
        q_a_layernorm: GpuBuf,
        q_b_proj: GpuMat,
    },
    Full(GpuMat),
}

/// One MLA layer's projections on the device.
pub(crate) struct MlaGpu {
    pub(crate) q: QProj,
    /// `kv_a_proj_with_mqa` rows `[0, kv_lora_rank)`: the latent part.
    pub(crate) kv_a_latent: GpuMat,
    /// `kv_a_proj_with_mqa` rows `[kv_lora_rank, kv_lora_rank + qk_rope_head_dim)`: the shared
    /// rope key.
    pub(crate) kv_a_rope: GpuMat,
    pub(crate) kv_a_layernorm: GpuBuf,
    pub(crate) kv_b_proj: GpuMat,
    /// K3's output gate `g_proj` `[n_heads * v_head_dim, hidden]` (`mla_use_output_gate`).
    pub(crate) g_proj: Option<GpuMat>,
    pub(crate) o_proj: GpuMat,
}

/// What decides which MLA tensors a layer has and how `kv_a_proj_with_mqa` splits.
pub(crate) struct MlaLayout {
    /// `q_lora_rank` is set (q-LoRA) rather than a plain `q_proj`.
    pub(crate) q_lora: bool,
    pub(crate) kv_lora_rank: usize,
    pub(crate) qk_rope_head_dim: usize,
    /// `mla_use_output_gate` (K3).
    pub(crate) output_gate: bool,
}

impl MlaGpu {
    /// Uploads the layer named by `n` through `up`.
    ///
    /// Errors: a missing or malformed tensor (named); a driver failure.
    pub(crate) fn upload(up: &Upload<'_>, n: &MlaTensorNames, layout: &MlaLayout) -> Result<Self, EngineError> {
        let (kvl, rope) = (layout.kv_lora_rank, layout.qk_rope_head_dim);
        Ok(Self {
            q: if layout.q_lora {
                QProj::Lora {
                    q_a_proj: up.mat(&n.q_a_proj)?,
                    q_a_layernorm: up.vec(&n.q_a_layernorm)?,
                    q_b_proj: up.mat(&n.q_b_proj)?,
                }
            } else {
                QProj::Full(up.mat(&n.q_proj)?)
            },
            kv_a_latent: up.mat_rows(&n.kv_a_proj_with_mqa, 0, kvl)?,
            kv_a_rope: up.mat_rows(&n.kv_a_proj_with_mqa, kvl, kvl + rope)?,
            kv_a_layernorm: up.vec(&n.kv_a_layernorm)?,
            kv_b_proj: up.mat(&n.kv_b_proj)?,
            g_proj: layout.output_gate.then(|| up.mat(&n.g_proj)).transpose()?,
            o_proj: up.mat(&n.o_proj)?,
        })
    }
}

//! One MLA layer's weights on the device, as DeepSeek-V3 / Kimi K2 and the MLA layers of Kimi
//! Linear / K3 run them on CUDA, uploaded once from the tensors the CPU model resolved at load
//! (`blocks/mla.rs`'s [`MlaTensors`]). Source: DeepSeek-V2 §2.1 (MLA); transformers' `DeepseekV3Attention`.

use deltafin_cuda::{GpuBuf, GpuMat, MlaShape};

use crate::blocks::mla::{self, MlaQueryTensors, MlaTensors};
use crate::models::gpu_fetch::Upload;
use crate::EngineError;

/// The MLA kernels' shape ([`deltafin_cuda::MlaShape`]) of the CPU block's shape `s` (its
/// softmax scale and RoPE are passed to the kernels on their own).
pub(crate) fn device_mla_shape(s: &mla::MlaShape<'_>) -> MlaShape {
    MlaShape {
        n_heads: s.n_heads,
        nope: s.nope,
        rope: s.rope,
        v_head_dim: s.v_head_dim,
        kv_lora_rank: s.kv_lora_rank,
    }
}

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

impl MlaGpu {
    /// Uploads the layer whose tensors the CPU model resolved at load (`t`, handles into
    /// `up.backbone`); `kv_a_proj_with_mqa` splits at `kv_lora_rank` (its last
    /// `qk_rope_head_dim` rows are the rope key).
    ///
    /// Errors: a driver failure.
    pub(crate) fn upload(
        up: &Upload<'_>,
        t: &MlaTensors,
        kv_lora_rank: usize,
        qk_rope_head_dim: usize,
    ) -> Result<Self, EngineError> {
        let kv_a = up.backbone.mat(&t.kv_a_proj_with_mqa);
        let kv_end = kv_lora_rank + qk_rope_head_dim;
        Ok(Self {
            q: match &t.query {
                MlaQueryTensors::Lora {
                    q_a_proj,
                    q_a_layernorm,
                    q_b_proj,
                } => QProj::Lora {
                    q_a_proj: up.mat_of(q_a_proj)?,
                    q_a_layernorm: up.vec_of(q_a_layernorm)?,
                    q_b_proj: up.mat_of(q_b_proj)?,
                },
                MlaQueryTensors::Plain { q_proj } => QProj::Full(up.mat_of(q_proj)?),
            },
            kv_a_latent: up.matrix(&kv_a.rows(0, kv_lora_rank))?,
            kv_a_rope: up.matrix(&kv_a.rows(kv_lora_rank, kv_end))?,
            kv_a_layernorm: up.vec_of(&t.kv_a_layernorm)?,
            kv_b_proj: up.mat_of(&t.kv_b_proj)?,
            g_proj: t.g_proj.as_ref().map(|g| up.mat_of(g)).transpose()?,
            o_proj: up.mat_of(&t.o_proj)?,
        })
    }
}

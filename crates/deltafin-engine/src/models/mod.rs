//! Model families, one file each, all behind [`crate::model::CausalLm`].

pub(crate) mod decoder;
pub mod deepseek_v3;
pub mod deepseek_v3_cuda;
pub mod gpt_oss;
pub mod gpu_fetch;
pub mod gqa_cuda;
pub mod gqa_lm;
pub mod hybrid_state;
pub mod kimi_linear;
pub mod kimi_linear_cuda;
pub mod mixtral;
pub(crate) mod mla_gpu;
pub mod qwen3_moe;
pub mod qwen3_next;

pub use deepseek_v3::{DeepseekV3, KvCache};
pub use deepseek_v3_cuda::DeepseekV3Cuda;
pub use gpt_oss::GptOss;
pub use gqa_cuda::GqaCuda;
pub use gqa_lm::GqaLm;
pub use kimi_linear::{KimiLinear, KimiLinearState};
pub use kimi_linear_cuda::KimiLinearCuda;
pub use mixtral::Mixtral;
pub use qwen3_moe::Qwen3Moe;
pub use qwen3_next::{Qwen3Next, Qwen3NextState};

use deltafin_format::{ModelConfig, ModelDir};

use crate::EngineError;

/// The config of the model in `dir` as one family's type, cloned: `as_family` is that family's
/// accessor on [`ModelConfig`] (e.g. [`ModelConfig::as_mixtral`]), `family` its `model_type`.
///
/// Errors: [`EngineError::Invalid`] `"{dir}: not a {family} model"` when `dir` holds another
/// family.
pub(crate) fn family_config<T: Clone>(
    dir: &ModelDir,
    family: &str,
    as_family: impl FnOnce(&ModelConfig) -> Option<&T>,
) -> Result<T, EngineError> {
    as_family(&dir.manifest.config)
        .cloned()
        .ok_or_else(|| EngineError::Invalid(format!("{}: not a {family} model", dir.path.display())))
}

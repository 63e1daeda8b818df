//! Model families, one file each, all behind [`crate::model::CausalLm`].

pub mod deepseek_v3;
pub mod kimi_linear;

pub use deepseek_v3::{DeepseekV3, KvCache};
pub use kimi_linear::{KimiLinear, KimiLinearState};

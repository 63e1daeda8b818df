//! Model families, one file each.

pub mod deepseek_v3;

pub use deepseek_v3::{DeepseekV3, KvCache};

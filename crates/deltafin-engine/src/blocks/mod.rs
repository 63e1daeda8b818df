//! Attention and mixer blocks that more than one model family uses, each with its own
//! per-sequence state and tests against reference outputs.
//!
//! - [`kda`]: Kimi Delta Attention (Kimi Linear, Kimi K3), a gated delta-rule linear attention with
//!   a fixed-size recurrent state, decode step and chunked prefill, and cheap rollback.
//! - [`gated_deltanet`]: Gated DeltaNet (Qwen3-Next, Qwen3.5-MoE), KDA's recurrence with one
//!   decay per head, grouped value heads and a gated RMSNorm output, with the same rollback.
//! - [`mla`]: multi-head latent attention (DeepSeek-V3 / Kimi K2 with RoPE, Kimi Linear / K3
//!   without and with K3's output gate), one token and a chunk, over a latent KV cache.

pub mod gated_deltanet;
pub mod kda;
pub mod mla;

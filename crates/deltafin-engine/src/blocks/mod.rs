//! Attention and mixer blocks that more than one model family uses, each with its own
//! per-sequence state and tests against reference outputs.
//!
//! - [`kda`]: Kimi Delta Attention (Kimi Linear, Kimi K3), a gated delta-rule linear attention with
//!   a fixed-size recurrent state, decode step and chunked prefill, and cheap rollback.

pub mod kda;

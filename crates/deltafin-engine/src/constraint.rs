//! Constrained decoding: a grammar that limits which tokens may come next (structured output:
//! a JSON schema, a tool call in the model's own markup).
//!
//! The engine knows only these two traits; the grammar engine behind them (llguidance in the
//! server) is the caller's. Per decode step the [`crate::sampler::Sampler`] asks the state for
//! the allowed set, sets every other logit to −∞ before any sampling step (so greedy, sampled
//! and speculative decoding all respect it), then commits the chosen token. A request without a
//! grammar never touches any of this.

/// A compiled grammar: immutable, shared, and the source of one [`GrammarState`] per
/// generation (a request's grammar is compiled once, where its errors can still be a 400).
pub trait Grammar: Send + Sync + std::fmt::Debug {
    /// A fresh state at the grammar's start.
    ///
    /// Errors: a one-line message (the grammar engine failed to start).
    fn start(&self) -> Result<Box<dyn GrammarState>, String>;
}

/// Where a generation stands in its grammar.
pub trait GrammarState: Send + std::fmt::Debug {
    /// Sets to `f32::NEG_INFINITY` the logit of every token the grammar does not allow next
    /// (`logits: [vocab]`, the model's vocabulary; ids past the tokenizer's are never allowed).
    /// Once the grammar is complete only end-of-sequence tokens are allowed.
    ///
    /// Errors: a one-line message when the grammar engine fails or allows no token at all.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;

    /// Advances past `token` (one the last mask allowed).
    ///
    /// Errors: a one-line message when the grammar rejects it.
    fn commit(&mut self, token: u32) -> Result<(), String>;

    /// Whether the output is complete: the grammar has ended and allows nothing more.
    fn is_finished(&self) -> bool;
}

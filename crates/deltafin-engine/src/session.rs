//! A generation session: one KV cache reused across requests by longest common token prefix,
//! step-wise decoding with cancellation, sampling, stop strings matched across token
//! boundaries, and per-token log-probabilities.
//!
//! Reuse is exact: a cached position's latent depends only on the tokens before it, so keeping
//! the cache of a shared prefix and running only the rest gives bit-identical logits to a fresh
//! run (`tests::reuse_is_exact` and the server's tests check the greedy output).
//!
//! Text flows token → [`deltafin_tokenizer::StreamDecoder`] (never splits a UTF-8 character)
//! → [`StopMatcher`] (holds back any tail that could start a stop string) → the caller, so the
//! streamed pieces concatenate to exactly the final text and a stop string never leaks.

use std::sync::Arc;
use std::time::Instant;

use deltafin_tokenizer::{Tokenizer, TokenizerError};

use crate::constraint::Grammar;
use crate::experts::StoreCounters;
pub use crate::generate::FinishReason;
use crate::generate::{decode_loop, GenerateStats, LoopSettings, Traces, DEFAULT_SPECULATE};
use crate::model::{CausalLm, DecodeState};
use crate::sampler::{logprob_of, top_logprobs, SamplingParams};
use crate::speculate::{SpeculateMode, Speculator};
use crate::EngineError;

/// One generation's settings.
#[derive(Debug, Clone, Default)]
pub struct GenerationRequest {
    /// Prompt token ids (non-empty, each below the model's vocabulary size).
    pub prompt: Vec<u32>,
    /// Tokens to generate at most (≥ 1).
    pub max_new_tokens: usize,
    /// How to choose tokens (default: greedy).
    pub sampling: SamplingParams,
    /// Stop strings: generation ends when the text contains one; the stop string and anything
    /// after it are not part of the output. Empty strings are ignored.
    pub stop: Vec<String>,
    /// Keep generating after an end-of-sequence token.
    pub ignore_eos: bool,
    /// `Some(n)`: report each chosen token's log-probability and the `n` most likely
    /// alternatives.
    pub logprobs: Option<usize>,
    /// Spell special tokens out in the text (as `skip_special_tokens=False` in vLLM): a tool-call
    /// parser needs markers that are special tokens (e.g. Kimi K2's
    /// `<|tool_calls_section_begin|>`, gpt-oss's `<|channel|>`). End-of-sequence tokens never
    /// appear either way.
    pub keep_special_tokens: bool,
    /// A grammar the output must follow (structured output, forced tool calls): each step
    /// chooses only among the tokens it allows, and the generation ends as soon as it is
    /// complete ([`FinishReason::Eos`], no end-of-sequence token is generated). `None` (the
    /// default) costs nothing.
    pub constraint: Option<Arc<dyn Grammar>>,
}

/// A chosen token's log-probability with the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprob {
    /// The chosen id.
    pub id: u32,
    /// Its text (special tokens spelled out; a partial UTF-8 character as U+FFFD).
    pub token: String,
    /// `log_softmax(logits)[id]` (natural log).
    pub logprob: f32,
    /// The most likely tokens `(id, text, logprob)`, most likely first.
    pub top: Vec<(u32, String, f32)>,
}

/// What one decode step (or the final flush) produced.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Delta {
    /// The token chosen at this step; `None` for the final flush of held-back text.
    pub token: Option<u32>,
    /// Text that became final (possibly empty: an incomplete character or a possible stop
    /// string prefix is held back).
    pub text: String,
    /// The token's log-probability, when requested.
    pub logprob: Option<TokenLogprob>,
}

/// What a generation produced.
#[derive(Debug, Clone)]
pub struct GenerationOutput {
    /// The generated text (stop strings excluded, and special tokens unless
    /// [`GenerationRequest::keep_special_tokens`]); equals the concatenation
    /// of every delta's text.
    pub text: String,
    /// Every generated id, including an end-of-sequence id and the token that completed a stop
    /// string.
    pub generated_ids: Vec<u32>,
    /// Why it ended.
    pub finish: FinishReason,
    /// Prompt tokens of the request.
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV-cache entries were reused from the previous request.
    pub reused_tokens: usize,
    /// Timing and expert-store statistics (`prompt_tokens` counts the whole prompt; the
    /// prefill rate covers the tokens actually run).
    pub stats: GenerateStats,
}

/// The model, its tokenizer and one reusable KV cache. Not shared: one generation at a time.
pub struct Session {
    model: Arc<dyn CausalLm>,
    tokenizer: Arc<Tokenizer>,
    eos_token_ids: Vec<u32>,
    cache: Box<dyn DecodeState>,
    /// The tokens whose entries `cache` holds, in order.
    cached: Vec<u32>,
    /// Prompt tokens per prefill pass (0 = automatic, 1 = token at a time).
    prefill_chunk: usize,
    /// Speculative decoding: the mode and the adaptive draft-length state, kept across
    /// requests so what a conversation's earlier turns taught (acceptance, per-position cost)
    /// carries over; its counters restart per request.
    spec: Speculator,
}

impl Session {
    /// A session with an empty cache. `eos_token_ids`: ids that end a generation (see
    /// [`deltafin_tokenizer::eos_token_ids_union`]).
    pub fn new(model: Arc<dyn CausalLm>, tokenizer: Arc<Tokenizer>, eos_token_ids: Vec<u32>) -> Self {
        let cache = model.new_state();
        Session {
            model,
            tokenizer,
            eos_token_ids,
            cache,
            cached: Vec::new(),
            prefill_chunk: 0,
            spec: Speculator::new(DEFAULT_SPECULATE),
        }
    }

    /// Prompt tokens per batched prefill pass (`--prefill-chunk`; 0 = as many as the memory
    /// allowance holds, 1 = token at a time). Output does not depend on it.
    pub fn set_prefill_chunk(&mut self, tokens: usize) {
        self.prefill_chunk = tokens;
    }

    /// Speculative decoding mode (`--speculate`). Greedy output does not depend on it; sampled
    /// output keeps its distribution (not its exact draws).
    pub fn set_speculate(&mut self, mode: SpeculateMode) {
        if mode != self.spec.mode() {
            self.spec = Speculator::new(mode);
        }
    }

    /// The model.
    pub fn model(&self) -> &Arc<dyn CausalLm> {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Arc<Tokenizer> {
        &self.tokenizer
    }

    /// Context length in tokens (`max_position_embeddings`): prompt plus generated tokens must
    /// fit in it.
    pub fn context_length(&self) -> usize {
        self.model.context_length()
    }

    /// Size of the model's vocabulary (prompt ids must be below it).
    pub fn vocab_size(&self) -> usize {
        self.model.vocab_size()
    }

    /// The ids that end a generation.
    pub fn eos_token_ids(&self) -> &[u32] {
        &self.eos_token_ids
    }

    /// Cumulative expert-store counters.
    pub fn counters(&self) -> StoreCounters {
        self.model.store().counters()
    }

    /// Tokens currently held in the KV cache.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Drops the KV cache.
    pub fn reset(&mut self) {
        self.cache = self.model.new_state();
        self.cached.clear();
    }

    /// Generates from `req.prompt`, reusing the cached prefix it shares with the previous
    /// request. `should_stop` is checked before every forward pass (prefill and decode), so a
    /// cancellation takes effect within one step; `on_delta` receives each step's output and
    /// cancels by returning false.
    ///
    /// Errors: empty prompt, `max_new_tokens == 0`, prompt ids outside the vocabulary, sampling
    /// settings out of range ([`SamplingParams::check`]), prompt plus `max_new_tokens` beyond the
    /// context length, expert read failures (the cache is then reset).
    pub fn generate(
        &mut self,
        req: &GenerationRequest,
        should_stop: &dyn Fn() -> bool,
        mut on_delta: impl FnMut(Delta) -> bool,
    ) -> Result<GenerationOutput, EngineError> {
        let n_prompt = req.prompt.len();
        if n_prompt == 0 {
            return Err(EngineError::Invalid(
                "the prompt is empty: at least one token is needed".into(),
            ));
        }
        if req.max_new_tokens == 0 {
            return Err(EngineError::Invalid("max_new_tokens must be at least 1".into()));
        }
        let vocab = self.vocab_size();
        EngineError::check_tokens(&req.prompt, vocab)?;
        req.sampling.check(vocab).map_err(EngineError::Invalid)?;
        let ctx = self.context_length();
        if n_prompt + req.max_new_tokens > ctx {
            return Err(EngineError::Invalid(format!(
                "prompt ({n_prompt} tokens) plus max_new_tokens ({}) exceeds the context length {ctx}",
                req.max_new_tokens
            )));
        }
        let started = Instant::now();

        // Reuse the longest common prefix, but always run the last prompt token: its logits
        // choose the first generated token.
        let common = self
            .cached
            .iter()
            .zip(&req.prompt)
            .take_while(|(a, b)| a == b)
            .count()
            .min(n_prompt - 1);
        if self.cache.len() != self.cached.len() {
            self.reset();
        }
        let mut reused = common.min(self.cached.len());
        if !self.model.rollback(self.cache.as_mut(), reused) {
            // A recurrent state that cannot go back this far: start over.
            self.reset();
            reused = 0;
        }
        self.cached.truncate(reused);

        let tokenizer = Arc::clone(&self.tokenizer);
        let mut decoder = tokenizer.stream_decoder(!req.keep_special_tokens);
        let mut stops = StopMatcher::new(&req.stop);
        let mut text = String::new();
        let mut hook = |id: u32, logits: Vec<f32>, is_eos: bool| {
            let logprob = req.logprobs.map(|n| token_logprob(&tokenizer, &logits, id, n));
            if is_eos {
                let delta = Delta {
                    token: Some(id),
                    text: String::new(),
                    logprob,
                };
                return Ok(Some(if on_delta(delta) {
                    FinishReason::Eos
                } else {
                    FinishReason::Cancelled
                }));
            }
            let piece = match decoder.push(id) {
                Ok(p) => p,
                // An id the tokenizer does not know (a padded vocabulary row) has no text.
                Err(TokenizerError::UnknownTokenId { .. }) => String::new(),
                Err(e) => return Err(e.into()),
            };
            let (piece, matched) = stops.push(&piece);
            text.push_str(&piece);
            let keep_going = on_delta(Delta {
                token: Some(id),
                text: piece,
                logprob,
            });
            Ok(match matched {
                Some(i) => Some(FinishReason::StopString(i)),
                None if !keep_going => Some(FinishReason::Cancelled),
                None => None,
            })
        };
        let settings = LoopSettings {
            prompt: &req.prompt,
            max_new_tokens: req.max_new_tokens,
            eos_token_ids: &self.eos_token_ids,
            ignore_eos: req.ignore_eos,
            prefill_chunk: self.prefill_chunk,
            sampling: &req.sampling,
            constraint: req.constraint.as_ref(),
            should_stop,
            started,
        };
        // Taken for the request and put back at its end (a failed request starts afresh).
        let mode = self.spec.mode();
        let mut spec = std::mem::replace(&mut self.spec, Speculator::new(mode));
        spec.stats = Default::default();
        let model = Arc::clone(&self.model);
        let r = decode_loop(
            model.as_ref(),
            &mut self.cache,
            &mut self.cached,
            &mut spec,
            &mut Traces::default(),
            &settings,
            &mut hook,
        );
        // A decode that failed left `spec` fresh (see `decode_loop`).
        self.spec = spec;
        let r = r?;
        let mut finish = r.finish;
        if matches!(finish, FinishReason::Eos | FinishReason::Length) {
            // Eos or length: flush what the decoder and the stop matcher held back.
            let tail = decoder.finish()?;
            let (mut piece, matched) = stops.push(&tail);
            match matched {
                Some(i) => finish = FinishReason::StopString(i),
                None => piece.push_str(&stops.flush()),
            }
            if !piece.is_empty() {
                text.push_str(&piece);
                on_delta(Delta {
                    token: None,
                    text: piece,
                    logprob: None,
                });
            }
        }
        let mut stats = r.stats;
        stats.finish_reason = match finish {
            FinishReason::Eos => "eos",
            FinishReason::StopString(_) => "stop",
            FinishReason::Length => "length",
            FinishReason::Cancelled => "cancelled",
        };
        Ok(GenerationOutput {
            text,
            generated_ids: r.generated_ids,
            finish,
            prompt_tokens: n_prompt,
            reused_tokens: reused,
            stats,
        })
    }
}

/// The text of one token (special tokens spelled out; an unknown id as `<token ID>`).
fn token_text(tokenizer: &Tokenizer, id: u32) -> String {
    tokenizer
        .decode(&[id], false)
        .unwrap_or_else(|_| format!("<token {id}>"))
}

/// `id`'s log-probability under `logits` with the `n` most likely alternatives.
fn token_logprob(tokenizer: &Tokenizer, logits: &[f32], id: u32, n: usize) -> TokenLogprob {
    TokenLogprob {
        id,
        token: token_text(tokenizer, id),
        logprob: logprob_of(logits, id),
        top: top_logprobs(logits, n)
            .into_iter()
            .map(|(t, lp)| (t, token_text(tokenizer, t), lp))
            .collect(),
    }
}

/// Finds stop strings in streamed text without releasing any part of one.
///
/// `push` returns the text that can no longer belong to a stop string: everything except the
/// longest tail that is a proper prefix of some stop string. When a stop string appears
/// (possibly across pushes), the text before its earliest occurrence is returned with its index
/// and the rest is discarded.
#[derive(Debug, Clone, Default)]
pub struct StopMatcher {
    stops: Vec<String>,
    pending: String,
}

impl StopMatcher {
    /// A matcher for `stops` (empty strings never match).
    pub fn new(stops: &[String]) -> Self {
        StopMatcher {
            stops: stops.to_vec(),
            pending: String::new(),
        }
    }

    /// Adds text; returns the releasable text and the index of the stop string found, if any.
    pub fn push(&mut self, text: &str) -> (String, Option<usize>) {
        self.pending.push_str(text);
        let found = self
            .stops
            .iter()
            .enumerate()
            .filter(|(_, s)| !s.is_empty())
            .filter_map(|(i, s)| self.pending.find(s.as_str()).map(|at| (at, i)))
            .min();
        if let Some((at, i)) = found {
            let out = self.pending[..at].to_string();
            self.pending.clear();
            return (out, Some(i));
        }
        let hold = self
            .stops
            .iter()
            .map(|s| {
                (1..s.len())
                    .rev()
                    .find(|&k| s.is_char_boundary(k) && self.pending.ends_with(&s[..k]))
                    .unwrap_or(0)
            })
            .max()
            .unwrap_or(0);
        let cut = self.pending.len() - hold;
        let out = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (out, None)
    }

    /// Releases whatever is held (no more text will come).
    pub fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::StopMatcher;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, Option<usize>) {
        let stops: Vec<String> = stops.iter().map(|s| s.to_string()).collect();
        let mut m = StopMatcher::new(&stops);
        let mut out = String::new();
        for p in pieces {
            let (t, hit) = m.push(p);
            // Nothing released may contain (or end with the start of) a matched stop.
            out.push_str(&t);
            if hit.is_some() {
                return (out, hit);
            }
        }
        out.push_str(&m.flush());
        (out, None)
    }

    #[test]
    fn stop_across_pieces_never_leaks() {
        assert_eq!(run(&["END"], &["abc E", "N", "D tail"]), ("abc ".into(), Some(0)));
        assert_eq!(run(&["END"], &["abc E", "N", "x"]), ("abc ENx".into(), None));
        assert_eq!(run(&["xyz", "b"], &["aab"]), ("aa".into(), Some(1)));
        assert_eq!(run(&["é!"], &["café", "!"]), ("caf".into(), Some(0)));
        assert_eq!(run(&[], &["a", "b"]), ("ab".into(), None));
        assert_eq!(run(&[""], &["a", "b"]), ("ab".into(), None));
    }

    #[test]
    fn held_prefix_is_released_when_it_cannot_match() {
        let stops = vec!["\n\n".to_string()];
        let mut m = StopMatcher::new(&stops);
        assert_eq!(m.push("a\n"), ("a".into(), None));
        assert_eq!(m.push("b"), ("\nb".into(), None));
        assert_eq!(m.push("\n"), ("".into(), None));
        assert_eq!(m.push("\n"), ("".into(), Some(0)));
    }
}

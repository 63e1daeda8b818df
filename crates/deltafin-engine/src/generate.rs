//! Greedy generation with timing and expert-store statistics.
//!
//! Timing definitions (also in the README): time to first token (TTFT) runs from the start of the
//! prompt's forward passes to the first generated token; prefill rate = prompt tokens ÷ that
//! time; steady decode rate = decode steps after the first ÷ their time (the first decode step
//! is excluded because it pays one-off costs such as cold caches).

use std::time::{Duration, Instant};

use crate::experts::StoreCounters;
use crate::models::deepseek_v3::{DeepseekV3, KvCache};
use crate::EngineError;

/// Generation settings.
#[derive(Debug, Clone)]
pub struct GenerateOptions {
    /// Tokens to generate at most.
    pub max_new_tokens: usize,
    /// End-of-sequence ids; generation stops after producing one unless `ignore_eos`.
    pub eos_token_ids: Vec<u32>,
    pub ignore_eos: bool,
    /// Keep the logits of every step (for `--logits-out`).
    pub record_logits: bool,
}

/// Statistics of one generation.
#[derive(Debug, Clone, Default)]
pub struct GenerateStats {
    pub prompt_tokens: usize,
    pub generated_tokens: usize,
    /// Time to first token.
    pub ttft: Duration,
    /// Prompt tokens per second over the TTFT.
    pub prefill_tokens_per_s: f64,
    /// Decode steps after the first, and their total time.
    pub steady_decode_steps: usize,
    pub steady_decode_time: Duration,
    /// Expert-store counters accumulated during this generation.
    pub experts: StoreCounters,
    /// Peak resident memory of the process so far, bytes (VmHWM).
    pub peak_rss_bytes: Option<u64>,
    /// Stop reason: `eos` or `length`.
    pub finish_reason: &'static str,
}

impl GenerateStats {
    /// Steady decode tokens per second (None when fewer than two decode steps ran).
    pub fn steady_decode_tokens_per_s(&self) -> Option<f64> {
        if self.steady_decode_steps == 0 || self.steady_decode_time.is_zero() {
            None
        } else {
            Some(self.steady_decode_steps as f64 / self.steady_decode_time.as_secs_f64())
        }
    }
}

/// What a generation produced.
#[derive(Debug, Clone, Default)]
pub struct GenerateOutput {
    pub generated_ids: Vec<u32>,
    /// `step_logits[k]` produced `generated_ids[k]` (only with `record_logits`).
    pub step_logits: Vec<Vec<f32>>,
    pub stats: GenerateStats,
}

fn diff(a: StoreCounters, b: StoreCounters) -> StoreCounters {
    StoreCounters {
        hits: a.hits - b.hits,
        misses: a.misses - b.misses,
        evictions: a.evictions - b.evictions,
        bytes_read: a.bytes_read - b.bytes_read,
        read_wait_ns: a.read_wait_ns - b.read_wait_ns,
    }
}

/// Greedy generation from `prompt` (non-empty) on a fresh KV cache; `on_token` is called with
/// each generated id as soon as it is chosen (for streaming output) and may stop the
/// generation by returning false.
///
/// Errors: empty prompt, token ids outside the vocabulary, expert read failures.
pub fn generate(
    model: &DeepseekV3,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<GenerateOutput, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid(
            "the prompt is empty: at least one token is needed".into(),
        ));
    }
    let start_counters = model.store.counters();
    let mut cache: KvCache = model.new_cache();
    let mut out = GenerateOutput::default();
    let t0 = Instant::now();
    let mut logits = Vec::new();
    for &t in prompt {
        logits = model.forward(&mut cache, t)?.0;
    }
    let mut finish = "length";
    let mut steady_start: Option<Instant> = None;
    for step in 0..opts.max_new_tokens {
        if step > 0 {
            let last = *out.generated_ids.last().expect("one token per step");
            if step == 2 {
                steady_start = Some(Instant::now());
            }
            logits = model.forward(&mut cache, last)?.0;
        }
        let next = DeepseekV3::greedy(&logits);
        if step == 0 {
            out.stats.ttft = t0.elapsed();
        }
        if opts.record_logits {
            out.step_logits.push(logits.clone());
        }
        out.generated_ids.push(next);
        let keep_going = on_token(next);
        if !opts.ignore_eos && opts.eos_token_ids.contains(&next) {
            finish = "eos";
            break;
        }
        if !keep_going {
            finish = "stop";
            break;
        }
    }
    // Decode steps: step 1 (the first forward of a generated token) is excluded; steps 2.. count.
    let decode_steps = out.generated_ids.len().saturating_sub(1);
    if let Some(s) = steady_start {
        out.stats.steady_decode_time = s.elapsed();
        out.stats.steady_decode_steps = decode_steps.saturating_sub(1);
    }
    out.stats.prompt_tokens = prompt.len();
    out.stats.generated_tokens = out.generated_ids.len();
    out.stats.prefill_tokens_per_s = if out.stats.ttft.is_zero() {
        0.0
    } else {
        prompt.len() as f64 / out.stats.ttft.as_secs_f64()
    };
    out.stats.experts = diff(model.store.counters(), start_counters);
    out.stats.peak_rss_bytes = crate::mem::peak_rss_bytes();
    out.stats.finish_reason = finish;
    Ok(out)
}

//! Greedy generation with timing and expert-store statistics.
//!
//! Timing definitions (also in the README): time to first token (TTFT) runs from the start of the
//! prompt's forward passes to the first generated token; prefill rate = prompt tokens ÷ that
//! time; steady decode rate = decode steps after the first ÷ their time (the first decode step
//! is excluded because it pays one-off costs such as cold caches).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::experts::StoreCounters;
use crate::model::{CausalLm, DecodeState};
use crate::traces::{TraceShape, TraceWriter};
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
    /// Append every token's routed-expert choices to this router trace file
    /// (format: [`crate::traces`]).
    pub trace_routes: Option<PathBuf>,
}

/// Where one forward pass's time went.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// `prefill` (a prompt token) or `decode` (a generated token).
    pub kind: &'static str,
    /// Wall time of the forward pass, seconds.
    pub seconds: f64,
    /// Time the compute waited for expert reads, seconds.
    pub io_wait_s: f64,
    /// MLP and MoE blocks (router, shared and routed experts) minus the I/O wait, seconds.
    pub expert_compute_s: f64,
    /// Attention (MLA) including its projections, seconds.
    pub attention_s: f64,
    /// Everything else (embedding, norms, lm_head, bookkeeping), seconds.
    pub other_s: f64,
    /// Routed-expert bytes read from storage on demand during the pass (speculative reads are
    /// counted in the run totals).
    pub expert_bytes_read: u64,
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
    /// One entry per forward pass, prompt tokens first.
    pub steps: Vec<StepStats>,
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
    a.since(&b)
}

/// Greedy generation from `prompt` (non-empty) on a fresh KV cache; `on_token` is called with
/// each generated id as soon as it is chosen (for streaming output) and may stop the
/// generation by returning false.
///
/// Errors: empty prompt, token ids outside the vocabulary, expert read failures.
pub fn generate(
    model: &dyn CausalLm,
    prompt: &[u32],
    opts: &GenerateOptions,
    mut on_token: impl FnMut(u32) -> bool,
) -> Result<GenerateOutput, EngineError> {
    if prompt.is_empty() {
        return Err(EngineError::Invalid(
            "the prompt is empty: at least one token is needed".into(),
        ));
    }
    let start_counters = model.store().counters();
    let mut cache = model.new_state();
    let mut out = GenerateOutput::default();
    let mut trace = match &opts.trace_routes {
        Some(p) => {
            let c = model.config();
            let n_layers = c.num_hidden_layers();
            let first_moe = (0..n_layers).find(|&l| c.is_moe_layer(l)).unwrap_or(n_layers);
            if (first_moe..n_layers).any(|l| !c.is_moe_layer(l)) {
                return Err(EngineError::Invalid(
                    "--trace-routes: this model's MoE layers are not one contiguous run, which the trace format requires".into(),
                ));
            }
            let shape = TraceShape {
                n_layers: n_layers as u32,
                first_moe: first_moe as u32,
                n_experts: c.n_routed_experts() as u32,
                top_k: model.routed().experts_per_token() as u32,
            };
            Some(TraceWriter::open(p, shape)?)
        }
        None => None,
    };
    let mut run_step =
        |cache: &mut Box<dyn DecodeState>, token: u32, kind: &'static str, steps: &mut Vec<StepStats>| {
            let (c0, p0, t) = (model.store().counters(), model.routed().profile(), Instant::now());
            let pos = cache.len();
            let (logits, routes) = model.forward(cache.as_mut(), token)?;
            let seconds = t.elapsed().as_secs_f64();
            let (c1, p1) = (model.store().counters(), model.routed().profile());
            let d = diff(c1, c0);
            let io_wait_s = d.read_wait_ns as f64 * 1e-9;
            let attention_s = (p1.attention_ns - p0.attention_ns) as f64 * 1e-9;
            let expert_compute_s = ((p1.mlp_ns - p0.mlp_ns) as f64 * 1e-9 - io_wait_s).max(0.0);
            steps.push(StepStats {
                kind,
                seconds,
                io_wait_s,
                expert_compute_s,
                attention_s,
                other_s: (seconds - io_wait_s - expert_compute_s - attention_s).max(0.0),
                expert_bytes_read: d.bytes_read_demand,
            });
            if let Some(w) = trace.as_mut() {
                let r: Vec<&[usize]> = routes.iter().map(|(_, r)| r.experts.as_slice()).collect();
                w.record(pos, &r)?;
            }
            Ok::<Vec<f32>, EngineError>(logits)
        };
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let mut steps = Vec::new();
    for &t in prompt {
        logits = run_step(&mut cache, t, "prefill", &mut steps)?;
    }
    let mut finish = "length";
    let mut steady_start: Option<Instant> = None;
    for step in 0..opts.max_new_tokens {
        if step > 0 {
            let last = *out.generated_ids.last().expect("one token per step");
            if step == 2 {
                steady_start = Some(Instant::now());
            }
            logits = run_step(&mut cache, last, "decode", &mut steps)?;
        }
        let next = deltafin_kernels::argmax(&logits) as u32;
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
    out.stats.experts = diff(model.store().counters(), start_counters);
    out.stats.peak_rss_bytes = crate::mem::peak_rss_bytes();
    out.stats.finish_reason = finish;
    out.stats.steps = steps;
    Ok(out)
}

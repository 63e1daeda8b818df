//! Generation (greedy by default) with timing and expert-store statistics.
//!
//! Timing definitions (also in the README): time to first token (TTFT) runs from the start of the
//! prompt's forward passes to the first generated token; prefill rate = prompt tokens ÷ that
//! time; steady decode rate = decode steps after the first ÷ their time (the first decode step
//! is excluded because it pays one-off costs such as cold caches).

use std::path::PathBuf;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::experts::StoreCounters;
use crate::model::{CausalLm, LayerRoutes};
use crate::sampler::{Sampler, SamplingParams};
use crate::speculate::{SpecStats, SpeculateMode, Speculator};
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
    /// Measurement: append, for every one-token forward pass, the next-layer expert predictions
    /// (the experts `--prefetch on` would read) to this file, as a router trace of the MoE
    /// layers after the first (header `first_moe` one above the model's; the model must log
    /// predictions: [`crate::model::RoutedExperts::log_predictions`]). Batched passes predict
    /// nothing and write no record. `deltafin replay --predictions` replays them.
    pub trace_predictions: Option<PathBuf>,
    /// Prompt tokens per batched prefill pass (`--prefill-chunk`): 1 = token at a time, 0 =
    /// as many as the memory allowance holds ([`prefill_chunk_tokens`]).
    pub prefill_chunk: usize,
    /// Speculative decoding (`--speculate`); greedy output is identical either way.
    pub speculate: SpeculateMode,
    /// How to choose tokens (default: greedy, the exact argmax).
    pub sampling: SamplingParams,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 16,
            eos_token_ids: Vec::new(),
            ignore_eos: false,
            record_logits: false,
            trace_routes: None,
            trace_predictions: None,
            prefill_chunk: 0,
            speculate: DEFAULT_SPECULATE,
            sampling: SamplingParams::default(),
        }
    }
}

/// Default `--speculate` (see bench/NOTES.md, "Multi-token passes": where it pays).
pub const DEFAULT_SPECULATE: SpeculateMode = SpeculateMode::Off;

/// Activation memory a batched prefill pass may hold, bytes: an eighth of the expert cache
/// budget, at least 32 MiB (the budget is the memory the user gave the engine; activations live
/// beside it).
pub fn prefill_allowance(budget: u64) -> u64 {
    (budget / 8).max(32 << 20)
}

/// Prompt tokens per prefill pass: `requested` when non-zero, else as many as
/// [`prefill_allowance`] holds at [`CausalLm::batch_bytes_per_token`], capped at 4096; never
/// more than the prompt.
pub fn prefill_chunk_tokens(model: &dyn CausalLm, requested: usize, prompt: usize) -> usize {
    let n = if requested > 0 {
        requested
    } else {
        let per = model.batch_bytes_per_token().max(1) as u64;
        (prefill_allowance(model.store().budget()) / per).clamp(1, 4096) as usize
    };
    n.min(prompt).max(1)
}

/// Where one forward pass's time went.
#[derive(Debug, Clone, Serialize)]
pub struct StepStats {
    /// `prefill` (a chunk of prompt tokens), `decode` (one generated token) or `verify` (a
    /// speculative pass: the drafted tokens checked at once).
    pub kind: &'static str,
    /// Tokens the pass produced: the chunk's prompt tokens (prefill), 1 (decode), or the
    /// accepted drafts plus one (verify), of which only those handed out before the generation
    /// ended (`max_new_tokens`, EOS, stop) count.
    pub tokens: usize,
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
    /// Prompt tokens per prefill pass used.
    pub prefill_chunk: usize,
    /// Routed-expert bytes read on demand during the prefill.
    pub prefill_expert_bytes: u64,
    /// Distinct (layer, routed expert) pairs the prompt's tokens chose.
    pub prefill_unique_experts: usize,
    /// MoE layers of the model (to turn `prefill_unique_experts` into a per-layer mean).
    pub moe_layers: usize,
    /// Speculative decoding counters.
    pub speculation: SpecStats,
    /// The `--speculate` mode of the generation (`off`, `auto`, `lookup`, `self`).
    pub speculate: &'static str,
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

/// Generation from `prompt` (non-empty) on a fresh KV cache, greedy unless `opts.sampling` says
/// otherwise; `on_token` is called with each generated id as soon as it is chosen (for
/// streaming output) and may stop the generation by returning false.
///
/// Errors: empty prompt, token ids outside the vocabulary, sampling settings out of range
/// ([`SamplingParams::check`]), expert read failures.
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
    opts.sampling.check(model.vocab_size()).map_err(EngineError::Invalid)?;
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
            Some(TraceWriter::open(p, shape).map_err(|e| EngineError::Invalid(format!("--trace-routes: {e}")))?)
        }
        None => None,
    };
    let mut predictions = match &opts.trace_predictions {
        Some(p) => {
            let s = TraceShape::for_model(model.config())
                .map_err(|e| EngineError::Invalid(format!("--trace-predictions: {e}")))?;
            let shape = TraceShape {
                first_moe: s.first_moe + 1,
                top_k: model.routed().experts_per_token() as u32,
                ..s
            };
            if shape.first_moe >= shape.n_layers {
                return Err(EngineError::Invalid(
                    "--trace-predictions: the model has one MoE layer, so nothing is predicted".into(),
                ));
            }
            Some((
                TraceWriter::open(p, shape).map_err(|e| EngineError::Invalid(format!("--trace-predictions: {e}")))?,
                shape,
            ))
        }
        None => None,
    };
    let moe_layers = model.config().moe_layers().count();
    // One forward pass with its time breakdown.
    let measure = |kind: &'static str,
                   f: &mut dyn FnMut() -> Result<(usize, Vec<LayerRoutes>), EngineError>,
                   steps: &mut Vec<StepStats>|
     -> Result<Vec<LayerRoutes>, EngineError> {
        let (c0, p0, t) = (model.store().counters(), model.routed().profile(), Instant::now());
        let (tokens, routes) = f()?;
        let seconds = t.elapsed().as_secs_f64();
        let (c1, p1) = (model.store().counters(), model.routed().profile());
        let d = diff(c1, c0);
        let io_wait_s = d.read_wait_ns as f64 * 1e-9;
        let attention_s = (p1.attention_ns - p0.attention_ns) as f64 * 1e-9;
        let expert_compute_s = ((p1.mlp_ns - p0.mlp_ns) as f64 * 1e-9 - io_wait_s).max(0.0);
        steps.push(StepStats {
            kind,
            tokens,
            seconds,
            io_wait_s,
            expert_compute_s,
            attention_s,
            other_s: (seconds - io_wait_s - expert_compute_s - attention_s).max(0.0),
            expert_bytes_read: d.bytes_read_demand,
        });
        Ok(routes)
    };
    let t0 = Instant::now();
    let mut logits = Vec::new();
    let mut steps = Vec::new();
    let chunk = prefill_chunk_tokens(model, opts.prefill_chunk, prompt.len());
    let mut unique = std::collections::HashSet::new();
    let mut pos = 0;
    let c_prefill = model.store().counters();
    for c in prompt.chunks(chunk) {
        let routes = measure(
            "prefill",
            &mut || {
                let mut out = model.forward_batch(cache.as_mut(), c, false)?;
                logits = out
                    .logits
                    .pop()
                    .ok_or_else(|| EngineError::Invalid("prefill returned no logits".into()))?;
                Ok((c.len(), out.routes))
            },
            &mut steps,
        )?;
        if let Some((w, shape)) = predictions.as_mut() {
            // A one-token chunk (`--prefill-chunk 1`) predicts as decoding does.
            let p = model.routed().take_predictions();
            let want = shape.first_moe as usize..shape.n_layers as usize;
            if routes.len() == 1 && p.iter().map(|x| x.0).eq(want) {
                let rr: Vec<&[usize]> = p.iter().map(|(_, x)| x.as_slice()).collect();
                w.record(pos, &rr)?;
            }
        }
        for r in &routes {
            for (l, routing) in r {
                unique.extend(routing.experts.iter().map(|&e| (*l, e)));
            }
            if let Some(w) = trace.as_mut() {
                let rr: Vec<&[usize]> = r.iter().map(|(_, x)| x.experts.as_slice()).collect();
                w.record(pos, &rr)?;
            }
            pos += 1;
        }
    }
    out.stats.prefill_expert_bytes = diff(model.store().counters(), c_prefill).bytes_read_demand;
    out.stats.prefill_unique_experts = unique.len();
    out.stats.moe_layers = moe_layers;
    out.stats.prefill_chunk = chunk;
    let mut finish = "length";
    let mut steady_start: Option<Instant> = None;
    let mut steady_from = 0;
    let mut chooser = Sampler::with_prompt(opts.sampling.clone(), prompt);
    let mut spec = Speculator::new(opts.speculate);
    let mut context: Vec<u32> = prompt.to_vec();
    // Tokens chosen but not yet handed out, with the logits that chose them.
    let mut pending: std::collections::VecDeque<(u32, Vec<f32>)> = Default::default();
    pending.push_back((chooser.sample(&logits), std::mem::take(&mut logits)));
    out.stats.ttft = t0.elapsed();
    'gen: while out.generated_ids.len() < opts.max_new_tokens {
        if pending.is_empty() {
            if out.generated_ids.len() >= 2 && steady_start.is_none() {
                steady_start = Some(Instant::now());
                steady_from = out.generated_ids.len();
            }
            let mut step_out = None;
            let routes = measure(
                "decode",
                &mut || {
                    spec.set_remaining(opts.max_new_tokens - out.generated_ids.len());
                    let s = spec.step(model, cache.as_mut(), &context, &mut chooser)?;
                    let routes = s.routes.clone();
                    let n = s.tokens.len();
                    step_out = Some(s);
                    Ok((n, routes))
                },
                &mut steps,
            )?;
            let s = step_out.ok_or_else(|| EngineError::Invalid("decode step produced nothing".into()))?;
            if s.drafted > 0 {
                if let Some(last) = steps.last_mut() {
                    last.kind = "verify";
                }
            }
            let base = context.len() - 1;
            if let Some(w) = trace.as_mut() {
                for (i, r) in routes.iter().enumerate() {
                    let rr: Vec<&[usize]> = r.iter().map(|(_, x)| x.experts.as_slice()).collect();
                    w.record(base + i, &rr)?;
                }
            }
            if let Some((w, shape)) = predictions.as_mut() {
                // One prediction per MoE layer after the first, in layer order, from a one-token
                // pass; anything else (a verify pass predicts nothing) writes no record.
                let p = model.routed().take_predictions();
                let want = shape.first_moe as usize..shape.n_layers as usize;
                if routes.len() == 1 && p.iter().map(|x| x.0).eq(want) {
                    let rr: Vec<&[usize]> = p.iter().map(|(_, x)| x.as_slice()).collect();
                    w.record(base, &rr)?;
                }
            }
            pending.extend(s.tokens.into_iter().zip(s.logits));
        }
        while let Some((next, l)) = pending.pop_front() {
            if opts.record_logits {
                out.step_logits.push(l);
            }
            out.generated_ids.push(next);
            context.push(next);
            let keep_going = on_token(next);
            if !opts.ignore_eos && opts.eos_token_ids.contains(&next) {
                finish = "eos";
                break 'gen;
            }
            if !keep_going {
                finish = "stop";
                break 'gen;
            }
            if out.generated_ids.len() >= opts.max_new_tokens {
                break 'gen;
            }
        }
    }
    // A verification pass can choose more tokens than were handed out (max_new_tokens, EOS or
    // a stop came first): its step counts only those handed out.
    if let Some(last) = steps.last_mut().filter(|s| s.kind != "prefill") {
        last.tokens = last.tokens.saturating_sub(pending.len());
    }
    out.stats.speculation = spec.stats;
    out.stats.speculate = spec.mode().name();
    // Steady decode: the tokens chosen after the first decode step (which pays one-off costs).
    if let Some(s) = steady_start {
        out.stats.steady_decode_time = s.elapsed();
        out.stats.steady_decode_steps = out.generated_ids.len().saturating_sub(steady_from);
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

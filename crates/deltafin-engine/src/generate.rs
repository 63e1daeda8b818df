//! Generation (greedy by default) with timing and expert-store statistics.
//!
//! [`decode_loop`] is the one generation loop: [`generate`] (`run`, and `bench` through `run`)
//! and [`crate::session::Session::generate`] (`chat`, `serve`) are thin callers that add, for
//! the first, a fresh state, router traces and recorded logits, and for the second, prefix
//! reuse, text, stop strings, log-probabilities and a grammar.
//!
//! Timing definitions (also in the README): time to first token (TTFT) runs from the start of the
//! prompt's forward passes to the first generated token; prefill rate = prompt tokens ÷ that
//! time; steady decode rate = decode steps after the first ÷ their time (the first decode step
//! is excluded because it pays one-off costs such as cold caches).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde::Serialize;

use crate::constraint::Grammar;
use crate::experts::StoreCounters;
use crate::model::{CausalLm, DecodeState, LayerRoutes};
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

/// Why a generation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-sequence token was produced, or the request's grammar is complete.
    Eos,
    /// The text reached a stop string (its index in the request).
    StopString(usize),
    /// `max_new_tokens` were produced.
    Length,
    /// The caller asked to stop (`should_stop` or the token callback returned false).
    Cancelled,
}

/// The router-trace files one generation appends to (`--trace-routes`, `--trace-predictions`).
#[derive(Default)]
pub(crate) struct Traces {
    routes: Option<TraceWriter>,
    /// The predictions' writer with its shape (MoE layers after the first).
    predictions: Option<(TraceWriter, TraceShape)>,
}

impl Traces {
    /// Opens the files `opts` names for `model`.
    ///
    /// Errors: the model's MoE layers are not one contiguous run (routes), the model has one MoE
    /// layer (predictions), a file cannot be created.
    fn open(model: &dyn CausalLm, opts: &GenerateOptions) -> Result<Self, EngineError> {
        let routes = match &opts.trace_routes {
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
        let predictions = match &opts.trace_predictions {
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
                    TraceWriter::open(p, shape)
                        .map_err(|e| EngineError::Invalid(format!("--trace-predictions: {e}")))?,
                    shape,
                ))
            }
            None => None,
        };
        Ok(Traces { routes, predictions })
    }

    /// Records a pass's routes, one position per entry from position `pos`, and (a one-token
    /// pass only) the model's next-layer predictions at `pos`; a pass that predicted anything
    /// else (a batched or verify pass predicts nothing) writes no prediction record.
    fn record(&mut self, model: &dyn CausalLm, pos: usize, routes: &[LayerRoutes]) -> Result<(), EngineError> {
        if let Some((w, shape)) = self.predictions.as_mut() {
            // One prediction per MoE layer after the first, in layer order.
            let p = model.routed().take_predictions();
            let want = shape.first_moe as usize..shape.n_layers as usize;
            if routes.len() == 1 && p.iter().map(|x| x.0).eq(want) {
                let rr: Vec<&[usize]> = p.iter().map(|(_, x)| x.as_slice()).collect();
                w.record(pos, &rr)?;
            }
        }
        if let Some(w) = self.routes.as_mut() {
            for (i, r) in routes.iter().enumerate() {
                let rr: Vec<&[usize]> = r.iter().map(|(_, x)| x.experts.as_slice()).collect();
                w.record(pos + i, &rr)?;
            }
        }
        Ok(())
    }
}

/// One generation's settings for [`decode_loop`], the loop every generation runs (`run`,
/// `bench` through `run`, `chat` and `serve` through [`crate::session::Session`]).
pub(crate) struct LoopSettings<'a> {
    /// The whole prompt (non-empty); its first `cached.len()` tokens are in the state already.
    pub prompt: &'a [u32],
    pub max_new_tokens: usize,
    pub eos_token_ids: &'a [u32],
    pub ignore_eos: bool,
    /// Prompt tokens per prefill pass (0 = automatic: [`prefill_chunk_tokens`]).
    pub prefill_chunk: usize,
    pub sampling: &'a SamplingParams,
    /// A grammar the output must follow.
    pub constraint: Option<&'a Arc<dyn Grammar>>,
    /// Checked before every forward pass (prefill and decode): true cancels the generation.
    pub should_stop: &'a dyn Fn() -> bool,
    /// When the generation started (TTFT runs from here).
    pub started: Instant,
}

/// What [`decode_loop`] produced: the generated ids, why it ended, and every statistic but
/// `finish_reason` (the caller names its end).
pub(crate) struct LoopOutput {
    pub generated_ids: Vec<u32>,
    pub finish: FinishReason,
    pub stats: GenerateStats,
}

/// The generation loop: prefills `s.prompt[cached.len()..]` in chunks into `state`, chooses the
/// first token from the last prompt position's logits, then decodes (speculating as `spec`
/// says) until `max_new_tokens`, an end the `on_token` hook names, or a complete grammar.
///
/// `cached` holds the tokens whose entries `state` holds and is kept so: on return, every
/// token but the last generated one. `on_token(id, logits, is_eos)` receives each generated
/// id in order with the logits that chose it and whether it is an end-of-sequence id (never
/// with `ignore_eos`), and returns `Some(reason)` to end the generation after it.
///
/// Errors: sampling and grammar failures, forward-pass failures (`state` and `cached` are then
/// reset, since a pass that failed midway may have appended to some layers only), the
/// `on_token` hook's errors, trace-file write failures. An error once decoding began (the first
/// token chosen) also leaves `spec` fresh; before that `spec` is untouched.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_loop(
    model: &dyn CausalLm,
    state: &mut Box<dyn DecodeState>,
    cached: &mut Vec<u32>,
    spec: &mut Speculator,
    traces: &mut Traces,
    s: &LoopSettings,
    on_token: &mut dyn FnMut(u32, Vec<f32>, bool) -> Result<Option<FinishReason>, EngineError>,
) -> Result<LoopOutput, EngineError> {
    // A failed forward pass may leave some layers appended: the caller's state starts afresh.
    let forward_failed = |state: &mut Box<dyn DecodeState>, cached: &mut Vec<u32>, e: EngineError| {
        *state = model.new_state();
        cached.clear();
        e
    };
    let start_counters = model.store().counters();
    let rest = &s.prompt[cached.len()..];
    let chunk = prefill_chunk_tokens(model, s.prefill_chunk, rest.len());
    let mut out = LoopOutput {
        generated_ids: Vec::new(),
        finish: FinishReason::Length,
        stats: GenerateStats {
            prompt_tokens: s.prompt.len(),
            prefill_chunk: chunk,
            moe_layers: model.config().moe_layers().count(),
            ..Default::default()
        },
    };
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
    let end = |mut out: LoopOutput, steady: Option<(Instant, usize)>| {
        let st = &mut out.stats;
        st.generated_tokens = out.generated_ids.len();
        // The prefill rate covers the tokens run here, not a reused prefix.
        st.prefill_tokens_per_s = if st.ttft.is_zero() {
            0.0
        } else {
            rest.len() as f64 / st.ttft.as_secs_f64()
        };
        // Steady decode: the tokens chosen after the first decode step (which pays one-off
        // costs).
        if let Some((t, from)) = steady {
            st.steady_decode_time = t.elapsed();
            st.steady_decode_steps = out.generated_ids.len().saturating_sub(from);
        }
        st.experts = diff(model.store().counters(), start_counters);
        st.peak_rss_bytes = crate::mem::peak_rss_bytes();
        out
    };

    let mut logits = Vec::new();
    let mut steps = Vec::new();
    // Distinct (layer, expert) of the tokens prefilled here (not of a reused prefix).
    let mut unique = std::collections::HashSet::new();
    for c in rest.chunks(chunk) {
        if (s.should_stop)() {
            out.finish = FinishReason::Cancelled;
            out.stats.steps = steps;
            return Ok(end(out, None));
        }
        let pos = cached.len();
        let r = measure(
            "prefill",
            &mut || {
                let mut o = model.forward_batch(state.as_mut(), c, false)?;
                logits = o
                    .logits
                    .pop()
                    .ok_or_else(|| EngineError::Invalid("prefill returned no logits".into()))?;
                Ok((c.len(), o.routes))
            },
            &mut steps,
        );
        let routes = r.map_err(|e| forward_failed(state, cached, e))?;
        cached.extend_from_slice(c);
        // A one-token chunk (`--prefill-chunk 1`) predicts as decoding does.
        traces.record(model, pos, &routes)?;
        for r in &routes {
            for (l, routing) in r {
                unique.extend(routing.experts.iter().map(|&e| (*l, e)));
            }
        }
    }
    out.stats.prefill_expert_bytes = diff(model.store().counters(), start_counters).bytes_read_demand;
    out.stats.prefill_unique_experts = unique.len();

    let mut sampler = Sampler::with_prompt(s.sampling.clone(), s.prompt);
    if let Some(g) = s.constraint {
        sampler.constrain(
            g.start()
                .map_err(|e| EngineError::Invalid(format!("the output grammar: {e}")))?,
        );
    }
    let mut steady: Option<(Instant, usize)> = None;
    // Tokens chosen but not yet handed out, with the logits that chose them.
    let mut pending: std::collections::VecDeque<(u32, Vec<f32>)> = Default::default();
    pending.push_back((sampler.sample(&logits), std::mem::take(&mut logits)));
    out.stats.ttft = s.started.elapsed();
    let mode = spec.mode();
    let generated = &mut out.generated_ids;
    let finish = &mut out.finish;
    let mut decode = || -> Result<(), EngineError> {
        'gen: while generated.len() < s.max_new_tokens {
            if pending.is_empty() {
                if (s.should_stop)() {
                    *finish = FinishReason::Cancelled;
                    break;
                }
                if generated.len() >= 2 && steady.is_none() {
                    steady = Some((Instant::now(), generated.len()));
                }
                // The last generated token is not in the state yet: the step runs it first.
                cached.push(generated[generated.len() - 1]);
                let pos = cached.len() - 1;
                spec.set_remaining(s.max_new_tokens - generated.len());
                let mut step_out = None;
                let r = measure(
                    "decode",
                    &mut || {
                        let o = spec.step(model, state.as_mut(), cached, &mut sampler)?;
                        let routes = o.routes.clone();
                        let n = o.tokens.len();
                        step_out = Some(o);
                        Ok((n, routes))
                    },
                    &mut steps,
                );
                let routes = r.map_err(|e| forward_failed(state, cached, e))?;
                let o = step_out.ok_or_else(|| EngineError::Invalid("decode step produced nothing".into()))?;
                if o.drafted > 0 {
                    if let Some(last) = steps.last_mut() {
                        last.kind = "verify";
                    }
                }
                cached.extend_from_slice(&o.tokens[..o.tokens.len().saturating_sub(1)]);
                traces.record(model, pos, &routes)?;
                pending.extend(o.tokens.into_iter().zip(o.logits));
            }
            while let Some((id, l)) = pending.pop_front() {
                if let Some(e) = sampler.take_grammar_error() {
                    return Err(EngineError::Invalid(format!("constrained decoding failed: {e}")));
                }
                generated.push(id);
                let is_eos = !s.ignore_eos && s.eos_token_ids.contains(&id);
                if let Some(reason) = on_token(id, l, is_eos)? {
                    *finish = reason;
                    break 'gen;
                }
                if sampler.grammar_finished_after() == Some(generated.len()) {
                    *finish = FinishReason::Eos;
                    break 'gen;
                }
                if generated.len() >= s.max_new_tokens {
                    break 'gen;
                }
            }
        }
        Ok(())
    };
    if let Err(e) = decode() {
        // A failed decode leaves the speculator fresh: its adaptive state may be half-updated.
        *spec = Speculator::new(mode);
        return Err(e);
    }
    // A verification pass can choose more tokens than were handed out (max_new_tokens, EOS or
    // a stop came first): its step counts only those handed out.
    if let Some(last) = steps.last_mut().filter(|s| s.kind != "prefill") {
        last.tokens = last.tokens.saturating_sub(pending.len());
    }
    out.stats.steps = steps;
    out.stats.speculation = spec.stats;
    out.stats.speculate = spec.mode().name();
    Ok(end(out, steady))
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
    let mut state = model.new_state();
    let mut traces = Traces::open(model, opts)?;
    let settings = LoopSettings {
        prompt,
        max_new_tokens: opts.max_new_tokens,
        eos_token_ids: &opts.eos_token_ids,
        ignore_eos: opts.ignore_eos,
        prefill_chunk: opts.prefill_chunk,
        sampling: &opts.sampling,
        constraint: None,
        should_stop: &|| false,
        started: Instant::now(),
    };
    let mut step_logits = Vec::new();
    let mut hook = |id: u32, logits: Vec<f32>, is_eos: bool| {
        if opts.record_logits {
            step_logits.push(logits);
        }
        let keep_going = on_token(id);
        Ok(if is_eos {
            Some(FinishReason::Eos)
        } else if !keep_going {
            Some(FinishReason::Cancelled)
        } else {
            None
        })
    };
    let mut spec = Speculator::new(opts.speculate);
    let r = decode_loop(
        model,
        &mut state,
        &mut Vec::with_capacity(prompt.len() + opts.max_new_tokens),
        &mut spec,
        &mut traces,
        &settings,
        &mut hook,
    )?;
    let mut stats = r.stats;
    stats.finish_reason = match r.finish {
        FinishReason::Eos => "eos",
        FinishReason::Length => "length",
        // The caller's callback stopped it (`run`: a stop string or an output error).
        FinishReason::Cancelled | FinishReason::StopString(_) => "stop",
    };
    Ok(GenerateOutput {
        generated_ids: r.generated_ids,
        step_logits,
        stats,
    })
}

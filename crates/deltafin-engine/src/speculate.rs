//! Exact speculative decoding with drafters that need no extra model.
//!
//! A decode step either runs one token (plain) or drafts `k` tokens and verifies them in one
//! multi-position pass ([`CausalLm::forward_batch`] over `[last, d_1 .. d_k]`), which reads the
//! union of the experts the positions select once. The longest prefix of the draft that the
//! chooser accepts is kept, plus one token chosen from the logits after it (the correction, or
//! a bonus token when all were accepted); the decode state is rolled back to the accepted length
//! ([`CausalLm::rollback`]). Greedy: a draft token is accepted iff it is the argmax, so the
//! output is exactly plain greedy decoding's (the batched pass gives the one-token logits). With
//! sampling, [`Sampler::verify_draft`] applies the speculative-sampling rejection rule for a
//! deterministic drafter (Leviathan et al. 2023, arXiv:2211.17192, §2.3; Chen et al. 2023,
//! arXiv:2302.01318), so the output distribution is unchanged. [SPEC_VERIFY]
//!
//! Drafters:
//! - `lookup` (prompt lookup decoding): the tokens that followed the most recent earlier
//!   occurrence of the context's last `n` tokens (`n` = 3, 2, 1, longest match first).
//! - `auto`: lookup when the context has a match and its acceptance so far is at least
//!   self-drafting's, else self-drafting.
//! - `self`: the target model itself with every MoE layer routed among the experts already in
//!   the expert cache, plus the shared experts ([`CausalLm::forward_draft`]): no expert reads.
//!
//! Draft length is chosen per step by expected benefit ([`Adaptive`]): with `a` the drafter's
//! per-token acceptance so far, `k` drafted tokens yield `E(k) = 1 + a + … + a^k` tokens per pass
//! and cost `t_1 + k·(δ + t_d)`, where `t_1` is a plain step's time, `δ` the measured extra time
//! per verified position (mostly the extra expert bytes the position adds to the union: on an
//! I/O-bound model time is bytes), and `t_d` the drafter's time per token. The `k` (0 = plain)
//! with the highest `E(k) / cost(k)` is taken. After 32 steps that would be plain, one tries
//! `k = 1` instead (exploration), and every 32nd pass in a row is replaced by a plain step, so
//! the estimates follow the text and the cache (the first plain step, which pays one-off costs,
//! is not timed). A drafter is first tried by such an exploration, not on the prior (drafts
//! are offered at every step by self-drafting and at every unigram match by lookup, evidence of
//! nothing). An exploratory draft that is rejected doubles the
//! interval to the next one
//! (32, 64, … 1024 plain steps); any accepted token resets it to 32. So when drafts never pay,
//! exploration adds at most one extra verified position per 32 plain steps at first and a
//! vanishing share later: with a position as dear as a plain step (random routing, I/O-bound),
//! 1/32 ≈ 3 % over the first 32 steps and ⌊log2(n / 32 + 1)⌋ extra steps in an n-step
//! generation (4 in 512: 0.8 %), plus the drafter's own time for self-drafting.

use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::model::{CausalLm, DecodeState, LayerRoutes};
use crate::sampler::Sampler;
use crate::EngineError;

/// Most tokens drafted per step.
pub const MAX_DRAFT: usize = 8;
// A verification pass (at most `MAX_DRAFT + 1` tokens) must stay below the chunk length from
// which a fast batch form may switch MLA to its decompressed form, so that verification stays
// bit-identical to token-at-a-time decoding and speculation never changes greedy output.
const _: () = assert!(crate::blocks::mla::DECOMPRESSED_MIN_TOKENS > MAX_DRAFT + 1);

/// `--speculate`: which drafter proposes tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum SpeculateMode {
    /// Plain decoding, one token per pass.
    Off,
    /// Prompt lookup when the context has a match, self-drafting otherwise.
    Auto,
    /// Prompt lookup only.
    Lookup,
    /// Self-drafting only.
    SelfDraft,
}

crate::cli_names!(SpeculateMode, "speculation mode", {
    Off => "off",
    Auto => "auto",
    Lookup => "lookup",
    SelfDraft => "self",
});

/// Which drafter proposed a draft.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Drafter {
    Lookup = 0,
    SelfDraft = 1,
    /// Test and measurement only: a fixed continuation given by the caller.
    Oracle = 2,
}

/// Counters of one generation's speculation.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize, PartialEq)]
#[serde(default)]
pub struct SpecStats {
    /// Plain (one-token) decode steps.
    pub plain_steps: u64,
    /// Verification passes (multi-position).
    pub passes: u64,
    /// Tokens produced by verification passes (accepted drafts plus one each).
    pub pass_tokens: u64,
    /// Drafted / accepted tokens per drafter: `[lookup, self, oracle]`.
    pub drafted: [u64; 3],
    pub accepted: [u64; 3],
    /// Routed-expert bytes read on demand by verification passes.
    pub verify_bytes: u64,
    /// Seconds spent drafting and verifying.
    pub draft_s: f64,
    pub verify_s: f64,
}

impl SpecStats {
    /// Tokens per verification pass (0 without passes).
    pub fn tokens_per_pass(&self) -> f64 {
        ratio(self.pass_tokens as f64, self.passes as f64)
    }

    /// Share of `d`'s drafted tokens that were accepted.
    pub fn acceptance(&self, d: Drafter) -> f64 {
        ratio(self.accepted[d as usize] as f64, self.drafted[d as usize] as f64)
    }

    /// Expert bytes read by verification passes per token they produced.
    pub fn bytes_per_pass_token(&self) -> f64 {
        ratio(self.verify_bytes as f64, self.pass_tokens as f64)
    }
}

fn ratio(a: f64, b: f64) -> f64 {
    if b == 0.0 {
        0.0
    } else {
        a / b
    }
}

/// The draft-length controller (see the module docs).
#[derive(Debug, Clone)]
pub struct Adaptive {
    /// EMA of a plain step's seconds (None until one ran).
    t1: Option<f64>,
    /// EMA of the extra seconds per verified position beyond the first.
    delta: Option<f64>,
    /// EMA of drafting seconds per drafted token, per drafter.
    t_draft: [Option<f64>; 3],
    /// Decayed (accepted, trials) per drafter, for the per-token acceptance estimate.
    acc: [(f64, f64); 3],
    /// Plain steps since the last verification pass.
    since_pass: usize,
    /// Verification passes since the last plain step.
    since_plain: usize,
    /// Plain steps seen (the first is not timed: it pays one-off costs).
    plain_seen: usize,
    /// Plain steps between exploratory drafts now: [`EXPLORE_EVERY`], doubled after each
    /// rejected exploration up to [`EXPLORE_MAX`].
    explore_every: usize,
    /// The pass in flight is exploratory (chosen by the interval, not by expected benefit).
    exploring: bool,
}

impl Default for Adaptive {
    fn default() -> Self {
        Adaptive {
            t1: None,
            delta: None,
            t_draft: [None; 3],
            acc: [(0.0, 0.0); 3],
            since_pass: 0,
            since_plain: 0,
            plain_seen: 0,
            explore_every: EXPLORE_EVERY,
            exploring: false,
        }
    }
}

const EMA: f64 = 0.3;
const DECAY: f64 = 0.9;
/// Steps that would be plain before the first exploratory one-token draft.
const EXPLORE_EVERY: usize = 32;
/// The longest interval between exploratory drafts (after repeated rejections).
const EXPLORE_MAX: usize = 1024;

fn ema(old: Option<f64>, new: f64) -> f64 {
    old.map_or(new, |o| o + EMA * (new - o))
}

impl Adaptive {
    /// Per-token acceptance estimate of `d` (a Beta(1, 1) prior on the decayed counts).
    pub fn acceptance(&self, d: Drafter) -> f64 {
        let (a, n) = self.acc[d as usize];
        (a + 1.0) / (n + 2.0)
    }

    /// Draft length for drafter `d` with at most `avail` tokens on offer: the `k` in `0..=avail`
    /// maximising expected tokens per second; 0 = a plain step.
    pub fn choose(&mut self, d: Drafter, avail: usize) -> usize {
        let Some(t1) = self.t1 else { return 0 };
        if avail == 0 {
            return 0;
        }
        if self.since_plain >= EXPLORE_EVERY {
            // Re-time a plain step now and then, so the comparison follows the cache's state.
            return 0;
        }
        // Before any pass, assume a verified position costs a quarter of a plain step.
        let delta = self.delta.unwrap_or(0.25 * t1).max(0.0);
        let a = self.acceptance(d);
        let per = delta + self.t_draft[d as usize].unwrap_or(0.0);
        let (mut best, mut best_rate) = (0, 1.0 / t1);
        let (mut e, mut ai) = (1.0, 1.0);
        for k in 1..=avail.min(MAX_DRAFT) {
            ai *= a;
            e += ai;
            let rate = e / (t1 + k as f64 * per);
            if rate > best_rate {
                (best, best_rate) = (k, rate);
            }
        }
        // No evidence yet that this drafter's tokens are accepted (self-drafting offers at every
        // step, lookup at every unigram match): its first try is an exploration after the
        // interval, not a bet on the prior.
        if self.acc[d as usize].1 == 0.0 {
            best = 0;
        }
        if best == 0 {
            self.since_pass += 1;
            if self.since_pass >= self.explore_every {
                self.since_pass = 0;
                self.exploring = true;
                return 1;
            }
        } else {
            self.since_pass = 0;
        }
        best
    }

    /// Records a plain step's time.
    pub fn plain(&mut self, seconds: f64) {
        self.plain_seen += 1;
        self.since_plain = 0;
        if self.plain_seen > 1 {
            self.t1 = Some(ema(self.t1, seconds));
        }
    }

    /// Records a pass of `k` drafted tokens of which `j` were accepted, its verification time
    /// and the drafting time.
    pub fn pass(&mut self, d: Drafter, k: usize, j: usize, verify_s: f64, draft_s: f64) {
        let i = d as usize;
        let (a, n) = self.acc[i];
        let trials = j + usize::from(j < k);
        self.acc[i] = (DECAY * a + j as f64, DECAY * n + trials as f64);
        self.since_plain += 1;
        if j > 0 {
            self.explore_every = EXPLORE_EVERY;
        } else if std::mem::take(&mut self.exploring) {
            self.explore_every = (2 * self.explore_every).min(EXPLORE_MAX);
        }
        if k > 0 {
            self.t_draft[i] = Some(ema(self.t_draft[i], draft_s / k as f64));
            if let Some(t1) = self.t1 {
                self.delta = Some(ema(self.delta, ((verify_s - t1) / k as f64).max(0.0)));
            }
        }
    }
}

/// Prompt lookup: the tokens after the most recent earlier occurrence of the last `n` tokens of
/// `context` (n = 3, 2, 1), at most `max`. Empty when nothing matches.
pub fn lookup_draft(context: &[u32], max: usize) -> Vec<u32> {
    let len = context.len();
    for n in (1..=3usize).rev() {
        if len <= n {
            continue;
        }
        let tail = &context[len - n..];
        // Most recent earlier occurrence: start positions from len - n - 1 down to 0.
        for s in (0..len - n).rev() {
            if &context[s..s + n] == tail {
                let from = s + n;
                let to = (from + max).min(len);
                if from < to {
                    return context[from..to].to_vec();
                }
            }
        }
    }
    Vec::new()
}

/// What one decode step produced.
#[derive(Debug, Clone, Default)]
pub struct StepOutput {
    /// The chosen tokens, in order (one for a plain step; accepted drafts plus one for a pass).
    pub tokens: Vec<u32>,
    /// `logits[i]` produced `tokens[i]`.
    pub logits: Vec<Vec<f32>>,
    /// Routing of every position the step added to the state (`last` and the accepted drafts).
    pub routes: Vec<LayerRoutes>,
    /// Drafted tokens (0 for a plain step).
    pub drafted: usize,
}

/// Runs the decode steps of one generation, speculating as `mode` says.
#[derive(Debug, Clone)]
pub struct Speculator {
    mode: SpeculateMode,
    adaptive: Adaptive,
    /// Fixed draft length (research / tests); None = adaptive.
    fixed_k: Option<usize>,
    /// Tokens the generation still needs ([`Self::set_remaining`]); None = unbounded.
    remaining: Option<usize>,
    pub stats: SpecStats,
}

impl Speculator {
    /// A speculator for `mode`, with the adaptive draft length.
    pub fn new(mode: SpeculateMode) -> Self {
        Speculator {
            mode,
            adaptive: Adaptive::default(),
            fixed_k: None,
            remaining: None,
            stats: SpecStats::default(),
        }
    }

    /// Tells the speculator that the generation needs at most `n` more tokens: later steps
    /// draft at most `n - 1` (a pass yields its accepted drafts plus one), so no pass computes
    /// or counts tokens past the end.
    pub fn set_remaining(&mut self, n: usize) {
        self.remaining = Some(n);
    }

    /// Drafts exactly `k` tokens whenever the drafter offers them (no adaptation); for tests and
    /// measurements.
    pub fn with_fixed_draft(mut self, k: usize) -> Self {
        self.fixed_k = Some(k.min(MAX_DRAFT));
        self
    }

    /// The mode.
    pub fn mode(&self) -> SpeculateMode {
        self.mode
    }

    /// One decode step. `context` is every token so far (prompt and generated, non-empty);
    /// `state` holds all but the last. Returns the chosen tokens; afterwards `state` holds
    /// `context` plus every returned token but the last.
    ///
    /// Errors: forward-pass failures (the state may then hold extra positions; the caller
    /// resets it).
    pub fn step(
        &mut self,
        model: &dyn CausalLm,
        state: &mut dyn DecodeState,
        context: &[u32],
        chooser: &mut Sampler,
    ) -> Result<StepOutput, EngineError> {
        let (drafter, avail) = self.offer(model, context);
        // A pass runs 1 + k positions from position len - 1: stay within the context length.
        let mut avail = avail.min(model.context_length().saturating_sub(context.len()));
        if let Some(n) = self.remaining {
            avail = avail.min(n.saturating_sub(1));
        }
        let k = match (self.fixed_k, drafter) {
            (_, None) => 0,
            (Some(k), Some(_)) => k.min(avail),
            (None, Some(d)) => self.adaptive.choose(d, avail),
        };
        match drafter {
            Some(d) if k > 0 => {
                let t = Instant::now();
                let draft = self.draft(model, state, context, d, k)?;
                let draft_s = t.elapsed().as_secs_f64();
                self.verify(model, state, context, d, &draft, draft_s, chooser)
            }
            _ => self.plain(model, state, context, chooser),
        }
    }

    /// One step verifying the caller's `draft` (the oracle drafter of the measurements).
    ///
    /// Errors: as [`Self::step`].
    pub fn step_with_draft(
        &mut self,
        model: &dyn CausalLm,
        state: &mut dyn DecodeState,
        context: &[u32],
        draft: &[u32],
        chooser: &mut Sampler,
    ) -> Result<StepOutput, EngineError> {
        if draft.is_empty() {
            return self.plain(model, state, context, chooser);
        }
        self.verify(model, state, context, Drafter::Oracle, draft, 0.0, chooser)
    }

    /// Which drafter would draft now, and how many tokens it can offer.
    fn offer(&self, model: &dyn CausalLm, context: &[u32]) -> (Option<Drafter>, usize) {
        let lookup = || {
            let n = lookup_draft(context, MAX_DRAFT).len();
            (n > 0).then_some((Some(Drafter::Lookup), n))
        };
        let self_ok = model.supports_draft();
        match self.mode {
            SpeculateMode::Off => (None, 0),
            SpeculateMode::Lookup => lookup().unwrap_or((None, 0)),
            SpeculateMode::SelfDraft if self_ok => (Some(Drafter::SelfDraft), MAX_DRAFT),
            SpeculateMode::SelfDraft => (None, 0),
            SpeculateMode::Auto => {
                let own = if self_ok {
                    (Some(Drafter::SelfDraft), MAX_DRAFT)
                } else {
                    (None, 0)
                };
                match lookup() {
                    // A match is free to draft; take it unless self-drafting has been accepted
                    // more often.
                    Some(l)
                        if !self_ok
                            || self.adaptive.acceptance(Drafter::Lookup)
                                >= self.adaptive.acceptance(Drafter::SelfDraft) =>
                    {
                        l
                    }
                    _ => own,
                }
            }
        }
    }

    fn draft(
        &self,
        model: &dyn CausalLm,
        state: &mut dyn DecodeState,
        context: &[u32],
        d: Drafter,
        k: usize,
    ) -> Result<Vec<u32>, EngineError> {
        match d {
            Drafter::Lookup | Drafter::Oracle => {
                let mut v = lookup_draft(context, k);
                v.truncate(k);
                Ok(v)
            }
            Drafter::SelfDraft => {
                // The k one-token forwards are rolled back together: give them a whole window.
                state.commit();
                let base = state.len();
                let mut last = *context
                    .last()
                    .ok_or_else(|| EngineError::Invalid("empty context".into()))?;
                let mut out = Vec::with_capacity(k);
                for _ in 0..k {
                    let Some(logits) = model.forward_draft(state, last)? else {
                        break;
                    };
                    last = deltafin_kernels::argmax(&logits) as u32;
                    out.push(last);
                }
                if !model.rollback(state, base) {
                    return Err(EngineError::Invalid(
                        "self-drafting: the decode state cannot roll back".into(),
                    ));
                }
                Ok(out)
            }
        }
    }

    fn plain(
        &mut self,
        model: &dyn CausalLm,
        state: &mut dyn DecodeState,
        context: &[u32],
        chooser: &mut Sampler,
    ) -> Result<StepOutput, EngineError> {
        let last = *context
            .last()
            .ok_or_else(|| EngineError::Invalid("empty context".into()))?;
        let t = Instant::now();
        let (logits, routes) = model.forward(state, last)?;
        self.adaptive.plain(t.elapsed().as_secs_f64());
        self.stats.plain_steps += 1;
        let id = chooser.sample(&logits);
        Ok(StepOutput {
            tokens: vec![id],
            logits: vec![logits],
            routes: vec![routes],
            drafted: 0,
        })
    }

    #[allow(clippy::too_many_arguments)]
    fn verify(
        &mut self,
        model: &dyn CausalLm,
        state: &mut dyn DecodeState,
        context: &[u32],
        d: Drafter,
        draft: &[u32],
        draft_s: f64,
        chooser: &mut Sampler,
    ) -> Result<StepOutput, EngineError> {
        if draft.is_empty() {
            return self.plain(model, state, context, chooser);
        }
        let last = *context
            .last()
            .ok_or_else(|| EngineError::Invalid("empty context".into()))?;
        let base = state.len();
        let mut run = Vec::with_capacity(draft.len() + 1);
        run.push(last);
        run.extend_from_slice(draft);
        let (c0, t) = (model.store().counters(), Instant::now());
        let pass = model.forward_batch(state, &run, true)?;
        let verify_s = t.elapsed().as_secs_f64();
        let bytes = model.store().counters().since(&c0).bytes_read_demand;
        let mut out = StepOutput {
            drafted: draft.len(),
            ..Default::default()
        };
        let mut logits = pass.logits.into_iter();
        let mut accepted = 0;
        for &dt in draft {
            let l = logits
                .next()
                .ok_or_else(|| EngineError::Invalid("verification returned too few logits".into()))?;
            match chooser.verify_draft(&l, dt) {
                Ok(()) => {
                    out.tokens.push(dt);
                    out.logits.push(l);
                    accepted += 1;
                }
                Err(other) => {
                    out.tokens.push(other);
                    out.logits.push(l);
                    break;
                }
            }
        }
        if accepted == draft.len() {
            // Every draft token accepted: the last position's logits give a bonus token.
            let l = logits
                .next()
                .ok_or_else(|| EngineError::Invalid("verification returned too few logits".into()))?;
            out.tokens.push(chooser.sample(&l));
            out.logits.push(l);
        }
        // Keep `last` and the accepted drafts.
        if !model.rollback(state, base + 1 + accepted) {
            return Err(EngineError::Invalid(
                "speculative decoding: the decode state cannot roll back".into(),
            ));
        }
        out.routes = pass.routes.into_iter().take(1 + accepted).collect();
        let s = &mut self.stats;
        s.passes += 1;
        s.pass_tokens += out.tokens.len() as u64;
        s.drafted[d as usize] += draft.len() as u64;
        s.accepted[d as usize] += accepted as u64;
        s.verify_bytes += bytes;
        s.draft_s += draft_s;
        s.verify_s += verify_s;
        self.adaptive.pass(d, draft.len(), accepted, verify_s, draft_s);
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lookup_takes_the_most_recent_longest_match() {
        // ... 1 2 3 [4 5] ... 1 2 3 [9 8] ... 2 3 → longest match "2 3" most recent: 9 8 ...
        let ctx = [1, 2, 3, 4, 5, 1, 2, 3, 9, 8, 7, 2, 3];
        assert_eq!(lookup_draft(&ctx, 2), vec![9, 8]);
        assert_eq!(lookup_draft(&ctx, 8), vec![9, 8, 7, 2, 3]);
        // No earlier occurrence of the last token: nothing.
        assert!(lookup_draft(&[1, 2, 3], 4).is_empty());
        // A unigram match when no longer one exists.
        assert_eq!(lookup_draft(&[5, 6, 7, 8, 6], 3), vec![7, 8, 6]);
    }

    #[test]
    fn adaptive_length_follows_acceptance_and_cost() {
        let mut a = Adaptive::default();
        assert_eq!(a.choose(Drafter::Lookup, 4), 0, "no plain step measured yet");
        a.plain(50.0); // the first plain step is not timed
        assert_eq!(a.choose(Drafter::Lookup, 4), 0, "no plain step timed yet");
        a.plain(1.0);
        // Cheap positions (δ = 0.1 s) and high acceptance: draft long.
        for _ in 0..20 {
            a.pass(Drafter::Lookup, 4, 4, 1.4, 0.0);
        }
        assert!(a.choose(Drafter::Lookup, 8) >= 4);
        // Expensive positions (each as dear as a plain step) and no acceptance: plain, with one
        // exploratory draft every EXPLORE_EVERY steps.
        let mut b = Adaptive::default();
        b.plain(1.0);
        b.plain(1.0);
        for _ in 0..20 {
            b.pass(Drafter::SelfDraft, 2, 0, 3.0, 0.1);
        }
        let ks: Vec<usize> = (0..EXPLORE_EVERY).map(|_| b.choose(Drafter::SelfDraft, 8)).collect();
        assert_eq!(ks.iter().filter(|&&k| k > 0).count(), 1);
        assert_eq!(
            ks[EXPLORE_EVERY - 1],
            1,
            "the exploration comes after {EXPLORE_EVERY} plain steps"
        );
    }

    /// Counts the steps that explore within `steps` choices, feeding each exploration's outcome
    /// back as a pass with `accepted` tokens.
    fn explorations(a: &mut Adaptive, steps: usize, accepted: usize) -> Vec<usize> {
        let mut at = Vec::new();
        for s in 0..steps {
            if a.choose(Drafter::Lookup, 8) > 0 {
                a.pass(Drafter::Lookup, 1, accepted, 2.0, 0.0);
                at.push(s);
            } else {
                a.plain(1.0);
            }
        }
        at
    }

    #[test]
    fn a_drafter_is_first_tried_by_an_exploration() {
        let mut a = Adaptive::default();
        a.plain(1.0);
        a.plain(1.0);
        let ks: Vec<usize> = (0..EXPLORE_EVERY).map(|_| a.choose(Drafter::SelfDraft, 8)).collect();
        assert_eq!(ks.iter().filter(|&&k| k > 0).count(), 1, "{ks:?}");
        assert_eq!(ks[EXPLORE_EVERY - 1], 1);
        // Likewise lookup; once a drafter has been accepted, it drafts without waiting.
        let mut b = Adaptive::default();
        b.plain(1.0);
        b.plain(1.0);
        assert_eq!(b.choose(Drafter::Lookup, 8), 0);
        for _ in 0..4 {
            b.pass(Drafter::Lookup, 4, 4, 1.1, 0.0);
        }
        assert!(b.choose(Drafter::Lookup, 8) > 0);
    }

    #[test]
    fn rejected_explorations_back_off_and_acceptance_resets_them() {
        // Each position as dear as a plain step, drafts never accepted: explorations after
        // 32, 64, 128, … plain steps: 5 in 1000 steps.
        let mut a = Adaptive::default();
        a.plain(1.0);
        a.plain(1.0);
        for _ in 0..20 {
            a.pass(Drafter::Lookup, 1, 0, 2.0, 0.0);
        }
        a.explore_every = EXPLORE_EVERY;
        let at = explorations(&mut a, 1000, 0);
        assert_eq!(at, vec![31, 95, 223, 479, 991]);
        // The interval stops growing at EXPLORE_MAX.
        let later = explorations(&mut a, 6000, 0);
        let gaps: Vec<usize> = later.windows(2).map(|w| w[1] - w[0]).collect();
        assert!(gaps.iter().all(|&g| g <= EXPLORE_MAX), "{gaps:?}");
        assert_eq!(gaps.last(), Some(&EXPLORE_MAX));
        // An accepted exploration resets the interval to EXPLORE_EVERY.
        a.explore_every = EXPLORE_MAX;
        a.exploring = true;
        a.pass(Drafter::Lookup, 1, 1, 2.0, 0.0);
        assert_eq!(a.explore_every, EXPLORE_EVERY);
    }
}

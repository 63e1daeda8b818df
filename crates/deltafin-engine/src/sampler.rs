//! Choosing the next token from logits: greedy (exact argmax) or seeded sampling with
//! temperature, min-p, top-k and top-p (nucleus), after optional logit adjustments (logit bias,
//! repetition, frequency and presence penalties), plus log-probabilities for the API's
//! `logprobs`.
//!
//! Order of operations, as vLLM's sampler (`vllm/v1/sample/sampler.py`) applies them:
//! 1. logit adjustments, which also change greedy choices: `logit_bias` added to its tokens'
//!    logits; the repetition penalty (transformers' `RepetitionPenaltyLogitsProcessor`, vLLM's
//!    `repetition_penalty`): the logit of every token seen in the prompt or the output so far is
//!    divided by the penalty when positive, multiplied by it otherwise; then OpenAI's frequency
//!    and presence penalties over the tokens generated so far:
//!    `logit[j] -= count[j] × frequency_penalty + (count[j] > 0) × presence_penalty`;
//! 2. greedy: the argmax of the adjusted logits;
//! 3. otherwise logits ÷ temperature → softmax → min-p (drop tokens whose probability is below
//!    `min_p` × the most likely token's) → keep the `top_k` most likely → keep the smallest set
//!    of most likely tokens whose probability sums to at least `top_p` → draw one with the
//!    seeded generator.
//!
//! With a grammar ([`crate::constraint`]), every token it does not allow next gets logit −∞
//! after the adjustments and before step 2, and the chosen token is committed to it; greedy,
//! sampled and speculative decoding (whose draft is verified against the masked distribution)
//! all respect it.
//!
//! With no adjustment and no grammar the logits are used as given (no copy, no extra pass), so
//! greedy output is the plain argmax.
//! Reported log-probabilities are those of the model's own distribution (`log_softmax` of the
//! raw logits, before adjustments, temperature or truncation), as OpenAI and vLLM report them.

use std::collections::{HashMap, HashSet};

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use crate::constraint::GrammarState;

/// How to choose tokens. `temperature == 0` means greedy (exact argmax, the default). The
/// default value of every other field turns it off.
#[derive(Debug, Clone, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Drop tokens whose probability is below `min_p` × the most likely token's, in [0, 1];
    /// 0 = off (vLLM's and transformers' `min_p`).
    pub min_p: f32,
    /// OpenAI `presence_penalty`, in [-2, 2]: subtracted once from the logit of every token
    /// generated so far; 0 = off.
    pub presence_penalty: f32,
    /// OpenAI `frequency_penalty`, in [-2, 2]: subtracted from a token's logit once per time it
    /// was generated so far; 0 = off.
    pub frequency_penalty: f32,
    /// Repetition penalty (> 0) over the prompt and output tokens, as transformers and vLLM:
    /// positive logits divided by it, others multiplied; 1 = off.
    pub repetition_penalty: f32,
    /// `(token id, bias)` pairs added to those tokens' logits before anything else (OpenAI
    /// `logit_bias`, bias in [-100, 100]); ids past the logits are ignored (callers check them
    /// against the vocabulary). Empty = off.
    pub logit_bias: Vec<(u32, f32)>,
    /// Seed of the generator; `None` draws one from the operating system.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            repetition_penalty: 1.0,
            logit_bias: Vec::new(),
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Whether these parameters choose the argmax (of the adjusted logits).
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }

    /// Whether any logit adjustment (bias or penalty) is set.
    pub fn adjusts_logits(&self) -> bool {
        !self.logit_bias.is_empty() || self.penalises_output() || self.repetition_penalty != 1.0
    }

    /// Checks every field's range (as documented on the fields) and that `logit_bias` names
    /// tokens below `vocab_size`.
    ///
    /// Errors: a one-line message naming the field (`logit_bias`, `min_p`, …) and the value.
    pub fn check(&self, vocab_size: usize) -> Result<(), String> {
        let t = self.temperature;
        if !(t.is_finite() && t >= 0.0) {
            return Err(format!("temperature must be 0 or more, got {t}"));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p must be between 0 and 1, got {}", self.min_p));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(format!("{name} must be between -2 and 2, got {v}"));
            }
        }
        let r = self.repetition_penalty;
        if !(r.is_finite() && r > 0.0) {
            return Err(format!("repetition_penalty must be greater than 0, got {r}"));
        }
        for &(id, bias) in &self.logit_bias {
            if id as usize >= vocab_size {
                return Err(format!(
                    "logit_bias: token id {id} is out of range: the vocabulary has {vocab_size} tokens"
                ));
            }
            if !(-100.0..=100.0).contains(&bias) {
                return Err(format!(
                    "logit_bias: the bias of token {id} must be between -100 and 100, got {bias}"
                ));
            }
        }
        Ok(())
    }

    fn penalises_output(&self) -> bool {
        self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// What the penalties need to know about the tokens so far.
#[derive(Debug, Clone, Default)]
struct Adjuster {
    /// Distinct prompt and output tokens (kept only with a repetition penalty).
    seen: HashSet<u32>,
    /// Output tokens and how often each was chosen (kept only with presence or frequency
    /// penalties).
    counts: HashMap<u32, u32>,
}

/// A generation's grammar and how it went.
#[derive(Debug)]
struct Constrained {
    state: Box<dyn GrammarState>,
    /// Tokens committed so far.
    committed: usize,
    /// How many tokens had been committed when the grammar ended.
    finished_after: Option<usize>,
    /// The first failure of the grammar engine (the step's token was then chosen unmasked).
    error: Option<String>,
}

/// A token chooser holding its random generator (one per generation, so the same seed and
/// prompt give the same output), with penalties the tokens chosen so far, and optionally a
/// grammar ([`Sampler::constrain`]).
#[derive(Debug)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Scratch: candidate (id, value) pairs, reused across steps.
    scratch: Vec<(u32, f32)>,
    /// Present only when a logit adjustment is set.
    adjuster: Option<Box<Adjuster>>,
    /// Present only with a grammar.
    constrained: Option<Box<Constrained>>,
    /// Scratch: the adjusted and masked logits of the current step (used only with an
    /// adjustment or a grammar).
    work: Vec<f32>,
}

impl Sampler {
    /// A sampler for `params`, as if the prompt were empty (see [`Sampler::with_prompt`]).
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        let adjuster = params.adjusts_logits().then(Box::default);
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
            adjuster,
            constrained: None,
            work: Vec::new(),
        }
    }

    /// Limits every following choice to the tokens `state` allows (see [`crate::constraint`]).
    pub fn constrain(&mut self, state: Box<dyn GrammarState>) {
        self.constrained = Some(Box::new(Constrained {
            state,
            committed: 0,
            finished_after: None,
            error: None,
        }));
    }

    /// With a grammar: how many chosen tokens complete it, once they have been chosen (the
    /// generation ends after that many tokens).
    pub fn grammar_finished_after(&self) -> Option<usize> {
        self.constrained.as_ref().and_then(|c| c.finished_after)
    }

    /// With a grammar: its engine's first failure, taken (the generation must fail: the tokens
    /// from that step on were not checked).
    pub fn take_grammar_error(&mut self) -> Option<String> {
        self.constrained.as_mut().and_then(|c| c.error.take())
    }

    /// A sampler for `params` continuing `prompt` (whose tokens the repetition penalty counts).
    pub fn with_prompt(params: SamplingParams, prompt: &[u32]) -> Self {
        let mut s = Sampler::new(params);
        if s.params.repetition_penalty != 1.0 {
            if let Some(a) = s.adjuster.as_mut() {
                a.seen.extend(prompt.iter().copied());
            }
        }
        s
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits: [vocab]` (non-empty).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.adjuster.is_none() && self.constrained.is_none() {
            return self.choose(logits);
        }
        let mut work = std::mem::take(&mut self.work);
        self.prepare(&mut work, logits);
        let id = self.choose(&work);
        self.work = work;
        self.chosen(id);
        id
    }

    /// Speculative decoding: accepts the drafted token `draft` (proposed by a deterministic
    /// drafter) with probability `p(draft)` under this sampler's distribution for `logits`
    /// (`Ok(())`), or rejects it and returns a token drawn from `p` with `draft` removed and
    /// renormalised (`Err(token)`). For a drafter whose proposal is a point mass this is the
    /// speculative-sampling rule `min(1, p/q)` with residual `norm(max(0, p − q))`, so the
    /// token's distribution is exactly `p` (Leviathan et al. 2023, arXiv:2211.17192).
    /// Greedy: accepted iff `draft` is the argmax, otherwise the argmax. [SPEC_VERIFY]
    /// With penalties, the accepted draft or the replacement counts as chosen.
    pub fn verify_draft(&mut self, logits: &[f32], draft: u32) -> Result<(), u32> {
        if self.adjuster.is_none() && self.constrained.is_none() {
            return self.verify(logits, draft);
        }
        let mut work = std::mem::take(&mut self.work);
        self.prepare(&mut work, logits);
        let r = self.verify(&work, draft);
        self.work = work;
        self.chosen(match r {
            Ok(()) => draft,
            Err(t) => t,
        });
        r
    }

    /// Writes `logits` adjusted (see the module documentation for the order) and masked by the
    /// grammar into `l`. A grammar failure is recorded and leaves the logits unmasked.
    fn prepare(&mut self, l: &mut Vec<f32>, logits: &[f32]) {
        l.clear();
        l.extend_from_slice(logits);
        if let Some(a) = self.adjuster.as_deref() {
            self.adjust(a, l);
        }
        if let Some(c) = self.constrained.as_deref_mut() {
            if c.error.is_none() {
                if let Err(e) = c.state.mask(l) {
                    c.error = Some(e);
                    l.clear();
                    l.extend_from_slice(logits);
                }
            }
        }
    }

    /// Applies the logit adjustments to `l` in place.
    fn adjust(&self, a: &Adjuster, l: &mut [f32]) {
        let p = &self.params;
        for &(id, bias) in &p.logit_bias {
            if let Some(x) = l.get_mut(id as usize) {
                *x += bias;
            }
        }
        let r = p.repetition_penalty;
        if r != 1.0 {
            for &id in &a.seen {
                if let Some(x) = l.get_mut(id as usize) {
                    *x = if *x > 0.0 { *x / r } else { *x * r };
                }
            }
        }
        for (&id, &n) in &a.counts {
            if let Some(x) = l.get_mut(id as usize) {
                *x -= n as f32 * p.frequency_penalty + p.presence_penalty;
            }
        }
    }

    /// Records `id` as generated, for the penalties and the grammar.
    fn chosen(&mut self, id: u32) {
        if let Some(c) = self.constrained.as_deref_mut() {
            if c.error.is_none() && c.finished_after.is_none() {
                match c.state.commit(id) {
                    Ok(()) => {
                        c.committed += 1;
                        if c.state.is_finished() {
                            c.finished_after = Some(c.committed);
                        }
                    }
                    Err(e) => c.error = Some(e),
                }
            }
        }
        let penalise = self.params.penalises_output();
        let repeat = self.params.repetition_penalty != 1.0;
        if let Some(a) = self.adjuster.as_mut() {
            if penalise {
                *a.counts.entry(id).or_insert(0) += 1;
            }
            if repeat {
                a.seen.insert(id);
            }
        }
    }

    fn choose(&mut self, logits: &[f32]) -> u32 {
        if self.params.is_greedy() || logits.len() <= 1 {
            return greedy(logits);
        }
        let Some((keep, mass)) = self.distribution(logits) else {
            return greedy(logits);
        };
        let c = &self.scratch;
        let r = self.rng.random::<f64>() * mass;
        let mut acc = 0f64;
        for e in &c[..keep] {
            acc += e.1 as f64;
            if r < acc {
                return e.0;
            }
        }
        c[keep - 1].0
    }

    fn verify(&mut self, logits: &[f32], draft: u32) -> Result<(), u32> {
        if self.params.is_greedy() || logits.len() <= 1 {
            let g = greedy(logits);
            return if g == draft { Ok(()) } else { Err(g) };
        }
        let Some((keep, mass)) = self.distribution(logits) else {
            let g = greedy(logits);
            return if g == draft { Ok(()) } else { Err(g) };
        };
        let c = &self.scratch;
        let p_draft = c[..keep]
            .iter()
            .find(|e| e.0 == draft)
            .map_or(0.0, |e| e.1 as f64 / mass);
        if self.rng.random::<f64>() < p_draft {
            return Ok(());
        }
        let rest = mass - p_draft * mass;
        if rest <= 0.0 {
            // p(draft) = 1 up to rounding and the draw still failed: the draft is the only token.
            return Ok(());
        }
        let r = self.rng.random::<f64>() * rest;
        let mut acc = 0f64;
        let mut last = None;
        for e in c[..keep].iter().filter(|e| e.0 != draft) {
            acc += e.1 as f64;
            last = Some(e.0);
            if r < acc {
                return Err(e.0);
            }
        }
        last.map_or(Ok(()), Err)
    }

    /// The sampling distribution of `logits` in `scratch`: (id, unnormalised probability)
    /// descending, the first `keep` survive min-p/top-k/top-p, with total mass `mass`. None when every
    /// logit is NaN.
    fn distribution(&mut self, logits: &[f32]) -> Option<(usize, f64)> {
        let inv_t = 1.0 / self.params.temperature;
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                // −∞ is a masked or banned token: never a candidate.
                .filter(|(_, l)| !l.is_nan() && **l != f32::NEG_INFINITY)
                .map(|(i, &l)| (i as u32, l * inv_t)),
        );
        if c.is_empty() {
            return None;
        }
        // Descending by value, ties by ascending id, so the order (and the draw) is reproducible.
        let by_value = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = self.params.top_k;
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, by_value);
            c.truncate(k);
        }
        c.sort_unstable_by(by_value);
        // softmax over the survivors (unnormalised: the most likely token has 1)
        let max = c[0].1;
        let mut sum = 0f64;
        for e in c.iter_mut() {
            let p = ((e.1 - max) as f64).exp();
            e.1 = p as f32;
            sum += p;
        }
        // min-p: a probability below min_p × the largest is below min_p here; the survivors are
        // a prefix of the descending order, so this commutes with top-k.
        let min_p = self.params.min_p;
        let mut keep = c.len();
        if min_p > 0.0 {
            keep = c.partition_point(|e| e.1 >= min_p).max(1);
            sum = c[..keep].iter().map(|e| e.1 as f64).sum();
        }
        let top_p = self.params.top_p as f64;
        if top_p < 1.0 {
            let mut acc = 0f64;
            for (i, e) in c[..keep].iter().enumerate() {
                acc += e.1 as f64 / sum;
                if acc >= top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        let mass: f64 = c[..keep].iter().map(|e| e.1 as f64).sum();
        Some((keep, mass))
    }
}

/// The argmax of `logits` (the lowest id among equal maxima), exactly as greedy decoding picks.
pub fn greedy(logits: &[f32]) -> u32 {
    deltafin_kernels::argmax(logits) as u32
}

/// `log_softmax(logits)[id]`, computed in f64 for stability.
pub fn logprob_of(logits: &[f32], id: u32) -> f32 {
    let lse = log_sum_exp(logits);
    logits
        .get(id as usize)
        .map_or(f32::NEG_INFINITY, |&l| (l as f64 - lse) as f32)
}

/// The `n` most likely tokens with their log-probabilities, most likely first (ties by id).
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(u32, f32)> {
    if n == 0 || logits.is_empty() {
        return Vec::new();
    }
    let lse = log_sum_exp(logits);
    let mut c: Vec<(u32, f32)> = logits.iter().enumerate().map(|(i, &l)| (i as u32, l)).collect();
    let by_value = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
    let n = n.min(c.len());
    if n < c.len() {
        c.select_nth_unstable_by(n - 1, by_value);
        c.truncate(n);
    }
    c.sort_unstable_by(by_value);
    c.into_iter().map(|(i, l)| (i, (l as f64 - lse) as f32)).collect()
}

fn log_sum_exp(logits: &[f32]) -> f64 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
    if !max.is_finite() {
        return max;
    }
    let s: f64 = logits.iter().map(|&l| (l as f64 - max).exp()).sum();
    max + s.ln()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        (0..50)
            .map(|i| ((i * 37) % 11) as f32 * 0.3 - (i as f32) * 0.01)
            .collect()
    }

    #[test]
    fn greedy_is_exact_argmax() {
        let l = logits();
        let mut s = Sampler::new(SamplingParams::default());
        assert_eq!(s.sample(&l), greedy(&l));
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 1,
            ..Default::default()
        });
        assert_eq!(s.sample(&l), greedy(&l));
    }

    #[test]
    fn same_seed_same_draws_and_different_seeds_differ() {
        let l = logits();
        let p = |seed| SamplingParams {
            temperature: 1.5,
            seed: Some(seed),
            ..Default::default()
        };
        let draw = |seed| {
            let mut s = Sampler::new(p(seed));
            (0..64).map(|_| s.sample(&l)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
    }

    #[test]
    fn top_k_and_top_p_restrict_the_support() {
        let l = logits();
        let top3: Vec<u32> = top_logprobs(&l, 3).into_iter().map(|(i, _)| i).collect();
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 3,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..200 {
            assert!(top3.contains(&s.sample(&l)));
        }
        // A tiny nucleus keeps only the most likely token.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            seed: Some(1),
            ..Default::default()
        });
        for _ in 0..50 {
            assert_eq!(s.sample(&l), greedy(&l));
        }
    }

    #[test]
    fn logprobs_normalise() {
        let l = logits();
        let total: f64 = (0..l.len() as u32).map(|i| (logprob_of(&l, i) as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
        let top = top_logprobs(&l, 5);
        assert_eq!(top.len(), 5);
        assert_eq!(top[0].0, greedy(&l));
        assert!(top.windows(2).all(|w| w[0].1 >= w[1].1));
        assert!((top[0].1 - logprob_of(&l, top[0].0)).abs() < 1e-6);
    }

    /// The speculative rejection rule leaves the token distribution unchanged: the empirical
    /// distribution of (draft if accepted, else the replacement) matches plain sampling's
    /// probabilities, for a likely, an unlikely and an excluded (top-k) draft. [SPEC_VERIFY]
    #[test]
    fn draft_verification_keeps_the_distribution() {
        let logits = [2.0f32, 1.0, 0.5, -1.0, 0.0];
        let params = SamplingParams {
            temperature: 0.8,
            top_k: 4,
            seed: Some(7),
            ..Default::default()
        };
        // Exact probabilities: softmax(logits / T) over the top 4 (id 3 excluded).
        let kept = [0usize, 1, 2, 4];
        let z: f64 = kept.iter().map(|&i| (logits[i] as f64 / 0.8).exp()).sum();
        let mut p = [0f64; 5];
        for &i in &kept {
            p[i] = (logits[i] as f64 / 0.8).exp() / z;
        }
        for draft in [0u32, 2, 3] {
            let mut s = Sampler::new(params.clone());
            let n = 40_000;
            let mut counts = [0usize; 5];
            for _ in 0..n {
                let t = match s.verify_draft(&logits, draft) {
                    Ok(()) => draft,
                    Err(t) => {
                        assert_ne!(t, draft, "a rejected draft is never the replacement");
                        t
                    }
                };
                counts[t as usize] += 1;
            }
            for i in 0..5 {
                let f = counts[i] as f64 / n as f64;
                assert!(
                    (f - p[i]).abs() < 0.01,
                    "draft {draft}: token {i} frequency {f:.4}, p {:.4}",
                    p[i]
                );
            }
        }
        // Greedy: accepted iff the argmax.
        let mut g = Sampler::new(SamplingParams::default());
        assert_eq!(g.verify_draft(&logits, 0), Ok(()));
        assert_eq!(g.verify_draft(&logits, 2), Err(0));
    }
    /// The logits the sampler chooses from at its next step (adjusted when an adjustment is set).
    fn adjusted(s: &Sampler, logits: &[f32]) -> Vec<f32> {
        match s.adjuster.as_deref() {
            Some(a) => {
                let mut l = logits.to_vec();
                s.adjust(a, &mut l);
                l
            }
            None => logits.to_vec(),
        }
    }

    #[test]
    fn nothing_set_adjusts_nothing() {
        let s = Sampler::new(SamplingParams::default());
        assert!(s.adjuster.is_none(), "no adjustment state without a bias or penalty");
        let s = Sampler::new(SamplingParams {
            temperature: 0.7,
            top_k: 5,
            top_p: 0.9,
            min_p: 0.1,
            ..Default::default()
        });
        assert!(s.adjuster.is_none(), "temperature and truncation do not adjust logits");
    }

    /// OpenAI `logit_bias`: added to the logits, also under greedy decoding.
    #[test]
    fn logit_bias_moves_the_greedy_choice() {
        let l = [1.0f32, 3.0, 2.0];
        let with = |bias: Vec<(u32, f32)>| {
            Sampler::new(SamplingParams {
                logit_bias: bias,
                ..Default::default()
            })
        };
        // 2 + 1.5 = 3.5 > 3
        let mut s = with(vec![(2, 1.5)]);
        assert_eq!(adjusted(&s, &l), [1.0, 3.0, 3.5]);
        assert_eq!(s.sample(&l), 2);
        // 3 - 100 = -97: the next best, 2.0, wins
        let mut s = with(vec![(1, -100.0)]);
        assert_eq!(adjusted(&s, &l), [1.0, -97.0, 2.0]);
        assert_eq!(s.sample(&l), 2);
        // +100 forces a token, also when sampling at a high temperature
        let mut s = Sampler::new(SamplingParams {
            temperature: 2.0,
            logit_bias: vec![(0, 100.0)],
            seed: Some(3),
            ..Default::default()
        });
        assert!((0..100).all(|_| s.sample(&l) == 0));
        // an id past the logits is ignored
        let s = with(vec![(9, 5.0)]);
        assert_eq!(adjusted(&s, &l), l);
    }

    /// Repetition penalty 2 over prompt tokens 0 and 3: 2.0 → 1.0 (divided), -0.5 → -1.0
    /// (multiplied); unseen tokens unchanged.
    #[test]
    fn repetition_penalty_divides_positive_and_multiplies_negative_logits_of_seen_tokens() {
        let l = [2.0f32, 1.5, -1.0, -0.5];
        let p = SamplingParams {
            repetition_penalty: 2.0,
            ..Default::default()
        };
        let mut s = Sampler::with_prompt(p.clone(), &[0, 3, 3]);
        assert_eq!(adjusted(&s, &l), [1.0, 1.5, -1.0, -1.0]);
        assert_eq!(s.sample(&l), 1);
        // token 1 is now seen too: 1.5 / 2 = 0.75 < 1.0
        assert_eq!(adjusted(&s, &l), [1.0, 0.75, -1.0, -1.0]);
        assert_eq!(s.sample(&l), 0);
        // without the prompt nothing is penalised at first
        let s = Sampler::new(p);
        assert_eq!(adjusted(&s, &l), l);
    }

    /// OpenAI's formula `logit[j] -= count[j] × frequency + (count[j] > 0) × presence` over the
    /// generated tokens only (the prompt does not count).
    #[test]
    fn frequency_and_presence_penalties_follow_openai() {
        let l = [1.0f32, 0.9, 0.0];
        // Presence 0.2: after token 0, 1.0 - 0.2 = 0.8 < 0.9 → 1; then 0.9 - 0.2 = 0.7 < 0.8 →
        // 0, and the penalty does not grow: 0 from then on.
        let mut s = Sampler::with_prompt(
            SamplingParams {
                presence_penalty: 0.2,
                ..Default::default()
            },
            &[1, 1, 1],
        );
        let got: Vec<u32> = (0..5).map(|_| s.sample(&l)).collect();
        assert_eq!(got, [0, 1, 0, 0, 0]);
        // Frequency 0.2 grows with each use: the two tokens alternate.
        let mut s = Sampler::new(SamplingParams {
            frequency_penalty: 0.2,
            ..Default::default()
        });
        let got: Vec<u32> = (0..5).map(|_| s.sample(&l)).collect();
        assert_eq!(got, [0, 1, 0, 1, 0]);
        // counts 0: 3, 1: 2 → 1.0 - 3 × 0.2 = 0.4, 0.9 - 2 × 0.2 = 0.5
        let a = adjusted(&s, &l);
        assert!(
            (a[0] - 0.4).abs() < 1e-6 && (a[1] - 0.5).abs() < 1e-6 && a[2] == 0.0,
            "{a:?}"
        );
        // A negative penalty rewards repeats.
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: -2.0,
            ..Default::default()
        });
        assert_eq!(s.sample(&[0.0, 1.0]), 1);
        assert_eq!(adjusted(&s, &[0.0, 1.0]), [0.0, 3.0]);
    }

    /// vLLM's order: bias, then repetition, then frequency and presence:
    /// (2 + 1) / 2 − 1 × 0.5 − 0.25 = 0.75.
    #[test]
    fn adjustments_apply_in_vllm_order() {
        let mut s = Sampler::with_prompt(
            SamplingParams {
                logit_bias: vec![(0, 1.0)],
                repetition_penalty: 2.0,
                frequency_penalty: 0.5,
                presence_penalty: 0.25,
                ..Default::default()
            },
            &[0],
        );
        // first step: (2 + 1) / 2 = 1.5 beats 1.0
        assert_eq!(adjusted(&s, &[2.0, 1.0]), [1.5, 1.0]);
        assert_eq!(s.sample(&[2.0, 1.0]), 0);
        assert_eq!(adjusted(&s, &[2.0, 1.0]), [0.75, 1.0]);
        assert_eq!(s.sample(&[2.0, 1.0]), 1);
    }

    /// min-p 0.2 on relative probabilities 1, 0.5, 0.1, 0.05 keeps tokens 0 and 1; 0.08 also
    /// keeps 2. Greedy ignores it (the most likely token always survives).
    #[test]
    fn min_p_drops_tokens_below_the_fraction_of_the_most_likely() {
        let l: Vec<f32> = [1.0f32, 0.5, 0.1, 0.05].iter().map(|p| p.ln()).collect();
        let support = |min_p: f32| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                min_p,
                seed: Some(5),
                ..Default::default()
            });
            let mut seen = [false; 4];
            for _ in 0..2000 {
                seen[s.sample(&l) as usize] = true;
            }
            seen
        };
        assert_eq!(support(0.2), [true, true, false, false]);
        assert_eq!(support(0.08), [true, true, true, false]);
        assert_eq!(support(0.0), [true, true, true, true]);
        assert_eq!(support(1.0), [true, false, false, false]);
        // Then top-p over the survivors (vLLM): p(0) = 1 / 1.5 ≈ 0.67 ≥ 0.6 keeps only token 0.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.2,
            top_p: 0.6,
            seed: Some(5),
            ..Default::default()
        });
        assert!((0..200).all(|_| s.sample(&l) == 0));
    }

    /// Under speculative verification the penalties see the accepted drafts and replacements.
    #[test]
    fn verified_drafts_count_for_the_penalties() {
        let l = [1.0f32, 0.9];
        let mut s = Sampler::new(SamplingParams {
            presence_penalty: 0.5,
            ..Default::default()
        });
        assert_eq!(s.verify_draft(&l, 0), Ok(()));
        // token 0 was generated: 0.5 < 0.9, so a draft of 0 is now rejected for 1
        assert_eq!(s.verify_draft(&l, 0), Err(1));
        // both penalised: 0.5 vs 0.4
        assert_eq!(s.sample(&l), 0);
    }
}

#[cfg(test)]
mod constrained {
    use super::*;

    /// Allows the tokens of `allowed[step]`, then ends after `allowed.len()` tokens; fails at
    /// the step `fail_at` when set.
    #[derive(Debug)]
    struct Script {
        allowed: Vec<Vec<u32>>,
        step: usize,
        fail_at: Option<usize>,
    }

    impl GrammarState for Script {
        fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
            if self.fail_at == Some(self.step) {
                return Err("scripted failure".into());
            }
            let ok = self.allowed.get(self.step).cloned().unwrap_or_default();
            for (i, l) in logits.iter_mut().enumerate() {
                if !ok.contains(&(i as u32)) {
                    *l = f32::NEG_INFINITY;
                }
            }
            Ok(())
        }
        fn commit(&mut self, token: u32) -> Result<(), String> {
            match self.allowed.get(self.step) {
                Some(ok) if ok.contains(&token) => {
                    self.step += 1;
                    Ok(())
                }
                _ => Err(format!("token {token} not allowed at step {}", self.step)),
            }
        }
        fn is_finished(&self) -> bool {
            self.step >= self.allowed.len()
        }
    }

    fn script(allowed: &[&[u32]]) -> Box<Script> {
        Box::new(Script {
            allowed: allowed.iter().map(|a| a.to_vec()).collect(),
            step: 0,
            fail_at: None,
        })
    }

    /// Token 0 is by far the most likely: a grammar that forbids it must still be obeyed.
    fn peaked() -> Vec<f32> {
        let mut l = vec![0.0f32; 16];
        l[0] = 50.0;
        l[7] = 1.0;
        l
    }

    #[test]
    fn greedy_and_sampled_choices_stay_inside_the_grammar() {
        let mut g = Sampler::new(SamplingParams::default());
        g.constrain(script(&[&[3, 7], &[5]]));
        assert_eq!(g.sample(&peaked()), 7, "the best allowed token, not the argmax");
        assert_eq!(g.grammar_finished_after(), None);
        assert_eq!(g.sample(&peaked()), 5);
        assert_eq!(g.grammar_finished_after(), Some(2));
        assert_eq!(g.take_grammar_error(), None);

        let allowed: Vec<u32> = vec![2, 9, 11];
        let mut steps: Vec<&[u32]> = Vec::new();
        for _ in 0..500 {
            steps.push(&allowed);
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.5,
            top_k: 8,
            seed: Some(3),
            ..Default::default()
        });
        s.constrain(script(&steps));
        let mut seen = HashSet::new();
        for _ in 0..500 {
            let id = s.sample(&peaked());
            assert!(allowed.contains(&id), "sampled {id} outside the grammar");
            seen.insert(id);
        }
        assert_eq!(seen.len(), 3, "every allowed token is drawn at equal logits");
        assert_eq!(s.take_grammar_error(), None);
    }

    #[test]
    fn a_draft_outside_the_grammar_is_rejected() {
        for params in [
            SamplingParams::default(),
            SamplingParams {
                temperature: 1.0,
                seed: Some(1),
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params);
            s.constrain(script(&[&[7], &[4]]));
            // 0 is the model's favourite but not allowed: replaced by the only allowed token.
            assert_eq!(s.verify_draft(&peaked(), 0), Err(7));
            assert_eq!(s.verify_draft(&peaked(), 4), Ok(()));
            assert_eq!(s.grammar_finished_after(), Some(2));
        }
    }

    #[test]
    fn a_failing_grammar_is_reported_once() {
        let mut s = Sampler::new(SamplingParams::default());
        s.constrain(Box::new(Script {
            allowed: vec![vec![7], vec![7]],
            step: 0,
            fail_at: Some(1),
        }));
        assert_eq!(s.sample(&peaked()), 7);
        assert_eq!(s.take_grammar_error(), None);
        s.sample(&peaked());
        assert_eq!(s.take_grammar_error().as_deref(), Some("scripted failure"));
        assert_eq!(s.take_grammar_error(), None);
    }
}

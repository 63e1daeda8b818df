//! Choosing the next token from logits: greedy (exact argmax) or seeded sampling with
//! temperature, top-k and top-p (nucleus), plus log-probabilities for the API's `logprobs`.
//!
//! Order of operations (as in Hugging Face `generate` and vLLM): logits ÷ temperature →
//! keep the `top_k` largest → softmax → keep the smallest set of most likely tokens whose
//! probability sums to at least `top_p` → draw one with the seeded generator.
//! Reported log-probabilities are those of the model's own distribution (`log_softmax` of the
//! raw logits, before temperature or truncation), as OpenAI and vLLM report them.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// How to choose tokens. `temperature == 0` means greedy (exact argmax, the default).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplingParams {
    /// Softmax temperature; 0 = greedy.
    pub temperature: f32,
    /// Nucleus mass in (0, 1]; 1 = off.
    pub top_p: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Seed of the generator; `None` draws one from the operating system.
    pub seed: Option<u64>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_p: 1.0,
            top_k: 0,
            seed: None,
        }
    }
}

impl SamplingParams {
    /// Whether these parameters choose the argmax.
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0 || self.top_k == 1
    }
}

/// A token chooser holding its random generator (one per generation, so the same seed and
/// prompt give the same output).
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplingParams,
    rng: StdRng,
    /// Scratch: candidate (id, value) pairs, reused across steps.
    scratch: Vec<(u32, f32)>,
}

impl Sampler {
    /// A sampler for `params`.
    pub fn new(params: SamplingParams) -> Self {
        let rng = match params.seed {
            Some(s) => StdRng::seed_from_u64(s),
            None => StdRng::from_os_rng(),
        };
        Sampler {
            params,
            rng,
            scratch: Vec::new(),
        }
    }

    /// The parameters.
    pub fn params(&self) -> &SamplingParams {
        &self.params
    }

    /// Chooses the next token from `logits: [vocab]` (non-empty).
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
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

    /// Speculative decoding: accepts the drafted token `draft` (proposed by a deterministic
    /// drafter) with probability `p(draft)` under this sampler's distribution for `logits`
    /// (`Ok(())`), or rejects it and returns a token drawn from `p` with `draft` removed and
    /// renormalised (`Err(token)`). For a drafter whose proposal is a point mass this is the
    /// speculative-sampling rule `min(1, p/q)` with residual `norm(max(0, p − q))`, so the
    /// token's distribution is exactly `p` (Leviathan et al. 2023, arXiv:2211.17192).
    /// Greedy: accepted iff `draft` is the argmax, otherwise the argmax. [SPEC_VERIFY]
    pub fn verify_draft(&mut self, logits: &[f32], draft: u32) -> Result<(), u32> {
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
    /// descending, the first `keep` survive top-k/top-p, with total mass `mass`. None when every
    /// logit is NaN.
    fn distribution(&mut self, logits: &[f32]) -> Option<(usize, f64)> {
        let inv_t = 1.0 / self.params.temperature;
        let c = &mut self.scratch;
        c.clear();
        c.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
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
        // softmax over the survivors
        let max = c[0].1;
        let mut sum = 0f64;
        for e in c.iter_mut() {
            let p = ((e.1 - max) as f64).exp();
            e.1 = p as f32;
            sum += p;
        }
        let top_p = self.params.top_p as f64;
        let mut keep = c.len();
        if top_p < 1.0 {
            let mut acc = 0f64;
            for (i, e) in c.iter().enumerate() {
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
            top_p: 1.0,
            top_k: 0,
            seed: Some(seed),
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
            top_p: 1.0,
            top_k: 3,
            seed: Some(1),
        });
        for _ in 0..200 {
            assert!(top3.contains(&s.sample(&l)));
        }
        // A tiny nucleus keeps only the most likely token.
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 1e-6,
            top_k: 0,
            seed: Some(1),
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
            top_p: 1.0,
            top_k: 4,
            seed: Some(7),
        };
        // Exact probabilities: softmax(logits / T) over the top 4 (id 3 excluded).
        let kept = [0usize, 1, 2, 4];
        let z: f64 = kept.iter().map(|&i| (logits[i] as f64 / 0.8).exp()).sum();
        let mut p = [0f64; 5];
        for &i in &kept {
            p[i] = (logits[i] as f64 / 0.8).exp() / z;
        }
        for draft in [0u32, 2, 3] {
            let mut s = Sampler::new(params);
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
}

//! The DeepSeek-V3 router (`noaux_tc`): sigmoid scores, bias-corrected group-limited top-k
//! selection, weights from the unbiased scores.
//!
//! Source: DeepSeek-V3 technical report §2.1.2 (auxiliary-loss-free load balancing) and
//! transformers `DeepseekV3TopkRouter`, with one deliberate difference: experts of discarded
//! groups are masked to −∞, not 0, so they can never be chosen even when every biased score is
//! negative (the reference's 0-mask would pick them then). [ROUTER_MASK]

use deltafin_kernels::sigmoid;

/// Routing hyperparameters.
#[derive(Debug, Clone, Copy)]
pub struct RouterConfig {
    pub n_routed_experts: usize,
    pub top_k: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
}

/// Chosen experts for one token, sorted by expert id, with their combine weights.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// Indices of the `k` largest values, largest first; ties go to the lower index.
fn top_k_indices(v: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..v.len()).collect();
    idx.sort_by(|&a, &b| {
        v[b].partial_cmp(&v[a])
            .unwrap_or(std::cmp::Ordering::Equal)
            .then(a.cmp(&b))
    });
    idx.truncate(k);
    idx
}

/// Routes one token from its router logits `[n_routed_experts]` (f32, `x · W_gate^T`) and the
/// `e_score_correction_bias` `[n_routed_experts]`.
pub fn route(cfg: &RouterConfig, logits: &[f32], bias: &[f32]) -> Routing {
    route_masked(cfg, logits, bias, None)
}

/// [`route`] restricted to the experts with `allowed[e]` (self-drafting with the experts
/// already in memory): the groups are chosen as [`route`] chooses them, then the top-k is taken
/// among the allowed experts of the kept groups only, so fewer than top-k (even none) may be
/// chosen. The weights are normalised over the chosen experts. With `None` it is [`route`].
pub fn route_masked(cfg: &RouterConfig, logits: &[f32], bias: &[f32], allowed: Option<&[bool]>) -> Routing {
    let n = cfg.n_routed_experts;
    let scores: Vec<f32> = logits.iter().map(|&x| sigmoid(x)).collect();
    let mut choice: Vec<f32> = scores.iter().zip(bias).map(|(s, b)| s + b).collect();
    if cfg.n_group > 1 {
        let per = n / cfg.n_group;
        // Group score = sum of the group's two largest biased scores.
        let group_scores: Vec<f32> = (0..cfg.n_group)
            .map(|g| {
                let t = top_k_indices(&choice[g * per..(g + 1) * per], 2);
                t.iter().map(|&i| choice[g * per + i]).sum()
            })
            .collect();
        let keep = top_k_indices(&group_scores, cfg.topk_group);
        for g in 0..cfg.n_group {
            if !keep.contains(&g) {
                choice[g * per..(g + 1) * per].fill(f32::NEG_INFINITY);
            }
        }
    }
    if let Some(allowed) = allowed {
        for (c, &a) in choice.iter_mut().zip(allowed) {
            if !a {
                *c = f32::NEG_INFINITY;
            }
        }
    }
    let mut experts = top_k_indices(&choice, cfg.top_k);
    if allowed.is_some() {
        experts.retain(|&e| choice[e] > f32::NEG_INFINITY);
    }
    experts.sort_unstable();
    let mut weights: Vec<f32> = experts.iter().map(|&e| scores[e]).collect();
    if cfg.norm_topk_prob {
        // Summed in selection order in the reference; sum order differences are below f32 ulp
        // effects on the normalised weights only at the last bit.
        let denom: f32 = weights.iter().sum::<f32>() + 1e-20;
        for w in &mut weights {
            *w /= denom;
        }
    }
    for w in &mut weights {
        *w *= cfg.routed_scaling_factor;
    }
    Routing { experts, weights }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logit(p: f32) -> f32 {
        (p / (1.0 - p)).ln()
    }

    fn cfg(n: usize, k: usize, g: usize, tg: usize) -> RouterConfig {
        RouterConfig {
            n_routed_experts: n,
            top_k: k,
            n_group: g,
            topk_group: tg,
            norm_topk_prob: true,
            routed_scaling_factor: 2.0,
        }
    }

    #[test]
    fn bias_chooses_but_unbiased_scores_weigh() {
        // Scores 0.9, 0.8, 0.3, 0.2; bias lifts expert 3 above expert 1.
        let logits: Vec<f32> = [0.9, 0.8, 0.3, 0.2].iter().map(|&p| logit(p)).collect();
        let bias = [0.0, 0.0, 0.0, 0.7];
        let r = route(&cfg(4, 2, 1, 1), &logits, &bias);
        assert_eq!(r.experts, vec![0, 3]);
        // Weights from unbiased scores 0.9 and 0.2, normalised, times 2.
        assert!((r.weights[0] - 2.0 * 0.9 / 1.1).abs() < 1e-5, "{:?}", r.weights);
        assert!((r.weights[1] - 2.0 * 0.2 / 1.1).abs() < 1e-5, "{:?}", r.weights);
    }

    #[test]
    fn groups_are_ranked_by_sum_of_top2() {
        // Two groups of 3. Group 0: 0.95, 0.1, 0.1 (top-2 sum 1.05). Group 1: 0.6, 0.6, 0.1 (1.2).
        // Group 1 wins on the top-2 sum although group 0 holds the single best expert.
        let p = [0.95, 0.1, 0.1, 0.6, 0.6, 0.1];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let r = route(&cfg(6, 2, 2, 1), &logits, &[0.0; 6]);
        assert_eq!(r.experts, vec![3, 4]);
        assert!((r.weights[0] - 1.0).abs() < 1e-5 && (r.weights[1] - 1.0).abs() < 1e-5);
    }

    #[test]
    fn masked_experts_never_chosen_even_when_all_biased_scores_are_negative() {
        // Biased scores all negative. Group 1 (experts 2,3) has the better top-2 sum; with a
        // 0-mask, group 0's experts (masked to 0.0) would beat group 1's negative scores.
        let p = [0.5, 0.5, 0.5, 0.5];
        let logits: Vec<f32> = p.iter().map(|&x| logit(x)).collect();
        let bias = [-0.9, -0.9, -0.6, -0.7];
        let r = route(&cfg(4, 2, 2, 1), &logits, &bias);
        assert_eq!(r.experts, vec![2, 3]);
    }

    #[test]
    fn no_normalisation_keeps_raw_scores_times_factor() {
        let mut c = cfg(4, 1, 1, 1);
        c.norm_topk_prob = false;
        c.routed_scaling_factor = 2.5;
        let logits: Vec<f32> = [0.2, 0.7, 0.1, 0.3].iter().map(|&p| logit(p)).collect();
        let r = route(&c, &logits, &[0.0; 4]);
        assert_eq!(r.experts, vec![1]);
        assert!((r.weights[0] - 2.5 * 0.7).abs() < 1e-5);
    }
}

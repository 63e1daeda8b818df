//! MoE routers.
//!
//! [`route`] is the DeepSeek-V3 router (`noaux_tc`): sigmoid scores, bias-corrected
//! group-limited top-k selection, weights from the unbiased scores.
//!
//! Source: DeepSeek-V3 technical report §2.1.2 (auxiliary-loss-free load balancing) and
//! transformers `DeepseekV3TopkRouter`, with one deliberate difference: experts of discarded
//! groups are masked to −∞, not 0, so they can never be chosen even when every biased score is
//! negative (the reference's 0-mask would pick them then). [ROUTER_MASK]

use deltafin_kernels::{sigmoid, softmax_inplace};

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
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Routing {
    pub experts: Vec<usize>,
    pub weights: Vec<f32>,
}

/// [`top_k_indices`] among the indices with `allowed[i]` (all with `None`).
fn top_k_allowed(v: &[f32], k: usize, allowed: Option<&[bool]>) -> Vec<usize> {
    match allowed {
        None => top_k_indices(v, k),
        Some(a) => {
            let mut c = top_k_indices(v, v.len());
            c.retain(|&e| a.get(e).copied().unwrap_or(false));
            c.truncate(k);
            c
        }
    }
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

/// Softmax top-k router of Mixtral and Qwen3-MoE: `p = softmax(logits)` over all
/// `n_routed_experts` in f32, the `top_k` largest `p` chosen (ties to the lower id), their
/// weights `p` divided by their sum when `norm_topk_prob` (always for Mixtral), else left as
/// they are. The sum is taken in descending-probability order, as `torch.topk` returns them.
///
/// `logits: [n_routed_experts]` (`x · W_gate^T`, f32); `scratch` is reused for the
/// probabilities (no allocation once it has grown). `top_k` must be in `1..=n_routed_experts`.
///
/// Source: transformers `MixtralTopKRouter` / `Qwen3MoeTopKRouter`; Shazeer et al. 2017
/// (arXiv:1701.06538) for the top-k gate; Jiang et al. 2024 (Mixtral, arXiv:2401.04088) §2.1.
/// [SOFTMAX_TOPK]
pub fn route_softmax(logits: &[f32], top_k: usize, norm_topk_prob: bool, scratch: &mut Vec<f32>) -> Routing {
    route_softmax_masked(logits, top_k, norm_topk_prob, scratch, None)
}

/// [`route_softmax`] restricted to the experts with `allowed[e]` (`[n_routed_experts]`;
/// self-drafting with the experts already in memory): the probabilities are the softmax over
/// every expert as the model computes them, the top-k is taken among the allowed ones only (so
/// fewer than top-k, even none, may be chosen), and with `norm_topk_prob` the weights are
/// normalised over the chosen. With `None` it is [`route_softmax`].
pub fn route_softmax_masked(
    logits: &[f32],
    top_k: usize,
    norm_topk_prob: bool,
    scratch: &mut Vec<f32>,
    allowed: Option<&[bool]>,
) -> Routing {
    scratch.clear();
    scratch.extend_from_slice(logits);
    softmax_inplace(scratch);
    let chosen = top_k_allowed(scratch, top_k, allowed);
    let mut weights_desc: Vec<f32> = chosen.iter().map(|&e| scratch[e]).collect();
    if norm_topk_prob {
        let denom: f32 = weights_desc.iter().sum();
        for w in &mut weights_desc {
            *w /= denom;
        }
    }
    // Sorted by expert id, weights alongside.
    let mut pairs: Vec<(usize, f32)> = chosen.into_iter().zip(weights_desc).collect();
    pairs.sort_unstable_by_key(|&(e, _)| e);
    Routing {
        experts: pairs.iter().map(|&(e, _)| e).collect(),
        weights: pairs.iter().map(|&(_, w)| w).collect(),
    }
}

/// gpt-oss router: the `top_k` largest `logits` (`x · W^T + b`, `[n_routed_experts]`; ties to
/// the lower id) are chosen first, and their weights are the softmax over those `top_k` logits
/// only (the other experts take no share of the denominator). Returns the experts sorted by id
/// with their weights.
///
/// Source: transformers `models/gpt_oss/modeling_gpt_oss.py` `GptOssTopKRouter`
/// (`torch.topk` then `softmax(router_top_value)`). [TOPK_THEN_SOFTMAX]
pub fn route_topk_softmax(logits: &[f32], top_k: usize) -> Routing {
    route_topk_softmax_masked(logits, top_k, None)
}

/// [`route_topk_softmax`] restricted to the experts with `allowed[e]` (`[n_routed_experts]`;
/// self-drafting with the experts already in memory): the top-k among the allowed experts (fewer
/// when fewer are allowed), weights the softmax over the chosen logits. With `None` it is
/// [`route_topk_softmax`].
pub fn route_topk_softmax_masked(logits: &[f32], top_k: usize, allowed: Option<&[bool]>) -> Routing {
    let chosen = top_k_allowed(logits, top_k, allowed);
    let mut w: Vec<f32> = chosen.iter().map(|&e| logits[e]).collect();
    softmax_inplace(&mut w);
    let mut pairs: Vec<(usize, f32)> = chosen.into_iter().zip(w).collect();
    pairs.sort_unstable_by_key(|&(e, _)| e);
    Routing {
        experts: pairs.iter().map(|&(e, _)| e).collect(),
        weights: pairs.iter().map(|&(_, w)| w).collect(),
    }
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

    #[test]
    fn softmax_router_hand_computed() {
        // logits ln 4, ln 2, ln 1, ln 1: softmax = 4/8, 2/8, 1/8, 1/8 = 0.5, 0.25, 0.125, 0.125.
        let logits = [4f32.ln(), 2f32.ln(), 0.0, 0.0];
        let mut scratch = Vec::new();
        // top-2 unnormalised: the raw probabilities.
        let r = route_softmax(&logits, 2, false, &mut scratch);
        assert_eq!(r.experts, vec![0, 1]);
        assert!(
            (r.weights[0] - 0.5).abs() < 1e-6 && (r.weights[1] - 0.25).abs() < 1e-6,
            "{r:?}"
        );
        // Normalised: 0.5/0.75 = 2/3, 0.25/0.75 = 1/3.
        let r = route_softmax(&logits, 2, true, &mut scratch);
        assert!(
            (r.weights[0] - 2.0 / 3.0).abs() < 1e-6 && (r.weights[1] - 1.0 / 3.0).abs() < 1e-6,
            "{r:?}"
        );
        // top-3: the tie between experts 2 and 3 goes to the lower id.
        let r = route_softmax(&logits, 3, true, &mut scratch);
        assert_eq!(r.experts, vec![0, 1, 2]);
        assert!((r.weights[2] - 0.125 / 0.875).abs() < 1e-6, "{r:?}");
    }

    #[test]
    fn masked_topk_then_softmax_router_hand_computed() {
        // Expert 2 (the second largest logit) not resident: top-2 among {0, 1, 3} = 3 and 1,
        // weights softmax(2, 4) = (1 / (1 + e²), e² / (1 + e²)) = (0.11920, 0.88080).
        let logits = [1f32, 2.0, 3.0, 4.0];
        let r = route_topk_softmax_masked(&logits, 2, Some(&[true, true, false, true]));
        assert_eq!(r.experts, vec![1, 3]);
        assert!((r.weights[0] - 0.119_203).abs() < 1e-5 && (r.weights[1] - 0.880_797).abs() < 1e-5);
        assert!(route_topk_softmax_masked(&logits, 2, Some(&[false; 4]))
            .experts
            .is_empty());
        assert_eq!(
            route_topk_softmax_masked(&logits, 2, None),
            route_topk_softmax(&logits, 2)
        );
    }

    #[test]
    fn masked_softmax_router_hand_computed() {
        // Probabilities 0.1, 0.2, 0.3, 0.4 (logits ln 1..ln 4); experts 2 and 3 not resident.
        let logits: Vec<f32> = [1f32, 2.0, 3.0, 4.0].iter().map(|x| x.ln()).collect();
        let allowed = [true, true, false, false];
        let mut scratch = Vec::new();
        let r = route_softmax_masked(&logits, 2, true, &mut scratch, Some(&allowed));
        assert_eq!(r.experts, vec![0, 1]);
        assert!((r.weights[0] - 1.0 / 3.0).abs() < 1e-6 && (r.weights[1] - 2.0 / 3.0).abs() < 1e-6);
        // Without norm_topk_prob the weights stay the model's probabilities.
        let r = route_softmax_masked(&logits, 2, false, &mut scratch, Some(&allowed));
        assert!((r.weights[0] - 0.1).abs() < 1e-6 && (r.weights[1] - 0.2).abs() < 1e-6);
        // One allowed expert: fewer than top-k; none: nothing.
        let r = route_softmax_masked(&logits, 2, true, &mut scratch, Some(&[false, false, true, false]));
        assert_eq!((r.experts, r.weights), (vec![2], vec![1.0]));
        let r = route_softmax_masked(&logits, 2, true, &mut scratch, Some(&[false; 4]));
        assert!(r.experts.is_empty() && r.weights.is_empty());
        // No mask: the plain router.
        assert_eq!(
            route_softmax_masked(&logits, 2, true, &mut scratch, None),
            route_softmax(&logits, 2, true, &mut scratch)
        );
    }

    #[test]
    fn softmax_router_returns_experts_by_id_with_their_own_weights() {
        // Expert 5 is best, then 1: weights follow the experts after sorting by id.
        // logits 0, ln 3, 0, 0, 0, ln 6 over 6 experts: sum = 4 + 3 + 6 = 13.
        let logits = [0.0, 3f32.ln(), 0.0, 0.0, 0.0, 6f32.ln()];
        let mut scratch = Vec::new();
        let r = route_softmax(&logits, 2, false, &mut scratch);
        assert_eq!(r.experts, vec![1, 5]);
        assert!((r.weights[0] - 3.0 / 13.0).abs() < 1e-6, "{r:?}");
        assert!((r.weights[1] - 6.0 / 13.0).abs() < 1e-6, "{r:?}");
        // Softmax is shift-invariant: adding 100 to every logit changes nothing.
        let shifted: Vec<f32> = logits.iter().map(|x| x + 100.0).collect();
        let r2 = route_softmax(&shifted, 2, false, &mut scratch);
        assert_eq!(r2.experts, r.experts);
        assert!((r2.weights[1] - 6.0 / 13.0).abs() < 1e-5, "{r2:?}");
    }

    #[test]
    fn topk_then_softmax_router_hand_computed() {
        // Logits 0, ln 3, -5, ln 1 + 0 ... top-2 are experts 1 (ln 3) and 0 or 3 (both 0): the
        // tie goes to expert 0. Softmax over ln 3 and 0 only: 3/4 and 1/4 (expert 2's -5 and
        // expert 3's 0 are not in the denominator).
        let logits = [0.0, 3f32.ln(), -5.0, 0.0];
        let r = route_topk_softmax(&logits, 2);
        assert_eq!(r.experts, vec![0, 1]);
        assert!(
            (r.weights[0] - 0.25).abs() < 1e-6 && (r.weights[1] - 0.75).abs() < 1e-6,
            "{r:?}"
        );
        // top-1: weight exactly 1.
        let r = route_topk_softmax(&logits, 1);
        assert_eq!((r.experts, r.weights), (vec![1], vec![1.0]));
    }
}

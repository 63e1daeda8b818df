//! The device router (`deltafin_cuda::Gpu::route_noaux`, what `--device cuda` routes with)
//! against the host's `moe::route` (the CPU path's router) on the same logits: the same experts
//! always (ties included: to the lower id), the same weights up to the last bits of `exp` (the
//! device's `expf` and the host libm's may differ by an ulp). Skips with one line without a GPU.

use deltafin_cuda::testing::{gpu_or_skip, refusal};
use deltafin_cuda::RouterShape;
use deltafin_engine::moe::{route, RouterConfig};

/// A small deterministic generator (xorshift), values in [-r, r).
fn values(seed: u64, n: usize, r: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) as f32 * r
        })
        .collect()
}

/// `n` tokens of `e` logits from `seed`: on a coarse grid (many exact ties) for the first half
/// of the tokens, fine for the rest.
fn tied_logits(seed: u64, n: usize, e: usize) -> Vec<f32> {
    let mut logits = values(seed, n * e, 4.0);
    for v in logits[..(n / 2) * e].iter_mut() {
        *v = (*v * 2.0).round() / 2.0;
    }
    logits
}

/// The device's experts and weights of one token equal the host's: the same ids, weights
/// within 4 ulp.
fn assert_same_route(ids: &[i32], w: &[f32], want: &deltafin_engine::moe::Routing, what: &str) {
    let got: Vec<usize> = ids.iter().map(|&v| v as usize).collect();
    assert_eq!(got, want.experts, "{what}: experts");
    for (a, b) in w.iter().zip(&want.weights) {
        assert!(
            (a - b).abs() <= 4.0 * f32::EPSILON * b.abs(),
            "{what}: weight {a} vs {b}"
        );
    }
}

#[test]
fn device_router_chooses_what_the_host_router_chooses() {
    let Some(g) = gpu_or_skip("device_router_chooses_what_the_host_router_chooses") else {
        return;
    };
    // (experts, top_k, groups, kept groups, norm, scale): DeepSeek-V3's shape, no groups, Kimi
    // K3's 896 choose 16, groups of one and of several lanes (the kernel's register form), and
    // a tiny one (its general form).
    let cases = [
        (256usize, 8usize, 8usize, 4usize, true, 2.5f32),
        (64, 6, 1, 1, false, 1.0),
        (896, 16, 1, 1, true, 2.827),
        (32, 4, 4, 2, true, 1.0),
        (128, 6, 8, 3, false, 1.5),
        (8, 2, 4, 2, true, 1.0),
    ];
    for (ci, &(e, k, ng, tg, norm, scale)) in cases.iter().enumerate() {
        let n = 33;
        let logits = tied_logits(ci as u64 + 1, n, e);
        let bias = values(ci as u64 + 100, e, 0.05);
        let shape = RouterShape {
            n_experts: e,
            top_k: k,
            n_group: ng,
            topk_group: tg,
            norm_topk_prob: norm,
            routed_scaling_factor: scale,
        };
        let cfg = RouterConfig {
            n_routed_experts: e,
            top_k: k,
            n_group: ng,
            topk_group: tg,
            norm_topk_prob: norm,
            routed_scaling_factor: scale,
        };
        let (dl, db) = (g.upload(&logits).unwrap(), g.upload(&bias).unwrap());
        let mut ids = g.upload(&vec![-1i32; n * k + 3]).unwrap();
        let mut w = g.upload(&vec![f32::NAN; n * k + 3]).unwrap();
        g.route_noaux(shape, &dl, n, &db, &mut ids, &mut w, 3).unwrap();
        let (ids, w) = (g.download(&ids).unwrap(), g.download(&w).unwrap());
        assert_eq!(&ids[..3], &[-1, -1, -1], "case {ci}: wrote before the offset");
        for t in 0..n {
            let want = route(&cfg, &logits[t * e..(t + 1) * e], &bias);
            let (at, what) = (3 + t * k..3 + (t + 1) * k, format!("case {ci} token {t}"));
            assert_same_route(&ids[at.clone()], &w[at], &want, &what);
        }
    }
    // Shapes the kernel cannot take are refused with the reason.
    let bad = RouterShape {
        n_experts: 8,
        top_k: 17,
        n_group: 1,
        topk_group: 1,
        norm_topk_prob: true,
        routed_scaling_factor: 1.0,
    };
    let mut ids = g.upload(&[0i32; 17]).unwrap();
    let mut w = g.zeros(17).unwrap();
    let e = refusal(g.route_noaux(bad, &g.zeros(8).unwrap(), 1, &g.zeros(8).unwrap(), &mut ids, &mut w, 0));
    assert!(e.contains("route_noaux"), "{e}");
}

/// The device's softmax top-k routers (`deltafin_cuda::Gpu::route_softmax_topk`, what
/// `--device cuda` routes Mixtral, Qwen3-MoE and gpt-oss with) against the host's
/// `moe::route_softmax` / `moe::route_topk_softmax` (the CPU path's routers) on the same
/// logits: the same experts always (ties included: to the lower id), the same weights up to the
/// last bits of `exp`.
#[test]
fn device_softmax_routers_choose_what_the_host_routers_choose() {
    use deltafin_cuda::SoftmaxRouter;
    use deltafin_engine::moe::{route_softmax, route_topk_softmax};
    let Some(g) = gpu_or_skip("device_softmax_routers_choose_what_the_host_routers_choose") else {
        return;
    };
    // (experts, top_k): Mixtral, the Qwen3-MoE fixtures, Qwen3-MoE 30B-A3B, gpt-oss 20b / 120b,
    // and odd counts up to k = 16.
    let cases = [(8usize, 2usize), (12, 3), (128, 8), (32, 4), (128, 4), (61, 16), (5, 5)];
    for (ci, &(e, k)) in cases.iter().enumerate() {
        let n = 33;
        let logits = tied_logits(ci as u64 + 7, n, e);
        for router in SoftmaxRouter::ALL {
            let mut probs = g.zeros(n * e).unwrap();
            let mut ids = g.upload(&vec![-2i32; n * k]).unwrap();
            let mut w = g.upload(&vec![f32::NAN; n * k]).unwrap();
            g.route_softmax_topk(
                router,
                &g.upload(&logits).unwrap(),
                n,
                e,
                k,
                &mut probs,
                &mut ids,
                &mut w,
            )
            .unwrap();
            let (ids, w) = (g.download(&ids).unwrap(), g.download(&w).unwrap());
            let mut scratch = Vec::new();
            for t in 0..n {
                let row = &logits[t * e..(t + 1) * e];
                let want = match router {
                    SoftmaxRouter::SoftmaxThenTopK { norm_topk_prob } => {
                        route_softmax(row, k, norm_topk_prob, &mut scratch)
                    }
                    SoftmaxRouter::TopKThenSoftmax => route_topk_softmax(row, k),
                };
                let (at, what) = (t * k..(t + 1) * k, format!("case {ci} {router:?} token {t}"));
                assert_same_route(&ids[at.clone()], &w[at], &want, &what);
            }
        }
    }
}

//! Hand-worked values for the KDA gate, L2 norm, short convolution and one recurrence step, and
//! equivalence of the chunked, token-by-token and rolled-back paths on seeded random weights.

use super::*;
use deltafin_kernels::MatData;
use rand::{rngs::StdRng, Rng, SeedableRng};

fn close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol
}

fn assert_all_close(got: &[f32], want: &[f32], tol: f32, what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    for (i, (a, b)) in got.iter().zip(want).enumerate() {
        assert!(close(*a, *b, tol), "{what}[{i}]: got {a}, want {b}");
    }
}

#[test]
fn softplus_gate_by_hand() {
    // A_log = ln 2 (decay rate 2)
    let a = 2f32.ln();
    // u = 0: -2 · ln 2
    assert!(close(DecayGate::Softplus.apply(a, 0.0), -1.386_294_4, 1e-6));
    // u = -1: -2 · ln(1 + e^-1) = -2 · 0.313261687
    assert!(close(DecayGate::Softplus.apply(a, -1.0), -0.626_523_4, 1e-6));
    // u = 25 > 20: softplus(u) taken as u exactly
    assert_eq!(DecayGate::Softplus.apply(a, 25.0), -50.0);
    // u = 20 is not above the threshold: ln(1 + e^20) = 20.000000002 → 20 in f32
    assert!(close(DecayGate::Softplus.apply(0.0, 20.0), -20.0, 1e-5));
}

#[test]
fn scaled_sigmoid_gate_by_hand() {
    let gate = DecayGate::ScaledSigmoid { lower_bound: -5.0 };
    // rate 1, u = 0: -5 · σ(0) = -2.5
    assert_eq!(gate.apply(0.0, 0.0), -2.5);
    // rate 2, u = ln(3)/2: σ(ln 3) = 3/4 → -3.75
    assert!(close(gate.apply(2f32.ln(), 3f32.ln() / 2.0), -3.75, 1e-6));
    // large |u| saturates to the bound and to 0, never past them
    assert_eq!(gate.apply(0.0, 100.0), -5.0);
    assert!(gate.apply(0.0, -100.0) <= 0.0 && gate.apply(0.0, -100.0) > -1e-30);
}

#[test]
fn l2_norm_by_hand() {
    let mut x = [3.0f32, 4.0];
    l2_normalize(&mut x);
    // 3 / sqrt(25 + 1e-6), 4 / sqrt(25 + 1e-6)
    assert_all_close(&x, &[0.6, 0.8], 1e-6, "l2");
    // the eps keeps a zero vector at zero instead of NaN
    let mut z = [0.0f32; 4];
    l2_normalize(&mut z);
    assert_eq!(z, [0.0; 4]);
    // eps visible on a tiny vector: 1e-3 / sqrt(1e-6 + 1e-6)
    let mut t = [1e-3f32];
    l2_normalize(&mut t);
    assert!(close(t[0], std::f32::consts::FRAC_1_SQRT_2, 1e-4), "{}", t[0]);
}

#[test]
fn one_recurrence_step_by_hand() {
    // d = 2, S0 = [[1, 0], [0, 2]] (rows = key channels), g = [ln 0.5, 0], k = [0.6, 0.8],
    // v = [1, 1], β = 0.5, q = [0.5, 0.5]:
    // decayed S = [[0.5, 0], [0, 2]]; r = S^T k = [0.3, 1.6]; δ = 0.5 (v − r) = [0.35, −0.3];
    // S += k δ^T → [[0.71, −0.18], [0.28, 1.76]]; o = S^T q = [0.495, 0.79].
    let src = [1.0f32, 0.0, 0.0, 2.0];
    let (k, v, g, q) = ([0.6f32, 0.8], [1.0f32, 1.0], [0.5f32.ln(), 0.0], [0.5f32, 0.5]);
    let want_s = [0.71f32, -0.18, 0.28, 1.76];
    let mut out = [0f32; 2];
    // in place
    let mut s = src;
    delta_step(None, &mut s, 2, Some(&q), &k, &v, &g, 0.5, Some(&mut out));
    assert_all_close(&s, &want_s, 1e-6, "state");
    assert_all_close(&out, &[0.495, 0.79], 1e-6, "output");
    // out of place: the source is untouched and the result is the same
    let mut dst = [9f32; 4];
    delta_step(Some(&src), &mut dst, 2, Some(&q), &k, &v, &g, 0.5, None);
    assert_eq!(dst, s);
    assert_eq!(src, [1.0, 0.0, 0.0, 2.0]);
    // the chunked form of a one-token chunk is the same step
    let mut sc = src;
    let mut oc = [0f32; 2];
    chunk_step(None, &mut sc, 2, &q, &k, &v, &g, &[0.5], &mut oc);
    assert_all_close(&sc, &want_s, 1e-6, "chunk state");
    assert_all_close(&oc, &[0.495, 0.79], 1e-6, "chunk output");
}

#[test]
fn two_step_chunk_by_hand() {
    // d = 1: S is a scalar. S0 = 2, tokens (k, v, g, β, q) = (1, 3, ln 0.5, 0.5, 1), (1, 0, ln 0.25, 1, 2).
    // step 1: S = 1; δ = 0.5 (3 − 1) = 1; S = 2; o = 2.
    // step 2: S = 0.5; δ = 1 (0 − 0.5) = −0.5; S = 0; o = 0.
    let (q, k, v, g, b) = (
        [1.0f32, 2.0],
        [1.0f32, 1.0],
        [3.0f32, 0.0],
        [0.5f32.ln(), 0.25f32.ln()],
        [0.5f32, 1.0],
    );
    let mut s = [2.0f32];
    let mut o = [0f32; 2];
    chunk_step(None, &mut s, 1, &q, &k, &v, &g, &b, &mut o);
    assert_all_close(&o, &[2.0, 0.0], 1e-6, "chunk outputs");
    assert!(close(s[0], 0.0, 1e-6), "{}", s[0]);
}

/// A `[rows, cols]` f32 matrix with N(0, 1/cols)-ish entries.
fn rand_mat(rng: &mut StdRng, rows: usize, cols: usize) -> Vec<f32> {
    let sc = 1.0 / (cols as f32).sqrt();
    (0..rows * cols)
        .map(|_| (rng.random::<f32>() * 2.0 - 1.0) * 1.7 * sc)
        .collect()
}

struct Owned {
    cfg: KdaConfig,
    m: Vec<Vec<f32>>,
}

const ORDER: [&str; 14] = [
    "q", "k", "v", "qc", "kc", "vc", "fa", "fb", "alog", "dt", "b", "g", "on", "o",
];

impl Owned {
    fn new(cfg: KdaConfig, seed: u64) -> Self {
        let mut rng = StdRng::seed_from_u64(seed);
        let (h, p, d, nh, kk) = (
            cfg.hidden_size,
            cfg.proj_dim(),
            cfg.head_dim,
            cfg.num_heads,
            cfg.conv_kernel_size,
        );
        let mut m = Vec::new();
        for name in ORDER {
            m.push(match name {
                "q" | "k" | "v" | "g" => rand_mat(&mut rng, p, h),
                "qc" | "kc" | "vc" => rand_mat(&mut rng, p, kk),
                "fa" => rand_mat(&mut rng, d, h),
                "fb" => rand_mat(&mut rng, p, d),
                "alog" => (0..nh).map(|_| (1.0 + 3.0 * rng.random::<f32>()).ln()).collect(),
                "dt" => (0..p).map(|_| rng.random::<f32>() - 0.5).collect(),
                "b" => rand_mat(&mut rng, nh, h),
                "on" => (0..d).map(|_| 0.9 + 0.2 * rng.random::<f32>()).collect(),
                _ => rand_mat(&mut rng, h, p),
            });
        }
        Owned { cfg, m }
    }

    fn kda(&self) -> Kda<'_> {
        let c = &self.cfg;
        let (h, p, d, nh) = (c.hidden_size, c.proj_dim(), c.head_dim, c.num_heads);
        let mat = |i: usize, r: usize, cc: usize| MatRef::new(r, cc, MatData::F32(&self.m[i])).unwrap();
        Kda::new(
            *c,
            KdaWeights {
                q_proj: mat(0, p, h),
                k_proj: mat(1, p, h),
                v_proj: mat(2, p, h),
                q_conv: &self.m[3],
                k_conv: &self.m[4],
                v_conv: &self.m[5],
                f_a_proj: mat(6, d, h),
                f_b_proj: mat(7, p, d),
                a_log: &self.m[8],
                dt_bias: &self.m[9],
                b_proj: mat(10, nh, h),
                output_gate: OutputGate::FullRank(mat(11, p, h)),
                o_norm: &self.m[12],
                o_proj: mat(13, h, p),
            },
        )
        .unwrap()
    }
}

fn small_cfg(gate: DecayGate, chunk: usize) -> KdaConfig {
    KdaConfig {
        layer: 0,
        hidden_size: 12,
        num_heads: 3,
        head_dim: 8,
        conv_kernel_size: 4,
        norm_eps: 1e-5,
        decay_gate: gate,
        chunk_size: chunk,
    }
}

fn tokens(seed: u64, n: usize, h: usize) -> Vec<f32> {
    let mut rng = StdRng::seed_from_u64(seed);
    (0..n * h).map(|_| rng.random::<f32>() * 2.0 - 1.0).collect()
}

fn rel_l2(a: &[f32], b: &[f32]) -> f32 {
    let num: f32 = a.iter().zip(b).map(|(x, y)| (x - y) * (x - y)).sum();
    let den: f32 = b.iter().map(|y| y * y).sum();
    (num / den.max(1e-30)).sqrt()
}

fn run_steps(kda: &Kda, st: &mut KdaState, x: &[f32]) -> Vec<f32> {
    let h = kda.cfg.hidden_size;
    let mut out = vec![0f32; x.len()];
    for (xt, ot) in x.chunks(h).zip(out.chunks_mut(h)) {
        kda.step(st, xt, ot).unwrap();
    }
    out
}

#[test]
fn short_conv_by_hand() {
    // channel 0 of q with taps [0.5, -1, 0, 2] (tap 3 = the current token), inputs 1, 2, 3
    // after K − 1 = 3 zero rows of history.
    let cfg = small_cfg(DecayGate::Softplus, 4);
    let mut w = Owned::new(cfg, 1);
    w.m[3][..4].copy_from_slice(&[0.5, -1.0, 0.0, 2.0]);
    let kda = w.kda();
    let p = cfg.proj_dim();
    let row = 3 * p;
    // history: 3 zero rows (K − 1), then rows whose q channel 0 holds 1, 2, 3
    let mut hist = vec![0f32; 6 * row];
    for (i, v) in [1.0f32, 2.0, 3.0].iter().enumerate() {
        hist[(3 + i) * row] = *v;
    }
    let mut out = vec![0f32; 3 * p];
    kda.conv_rows(&hist, 3, 3, 0, p, &mut out);
    // t0: 2·1 = 2; t1: 0·1 + 2·2 = 4; t2: −1·1 + 0·2 + 2·3 = 5
    for (t, raw) in [2.0f32, 4.0, 5.0].iter().enumerate() {
        let want = raw / (1.0 + (-raw).exp());
        assert!(close(out[t * p], want, 1e-6), "t{t}: {} vs {want}", out[t * p]);
    }
    // a fourth input reaches back to the first: 0.5·1 − 1·2 + 0·3 + 2·4 = 6.5
    let mut hist4 = hist.clone();
    hist4.extend(std::iter::repeat_n(0.0, row));
    hist4[6 * row] = 4.0;
    let mut o4 = vec![0f32; p];
    kda.conv_rows(&hist4, 6, 1, 0, p, &mut o4);
    assert!(close(o4[0], 6.5 / (1.0 + (-6.5f32).exp()), 1e-6));
}

#[test]
fn chunked_prefill_equals_steps_for_any_chunk_size() {
    for gate in [DecayGate::Softplus, DecayGate::ScaledSigmoid { lower_bound: -5.0 }] {
        let w = Owned::new(small_cfg(gate, 1), 7);
        let x = tokens(8, 37, 12);
        let base = w.kda();
        let mut st = base.new_state(0);
        let want = run_steps(&base, &mut st, &x);
        for chunk in [1, 3, 8, 16, 64] {
            let kda = Kda {
                cfg: KdaConfig {
                    chunk_size: chunk,
                    ..base.cfg
                },
                ..base
            };
            let mut s2 = kda.new_state(0);
            let mut got = vec![0f32; x.len()];
            // two prefill calls (continuing the state), then compare
            kda.prefill(&mut s2, &x[..13 * 12], &mut got[..13 * 12]).unwrap();
            kda.prefill(&mut s2, &x[13 * 12..], &mut got[13 * 12..]).unwrap();
            let e = rel_l2(&got, &want);
            assert!(e < 1e-5, "{gate:?} chunk {chunk}: rel L2 {e}");
            let es = rel_l2(s2.recurrent(), st.recurrent());
            assert!(es < 1e-5, "{gate:?} chunk {chunk}: state rel L2 {es}");
        }
    }
}

#[test]
fn long_chunk_with_strong_decay_stays_finite() {
    // g ≈ −5 every token (K3 lower bound with a saturated sigmoid): over a 64-token chunk the
    // cumulative log-decay reaches −320, so e^{−G} would overflow f32; the differences do not.
    let d = 4;
    let c = 64;
    let mut rng = StdRng::seed_from_u64(3);
    let mut unit = |n: usize| -> Vec<f32> {
        let mut v: Vec<f32> = (0..n).map(|_| rng.random::<f32>() - 0.5).collect();
        for x in v.chunks_mut(d) {
            l2_normalize(x);
        }
        v
    };
    let (q, k) = (unit(c * d), unit(c * d));
    let v: Vec<f32> = (0..c * d).map(|i| (i as f32 * 0.37).sin()).collect();
    let g: Vec<f32> = (0..c * d).map(|i| -5.0 + 0.001 * (i % 7) as f32).collect();
    let beta: Vec<f32> = (0..c).map(|t| 0.2 + 0.6 * ((t % 5) as f32) / 4.0).collect();
    let s0: Vec<f32> = (0..d * d).map(|i| i as f32 * 0.1).collect();
    let mut sc = s0.clone();
    let mut oc = vec![0f32; c * d];
    chunk_step(None, &mut sc, d, &q, &k, &v, &g, &beta, &mut oc);
    let mut ss = s0.clone();
    let mut os = vec![0f32; c * d];
    for (t, &bt) in beta.iter().enumerate() {
        let r = t * d..(t + 1) * d;
        let (qt, kt, vt, gt) = (&q[r.clone()], &k[r.clone()], &v[r.clone()], &g[r.clone()]);
        delta_step(None, &mut ss, d, Some(qt), kt, vt, gt, bt, Some(&mut os[r]));
    }
    assert!(oc.iter().chain(&sc).all(|x| x.is_finite()));
    assert!(rel_l2(&oc, &os) < 1e-5, "{}", rel_l2(&oc, &os));
    assert_all_close(&sc, &ss, 1e-6, "state");
}

#[test]
fn rollback_replays_to_any_length_since_commit() {
    let w = Owned::new(small_cfg(DecayGate::ScaledSigmoid { lower_bound: -5.0 }, 4), 11);
    let kda = w.kda();
    let h = 12;
    let prompt = tokens(1, 9, h);
    let draft = tokens(2, 5, h);
    let other = tokens(3, 2, h);
    // reference: prompt, then 2 draft tokens, then 2 other tokens, no rollback
    let mut plain = kda.new_state(0);
    let mut tmp = vec![0f32; prompt.len()];
    kda.prefill(&mut plain, &prompt, &mut tmp).unwrap();
    run_steps(&kda, &mut plain, &draft[..2 * h]);
    let want = run_steps(&kda, &mut plain, &other);

    let mut st = kda.new_state(8);
    kda.prefill(&mut st, &prompt, &mut tmp).unwrap();
    st.commit();
    assert_eq!(st.committed_len(), 9);
    let committed = st.recurrent().to_vec();
    // speculative: verify 5 draft tokens in one chunked call, accept 2
    let mut o = vec![0f32; draft.len()];
    kda.prefill(&mut st, &draft, &mut o).unwrap();
    assert_eq!(st.len(), 14);
    st.rollback(&kda, 11).unwrap();
    assert_eq!(st.len(), 11);
    let got = run_steps(&kda, &mut st, &other);
    assert!(rel_l2(&got, &want) < 1e-5, "{}", rel_l2(&got, &want));
    assert!(rel_l2(st.recurrent(), plain.recurrent()) < 1e-5);
    // back to the commit itself: the committed buffer was never written
    st.rollback(&kda, 9).unwrap();
    assert_eq!(st.recurrent(), &committed[..]);
    // out of range: past the end, before the commit
    assert!(matches!(st.rollback(&kda, 10), Err(KdaError::Rollback { .. })));
    run_steps(&kda, &mut st, &draft[..h]);
    st.commit();
    assert!(matches!(
        st.rollback(&kda, 9),
        Err(KdaError::Rollback {
            to: 9,
            len: 10,
            min: 10,
            ..
        })
    ));
}

#[test]
fn window_overflow_commits_first() {
    let w = Owned::new(small_cfg(DecayGate::Softplus, 4), 5);
    let kda = w.kda();
    let h = 12;
    let x = tokens(4, 6, h);
    let mut st = kda.new_state(3);
    run_steps(&kda, &mut st, &x[..2 * h]);
    assert_eq!(st.committed_len(), 0);
    // a 3-token forward would make 5 > 3 logged tokens: it commits at 2 first
    let mut o = vec![0f32; 3 * h];
    kda.prefill(&mut st, &x[2 * h..5 * h], &mut o).unwrap();
    assert_eq!(st.committed_len(), 2);
    st.rollback(&kda, 3).unwrap();
    // a forward longer than the window commits after itself too
    let mut o2 = vec![0f32; 4 * h];
    let mut st2 = kda.new_state(3);
    kda.prefill(&mut st2, &x[..4 * h], &mut o2).unwrap();
    assert_eq!(st2.committed_len(), 4);
}

#[test]
fn bad_shapes_and_inputs_are_errors() {
    let cfg = small_cfg(DecayGate::Softplus, 4);
    let w = Owned::new(cfg, 1);
    let kda = w.kda();
    let mut bad = kda.w;
    bad.dt_bias = &w.m[9][..5];
    assert!(matches!(
        Kda::new(cfg, bad),
        Err(KdaError::Shape { tensor: "dt_bias", .. })
    ));
    let lb = KdaConfig {
        decay_gate: DecayGate::ScaledSigmoid { lower_bound: 1.0 },
        ..cfg
    };
    assert!(matches!(Kda::new(lb, kda.w), Err(KdaError::Config { .. })));
    let mut st = kda.new_state(0);
    let mut out = vec![0f32; 12];
    assert!(matches!(
        kda.step(&mut st, &[0.0; 11], &mut out),
        Err(KdaError::Input { .. })
    ));
    let other = Owned::new(KdaConfig { head_dim: 4, ..cfg }, 1);
    let mut wrong_state = other.kda().new_state(0);
    assert!(matches!(
        kda.step(&mut wrong_state, &[0.0; 12], &mut out),
        Err(KdaError::State { .. })
    ));
}

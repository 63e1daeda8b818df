//! The Kimi Linear / K3 CUDA kernels (`deltafin-cuda` `kernels/kda.cu`) against the CPU
//! reference of this crate (`blocks::kda`, `models::kimi_linear`), on awkward shapes (head
//! widths and lengths that are not multiples of the warp or the block, several heads, the
//! in-place and the two-buffer update), with outputs poisoned with NaN before each run (ggml
//! `test-backend-ops` habit). Each test skips with one line when this machine has no CUDA device.

use deltafin_cuda::testing::{gpu_or_skip, nans, refusal, rel_l2};
use deltafin_cuda::{GpuBuf, GpuMat, KdaGate};
use deltafin_engine::blocks::kda::{delta_step, l2_normalize, DecayGate};
use deltafin_engine::models::kimi_linear::{attn_res_mix, glu_mlp, situ};
use deltafin_format::kimi_linear::GluActivation;
use deltafin_kernels::{mxfp4, sigmoid, silu, MatRef};
use rand::{rngs::StdRng, Rng, SeedableRng};

fn rand_vec(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// The kernels do the CPU's operations in the CPU's order; only libm functions (exp, tanh, log)
/// may differ in the last bit, so agreement is far below this.
const TOL: f64 = 1e-6;

#[test]
fn situ_glu_and_sigmoid_mul_match_the_cpu() {
    let Some(g) = gpu_or_skip("situ_glu_and_sigmoid_mul_match_the_cpu") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(30);
    for len in [1usize, 31, 255, 1000, 4097] {
        // Values up to ±60 reach the saturated regions of both tanh branches and of σ.
        let (a, b) = (rand_vec(&mut rng, len, 60.0), rand_vec(&mut rng, len, 60.0));
        let (da, db) = (g.upload(&a).unwrap(), g.upload(&b).unwrap());
        for lin in [Some(25.0f32), None] {
            let mut out = nans(&g, len);
            g.situ_glu(&da, &db, 4.0, lin, &mut out).unwrap();
            let want: Vec<f32> = a.iter().zip(&b).map(|(x, u)| situ(*x, *u, 4.0, lin)).collect();
            let err = rel_l2(&g.download(&out).unwrap(), &want);
            assert!(err < TOL, "situ_glu len={len} lin={lin:?}: {err:e}");
        }
        let mut o = g.upload(&a).unwrap();
        g.sigmoid_mul(&mut o, &db).unwrap();
        let want: Vec<f32> = a.iter().zip(&b).map(|(x, u)| x * sigmoid(*u)).collect();
        let err = rel_l2(&g.download(&o).unwrap(), &want);
        assert!(err < TOL, "sigmoid_mul len={len}: {err:e}");
    }
    let e = refusal(g.situ_glu(
        &g.zeros(3).unwrap(),
        &g.zeros(4).unwrap(),
        4.0,
        None,
        &mut g.zeros(3).unwrap(),
    ));
    assert!(e.contains("situ_glu"), "{e}");
}

/// The short conv over a few tokens: each token's row appended after the `K - 1` previous rows,
/// `silu(Σ_j w[c, j] row_j[c])` per channel, against the formula of `Kda::conv_rows`.
#[test]
fn kda_conv_step_matches_the_cpu_formula() {
    let Some(g) = gpu_or_skip("kda_conv_step_matches_the_cpu_formula") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(31);
    for (p, kk) in [(5usize, 4usize), (37, 3), (300, 4), (64, 1)] {
        let row = 3 * p;
        let n_tok = 6;
        let w: Vec<Vec<f32>> = (0..3).map(|_| rand_vec(&mut rng, p * kk, 1.0)).collect();
        let dw: Vec<GpuBuf> = w.iter().map(|v| g.upload(v).unwrap()).collect();
        // History: K - 1 zero rows, then one row per token.
        let mut hist = vec![0f32; (kk - 1) * row];
        let mut dh = g.zeros((kk - 1 + n_tok) * row).unwrap();
        for t in 0..n_tok {
            let parts: Vec<Vec<f32>> = (0..3).map(|_| rand_vec(&mut rng, p, 2.0)).collect();
            for part in &parts {
                hist.extend_from_slice(part);
            }
            let dp: Vec<GpuBuf> = parts.iter().map(|v| g.upload(v).unwrap()).collect();
            let mut out = nans(&g, row);
            g.kda_conv_step(
                &mut dh,
                t,
                [&dp[0], &dp[1], &dp[2]],
                [&dw[0], &dw[1], &dw[2]],
                kk,
                &mut out,
            )
            .unwrap();
            let r = kk - 1 + t;
            let want: Vec<f32> = (0..row)
                .map(|c| {
                    let (wv, wc) = (&w[c / p], c % p);
                    let mut acc = 0f32;
                    for j in 0..kk {
                        acc += wv[wc * kk + j] * hist[(r + 1 + j - kk) * row + c];
                    }
                    silu(acc)
                })
                .collect();
            let err = rel_l2(&g.download(&out).unwrap(), &want);
            assert!(err < TOL, "kda_conv_step p={p} K={kk} token {t}: {err:e}");
        }
        assert_eq!(g.download(&dh).unwrap()[..hist.len()], hist[..], "history rows p={p}");
    }
}

/// `kda_prepare` then `kda_delta` for several tokens against `l2_normalize`, `DecayGate::apply`,
/// `sigmoid` and `delta_step` (the CPU recurrence), both gates, head widths below, at and above
/// the block's 128 threads, the two-buffer first update and in-place updates after it, and an
/// update-only replay that must reproduce the state bit for bit.
#[test]
fn kda_prepare_and_delta_match_the_cpu_recurrence() {
    let Some(g) = gpu_or_skip("kda_prepare_and_delta_match_the_cpu_recurrence") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(32);
    let gates = [
        (KdaGate::Softplus, DecayGate::Softplus),
        (
            KdaGate::ScaledSigmoid { lower_bound: -5.0 },
            DecayGate::ScaledSigmoid { lower_bound: -5.0 },
        ),
    ];
    for (nh, d) in [(1usize, 8usize), (3, 24), (2, 128), (2, 160)] {
        for (kgate, cgate) in gates {
            let p = nh * d;
            let n_tok = 5;
            let a_log = rand_vec(&mut rng, nh, 1.0);
            let dt_bias = rand_vec(&mut rng, p, 1.0);
            let (da, ddt) = (g.upload(&a_log).unwrap(), g.upload(&dt_bias).unwrap());
            let q_scale = 1.0 / (d as f32).sqrt();
            let mut s_cpu = rand_vec(&mut rng, nh * d * d, 0.5);
            let init = s_cpu.clone();
            let mut rec = [g.upload(&s_cpu).unwrap(), nans(&g, nh * d * d)];
            let mut log = [
                nans(&g, n_tok * p),
                nans(&g, n_tok * p),
                nans(&g, n_tok * p),
                nans(&g, n_tok * nh),
            ];
            for t in 0..n_tok {
                let conv = rand_vec(&mut rng, 3 * p, 3.0);
                // u spans the softplus threshold (20) and both sides of 0.
                let u = rand_vec(&mut rng, p, 30.0);
                let braw = rand_vec(&mut rng, nh, 4.0);
                let mut q = nans(&g, p);
                {
                    let [lk, lv, lg, lb] = &mut log;
                    g.kda_prepare(
                        &g.upload(&conv).unwrap(),
                        &g.upload(&u).unwrap(),
                        &g.upload(&braw).unwrap(),
                        &da,
                        &ddt,
                        d,
                        kgate,
                        q_scale,
                        &mut q,
                        [lk, lv, lg, lb],
                        t,
                    )
                    .unwrap();
                }
                let mut o = nans(&g, p);
                {
                    let (a, b) = rec.split_at_mut(1);
                    let [lk, lv, lg, lb] = &log;
                    // Token 0: read buffer 0, write buffer 1; later tokens in place in buffer 1.
                    let src = if t == 0 { Some(&a[0]) } else { None };
                    g.kda_delta(src, &mut b[0], d, [lk, lv, lg, lb], t, Some((&q, &mut o)))
                        .unwrap();
                }
                // CPU: the same activations, then delta_step per head.
                let mut want_o = vec![0f32; p];
                let mut want_q = vec![0f32; p];
                for hh in 0..nh {
                    let r = hh * d..(hh + 1) * d;
                    let mut qh = conv[r.clone()].to_vec();
                    l2_normalize(&mut qh);
                    for e in qh.iter_mut() {
                        *e *= q_scale;
                    }
                    let mut kh = conv[p + hh * d..p + (hh + 1) * d].to_vec();
                    l2_normalize(&mut kh);
                    let vh = &conv[2 * p + hh * d..2 * p + (hh + 1) * d];
                    let gh: Vec<f32> = (0..d)
                        .map(|i| cgate.apply(a_log[hh], u[hh * d + i] + dt_bias[hh * d + i]))
                        .collect();
                    let beta = sigmoid(braw[hh]);
                    delta_step(
                        None,
                        &mut s_cpu[hh * d * d..(hh + 1) * d * d],
                        d,
                        Some(&qh),
                        &kh,
                        vh,
                        &gh,
                        beta,
                        Some(&mut want_o[r.clone()]),
                    );
                    want_q[r].copy_from_slice(&qh);
                }
                let err_q = rel_l2(&g.download(&q).unwrap(), &want_q);
                let err_o = rel_l2(&g.download(&o).unwrap(), &want_o);
                let err_s = rel_l2(&g.download(&rec[1]).unwrap(), &s_cpu);
                assert!(
                    err_q < TOL && err_o < TOL && err_s < TOL,
                    "nh={nh} d={d} {kgate:?} token {t}: q {err_q:e}, o {err_o:e}, state {err_s:e}"
                );
            }
            // The committed state (buffer 0) is untouched; replaying the log from it gives the
            // current state's bits.
            assert_eq!(g.download(&rec[0]).unwrap(), init, "committed buffer changed");
            let now = g.download(&rec[1]).unwrap();
            let mut replay = [g.upload(&init).unwrap(), nans(&g, nh * d * d)];
            for t in 0..n_tok {
                let (a, b) = replay.split_at_mut(1);
                let [lk, lv, lg, lb] = &log;
                let src = if t == 0 { Some(&a[0]) } else { None };
                g.kda_delta(src, &mut b[0], d, [lk, lv, lg, lb], t, None).unwrap();
            }
            assert_eq!(g.download(&replay[1]).unwrap(), now, "nh={nh} d={d}: replay differs");
        }
    }
}

/// The depth mix against `models::kimi_linear::attn_res_mix`: empty bank (identity), 1..9
/// entries, widths not multiples of the block, entries of very different norms.
#[test]
fn attn_res_mix_matches_the_cpu() {
    let Some(g) = gpu_or_skip("attn_res_mix_matches_the_cpu") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(33);
    for (n_bank, dim) in [(0usize, 7usize), (1, 33), (3, 257), (9, 7168), (5, 1000)] {
        let bank: Vec<Vec<f32>> = (0..n_bank)
            .map(|k| rand_vec(&mut rng, dim, 10f32.powi(k as i32 % 3)))
            .collect();
        let cur = rand_vec(&mut rng, dim, 3.0);
        let w = rand_vec(&mut rng, dim, 1.0);
        let flat: Vec<f32> = bank.concat();
        let db = g.upload(&if flat.is_empty() { vec![0f32] } else { flat }).unwrap();
        let mut out = nans(&g, dim);
        g.attn_res_mix(
            &db,
            n_bank,
            &g.upload(&cur).unwrap(),
            &g.upload(&w).unwrap(),
            1e-5,
            &mut out,
        )
        .unwrap();
        let want = attn_res_mix(&bank, &cur, &w, 1e-5);
        let got = g.download(&out).unwrap();
        if n_bank == 0 {
            assert_eq!(got, want, "an empty bank is the identity");
        }
        let err = rel_l2(&got, &want);
        assert!(err < TOL, "attn_res_mix n_bank={n_bank} dim={dim}: {err:e}");
    }
}

type HostMat = (usize, usize, Vec<u8>, Vec<u8>);

fn mref(m: &HostMat) -> MatRef<'_> {
    MatRef::mxfp4(m.0, m.1, &m.2, &m.3).unwrap()
}

/// The fused SiTU routed experts equal the unfused GPU path bit for bit (matvec, `situ_glu`,
/// matvec, axpy into a zeroed sum) and the CPU's `glu_mlp` + axpy within rounding, on MXFP4
/// experts with partial MX blocks (cols 100, inter 70) and 1, 5 and 16 experts.
#[test]
fn fused_situ_experts_equal_the_unfused_path_and_the_cpu() {
    let Some(g) = gpu_or_skip("fused_situ_experts_equal_the_unfused_path_and_the_cpu") else {
        return;
    };
    let mut rng = StdRng::seed_from_u64(34);
    let (cols, inter) = (100usize, 70usize);
    let act = GluActivation::Situ {
        beta: 4.0,
        linear_beta: Some(25.0),
    };
    let quant = |rng: &mut StdRng, rows: usize, cols: usize| {
        let w = rand_vec(rng, rows * cols, 1.0);
        let mut packed = vec![0u8; rows * mxfp4::packed_row_bytes(cols)];
        let mut scales = vec![0u8; rows * mxfp4::scale_row_bytes(cols)];
        mxfp4::quantize(&w, rows, cols, &mut packed, &mut scales);
        (rows, cols, packed, scales)
    };
    for k in [1usize, 5, 16] {
        let host: Vec<[HostMat; 3]> = (0..k)
            .map(|_| {
                [
                    quant(&mut rng, inter, cols),
                    quant(&mut rng, inter, cols),
                    quant(&mut rng, cols, inter),
                ]
            })
            .collect();
        let dev: Vec<[GpuMat; 3]> = host
            .iter()
            .map(|e| {
                [
                    GpuMat::upload(&g, &mref(&e[0])).unwrap(),
                    GpuMat::upload(&g, &mref(&e[1])).unwrap(),
                    GpuMat::upload(&g, &mref(&e[2])).unwrap(),
                ]
            })
            .collect();
        let refs: Vec<&[GpuMat; 3]> = dev.iter().collect();
        let weights = rand_vec(&mut rng, k, 1.0);
        let x = rand_vec(&mut rng, cols, 2.0);
        let dx = g.upload(&x).unwrap();
        let mut h = nans(&g, 16 * inter);
        let mut y = nans(&g, 16 * cols);
        let mut acc = nans(&g, cols);
        g.moe_situ_fused(&refs, &weights, (4.0, Some(25.0)), &dx, &mut h, &mut y, &mut acc)
            .unwrap();
        let fused = g.download(&acc).unwrap();
        // Unfused on the GPU.
        let mut sum = g.zeros(cols).unwrap();
        let (mut a, mut b, mut t, mut o) = (nans(&g, inter), nans(&g, inter), nans(&g, inter), nans(&g, cols));
        for (e, &wt) in dev.iter().zip(&weights) {
            e[0].matvec(&g, &dx, &mut a).unwrap();
            e[1].matvec(&g, &dx, &mut b).unwrap();
            g.situ_glu(&a, &b, 4.0, Some(25.0), &mut t).unwrap();
            e[2].matvec(&g, &t, &mut o).unwrap();
            g.axpy(wt, &o, &mut sum).unwrap();
        }
        assert_eq!(fused, g.download(&sum).unwrap(), "k={k}: fused differs from unfused");
        // CPU.
        let mut want = vec![0f32; cols];
        for (e, &wt) in host.iter().zip(&weights) {
            let out = glu_mlp(act, mref(&e[0]), mref(&e[1]), mref(&e[2]), &x);
            deltafin_kernels::axpy(wt, &out, &mut want);
        }
        let err = rel_l2(&fused, &want);
        assert!(err < 1e-5, "k={k}: fused SiTU experts vs CPU {err:e}");
    }
}

//! The KDA block against transformers' `KimiLinearDeltaAttention` (golden input/output of one
//! layer, written by tests/fixtures/kimi_linear/make_fixtures.py):
//! - `kl_a`, `kl_b`: layer 1 / 2 of tiny Kimi-Linear checkpoints (softplus decay, low-rank output
//!   gate; conv kernel 4 with 2 heads of 16, conv kernel 3 with 4 heads of 8);
//! - `kda_k3`: one layer in Kimi K3's variant (gate_lower_bound, full-rank `g_proj`).
//!
//! The reference ran the prompt through its chunked torch path (chunk 8) and then each decode token
//! through its recurrent path. Here the prompt runs chunked (several chunk sizes, and split in two
//! calls) and token by token, the decode tokens by `step`; every output and the recurrent state
//! after each phase must be within relative L2 1e-4 of the reference.

use std::path::{Path, PathBuf};

use deltafin_engine::blocks::kda::{DecayGate, Kda, KdaConfig, KdaState, KdaTensorNames, KdaWeights, OutputGate};
use deltafin_format::checkpoint::Checkpoint;
use deltafin_kernels::{MatData, MatRef};
use serde_json::Value;

const TOL: f32 = 1e-4;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/kimi_linear")
        .join(case)
}

fn floats(v: &Value) -> Vec<f32> {
    v.as_array()
        .expect("array")
        .iter()
        .map(|x| x.as_f64().expect("number") as f32)
        .collect()
}

fn rel_l2(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len());
    let num: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
    let den: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
    (num / den).sqrt() as f32
}

/// One layer's tensors read from the fixture checkpoint as f32.
struct Layer {
    cfg: KdaConfig,
    full_rank: bool,
    t: Vec<Vec<f32>>,
    golden: Value,
}

impl Layer {
    fn load(case: &str) -> Layer {
        let dir = fixture(case);
        let golden: Value =
            serde_json::from_str(&std::fs::read_to_string(dir.join("kda_layer_golden.json")).unwrap()).unwrap();
        let u = |k: &str| golden[k].as_u64().unwrap() as usize;
        let (h, nh, d, kk) = (u("hidden_size"), u("num_heads"), u("head_dim"), u("conv_kernel_size"));
        let p = nh * d;
        let decay_gate = match golden["decay_gate"].as_str().unwrap() {
            "softplus" => DecayGate::Softplus,
            "lower_bound" => DecayGate::ScaledSigmoid {
                lower_bound: golden["gate_lower_bound"].as_f64().unwrap() as f32,
            },
            other => panic!("unknown gate {other}"),
        };
        let full_rank = golden["output_gate"] == "full_rank";
        let cfg = KdaConfig {
            layer: u("layer"),
            hidden_size: h,
            num_heads: nh,
            head_dim: d,
            conv_kernel_size: kk,
            norm_eps: golden["rms_norm_eps"].as_f64().unwrap() as f32,
            decay_gate,
            chunk_size: 16,
        };
        let prefix = golden["tensor_prefix"]
            .as_str()
            .unwrap()
            .trim_end_matches('.')
            .to_string();
        let n = KdaTensorNames::new(&prefix);
        let ck = Checkpoint::open(&dir).unwrap();
        // A_log is [1, 1, heads, 1] in Kimi Linear and [heads] in K3.
        let a_log_shape = ck.entry(&n.a_log).unwrap().shape.clone();
        assert_eq!(a_log_shape.iter().product::<usize>(), nh);
        let mut specs: Vec<(&str, Vec<usize>)> = vec![
            (&n.q_proj, vec![p, h]),
            (&n.k_proj, vec![p, h]),
            (&n.v_proj, vec![p, h]),
            (&n.q_conv1d, vec![p, 1, kk]),
            (&n.k_conv1d, vec![p, 1, kk]),
            (&n.v_conv1d, vec![p, 1, kk]),
            (&n.f_a_proj, vec![d, h]),
            (&n.f_b_proj, vec![p, d]),
            (&n.a_log, a_log_shape),
            (&n.dt_bias, vec![p]),
            (&n.b_proj, vec![nh, h]),
            (&n.o_norm, vec![d]),
            (&n.o_proj, vec![h, p]),
        ];
        if full_rank {
            specs.push((&n.g_proj, vec![p, h]));
        } else {
            specs.push((&n.g_a_proj, vec![d, h]));
            specs.push((&n.g_b_proj, vec![p, d]));
        }
        let t = specs
            .iter()
            .map(|(name, shape)| ck.read_f32(name, shape).unwrap())
            .collect();
        Layer {
            cfg,
            full_rank,
            t,
            golden,
        }
    }

    fn kda(&self, chunk_size: usize) -> Kda<'_> {
        let c = &self.cfg;
        let (h, p, d, nh) = (c.hidden_size, c.proj_dim(), c.head_dim, c.num_heads);
        let m = |i: usize, r: usize, cc: usize| MatRef::new(r, cc, MatData::F32(&self.t[i])).unwrap();
        let output_gate = if self.full_rank {
            OutputGate::FullRank(m(13, p, h))
        } else {
            OutputGate::LowRank {
                a: m(13, d, h),
                b: m(14, p, d),
            }
        };
        Kda::new(
            KdaConfig { chunk_size, ..*c },
            KdaWeights {
                q_proj: m(0, p, h),
                k_proj: m(1, p, h),
                v_proj: m(2, p, h),
                q_conv: &self.t[3],
                k_conv: &self.t[4],
                v_conv: &self.t[5],
                f_a_proj: m(6, d, h),
                f_b_proj: m(7, p, d),
                a_log: &self.t[8],
                dt_bias: &self.t[9],
                b_proj: m(10, nh, h),
                output_gate,
                o_norm: &self.t[11],
                o_proj: m(12, h, p),
            },
        )
        .unwrap()
    }
}

/// Runs the decode tokens by `step` and checks outputs and the final state.
fn check_decode(case: &str, what: &str, kda: &Kda, st: &mut KdaState, g: &Value) {
    let h = kda.cfg.hidden_size;
    let x = floats(&g["decode"]["input"]);
    let want = floats(&g["decode"]["output"]);
    let mut got = vec![0f32; x.len()];
    for (xt, ot) in x.chunks(h).zip(got.chunks_mut(h)) {
        kda.step(st, xt, ot).unwrap();
    }
    for (t, (a, b)) in got.chunks(h).zip(want.chunks(h)).enumerate() {
        let e = rel_l2(a, b);
        assert!(e <= TOL, "{case} {what}: decode step {t} output rel L2 {e}");
    }
    let e = rel_l2(st.recurrent(), &floats(&g["recurrent_state_after_decode"]));
    assert!(e <= TOL, "{case} {what}: state after decode rel L2 {e}");
}

fn check_case(case: &str) {
    let layer = Layer::load(case);
    let g = &layer.golden;
    let h = layer.cfg.hidden_size;
    let x = floats(&g["prefill"]["input"]);
    let want = floats(&g["prefill"]["output"]);
    let want_state = floats(&g["recurrent_state_after_prefill"]);
    let n = x.len() / h;
    assert!(
        n > g["reference_chunk_size"].as_u64().unwrap() as usize,
        "the prompt must span several reference chunks"
    );
    let mut chunked_out: Option<Vec<f32>> = None;
    for chunk in [1, 5, 8, 16, 64] {
        let kda = layer.kda(chunk);
        let what = format!("chunk {chunk}");
        let mut st = kda.new_state(0);
        let mut got = vec![0f32; x.len()];
        kda.prefill(&mut st, &x, &mut got).unwrap();
        for (t, (a, b)) in got.chunks(h).zip(want.chunks(h)).enumerate() {
            let e = rel_l2(a, b);
            assert!(e <= TOL, "{case} {what}: prefill position {t} output rel L2 {e}");
        }
        let e = rel_l2(st.recurrent(), &want_state);
        assert!(e <= TOL, "{case} {what}: state after prefill rel L2 {e}");
        check_decode(case, &what, &kda, &mut st, g);
        if chunk == 8 {
            chunked_out = Some(got);
        }
    }
    // token by token
    let kda = layer.kda(16);
    let mut st = kda.new_state(4);
    let mut steps = vec![0f32; x.len()];
    for (xt, ot) in x.chunks(h).zip(steps.chunks_mut(h)) {
        kda.step(&mut st, xt, ot).unwrap();
    }
    let e = rel_l2(&steps, &want);
    assert!(e <= TOL, "{case} token by token: prefill rel L2 {e}");
    // chunked == token by token (tighter: both are ours)
    let e = rel_l2(chunked_out.as_ref().unwrap(), &steps);
    assert!(e <= 1e-5, "{case}: chunked vs token by token rel L2 {e}");
    check_decode(case, "token by token", &kda, &mut st, g);
    // the prompt in two prefill calls whose split is not a chunk multiple
    let split = 21 * h;
    let mut st = kda.new_state(0);
    let mut got = vec![0f32; x.len()];
    kda.prefill(&mut st, &x[..split], &mut got[..split]).unwrap();
    kda.prefill(&mut st, &x[split..], &mut got[split..]).unwrap();
    let e = rel_l2(&got, &want);
    assert!(e <= TOL, "{case} split prefill: rel L2 {e}");
    check_decode(case, "split prefill", &kda, &mut st, g);
}

#[test]
fn kimi_linear_kda_layer_matches_transformers() {
    check_case("kl_a");
}

#[test]
fn kimi_linear_kda_layer_kernel_3_matches_transformers() {
    check_case("kl_b");
}

#[test]
fn k3_kda_layer_matches_reference() {
    check_case("kda_k3");
}

#[test]
fn speculative_rollback_reproduces_reference_decode() {
    // Prefill, then "verify" the reference decode tokens plus junk in one chunked call, roll back
    // to the accepted length, and decode the rest by step: the outputs still match.
    let layer = Layer::load("kl_a");
    let g = &layer.golden;
    let kda = layer.kda(8);
    let h = kda.cfg.hidden_size;
    let x = floats(&g["prefill"]["input"]);
    let dx = floats(&g["decode"]["input"]);
    let dy = floats(&g["decode"]["output"]);
    let mut st = kda.new_state(8);
    let mut o = vec![0f32; x.len()];
    kda.prefill(&mut st, &x, &mut o).unwrap();
    st.commit();
    let n0 = st.len();
    // 3 real decode tokens followed by 2 rejected ones (decode tokens 6 and 5 in the wrong place)
    let mut draft = dx[..3 * h].to_vec();
    draft.extend_from_slice(&dx[6 * h..7 * h]);
    draft.extend_from_slice(&dx[5 * h..6 * h]);
    let mut dout = vec![0f32; draft.len()];
    kda.prefill(&mut st, &draft, &mut dout).unwrap();
    for t in 0..3 {
        let e = rel_l2(&dout[t * h..(t + 1) * h], &dy[t * h..(t + 1) * h]);
        assert!(e <= TOL, "draft token {t}: rel L2 {e}");
    }
    st.rollback(&kda, n0 + 3).unwrap();
    let mut out = vec![0f32; h];
    for t in 3..dx.len() / h {
        kda.step(&mut st, &dx[t * h..(t + 1) * h], &mut out).unwrap();
        let e = rel_l2(&out, &dy[t * h..(t + 1) * h]);
        assert!(e <= TOL, "decode {t} after rollback: rel L2 {e}");
    }
    let e = rel_l2(st.recurrent(), &floats(&g["recurrent_state_after_decode"]));
    assert!(e <= TOL, "state after rollback + decode: rel L2 {e}");
}

//! Multi-token passes are exact: batched (expert-major) prefill gives the logits of
//! token-at-a-time processing bit for bit, speculative decoding gives the greedy output of plain
//! decoding, and a rolled-back decode state continues exactly like a fresh one.
//!
//! Models: the committed transformers fixtures (`tests/fixtures/deepseek_v3/dsv3_{a,b,c}`,
//! `qwen3_moe`, `mixtral`, `gpt_oss`, converted with the default int8 backbone and MXFP4
//! experts) and the `tiny` and `demo` synthetic shapes (`deltafin_format::synth`, written as
//! checkpoints and converted); Kimi Linear / K3 within rounding (see their test).
//!
//! Tolerance: 0. The batched kernels compute every row exactly as the one-token kernels do
//! (`MatRef::matmul` equals `n` matvecs bit for bit), attention runs the same per-head
//! operations, and routed experts are summed in the same (router) order, so equality is exact;
//! any difference is a bug, not rounding.

use std::path::{Path, PathBuf};

use deltafin_engine::experts::StoreOptions;
use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::sampler::{Sampler, SamplingParams};
use deltafin_engine::speculate::{SpeculateMode, Speculator};
use deltafin_engine::{load_model, BatchForm, CausalLm};
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::synth::{write_checkpoint, SynthSpec};
use deltafin_format::ModelDir;

fn fixture(case: &str, tmp: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(case);
    let out = tmp.join(case);
    convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    out
}

fn synth(name: &str, spec: &SynthSpec, tmp: &Path) -> PathBuf {
    let hf = tmp.join(format!("{name}-hf"));
    write_checkpoint(&hf, spec, 0, 1).unwrap();
    let out = tmp.join(name);
    convert(&hf, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    out
}

/// A model with `budget` bytes of expert cache and `readers` reader threads (1 reader makes the
/// expert-major window `top_k + 1`, smaller than a chunk's union of experts).
fn load(dir: &Path, budget: u64, readers: usize) -> Box<dyn CausalLm> {
    let mut o = StoreOptions::new(budget);
    o.readers = readers;
    load_model(&ModelDir::open(dir).unwrap(), o).unwrap()
}

/// As [`load`], with batched passes in `form`.
fn load_form(dir: &Path, budget: u64, readers: usize, form: BatchForm) -> Box<dyn CausalLm> {
    let mut m = load(dir, budget, readers);
    m.routed_mut().set_batch_form(form);
    m
}

/// Relative L2 distance `‖a − b‖ / ‖a‖`.
fn rel_l2(a: &[f32], b: &[f32]) -> f64 {
    let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
    let den: f64 = a.iter().map(|x| (*x as f64).powi(2)).sum();
    (num / den).sqrt()
}

fn prompt(model: &dyn CausalLm, n: usize, seed: u32) -> Vec<u32> {
    let v = model.vocab_size() as u32;
    (0..n as u32).map(|i| (i * 7919 + seed * 131 + 3) % v).collect()
}

/// Every position's logits, one forward per token.
fn token_at_a_time(model: &dyn CausalLm, tokens: &[u32]) -> Vec<Vec<f32>> {
    let mut st = model.new_state();
    tokens
        .iter()
        .map(|&t| model.forward(st.as_mut(), t).unwrap().0)
        .collect()
}

/// Every position's logits, in batched passes of `chunk` tokens.
fn chunked(model: &dyn CausalLm, tokens: &[u32], chunk: usize) -> Vec<Vec<f32>> {
    let mut st = model.new_state();
    let mut out = Vec::new();
    for c in tokens.chunks(chunk) {
        let o = model.forward_batch(st.as_mut(), c, true).unwrap();
        assert_eq!(o.logits.len(), c.len());
        assert_eq!(o.routes.len(), c.len());
        out.extend(o.logits);
    }
    assert_eq!(st.len(), tokens.len());
    out
}

fn assert_bit_identical(what: &str, a: &[Vec<f32>], b: &[Vec<f32>]) {
    assert_eq!(a.len(), b.len(), "{what}: positions");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        let same = x.len() == y.len() && x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits());
        if !same {
            let d = x.iter().zip(y).map(|(p, q)| (p - q).abs()).fold(0f32, f32::max);
            panic!("{what}: position {i} differs (max |Δ| {d:e})");
        }
    }
}

/// Batched prefill in the exact form equals token at a time bit for bit (chunks of 1, 7 and the
/// whole prompt); in the fast form (decompressed MLA: what `fast` picks for long prompt chunks)
/// within relative L2 1e-5 at every position, with the same argmax, and for an MLA family
/// (`mla`) visibly different from the exact form (so the test sees it).
fn check_prefill(name: &str, dir: &Path, n: usize, mla: bool) {
    // Budget 0 (nothing stays cached; every chunk's union exceeds the cache) with one reader,
    // and a roomy cache with the default readers.
    for (budget, readers) in [(0u64, 1usize), (64 << 20, 0)] {
        let mut model = load_form(dir, budget, readers, BatchForm::Exact);
        let p = prompt(model.as_ref(), n, 1);
        let reference = token_at_a_time(model.as_ref(), &p);
        for chunk in [1, 7, n] {
            let got = chunked(model.as_ref(), &p, chunk);
            assert_bit_identical(&format!("{name} budget {budget} chunk {chunk}"), &reference, &got);
        }
        // Last-position logits only.
        let mut st = model.new_state();
        let last = model.forward_batch(st.as_mut(), &p, false).unwrap();
        assert_eq!(last.logits.len(), 1);
        assert_bit_identical(&format!("{name} last only"), &reference[n - 1..], &last.logits);
        model.routed_mut().set_batch_form(BatchForm::FastAlways);
        let mut worst = 0f64;
        for chunk in [7, n] {
            let got = chunked(model.as_ref(), &p, chunk);
            for (i, (a, b)) in reference.iter().zip(&got).enumerate() {
                let rel = rel_l2(a, b);
                worst = worst.max(rel);
                assert!(
                    rel < 1e-5,
                    "{name} fast form, chunk {chunk}, position {i}: rel L2 {rel:e}"
                );
                assert_eq!(
                    deltafin_kernels::argmax(a),
                    deltafin_kernels::argmax(b),
                    "{name} fast form, chunk {chunk}, position {i}: argmax"
                );
            }
        }
        assert!(!mla || worst > 0.0, "{name}: the decompressed MLA form was not used");
        eprintln!("{name} budget {budget}: fast batched form vs token at a time, max rel L2 {worst:.3e}");
    }
}

#[test]
fn batched_prefill_equals_token_at_a_time_on_the_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["dsv3_a", "dsv3_b", "dsv3_c"] {
        let dir = fixture(case, tmp.path());
        check_prefill(case, &dir, 23, true);
    }
}

#[test]
fn batched_prefill_equals_token_at_a_time_on_synthetic_models() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = synth("tiny", &SynthSpec::tiny(300), tmp.path());
    check_prefill("tiny", &tiny, 40, true);
    let demo = synth("demo", &SynthSpec::demo(320), tmp.path());
    check_prefill("demo", &demo, 30, true);
}

/// Greedy ids of plain decoding and of `spec`, both after the same prompt; also checks the
/// state length after every step.
fn decode(model: &dyn CausalLm, p: &[u32], n: usize, mut spec: Speculator) -> (Vec<u32>, Speculator) {
    let mut st = model.new_state();
    let o = model.forward_batch(st.as_mut(), p, false).unwrap();
    let mut chooser = Sampler::new(SamplingParams::default());
    let mut ctx = p.to_vec();
    ctx.push(chooser.sample(&o.logits[0]));
    while ctx.len() < p.len() + n {
        let s = spec.step(model, st.as_mut(), &ctx, &mut chooser).unwrap();
        assert!(!s.tokens.is_empty());
        ctx.extend(&s.tokens);
        assert_eq!(st.len(), ctx.len() - 1, "state holds everything but the last token");
    }
    ctx.truncate(p.len() + n);
    (ctx[p.len()..].to_vec(), spec)
}

fn check_speculation(name: &str, model: &dyn CausalLm, p: &[u32], n: usize, fixed: &[usize]) {
    let (plain, _) = decode(model, p, n, Speculator::new(SpeculateMode::Off));
    for mode in [SpeculateMode::Lookup, SpeculateMode::SelfDraft, SpeculateMode::Auto] {
        let (ids, spec) = decode(model, p, n, Speculator::new(mode));
        assert_eq!(
            ids, plain,
            "{name}: --speculate {mode} (adaptive) changed the greedy output"
        );
        for &k in fixed {
            let (ids, spec_k) = decode(model, p, n, Speculator::new(mode).with_fixed_draft(k));
            assert_eq!(ids, plain, "{name}: --speculate {mode}, {k} drafted tokens per pass");
            if mode != SpeculateMode::Lookup {
                assert!(spec_k.stats.passes > 0, "{name}: {mode} k={k} never verified a draft");
            }
        }
        let _ = spec;
    }
}

#[test]
fn speculation_keeps_greedy_output_on_the_fixtures() {
    let tmp = tempfile::tempdir().unwrap();
    for case in ["dsv3_a", "dsv3_b", "dsv3_c"] {
        let dir = fixture(case, tmp.path());
        // A small cache, so self-drafting routes among a changing resident subset.
        let model = load(&dir, 16 << 10, 0);
        let p = prompt(model.as_ref(), 9, 2);
        check_speculation(case, model.as_ref(), &p, 40, &[1, 3, 8]);
        // And through `generate` with its options, every mode.
        let base = GenerateOptions {
            max_new_tokens: 40,
            ignore_eos: true,
            ..Default::default()
        };
        let plain = generate(
            model.as_ref(),
            &p,
            &GenerateOptions {
                speculate: SpeculateMode::Off,
                prefill_chunk: 1,
                ..base.clone()
            },
            |_| true,
        )
        .unwrap();
        for (mode, chunk) in [
            (SpeculateMode::Auto, 0),
            (SpeculateMode::Lookup, 4),
            (SpeculateMode::SelfDraft, 0),
        ] {
            let o = generate(
                model.as_ref(),
                &p,
                &GenerateOptions {
                    speculate: mode,
                    prefill_chunk: chunk,
                    ..base.clone()
                },
                |_| true,
            )
            .unwrap();
            assert_eq!(
                o.generated_ids, plain.generated_ids,
                "{case}: generate --speculate {mode}"
            );
            let toks: usize = o
                .stats
                .steps
                .iter()
                .filter(|s| s.kind != "prefill")
                .map(|s| s.tokens)
                .sum();
            assert_eq!(toks + 1, o.generated_ids.len(), "{case}: step token counts");
        }
    }
}

#[test]
fn speculation_keeps_greedy_output_on_a_long_demo_generation() {
    let tmp = tempfile::tempdir().unwrap();
    let demo = synth("demo", &SynthSpec::demo(320), tmp.path());
    // 4 MiB: about a third of one layer's experts stay resident.
    let model = load(&demo, 4 << 20, 0);
    let p = prompt(model.as_ref(), 12, 3);
    check_speculation("demo", model.as_ref(), &p, 200, &[4]);
}

#[test]
fn rollback_continues_like_a_fresh_state() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = fixture("dsv3_b", tmp.path());
    let model = load(&dir, 1 << 20, 0);
    let a = prompt(model.as_ref(), 12, 4);
    let b = prompt(model.as_ref(), 5, 5);
    let mut st = model.new_state();
    model.forward_batch(st.as_mut(), &a, false).unwrap();
    let full_bytes = st.bytes();
    assert!(st.truncate(7));
    assert_eq!(st.len(), 7);
    assert!(st.truncate(9), "truncating past the end is a no-op");
    assert_eq!(st.len(), 7);
    assert!(st.bytes() <= full_bytes);
    let rolled = model.forward_batch(st.as_mut(), &b, true).unwrap().logits;
    let mut fresh_tokens = a[..7].to_vec();
    fresh_tokens.extend(&b);
    let fresh = token_at_a_time(model.as_ref(), &fresh_tokens);
    assert_bit_identical("rollback", &fresh[7..], &rolled);
    // Self-drafting leaves no trace in the state once rolled back.
    let mut st2 = model.new_state();
    model.forward_batch(st2.as_mut(), &a[..7], false).unwrap();
    for &t in &b {
        assert!(model.forward_draft(st2.as_mut(), t).unwrap().is_some());
    }
    assert!(st2.truncate(7));
    let again = model.forward_batch(st2.as_mut(), &b, true).unwrap().logits;
    assert_bit_identical("rollback after drafting", &fresh[7..], &again);
    assert!(st2.truncate(0));
    assert!(st2.is_empty());
}

/// The expert-major pass also completes when called from the only thread of a rayon pool (it
/// then runs its own expert tasks while it waits), with a window smaller than the union.
#[test]
fn batched_prefill_inside_a_one_thread_pool() {
    let tmp = tempfile::tempdir().unwrap();
    let tiny = synth("tiny", &SynthSpec::tiny(300), tmp.path());
    let model = load(&tiny, 0, 1);
    let p = prompt(model.as_ref(), 16, 6);
    let reference = token_at_a_time(model.as_ref(), &p);
    let pool = rayon::ThreadPoolBuilder::new().num_threads(1).build().unwrap();
    let got = pool.install(|| chunked(model.as_ref(), &p, 16));
    assert_bit_identical("one-thread pool", &reference, &got);
}

/// A fixture of `family` (Kimi Linear / K3, Qwen3-Next, Qwen3.5-MoE) converted in the default
/// layout.
fn kimi_fixture(family: &str, case: &str, tmp: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(family)
        .join(case);
    let out = tmp.join(case);
    convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    out
}

/// Batched prefill of `family/case` (converted in the default layout) equals token at a time
/// within relative L2 `bound` at every position of an `n`-token prompt, with the same argmax, for
/// chunks of 1, 7 and `n` tokens, with a cache too small for a chunk's experts and a large one.
fn check_batched_within(family: &str, case: &str, bound: f64, n: usize, tmp: &Path) {
    let dir = kimi_fixture(family, case, tmp);
    for (budget, readers) in [(0u64, 1usize), (64 << 20, 0)] {
        let mut model = load(&dir, budget, readers);
        let p = prompt(model.as_ref(), n, 2);
        let reference = token_at_a_time(model.as_ref(), &p);
        let mut worst = 0f64;
        // Both batched forms (the fast one: decompressed MLA).
        for (form, chunk) in [
            (BatchForm::Exact, 1),
            (BatchForm::Exact, 7),
            (BatchForm::Exact, n),
            (BatchForm::FastAlways, 7),
            (BatchForm::FastAlways, n),
        ] {
            model.routed_mut().set_batch_form(form);
            let got = chunked(model.as_ref(), &p, chunk);
            for (i, (a, b)) in reference.iter().zip(&got).enumerate() {
                let rel = rel_l2(a, b);
                worst = worst.max(rel);
                assert!(
                    rel < bound,
                    "{case} budget {budget} {form:?} chunk {chunk} position {i}: rel L2 {rel:e}"
                );
                assert_eq!(
                    deltafin_kernels::argmax(a),
                    deltafin_kernels::argmax(b),
                    "{case} {form:?} chunk {chunk} position {i}: argmax"
                );
            }
        }
        eprintln!("{case} budget {budget}: batched vs token at a time, max rel L2 {worst:.3e}");
    }
}

/// Kimi Linear and K3: batched prefill (KDA chunked form over the whole chunk, MLA token by
/// token, expert-major MoE) equals token at a time within f32 rounding — the KDA chunked form is
/// the recurrence's algebra in another summation order, so not bit for bit: every position's
/// logits within relative L2 1e-5 (Kimi Linear) and the same argmax. The tiny random K3 fixtures
/// amplify f32 rounding ~1000× (a 1e-6 relative weight change moves their logits by up to
/// 7.5e-4, tests/fixtures/kimi_k3/README.md), so their bound is 1e-3.
#[test]
fn kimi_batched_prefill_equals_token_at_a_time_within_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, case) in [
        ("kimi_linear", "kl_a"),
        ("kimi_linear", "kl_b"),
        ("kimi_k3", "k3_a"),
        ("kimi_k3", "k3_b"),
    ] {
        let bound = if family == "kimi_k3" { 1e-3 } else { 1e-5 };
        check_batched_within(family, case, bound, 37, tmp.path());
    }
}

/// Qwen3-Next / Qwen3.5-MoE: batched prefill (gated DeltaNet in chunks of 64, attention token by
/// token, expert-major MoE) equals token at a time (the DeltaNet recurrence) within f32
/// rounding; 70 tokens, so the whole-prompt chunk spans two DeltaNet chunks. The chunked form
/// differences cumulative log-decays summed over up to 64 tokens, so it is not bit for bit:
/// measured max rel L2 2.0e-5 (qwen3_5_moe_b, whole-prompt chunk), bound 1e-4 (the lossless
/// bound against transformers).
#[test]
fn qwen3_next_batched_prefill_equals_token_at_a_time_within_rounding() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, case) in [
        ("qwen3_next", "qwen3_next_a"),
        ("qwen3_next", "qwen3_next_b"),
        ("qwen3_5_moe", "qwen3_5_moe_a"),
        ("qwen3_5_moe", "qwen3_5_moe_b"),
    ] {
        check_batched_within(family, case, 1e-4, 70, tmp.path());
    }
}

/// Speculative decoding with the prompt-lookup drafter on `family/case` keeps the greedy output
/// of plain decoding, for adaptive and fixed draft lengths; a repetitive prompt makes the drafter
/// propose, so verification and rollback of the recurrent states really run. Returns the model
/// directory, the prompt and the plain greedy continuation for further checks.
fn check_lookup_speculation(family: &str, case: &str, tmp: &Path) -> (PathBuf, Vec<u32>, Vec<u32>) {
    let dir = kimi_fixture(family, case, tmp);
    let model = load(&dir, 64 << 20, 0);
    let p: Vec<u32> = (0..18).map(|i| [11u32, 23, 37, 41, 53, 67][i % 6]).collect();
    let (plain, _) = decode(model.as_ref(), &p, 24, Speculator::new(SpeculateMode::Off));
    let (auto, _) = decode(model.as_ref(), &p, 24, Speculator::new(SpeculateMode::Auto));
    assert_eq!(auto, plain, "{case}: --speculate auto");
    let mut passes = 0;
    for k in [1, 3, 8] {
        let (ids, s) = decode(
            model.as_ref(),
            &p,
            24,
            Speculator::new(SpeculateMode::Lookup).with_fixed_draft(k),
        );
        assert_eq!(ids, plain, "{case}: --speculate lookup, {k} drafted tokens per pass");
        passes += s.stats.passes;
    }
    assert!(passes > 0, "{case}: the lookup drafter never proposed");
    (dir, p, plain)
}

/// Self-drafting keeps the greedy output `plain` of prompt `p` on the model at `dir`, with every
/// expert resident (the drafter is then the model itself: drafts are accepted and long rollbacks
/// of the recurrent states run) and with none (drafts from the shared experts alone).
fn check_self_drafting(case: &str, dir: &Path, p: &[u32], plain: &[u32]) {
    for budget in [64u64 << 20, 0] {
        let model = load(dir, budget, 0);
        let mut accepted = 0;
        for k in [1, 4] {
            let (ids, s) = decode(
                model.as_ref(),
                p,
                24,
                Speculator::new(SpeculateMode::SelfDraft).with_fixed_draft(k),
            );
            assert_eq!(
                ids, plain,
                "{case}: --speculate self, budget {budget}, {k} drafted per pass"
            );
            assert!(s.stats.passes > 0, "{case}: self-drafting never ran");
            accepted += s.stats.accepted[1];
        }
        if budget > 0 {
            assert!(
                accepted > 0,
                "{case}: with every expert resident, self-drafts must be accepted"
            );
        }
    }
}

/// [`check_lookup_speculation`] and [`check_self_drafting`] on every `(family, case)`.
fn speculation_keeps_greedy_output_on(cases: &[(&str, &str)]) {
    let tmp = tempfile::tempdir().unwrap();
    for &(family, case) in cases {
        let (dir, p, plain) = check_lookup_speculation(family, case, tmp.path());
        check_self_drafting(case, &dir, &p, &plain);
    }
}

/// Speculative decoding on Qwen3-Next / Qwen3.5-MoE (lookup and self-drafting) rolls the gated
/// DeltaNet states back (replay from the committed state) and the attention caches, and keeps
/// the greedy output.
#[test]
fn qwen3_next_speculation_keeps_greedy_output() {
    speculation_keeps_greedy_output_on(&[("qwen3_next", "qwen3_next_a"), ("qwen3_5_moe", "qwen3_5_moe_b")]);
}

/// Speculative decoding on Kimi Linear / K3 rolls the KDA states back (no state copies) and keeps
/// the greedy output: prompt lookup (a repetitive prompt makes it propose, so verification and
/// rollback really run) and self-drafting, both with every expert resident (the drafter is then
/// the model itself, so drafts are accepted and long rollbacks happen) and with none (drafts from
/// the shared experts alone, mostly rejected).
#[test]
fn kimi_speculation_keeps_greedy_output() {
    speculation_keeps_greedy_output_on(&[("kimi_linear", "kl_b"), ("kimi_k3", "k3_a")]);
}

/// The GQA families (Qwen3-MoE with dense and MoE layers and q/k norms; Mixtral with and without
/// a sliding window of 6; gpt-oss with sinks, biases and a window of 4 on some layers): batched
/// prefill (GQA over the chunk through the blocked kernel, expert-major MoE) equals token at a
/// time bit for bit (tolerance 0, as for DeepSeek-V3: the same per-row kernels, the same
/// per-(token, head) operations, the experts summed in the same order). 23 tokens with chunks of
/// 7 put chunk boundaries inside and across the windows.
#[test]
fn gqa_batched_prefill_equals_token_at_a_time() {
    let tmp = tempfile::tempdir().unwrap();
    for (family, case) in [
        ("qwen3_moe", "qwen3_moe_a"),
        ("qwen3_moe", "qwen3_moe_b"),
        ("mixtral", "mixtral_a"),
        ("mixtral", "mixtral_b"),
        ("gpt_oss", "gpt_oss_a"),
        ("gpt_oss", "gpt_oss_b"),
    ] {
        let dir = kimi_fixture(family, case, tmp.path());
        check_prefill(case, &dir, 23, false);
    }
}

/// Speculation keeps the greedy output of plain decoding on the GQA families: prompt lookup
/// (verification through the batched pass, rollback of the KV cache; the repetitive prompt makes
/// the drafter propose) and self-drafting with all and with no experts resident.
#[test]
fn gqa_speculation_keeps_greedy_output() {
    speculation_keeps_greedy_output_on(&[
        ("qwen3_moe", "qwen3_moe_b"),
        ("mixtral", "mixtral_b"),
        ("gpt_oss", "gpt_oss_a"),
    ]);
}

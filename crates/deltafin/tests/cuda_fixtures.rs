//! The CUDA forward pass (`--device cuda`) against Hugging Face transformers' goldens and against
//! the CPU path, on the reference fixtures of the families that run on the GPU
//! (`tests/fixtures/{deepseek_v3,kimi_linear,kimi_k3,qwen3_moe,mixtral,gpt_oss}/`), and the one-line
//! refusals. Tests that need a GPU skip with one line where there is none.

use std::path::{Path, PathBuf};

use deltafin_engine::experts::StoreOptions;
use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::{load_model_on, Device, GpuOptions};
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::{ModelDir, StoredDtype};
use serde_json::Value;

mod common;
use common::{greedy, ids, read_json, rel_l2_f32};

fn cases(family: &str) -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(family);
    let mut v: Vec<PathBuf> = std::fs::read_dir(&root)
        .unwrap()
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file())
        .collect();
    v.sort();
    assert!(!v.is_empty(), "no cases under {}", root.display());
    v
}

/// Each case of `family` ([`cases`]) with its `expected.json`, read as the loop reaches it.
fn cases_with_expected(family: &str) -> impl Iterator<Item = (PathBuf, Value)> {
    cases(family).into_iter().map(|case| {
        let expected = read_json(&case.join("expected.json"));
        (case, expected)
    })
}

/// What `items` gives when there is a GPU; nothing, after [`gpu_or_skip`]'s one `SKIPPED` line,
/// when there is not (`items` is not called then).
fn on_gpu<I: IntoIterator>(test: &str, items: impl FnOnce() -> I) -> impl Iterator<Item = I::Item> {
    gpu_or_skip(test).then(items).into_iter().flatten()
}

fn gpu_or_skip(test: &str) -> bool {
    match deltafin_cuda::probe() {
        Ok(_) => true,
        Err(e) => {
            eprintln!("SKIPPED {test}: {e}");
            false
        }
    }
}

/// Prints the worst relative L2 of `what` against `vs` (the figure to report) and asserts it is
/// under `bound`.
fn assert_within(worst: f64, bound: f64, what: &str, vs: &str) {
    eprintln!("{what}: {vs}: max rel L2 {worst:.3e}");
    assert!(worst < bound, "{what}: {vs}: rel L2 {worst:e}");
}

/// `deltafin run` of `model` on the GPU gives the CPU's 24 greedy ids, with and without
/// prompt-lookup speculation.
fn cuda_run_gives_the_cpu_ids(model: &Path, prompt: [&str; 2], stats: &Path, what: &str) {
    let generated = |extra: &[&str]| common::generated_ids(model, prompt, extra, stats);
    let cpu = generated(&["--device", "cpu", "--speculate", "off"]);
    assert_eq!(cpu.len(), 24, "{what}");
    assert_eq!(
        generated(&["--device", "cuda", "--speculate", "off"]),
        cpu,
        "{what}: cuda vs cpu"
    );
    assert_eq!(
        generated(&["--device", "cuda", "--speculate", "lookup"]),
        cpu,
        "{what}: cuda with lookup speculation vs cpu"
    );
}

/// A fixture case on the GPU in two layouts: the lossless one (f32 backbone, experts as
/// `lossless` names them) against the golden `expected` (ids equal, logits within `golden.0`;
/// printed as `golden.1`) and against the CPU path, and the default one (int8 backbone, MXFP4
/// experts) against the CPU path, both with equal ids and logits within `cpu_bound`; the CPU
/// prefills `cpu_chunk` tokens a pass (0: the default). Prints the measured figures.
fn cuda_matches_golden_and_cpu(
    case: &Path,
    expected: &Value,
    (name, experts): (&str, StoredDtype),
    (golden_bound, golden_vs): (f64, &str),
    cpu_bound: f64,
    cpu_chunk: usize,
) {
    let what = case.display().to_string();
    let tmp = tempfile::tempdir().unwrap();
    let dir = convert_case(case, StoredDtype::F32, experts, &tmp.path().join("f32"));
    let gpu = run(&dir, Device::Cuda(0), expected);
    assert_within(worst_vs_golden(&gpu, expected, &what), golden_bound, &what, golden_vs);
    let cpu = run_chunked(&dir, Device::Cpu, expected, cpu_chunk);
    let worst = worst_vs(&gpu, &cpu, &format!("{what} {name}: cuda vs cpu"));
    assert_within(worst, cpu_bound, &what, &format!("cuda vs cpu ({name})"));

    let dir = convert_default(case, &tmp.path().join("q"));
    let cpu = run_chunked(&dir, Device::Cpu, expected, cpu_chunk);
    let gpu = run(&dir, Device::Cuda(0), expected);
    let worst = worst_vs(&gpu, &cpu, &format!("{what} int8/mxfp4: cuda vs cpu"));
    assert_within(worst, cpu_bound, &what, "cuda vs cpu (int8/mxfp4)");
}

fn convert_case(case: &Path, backbone: StoredDtype, experts: StoredDtype, out: &Path) -> ModelDir {
    let opts = ConvertOptions {
        backbone,
        experts,
        force: false,
    };
    convert(case, out, &opts, &NoProgress).unwrap_or_else(|e| panic!("convert {}: {e}", case.display()));
    ModelDir::open(out).unwrap()
}

/// `case` converted to the default layout (int8 backbone, MXFP4 experts) in `out`.
fn convert_default(case: &Path, out: &Path) -> ModelDir {
    convert_case(case, StoredDtype::Int8, StoredDtype::Mxfp4, out)
}

/// The first case of `family` in the default layout ([`convert_default`]), in a fresh temporary
/// directory that lives as long as the returned guard.
fn first_case_default(family: &str) -> (tempfile::TempDir, ModelDir) {
    let tmp = tempfile::tempdir().unwrap();
    let dir = convert_default(&cases(family)[0], &tmp.path().join("q"));
    (tmp, dir)
}

/// The grouped-query-attention families that run on the GPU.
const GQA_FAMILIES: [&str; 3] = ["qwen3_moe", "mixtral", "gpt_oss"];

/// Greedy ids and per-step logits of every prompt of `case` on `device`.
fn run(dir: &ModelDir, device: Device, expected: &Value) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    run_chunked(dir, device, expected, 0)
}

/// [`run`] with prompts prefilled `prefill_chunk` tokens per pass (1: token at a time; 0: the
/// default).
fn run_chunked(
    dir: &ModelDir,
    device: Device,
    expected: &Value,
    prefill_chunk: usize,
) -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
    let (model, _) = load_model_on(dir, StoreOptions::new(1 << 30), device, GpuOptions::default()).unwrap();
    expected["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let opts = GenerateOptions {
                prefill_chunk,
                ..greedy(ids(&p["generated_ids"]).len())
            };
            let out = generate(model.as_ref(), &ids(&p["prompt_ids"]), &opts, |_| true).unwrap();
            (out.generated_ids, out.step_logits)
        })
        .collect()
}

/// Lossless layout on the GPU: the reference's greedy ids at every step, logits within 1e-4
/// (the CPU's bound); default layout (int8 backbone, MXFP4 experts): the CPU path's greedy ids,
/// logits within 1e-5 of the CPU path's (issue #16). Prints the measured figures.
#[test]
fn deepseek_v3_on_cuda_matches_transformers_and_the_cpu_path() {
    for (case, expected) in on_gpu("deepseek_v3_on_cuda_matches_transformers_and_the_cpu_path", || {
        cases_with_expected("deepseek_v3")
    }) {
        let tmp = tempfile::tempdir().unwrap();
        let what = case.display().to_string();
        let dir = convert_case(&case, StoredDtype::F32, StoredDtype::F32, &tmp.path().join("f32"));
        let worst = worst_vs_golden(&run(&dir, Device::Cuda(0), &expected), &expected, &what);
        assert_within(worst, 1e-4, &what, "cuda lossless vs transformers");

        let dir = convert_default(&case, &tmp.path().join("q"));
        let cpu = run(&dir, Device::Cpu, &expected);
        let gpu = run(&dir, Device::Cuda(0), &expected);
        let worst = worst_vs(&gpu, &cpu, &format!("{what} int8/mxfp4: cuda vs cpu"));
        assert_within(worst, 1e-5, &what, "cuda vs cpu (int8/mxfp4)");
    }
}

/// `--batch-form fast-always` on the GPU (MLA in the decompressed form for every batched pass,
/// `Gpu::mla_prefill_decompressed`): each prompt prefilled in one pass, then decoded. Lossless
/// layout against transformers' goldens (ids equal, logits within 1e-4, the CPU's bound); default
/// layout against the CPU path in the same batch form (ids equal, logits within 1e-5); and a
/// prompt split in two chunks gives every position the bits of the one-pass prefill (the
/// decompressed form does not depend on the chunking). Prints the measured figures.
#[test]
fn deepseek_v3_decompressed_mla_on_cuda_matches_transformers_the_cpu_and_any_chunking() {
    use deltafin_engine::{BatchForm, CausalLm};
    if !gpu_or_skip("deepseek_v3_decompressed_mla_on_cuda_matches_transformers_the_cpu_and_any_chunking") {
        return;
    }
    let open = |dir: &ModelDir, device: Device| -> Box<dyn CausalLm> {
        let (mut m, _) = load_model_on(dir, StoreOptions::new(1 << 30), device, GpuOptions::default()).unwrap();
        m.routed_mut().set_batch_form(BatchForm::FastAlways);
        m
    };
    let steps = |m: &dyn CausalLm, expected: &Value| -> Vec<(Vec<u32>, Vec<Vec<f32>>)> {
        expected["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| {
                let prompt = ids(&p["prompt_ids"]);
                let mut st = m.new_state();
                let mut logits = m
                    .forward_batch(st.as_mut(), &prompt, false)
                    .unwrap()
                    .logits
                    .pop()
                    .unwrap();
                let (mut out_ids, mut out_logits) = (Vec::new(), Vec::new());
                for _ in 0..ids(&p["generated_ids"]).len() {
                    let next = logits
                        .iter()
                        .enumerate()
                        .fold(
                            (0usize, f32::NEG_INFINITY),
                            |b, (i, &v)| if v > b.1 { (i, v) } else { b },
                        )
                        .0 as u32;
                    out_ids.push(next);
                    out_logits.push(logits);
                    logits = m.forward(st.as_mut(), next).unwrap().0;
                }
                (out_ids, out_logits)
            })
            .collect()
    };
    for (case, expected) in cases_with_expected("deepseek_v3") {
        let tmp = tempfile::tempdir().unwrap();
        let what = case.display().to_string();
        let dir = convert_case(&case, StoredDtype::F32, StoredDtype::F32, &tmp.path().join("f32"));
        let gpu = open(&dir, Device::Cuda(0));
        let worst = worst_vs_golden(&steps(gpu.as_ref(), &expected), &expected, "decompressed MLA on cuda");
        assert_within(worst, 1e-4, &what, "cuda decompressed MLA vs transformers");

        let dir = convert_default(&case, &tmp.path().join("q"));
        let (cpu, gpu) = (open(&dir, Device::Cpu), open(&dir, Device::Cuda(0)));
        let worst = worst_vs(
            &steps(cpu.as_ref(), &expected),
            &steps(gpu.as_ref(), &expected),
            "cpu vs cuda",
        );
        assert_within(worst, 1e-5, &what, "cuda vs cpu, decompressed MLA");
        for p in expected["prompts"].as_array().unwrap() {
            let prompt = ids(&p["prompt_ids"]);
            let mut a = gpu.new_state();
            let whole = gpu.forward_batch(a.as_mut(), &prompt, true).unwrap().logits;
            let k = prompt.len() / 2;
            let mut b = gpu.new_state();
            let mut parts = gpu.forward_batch(b.as_mut(), &prompt[..k], true).unwrap().logits;
            parts.extend(gpu.forward_batch(b.as_mut(), &prompt[k..], true).unwrap().logits);
            assert_eq!(
                whole,
                parts,
                "{}: chunks of {k} + {} differ from one pass",
                case.display(),
                prompt.len() - k
            );
        }
    }
}

/// The grouped-query-attention families on the GPU: Qwen3-MoE (tests/fixtures/qwen3_moe:
/// per-head q/k RMSNorm, dense `mlp_only_layers`, `decoder_sparse_step`, `norm_topk_prob` on and
/// off), Mixtral (tests/fixtures/mixtral: with and without a sliding window) and gpt-oss
/// (tests/fixtures/gpt_oss: q/k/v/o biases, sinks, alternating and uniform sliding windows, the
/// biased top-k-then-softmax router, clamped SwiGLU experts with biases; unquantized and Hub
/// MXFP4 experts): lossless layout against transformers' goldens
/// (ids equal, logits within 1e-4, the CPU's bound) and against the CPU path (ids equal, logits
/// within 1e-5); default layout (int8 backbone, MXFP4 experts) against the CPU path (ids equal,
/// logits within 1e-5, issue #16). Prints the measured figures.
#[test]
fn gqa_families_on_cuda_match_transformers_and_the_cpu_path() {
    for family in on_gpu("gqa_families_on_cuda_match_transformers_and_the_cpu_path", || {
        GQA_FAMILIES
    }) {
        for (case, expected) in cases_with_expected(family) {
            let lossless = ("f32", StoredDtype::F32);
            let golden = (1e-4, "cuda lossless vs transformers");
            cuda_matches_golden_and_cpu(&case, &expected, lossless, golden, 1e-5, 0);
        }
    }
}

/// A family not on the GPU yet is refused with one line naming it, GPU or not.
#[test]
fn other_families_are_refused_on_cuda_with_one_line() {
    let case = &cases("qwen3_next")[0];
    let tmp = tempfile::tempdir().unwrap();
    let dir = convert_default(case, &tmp.path().join("m"));
    let e = load_model_on(&dir, StoreOptions::new(1 << 30), Device::Cuda(0), GpuOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(
        !e.contains('\n')
            && e.contains("--device cuda:0")
            && e.contains("qwen3_next")
            && e.contains("does not run on CUDA yet"),
        "{e}"
    );
}

/// The GPU's batched prefill (a prompt chunk in one pass: matrix-matrix projections, MLA for the
/// whole chunk, expert-major MoE) gives every position the bits of token-at-a-time decoding on
/// the GPU (logits and routing), in both layouts, and a GPU expert cache far smaller than the
/// experts (misses and evictions every layer) changes no bit.
#[test]
fn cuda_chunked_prefill_equals_token_at_a_time_bit_for_bit() {
    if !gpu_or_skip("cuda_chunked_prefill_equals_token_at_a_time_bit_for_bit") {
        return;
    }
    chunked_prefill_equals_token_at_a_time("deepseek_v3");
}

/// [`cuda_chunked_prefill_equals_token_at_a_time_bit_for_bit`] for the grouped-query-attention
/// families (Qwen3-MoE with dense layers and per-head q/k norms, Mixtral with and without a
/// sliding window, gpt-oss with sinks, biases and windows per layer): batched projections,
/// `gqa_attend` over the chunk, expert-major MoE.
#[test]
fn gqa_cuda_chunked_prefill_equals_token_at_a_time_bit_for_bit() {
    if !gpu_or_skip("gqa_cuda_chunked_prefill_equals_token_at_a_time_bit_for_bit") {
        return;
    }
    chunked_prefill_equals_token_at_a_time("qwen3_moe");
    chunked_prefill_equals_token_at_a_time("mixtral");
    chunked_prefill_equals_token_at_a_time("gpt_oss");
}

/// The GQA families' KV cache on the GPU: 80 tokens fed one at a time (the cache grows past its
/// first 64 positions, copying them) give the bits of the same 80 in one chunk, and a rolled back
/// continuation followed by the true tokens gives the bits of a fresh state (speculative
/// verification's pattern), in the default layout of each family's first case.
#[test]
fn gqa_cuda_cache_growth_and_rollback_change_no_bit() {
    for family in on_gpu("gqa_cuda_cache_growth_and_rollback_change_no_bit", || GQA_FAMILIES) {
        let (_tmp, dir) = first_case_default(family);
        let (model, _) =
            load_model_on(&dir, StoreOptions::new(1 << 30), Device::Cuda(0), GpuOptions::default()).unwrap();
        let tokens: Vec<u32> = (3..83).collect();
        let mut a = model.new_state();
        let chunk = model.forward_batch(a.as_mut(), &tokens, true).unwrap().logits;
        let mut b = model.new_state();
        for (i, &t) in tokens.iter().enumerate() {
            let (logits, _) = model.forward(b.as_mut(), t).unwrap();
            assert_eq!(logits, chunk[i], "{family}: position {i} of 80 token at a time");
        }
        let (prompt, tail) = tokens.split_at(50);
        let mut c = model.new_state();
        model.forward_batch(c.as_mut(), prompt, false).unwrap();
        model.forward_batch(c.as_mut(), &[5, 6, 8, 9], true).unwrap();
        assert!(model.rollback(c.as_mut(), prompt.len()));
        let after = model.forward_batch(c.as_mut(), tail, true).unwrap().logits;
        for (i, l) in after.iter().enumerate() {
            assert_eq!(l, &chunk[50 + i], "{family}: position {} after a rollback", 50 + i);
        }
    }
}

/// Every fixture case of `family`, lossless and default layouts, GPU expert cache unbounded
/// and of two records: a prompt in one chunk gives each position the bits (logits, routing)
/// of feeding it token at a time, and so does the next token after it.
fn chunked_prefill_equals_token_at_a_time(family: &str) {
    for (case, expected) in cases_with_expected(family) {
        let tmp = tempfile::tempdir().unwrap();
        for (name, b, e) in [
            ("f32", StoredDtype::F32, StoredDtype::F32),
            ("q", StoredDtype::Int8, StoredDtype::Mxfp4),
        ] {
            let dir = convert_case(&case, b, e, &tmp.path().join(name));
            let record = dir.manifest.experts.records[0].length;
            for budget in [None, Some(2 * record)] {
                let gpu = GpuOptions { budget, preload: false };
                let (model, _) = load_model_on(&dir, StoreOptions::new(1 << 30), Device::Cuda(0), gpu).unwrap();
                for p in expected["prompts"].as_array().unwrap() {
                    let prompt = ids(&p["prompt_ids"]);
                    let mut a = model.new_state();
                    let chunk = model.forward_batch(a.as_mut(), &prompt, true).unwrap();
                    let mut b = model.new_state();
                    for (i, &t) in prompt.iter().enumerate() {
                        let (logits, routes) = model.forward(b.as_mut(), t).unwrap();
                        assert_eq!(
                            chunk.logits[i],
                            logits,
                            "{} {name} budget {budget:?}: position {i} of {} differs",
                            case.display(),
                            prompt.len()
                        );
                        let ids_of = |r: &deltafin_engine::LayerRoutes| {
                            r.iter().map(|(l, x)| (*l, x.experts.clone())).collect::<Vec<_>>()
                        };
                        assert_eq!(
                            ids_of(&chunk.routes[i]),
                            ids_of(&routes),
                            "{} position {i}",
                            case.display()
                        );
                    }
                    // The chunk's last-position logits alone, then the next token, agree too.
                    let mut c = model.new_state();
                    let last = model.forward_batch(c.as_mut(), &prompt, false).unwrap();
                    assert_eq!(last.logits.len(), 1);
                    assert_eq!(&last.logits[0], chunk.logits.last().unwrap());
                    let (n1, _) = model.forward(c.as_mut(), 1).unwrap();
                    let (n2, _) = model.forward(b.as_mut(), 1).unwrap();
                    assert_eq!(n1, n2, "{}: decoding after a chunk differs", case.display());
                }
            }
        }
    }
}

/// A decode step replayed from a captured CUDA graph (every expert preloaded on the device) gives
/// the bits of the same step queued launch by launch with experts fetched on demand (a 2-record
/// GPU cache), token after token, with two sequences interleaved on the graph model (each switch
/// names other KV-cache buffers, so the step is captured again) and across KV-cache growth.
#[test]
fn cuda_decode_graph_equals_queued_launches_bit_for_bit() {
    for (case, expected) in on_gpu("cuda_decode_graph_equals_queued_launches_bit_for_bit", || {
        cases_with_expected("deepseek_v3")
    }) {
        let tmp = tempfile::tempdir().unwrap();
        let dir = convert_default(&case, &tmp.path().join("q"));
        let record = dir.manifest.experts.records[0].length;
        let open = |budget, preload| {
            let gpu = GpuOptions { budget, preload };
            load_model_on(&dir, StoreOptions::new(1 << 30), Device::Cuda(0), gpu)
                .unwrap()
                .0
        };
        let (graph, queued) = (open(None, true), open(Some(2 * record), false));
        let prompts: Vec<Vec<u32>> = expected["prompts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| ids(&p["prompt_ids"]))
            .collect();
        let argmax = |v: &[f32]| v.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0 as u32;
        // Two sequences on each model, stepped alternately for 80 steps (past the KV cache's first
        // 64 positions, so it grows and the graph is captured again).
        let (mut ga, mut gb) = (graph.new_state(), graph.new_state());
        let (mut qa, mut qb) = (queued.new_state(), queued.new_state());
        let (mut ta, mut tb) = (prompts[0][0], prompts.last().unwrap()[0]);
        for step in 0..80 {
            let (x, _) = graph.forward(ga.as_mut(), ta).unwrap();
            let (y, _) = queued.forward(qa.as_mut(), ta).unwrap();
            assert_eq!(x, y, "{}: sequence a, step {step}", case.display());
            ta = argmax(&x);
            let (x, _) = graph.forward(gb.as_mut(), tb).unwrap();
            let (y, _) = queued.forward(qb.as_mut(), tb).unwrap();
            assert_eq!(x, y, "{}: sequence b, step {step}", case.display());
            tb = argmax(&x);
        }
        let s = graph.gpu_cache_stats().unwrap();
        assert_eq!(s.misses, 0, "{}: the preloaded model missed", case.display());
    }
}

/// Worst relative L2 between two runs' step logits, asserting equal greedy ids (`what` names the
/// comparison in the failure message).
fn worst_vs(a: &[(Vec<u32>, Vec<Vec<f32>>)], b: &[(Vec<u32>, Vec<Vec<f32>>)], what: &str) -> f64 {
    let mut worst = 0f64;
    for ((ai, al), (bi, bl)) in a.iter().zip(b) {
        assert_eq!(ai, bi, "{what}: greedy ids differ");
        assert_eq!(al.len(), bl.len(), "{what}: step counts differ");
        for (x, y) in al.iter().zip(bl) {
            let y64: Vec<f64> = y.iter().map(|v| *v as f64).collect();
            worst = worst.max(rel_l2_f32(x, &y64));
        }
    }
    worst
}

/// Worst relative L2 of a run's step logits against a golden file's, asserting the golden ids.
fn worst_vs_golden(got: &[(Vec<u32>, Vec<Vec<f32>>)], expected: &Value, what: &str) -> f64 {
    let mut worst = 0f64;
    for ((got_ids, got_logits), p) in got.iter().zip(expected["prompts"].as_array().unwrap()) {
        assert_eq!(
            got_ids,
            &ids(&p["generated_ids"]),
            "{what}: greedy ids differ from the golden"
        );
        for (g, w) in got_logits.iter().zip(p["step_logits"].as_array().unwrap()) {
            let w: Vec<f64> = w.as_array().unwrap().iter().map(|x| x.as_f64().unwrap()).collect();
            worst = worst.max(rel_l2_f32(g, &w));
        }
    }
    worst
}

/// Kimi Linear (tests/fixtures/kimi_linear: KDA with the softplus gate and low-rank output gate,
/// NoPE MLA with and without q-LoRA, conv kernels 3 and 4, SwiGLU MoE with shared experts) on
/// the GPU: lossless layout against transformers' goldens (ids equal, logits within 1e-4, the
/// CPU's bound); default layout (int8 backbone, MXFP4 experts) and lossless layout against the
/// CPU path (ids equal, logits within 1e-5, issue #16). The GPU runs a prompt token at a time,
/// so the CPU is compared prefilling token at a time too (the same operations; its chunked KDA
/// form is the same algebra in another order, and multi_token.rs bounds that separately).
#[test]
fn kimi_linear_on_cuda_matches_transformers_and_the_cpu_path() {
    for (case, expected) in on_gpu("kimi_linear_on_cuda_matches_transformers_and_the_cpu_path", || {
        cases_with_expected("kimi_linear")
    }) {
        let lossless = ("f32", StoredDtype::F32);
        let golden = (1e-4, "cuda lossless vs transformers");
        cuda_matches_golden_and_cpu(&case, &expected, lossless, golden, 1e-5, 1);
    }
}

/// GPU vs CPU bound on the tiny random K3-structured models: they amplify f32 rounding about
/// 1000× (a 1e-6 relative weight change moves their logits by up to 7.5e-4,
/// tests/fixtures/kimi_k3/README.md), so any two summation orders differ by up to ~1e-4 there;
/// multi_token.rs bounds the CPU's own batched-vs-token difference on them by 1e-3 for the same
/// reason. A wrong operation moves logits by O(1).
const K3_TINY_REL_L2: f64 = 1e-3;

/// Kimi K3 (tests/fixtures/kimi_k3: attention residuals across block boundaries, KDA with the
/// lower-bound gate and full-rank output gate, gated NoPE MLA, LatentMoE, SiTU, MXFP4 experts) on
/// the GPU: f32 backbone with the fixture's MXFP4 experts against llama.cpp's f32-expert goldens
/// (ids equal, logits within 1e-3, the CPU test's bound and reasons: reference_fixtures.rs), and
/// against the CPU path prefilling token at a time, in that layout and in the default one: ids
/// equal, logits within [`K3_TINY_REL_L2`] (printed: the figure to report).
#[test]
fn kimi_k3_on_cuda_matches_llama_cpp_and_the_cpu_path() {
    if !gpu_or_skip("kimi_k3_on_cuda_matches_llama_cpp_and_the_cpu_path") {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kimi_k3");
    let mut n = 0;
    for case in cases("kimi_k3") {
        let golden = case.join("expected_f32_experts.json");
        if !golden.is_file() {
            continue;
        }
        n += 1;
        let expected = read_json(&golden);
        let lossless = ("f32/mxfp4", StoredDtype::Mxfp4);
        let golden = (1e-3, "cuda vs llama.cpp (f32 experts)");
        cuda_matches_golden_and_cpu(&case, &expected, lossless, golden, K3_TINY_REL_L2, 1);
    }
    assert!(
        n >= 2,
        "fewer than 2 K3 cases with f32-expert goldens under {}",
        root.display()
    );
}

/// `synth --preset k3-tiny` (Kimi K3 structure, int8 backbone, random MXFP4 experts): greedy ids
/// of `deltafin run --device cuda` equal `--device cpu`'s (24 tokens), also with prompt-lookup
/// speculation on the GPU (its verification passes are rolled back through the KDA log); step
/// logits within [`K3_TINY_REL_L2`] of the CPU's (printed); and at the library level, a rollback followed by the same tokens gives the bits of a fresh state, a
/// GPU expert cache of two records changes no bit, and two runs are bit-identical.
#[test]
fn k3_tiny_on_cuda_matches_the_cpu_and_rolls_back_exactly() {
    if !gpu_or_skip("k3_tiny_on_cuda_matches_the_cpu_and_rolls_back_exactly") {
        return;
    }
    let t = tempfile::tempdir().unwrap();
    let m = t.path().join("k3");
    common::synth("k3-tiny", &m);
    cuda_run_gives_the_cpu_ids(&m, common::K3_PROMPT, &t.path().join("s.json"), "k3-tiny");

    let dir = ModelDir::open(&m).unwrap();
    // Logits of a 37-token prompt and 16 greedy steps, GPU against the CPU prefilling token at
    // a time.
    let steps = |device: Device, prefill_chunk: usize| {
        let (model, _) = load_model_on(&dir, StoreOptions::new(1 << 30), device, GpuOptions::default()).unwrap();
        let opts = GenerateOptions {
            prefill_chunk,
            ..greedy(16)
        };
        let prompt: Vec<u32> = (3..40).collect();
        let out = generate(model.as_ref(), &prompt, &opts, |_| true).unwrap();
        vec![(out.generated_ids, out.step_logits)]
    };
    let worst = worst_vs(
        &steps(Device::Cuda(0), 0),
        &steps(Device::Cpu, 1),
        "k3-tiny: cuda vs cpu",
    );
    assert_within(
        worst,
        K3_TINY_REL_L2,
        "k3-tiny",
        "cuda vs cpu, 16 steps after a 37-token prompt",
    );

    let record = dir.manifest.experts.records[0].length;
    let logits_of = |budget: Option<u64>| {
        let gpu = GpuOptions { budget, preload: false };
        let (model, _) = load_model_on(&dir, StoreOptions::new(1 << 30), Device::Cuda(0), gpu).unwrap();
        let prompt: Vec<u32> = (3..40).collect();
        let tail: Vec<u32> = vec![7, 11, 13, 17, 19];
        // Fresh: prompt, then the tail.
        let mut a = model.new_state();
        let mut fresh = model.forward_batch(a.as_mut(), &prompt, true).unwrap().logits;
        for &tok in &tail {
            fresh.push(model.forward(a.as_mut(), tok).unwrap().0);
        }
        // Prompt, commit, a wrong continuation, rolled back to the prompt, then the tail.
        let mut b = model.new_state();
        model.forward_batch(b.as_mut(), &prompt, false).unwrap();
        b.commit();
        model.forward_batch(b.as_mut(), &[5, 6, 8, 9], true).unwrap();
        assert!(model.rollback(b.as_mut(), prompt.len() + 2));
        assert!(model.rollback(b.as_mut(), prompt.len()));
        assert!(
            !model.rollback(b.as_mut(), prompt.len() - 1),
            "rollback before the commit"
        );
        for (i, &tok) in tail.iter().enumerate() {
            let l = model.forward(b.as_mut(), tok).unwrap().0;
            assert_eq!(l, fresh[prompt.len() + i], "tail token {i} after a rollback differs");
        }
        fresh
    };
    let full = logits_of(None);
    assert_eq!(logits_of(None), full, "two runs differ");
    assert_eq!(
        logits_of(Some(2 * record)),
        full,
        "a 2-record GPU expert cache changes bits"
    );
}

/// `deltafin run --device cuda` on converted GQA fixtures (default layout): the greedy ids of
/// `--device cpu`, with and without prompt-lookup speculation on the GPU (its verification
/// passes are chunks with every position's logits, rolled back on a miss).
#[test]
fn gqa_run_on_cuda_gives_the_cpu_ids() {
    for family in on_gpu("gqa_run_on_cuda_gives_the_cpu_ids", || GQA_FAMILIES) {
        let (tmp, dir) = first_case_default(family);
        let prompt = ["--prompt-ids", "3,9,4,9,4,9,4,9,4,9,4,9"];
        cuda_run_gives_the_cpu_ids(&dir.path, prompt, &tmp.path().join("s.json"), family);
    }
}

//! Proof of correctness against Hugging Face transformers' `deepseek_v3`, `kimi_linear`,
//! `qwen3_moe`, `mixtral`, `gpt_oss`, `qwen3_next` and `qwen3_5_moe` implementations (and llama.cpp's goldens for Kimi K3, see below).
//!
//! Each case in `tests/fixtures/<family>/` is a tiny random checkpoint together with the
//! reference's greedy ids and float32 logits (see `make_fixtures.py` and the README there). Here
//! each case is converted and generated from:
//! - lossless layout (`--backbone f32 --experts f32`): ids identical at every step, logits within
//!   relative L2 1e-4 of the reference;
//! - default layout (int8 backbone, MXFP4 experts): logits within the documented bound below.

use std::path::{Path, PathBuf};

use deltafin_engine::experts::StoreOptions;
use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::{load_model, CausalLm, Numerics};
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::{ModelDir, StoredDtype};
use serde_json::Value;

mod common;
use common::{floats, greedy, ids, read_json, rel_l2_f32};

/// Relative L2 error allowed in the lossless layout (issue #2).
const LOSSLESS_REL_L2: f64 = 1e-4;
/// Relative L2 error allowed for the default int8-backbone / MXFP4-expert layout on these
/// fixtures. Measured maximum: see `quantized_layout_stays_within_documented_bound` output and
/// README "Accuracy of the default layout".
const QUANTIZED_REL_L2: f64 = 0.8;

fn fixtures_root(family: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(family)
}

/// The reference cases of `family`, at least `min` of them.
fn family_cases(family: &str, min: usize) -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_root(family))
        .unwrap_or_else(|e| panic!("tests/fixtures/{family}: {e}"))
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file() && p.join("config.json").is_file())
        .collect();
    v.sort();
    assert!(
        v.len() >= min,
        "expected at least {min} {family} reference cases, found {v:?}"
    );
    v
}

fn cases() -> Vec<PathBuf> {
    family_cases("deepseek_v3", 3)
}

/// `case` converted with `backbone` / `experts` into a model directory inside a temporary
/// directory (removed when the returned guard drops).
fn convert_case(case: &Path, backbone: StoredDtype, experts: StoredDtype) -> (tempfile::TempDir, ModelDir) {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let opts = ConvertOptions {
        backbone,
        experts,
        force: false,
    };
    convert(case, &out, &opts, &NoProgress).unwrap_or_else(|e| panic!("convert {}: {e}", case.display()));
    let dir = ModelDir::open(&out).unwrap();
    (tmp, dir)
}

/// A copy of fixture `case` in a temporary directory (removed when the returned guard drops),
/// its `config.json` changed by `edit`.
fn edited_copy(case: &Path, edit: impl FnOnce(&mut Value)) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir(&src).unwrap();
    for f in std::fs::read_dir(case).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, src.join(f.file_name().unwrap())).unwrap();
    }
    let mut cfg = read_json(&src.join("config.json"));
    edit(&mut cfg);
    std::fs::write(src.join("config.json"), serde_json::to_vec(&cfg).unwrap()).unwrap();
    (tmp, src)
}

/// The bytes of tensor `key` (its name in the file) as stored in the safetensors file `file`;
/// None when the header does not list it.
fn safetensors_bytes(file: impl AsRef<Path>, key: &str) -> Option<Vec<u8>> {
    let bytes = std::fs::read(file).unwrap();
    let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
    let off = header[key]["data_offsets"].as_array()?;
    let (a, b) = (off[0].as_u64().unwrap() as usize, off[1].as_u64().unwrap() as usize);
    Some(bytes[8 + n + a..8 + n + b].to_vec())
}

struct CaseResult {
    max_rel_l2: f64,
    ids_equal: bool,
}

fn run_case(case: &Path, backbone: StoredDtype, experts: StoredDtype, budget: u64) -> CaseResult {
    let (_tmp, dir) = convert_case(case, backbone, experts);
    let model: Box<dyn CausalLm> = load_model(&dir, StoreOptions::new(budget)).unwrap();
    let expected = read_json(&case.join("expected.json"));
    let mut worst = 0f64;
    let mut ids_equal = true;
    for (pi, p) in expected["prompts"].as_array().expect("prompts").iter().enumerate() {
        let prompt = ids(&p["prompt_ids"]);
        let want_ids = ids(&p["generated_ids"]);
        let want_logits: Vec<Vec<f64>> = p["step_logits"].as_array().unwrap().iter().map(floats).collect();
        let got = generate(model.as_ref(), &prompt, &greedy(want_ids.len()), |_| true).unwrap();
        if got.generated_ids != want_ids {
            ids_equal = false;
        }
        // Compare logits step by step while the ids agree (after a divergence the inputs differ).
        let mut prompt_worst = 0f64;
        for (k, (g, w)) in got.step_logits.iter().zip(&want_logits).enumerate() {
            let e = rel_l2_f32(g, w);
            prompt_worst = prompt_worst.max(e);
            if k < want_ids.len() && got.generated_ids[k] != want_ids[k] {
                break;
            }
        }
        eprintln!(
            "{} {backbone:?}/{experts:?} prompt {pi} ({} tokens): max rel L2 {prompt_worst:.3e}",
            case.file_name().unwrap_or_default().to_string_lossy(),
            prompt.len()
        );
        worst = worst.max(prompt_worst);
    }
    CaseResult {
        max_rel_l2: worst,
        ids_equal,
    }
}

/// Checks `case` converted in the lossless layout against the reference: greedy ids identical,
/// logits within [`LOSSLESS_REL_L2`].
fn assert_lossless(case: &Path) {
    let r = run_case(case, StoredDtype::F32, StoredDtype::F32, 1 << 30);
    eprintln!("{}: lossless max rel L2 {:.3e}", case.display(), r.max_rel_l2);
    assert!(r.ids_equal, "{}: greedy ids differ from the reference", case.display());
    assert!(
        r.max_rel_l2 < LOSSLESS_REL_L2,
        "{}: logits rel L2 {:.3e} ≥ {LOSSLESS_REL_L2}",
        case.display(),
        r.max_rel_l2
    );
}

/// Checks `case` converted in the default layout (int8 backbone, MXFP4 experts): logits within
/// [`QUANTIZED_REL_L2`] of the reference.
fn assert_quantized(case: &Path) {
    let r = run_case(case, StoredDtype::Int8, StoredDtype::Mxfp4, 1 << 30);
    eprintln!(
        "{}: int8/mxfp4 max rel L2 {:.3e}, ids equal: {}",
        case.display(),
        r.max_rel_l2,
        r.ids_equal
    );
    assert!(
        r.max_rel_l2 < QUANTIZED_REL_L2,
        "{}: int8/mxfp4 logits rel L2 {:.3e} ≥ documented bound {QUANTIZED_REL_L2}",
        case.display(),
        r.max_rel_l2
    );
}

#[test]
fn lossless_layout_matches_transformers() {
    for case in cases() {
        assert_lossless(&case);
    }
}

#[test]
fn kimi_linear_lossless_layout_matches_transformers() {
    // KDA + NoPE MLA hybrid: prompts longer than the reference's KDA chunk (8), MoE with shared
    // experts, q_lora and not, conv kernels 3 and 4 (tests/fixtures/kimi_linear/README.md).
    for case in family_cases("kimi_linear", 2) {
        assert_lossless(&case);
    }
}

#[test]
fn quantized_layout_stays_within_documented_bound() {
    for case in cases() {
        assert_quantized(&case);
    }
}

fn check_lossless(family: &str, min_cases: usize, expect_model_type: &str) {
    for case in family_cases(family, min_cases) {
        assert_lossless(&case);
        let cfg = read_json(&case.join("config.json"));
        assert_eq!(cfg["model_type"], expect_model_type);
    }
}

fn check_quantized(family: &str, min_cases: usize) {
    for case in family_cases(family, min_cases) {
        assert_quantized(&case);
    }
}

#[test]
fn qwen3_moe_lossless_layout_matches_transformers() {
    check_lossless("qwen3_moe", 2, "qwen3_moe");
}

#[test]
fn qwen3_moe_default_layout_runs_within_bound() {
    check_quantized("qwen3_moe", 2);
}

/// Gated DeltaNet + gated attention hybrid (tests/fixtures/qwen3_next/make_fixtures.py): chat prompts
/// longer than the reference's DeltaNet chunk (64), per-expert tensors, fused in_proj_qkvz/ba.
#[test]
fn qwen3_next_lossless_layout_matches_transformers() {
    check_lossless("qwen3_next", 2, "qwen3_next");
}

#[test]
fn qwen3_next_default_layout_runs_within_bound() {
    check_quantized("qwen3_next", 2);
}

/// Qwen3.5-MoE text model behind its multimodal wrapper: `model.language_model.` names, fused
/// experts, separate DeltaNet projections, vision and MTP tensors skipped.
#[test]
fn qwen3_5_moe_lossless_layout_matches_transformers() {
    check_lossless("qwen3_5_moe", 2, "qwen3_5_moe");
}

/// Qwen3.5-MoE with its routed experts stored one tensor set per expert
/// (`mlp.experts.{e}.{gate,up,down}_proj.weight`, as re-exports hold them) instead of fused over
/// the experts: the converter follows the checkpoint's naming and the result still matches
/// transformers (the same expected.json) in the lossless layout.
#[test]
fn qwen3_5_moe_per_expert_names_match_transformers() {
    use safetensors::tensor::TensorView;
    use safetensors::{Dtype, SafeTensors};
    let src = fixtures_root("qwen3_5_moe").join("qwen3_5_moe_a");
    let tmp = tempfile::tempdir().unwrap();
    let split = tmp.path().join("split");
    std::fs::create_dir(&split).unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        if e.file_name() != "model.safetensors" {
            std::fs::copy(e.path(), split.join(e.file_name())).unwrap();
        }
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    // (name, shape, f32 little-endian bytes)
    let mut out: Vec<(String, Vec<usize>, Vec<u8>)> = Vec::new();
    let mut split_tensors = 0;
    for (name, t) in st.tensors() {
        assert_eq!(t.dtype(), Dtype::F32, "{name}");
        let shape = t.shape().to_vec();
        let data = t.data();
        if let Some(prefix) = name.strip_suffix(".gate_up_proj") {
            // [E, 2I, H]: gate rows first, then up.
            let (e, two_i, h) = (shape[0], shape[1], shape[2]);
            let half = two_i / 2 * h * 4;
            for x in 0..e {
                let m = &data[x * 2 * half..(x + 1) * 2 * half];
                out.push((
                    format!("{prefix}.{x}.gate_proj.weight"),
                    vec![two_i / 2, h],
                    m[..half].to_vec(),
                ));
                out.push((
                    format!("{prefix}.{x}.up_proj.weight"),
                    vec![two_i / 2, h],
                    m[half..].to_vec(),
                ));
            }
            split_tensors += 1;
        } else if name.contains(".mlp.experts.down_proj") {
            let (e, rows, cols) = (shape[0], shape[1], shape[2]);
            let prefix = name.strip_suffix(".down_proj").unwrap();
            let n = rows * cols * 4;
            for x in 0..e {
                out.push((
                    format!("{prefix}.{x}.down_proj.weight"),
                    vec![rows, cols],
                    data[x * n..(x + 1) * n].to_vec(),
                ));
            }
        } else {
            out.push((name.to_string(), shape, data.to_vec()));
        }
    }
    assert!(split_tensors > 0, "the fixture has no fused experts to split");
    let views: Vec<(String, TensorView<'_>)> = out
        .iter()
        .map(|(n, s, d)| (n.clone(), TensorView::new(Dtype::F32, s.clone(), d).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &split.join("model.safetensors")).unwrap();
    let r = run_case(&split, StoredDtype::F32, StoredDtype::F32, 1 << 30);
    assert!(r.ids_equal, "greedy ids differ from transformers");
    assert!(r.max_rel_l2 < 1e-4, "rel L2 {:e}", r.max_rel_l2);
}

#[test]
fn qwen3_5_moe_default_layout_runs_within_bound() {
    check_quantized("qwen3_5_moe", 2);
}

#[test]
fn mixtral_lossless_layout_matches_transformers() {
    check_lossless("mixtral", 2, "mixtral");
}

#[test]
fn mixtral_default_layout_runs_within_bound() {
    check_quantized("mixtral", 2);
}

/// The sliding window of `mixtral_b` matters: the same model with the window removed from its
/// config no longer reproduces the reference (so the lossless match above proves it is applied).
#[test]
fn mixtral_sliding_window_is_applied() {
    let case = fixtures_root("mixtral").join("mixtral_b");
    let (_tmp, src) = edited_copy(&case, |cfg| {
        assert_eq!(cfg["sliding_window"], 6);
        cfg["sliding_window"] = Value::Null;
    });
    let with_window = run_case(&case, StoredDtype::F32, StoredDtype::F32, 1 << 30);
    let without = run_case(&src, StoredDtype::F32, StoredDtype::F32, 1 << 30);
    eprintln!(
        "mixtral_b rel L2 with window {:.3e}, without {:.3e}",
        with_window.max_rel_l2, without.max_rel_l2
    );
    assert!(with_window.max_rel_l2 < LOSSLESS_REL_L2);
    assert!(without.max_rel_l2 > 100.0 * LOSSLESS_REL_L2, "{}", without.max_rel_l2);
}

#[test]
fn output_is_bit_identical_at_any_cache_budget() {
    let case = &cases()[0];
    let defaults = ConvertOptions::default();
    let (_tmp, dir) = convert_case(case, defaults.backbone, defaults.experts);
    let expected = read_json(&case.join("expected.json"));
    let prompt = ids(expected["prompts"].as_array().unwrap().last().unwrap()["prompt_ids"]
        .clone()
        .as_array()
        .map(|_| &expected["prompts"].as_array().unwrap().last().unwrap()["prompt_ids"])
        .unwrap());
    let opts = greedy(8);
    let mut runs = Vec::new();
    for budget in [0u64, 1, 64 << 10, 1 << 30] {
        let model = load_model(&dir, StoreOptions::new(budget)).unwrap();
        let g = generate(model.as_ref(), &prompt, &opts, |_| true).unwrap();
        if budget == 0 {
            assert_eq!(g.stats.experts.hits, 0, "a zero budget caches nothing");
        }
        runs.push(g);
    }
    for r in &runs[1..] {
        assert_eq!(r.generated_ids, runs[0].generated_ids);
        for (a, b) in r.step_logits.iter().zip(&runs[0].step_logits) {
            assert!(
                a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()),
                "logits differ bitwise across budgets"
            );
        }
    }
}

#[test]
fn generation_stops_at_an_end_of_sequence_id() {
    let case = &cases()[2];
    let (_tmp, dir) = convert_case(case, StoredDtype::F32, StoredDtype::F32);
    let model = load_model(&dir, StoreOptions::new(1 << 30)).unwrap();
    let expected = read_json(&case.join("expected.json"));
    let p = &expected["prompts"].as_array().unwrap()[1];
    let want = ids(&p["generated_ids"]);
    // Declare the reference's third generated token an end-of-sequence id: generation must stop
    // right after producing it (unless an earlier token has the same id).
    let eos = want[2];
    let stop_at = want.iter().position(|&t| t == eos).unwrap();
    let run = |ignore_eos: bool| {
        let opts = GenerateOptions {
            max_new_tokens: 8,
            eos_token_ids: vec![eos],
            ignore_eos,
            record_logits: false,
            trace_routes: None,
            ..Default::default()
        };
        generate(model.as_ref(), &ids(&p["prompt_ids"]), &opts, |_| true).unwrap()
    };
    let g = run(false);
    assert_eq!(g.generated_ids, want[..=stop_at].to_vec());
    assert_eq!(g.stats.finish_reason, "eos");
    // With ignore_eos the same model runs to the limit.
    let g = run(true);
    assert_eq!(g.generated_ids, want);
    assert_eq!(g.stats.finish_reason, "length");
}

/// Kimi K3 fixtures (tests/fixtures/kimi_k3, goldens from llama.cpp): routed experts are stored
/// as compressed-tensors MXFP4 and must be copied into the expert records bit for bit.
#[test]
fn kimi_k3_mxfp4_experts_are_copied_bit_for_bit() {
    use deltafin_format::checkpoint::Checkpoint;
    for case in family_cases("kimi_k3", 2) {
        let (_tmp, dir) = convert_case(&case, StoredDtype::F32, StoredDtype::Mxfp4);
        let pack = std::fs::read(dir.expert_pack_path()).unwrap();
        let ck = Checkpoint::open(&case).unwrap();
        let raw = |name: &str| -> Vec<u8> {
            // The checkpoint's own bytes of `name` (language_model. prefix in the file).
            let e = ck.entry(name).expect("tensor");
            safetensors_bytes(ck.shard_path(e), &e.file_name).unwrap()
        };
        let layout = &dir.manifest.experts.layout;
        let mut checked = 0;
        for r in &dir.manifest.experts.records {
            for m in layout {
                let base = format!(
                    "model.layers.{}.block_sparse_moe.experts.{}.{}",
                    r.layer, r.expert, m.name
                );
                let _ = ck.entry(&format!("{base}.weight")).expect("logical MXFP4 weight");
                let vals = &pack[(r.offset + m.offset) as usize..(r.offset + m.scales_offset) as usize];
                let scales = &pack[(r.offset + m.scales_offset) as usize..(r.offset + m.offset + m.bytes) as usize];
                // cols are multiples of 32 in these fixtures: rows need no padding.
                assert_eq!(
                    vals,
                    raw_part(&ck, &format!("{base}.weight"), true, &raw).as_slice(),
                    "{base} codes"
                );
                assert_eq!(
                    scales,
                    raw_part(&ck, &format!("{base}.weight"), false, &raw).as_slice(),
                    "{base} scales"
                );
                checked += 1;
            }
        }
        assert!(checked > 0);
    }
}

/// The packed codes (`codes`) or E8M0 scales of an MXFP4 weight, as stored in the checkpoint.
fn raw_part(
    ck: &deltafin_format::checkpoint::Checkpoint,
    name: &str,
    codes: bool,
    raw: &dyn Fn(&str) -> Vec<u8>,
) -> Vec<u8> {
    let e = ck.entry(name).unwrap();
    if codes {
        raw(name)
    } else {
        let aux = e.aux_file_names();
        let scale = aux
            .iter()
            .find(|n| n.ends_with("weight_scale"))
            .expect("weight_scale part");
        let logical = scale.trim_start_matches("language_model.").to_string();
        // Read the scale tensor by its file name through the header.
        safetensors_bytes(ck.shard_path(e), scale).unwrap_or_else(|| panic!("{logical} not in the header"))
    }
}

/// Agreement with llama.cpp's Kimi K3 goldens under its CPU numerics ([`Numerics::LlamaCppCpu`]).
/// A step agrees "exactly" within [`K3_EXACT_REL_L2`]; llama.cpp's own spread is below it (no-cache
/// vs cache max abs 2.6e-5, fixture README) and most steps measure 1e-7..5e-5 here. A step may
/// instead be off by an isolated `Q8_0` rounding flip: one input element of one expert matmul
/// rounds to the neighbouring int8 level because our f32 value differs from llama.cpp's in the
/// last bits, and these tiny random models amplify that to up to ~2e-2 (the spec-derived numpy
/// forward shows the same steps at the same sizes under 1e-7 weight perturbations). Such steps
/// must stay within [`K3_FLIP_REL_L2`], well below the reference-numerics gap (0.11 and 0.68), and
/// at least [`K3_MIN_EXACT_STEPS`] of the 48 steps must agree exactly (measured: 41).
const K3_EXACT_REL_L2: f64 = 1e-4;
const K3_FLIP_REL_L2: f64 = 5e-2;
const K3_MIN_EXACT_STEPS: usize = 38;

/// Kimi K3 against llama.cpp's goldens (tests/fixtures/kimi_k3, llama.cpp 34af94cd, CPU): both
/// cases, every prompt (1, 6, 30 tokens), 8 greedy steps: ids identical, and the step logits as
/// bounded above. This exercises attention residuals across block boundaries, gated NoPE MLA,
/// KDA with the lower-bound decay gate and full-rank output gate, LatentMoE, SiTU and the MXFP4
/// experts, prefill and decode.
///
/// llama.cpp's CPU backend rounds the input of every MXFP4 matmul through `Q8_0` (ggml's
/// `vec_dot_type` for MXFP4), and these fixtures amplify that rounding to up to 0.68 relative
/// L2. So the comparison runs with [`Numerics::LlamaCppCpu`], and the test also proves that the
/// rounding is what matters: with the reference numerics, each case's prompts' last positions
/// differ by more than 0.1 somewhere.
#[test]
fn kimi_k3_matches_llama_cpp_with_its_cpu_numerics() {
    let mut errors: Vec<f64> = Vec::new();
    for case in family_cases("kimi_k3", 2) {
        let (_tmp, dir) = convert_case(&case, StoredDtype::F32, StoredDtype::Mxfp4);
        let mut model = load_model(&dir, StoreOptions::new(1 << 30)).unwrap();
        model.set_numerics(Numerics::LlamaCppCpu).unwrap();
        let reference = load_model(&dir, StoreOptions::new(1 << 30)).unwrap();
        let expected = read_json(&case.join("expected.json"));
        let mut reference_worst = 0f64;
        for p in expected["prompts"].as_array().unwrap() {
            let prompt = ids(&p["prompt_ids"]);
            let want_ids = ids(&p["generated_ids"]);
            let opts = greedy(want_ids.len());
            let got = generate(model.as_ref(), &prompt, &opts, |_| true).unwrap();
            assert_eq!(
                got.generated_ids,
                want_ids,
                "{}: prompt of {}",
                case.display(),
                prompt.len()
            );
            let steps = p["step_logits"].as_array().unwrap();
            assert_eq!(got.step_logits.len(), steps.len());
            for (k, want) in steps.iter().enumerate() {
                let e = rel_l2_f32(&got.step_logits[k], &floats(want));
                assert!(
                    e < K3_FLIP_REL_L2,
                    "{}: prompt of {}, step {k}: rel L2 {e:.3e}",
                    case.display(),
                    prompt.len()
                );
                errors.push(e);
            }
            // Reference numerics: the prompt's last position (same inputs as step 0).
            let one = GenerateOptions {
                max_new_tokens: 1,
                ..opts
            };
            let r = generate(reference.as_ref(), &prompt, &one, |_| true).unwrap();
            reference_worst = reference_worst.max(rel_l2_f32(&r.step_logits[0], &floats(&steps[0])));
        }
        eprintln!(
            "{}: reference numerics at the prompts' last positions: rel L2 {reference_worst:.3e}",
            case.display()
        );
        assert!(
            reference_worst > 0.1,
            "{}: Q8_0 rounding no longer visible ({reference_worst:.3e})",
            case.display()
        );
    }
    let exact = errors.iter().filter(|e| **e < K3_EXACT_REL_L2).count();
    eprintln!(
        "kimi_k3: {exact} of {} steps within {K3_EXACT_REL_L2:e} of llama.cpp, worst {:.3e}",
        errors.len(),
        errors.iter().cloned().fold(0f64, f64::max)
    );
    assert_eq!(errors.len(), 48);
    assert!(
        exact >= K3_MIN_EXACT_STEPS,
        "only {exact} steps agree within {K3_EXACT_REL_L2:e}"
    );
}

#[test]
fn gpt_oss_lossless_layout_matches_transformers() {
    // gpt_oss_a: unquantized fused experts ([E, in, out]); gpt_oss_b: Hub MXFP4 experts, decoded.
    check_lossless("gpt_oss", 2, "gpt_oss");
}

#[test]
fn gpt_oss_default_layout_runs_within_bound() {
    check_quantized("gpt_oss", 2);
}

/// The tensor `name`'s bytes as stored in the single `model.safetensors` of `case`.
fn stored_bytes(case: &Path, name: &str) -> Vec<u8> {
    safetensors_bytes(case.join("model.safetensors"), name).unwrap_or_else(|| panic!("{name} not stored"))
}

/// gpt_oss_b stores its experts as the Hub's MXFP4 `_blocks`/`_scales`, fused over the experts:
/// each expert's record holds exactly its slice of those bytes (codes, then scales), its biases
/// as the stored f32, and the model run from those records (f32 backbone) reproduces the
/// reference, since MXFP4 values are exact in f32.
#[test]
fn gpt_oss_mxfp4_experts_are_copied_bit_for_bit() {
    let case = fixtures_root("gpt_oss").join("gpt_oss_b");
    let (_tmp, dir) = convert_case(&case, StoredDtype::F32, StoredDtype::Mxfp4);
    let pack = std::fs::read(dir.expert_pack_path()).unwrap();
    let layout = &dir.manifest.experts.layout;
    let dtypes: Vec<StoredDtype> = layout.iter().map(|m| m.dtype).collect();
    assert_eq!(
        dtypes,
        [
            StoredDtype::Mxfp4,
            StoredDtype::F32,
            StoredDtype::Mxfp4,
            StoredDtype::F32
        ]
    );
    let n_experts = dir.manifest.config.n_routed_experts();
    let mut checked = 0;
    for r in &dir.manifest.experts.records {
        for m in layout {
            let base = format!("model.layers.{}.mlp.experts.{}", r.layer, m.name);
            let part = |a: u64, b: u64| &pack[(r.offset + a) as usize..(r.offset + b) as usize];
            let slice = |name: &str| {
                let all = stored_bytes(&case, name);
                let n = all.len() / n_experts;
                all[r.expert as usize * n..(r.expert as usize + 1) * n].to_vec()
            };
            if m.dtype == StoredDtype::Mxfp4 {
                // cols are multiples of 32 here: rows need no padding.
                assert_eq!(
                    part(m.offset, m.scales_offset),
                    slice(&format!("{base}_blocks")),
                    "{base} codes"
                );
                assert_eq!(
                    part(m.scales_offset, m.offset + m.bytes),
                    slice(&format!("{base}_scales")),
                    "{base} scales"
                );
            } else {
                assert_eq!(part(m.offset, m.offset + m.bytes), slice(&base), "{base}");
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * dir.manifest.experts.records.len());
    assert!(checked > 0);
    let r = run_case(&case, StoredDtype::F32, StoredDtype::Mxfp4, 1 << 30);
    eprintln!("gpt_oss_b from MXFP4 records: max rel L2 {:.3e}", r.max_rel_l2);
    assert!(r.ids_equal && r.max_rel_l2 < LOSSLESS_REL_L2, "{}", r.max_rel_l2);
}

/// The per-layer sliding window of `gpt_oss_a` matters: with every layer `full_attention`, the
/// same weights no longer reproduce the reference (prompts are longer than the window of 4).
#[test]
fn gpt_oss_sliding_window_is_applied() {
    let case = fixtures_root("gpt_oss").join("gpt_oss_a");
    let (_tmp, src) = edited_copy(&case, |cfg| {
        assert_eq!(cfg["layer_types"][0], "sliding_attention");
        cfg["layer_types"] = serde_json::json!(["full_attention", "full_attention"]);
    });
    let without = run_case(&src, StoredDtype::F32, StoredDtype::F32, 1 << 30);
    eprintln!("gpt_oss_a rel L2 without the window {:.3e}", without.max_rel_l2);
    assert!(without.max_rel_l2 > 100.0 * LOSSLESS_REL_L2, "{}", without.max_rel_l2);
}

/// Kimi K3 against llama.cpp with f32 experts (`expected_f32_experts.json`, made by
/// tests/fixtures/kimi_k3/make_f32_goldens.py: the fixture's MXFP4 experts dequantized exactly, so
/// llama.cpp does not round its matmul inputs through Q8_0). deltafin's default numerics, experts
/// kept as MXFP4 records: ids identical on every prompt and every step's logits within relative
/// L2 1e-3 (measured max 5.2e-4). Epsilons: deltafin keeps 1e-6 for the MLA latent norms (the
/// value transformers' Kimi Linear and the Moonshot-derived ports use; K3-SPEC §4) where llama.cpp
/// uses rms_norm_eps 1e-5, and 1e-6 inside the KDA q/k L2 norm (fla) where llama.cpp uses 1e-5;
/// those differences are what the 1e-3 allows for.
#[test]
fn kimi_k3_matches_llama_cpp_f32_experts_within_1e3() {
    for case in family_cases("kimi_k3", 2) {
        let (_tmp, dir) = convert_case(&case, StoredDtype::F32, StoredDtype::Mxfp4);
        let model = load_model(&dir, StoreOptions::new(1 << 30)).unwrap();
        let expected = read_json(&case.join("expected_f32_experts.json"));
        let mut worst = 0f64;
        for p in expected["prompts"].as_array().unwrap() {
            let want_ids = ids(&p["generated_ids"]);
            let got = generate(model.as_ref(), &ids(&p["prompt_ids"]), &greedy(want_ids.len()), |_| {
                true
            })
            .unwrap();
            assert_eq!(got.generated_ids, want_ids, "{}: greedy ids differ", case.display());
            for (g, w) in got.step_logits.iter().zip(p["step_logits"].as_array().unwrap()) {
                worst = worst.max(rel_l2_f32(g, &floats(w)));
            }
        }
        eprintln!("{}: max rel L2 {worst:.3e} vs llama.cpp (f32 experts)", case.display());
        assert!(worst < 1e-3, "{}: logits rel L2 {worst:.3e} ≥ 1e-3", case.display());
    }
}

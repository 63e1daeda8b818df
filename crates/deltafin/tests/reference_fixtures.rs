//! Proof of correctness against Hugging Face transformers' `deepseek_v3` implementation.
//!
//! Each case in `tests/fixtures/deepseek_v3/` is a tiny random checkpoint written by transformers
//! together with the reference's greedy ids and float32 logits (see the README and
//! `make_fixtures.py` there). Here each case is converted and generated from:
//! - lossless layout (`--backbone f32 --experts f32`): ids identical at every step, logits within
//!   relative L2 1e-4 of the reference;
//! - default layout (int8 backbone, MXFP4 experts): logits within the documented bound below.

use std::path::{Path, PathBuf};

use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::models::DeepseekV3;
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::{ModelDir, StoredDtype};
use serde_json::Value;

/// Relative L2 error allowed in the lossless layout (issue #2).
const LOSSLESS_REL_L2: f64 = 1e-4;
/// Relative L2 error allowed for the default int8-backbone / MXFP4-expert layout on these
/// fixtures. Measured maximum: see `quantized_layout_stays_within_documented_bound` output and
/// README "Accuracy of the default layout".
const QUANTIZED_REL_L2: f64 = 0.8;

fn fixtures_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3")
}

fn cases() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = std::fs::read_dir(fixtures_root())
        .expect("tests/fixtures/deepseek_v3 exists")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("expected.json").is_file() && p.join("config.json").is_file())
        .collect();
    v.sort();
    assert!(v.len() >= 3, "expected at least 3 reference cases, found {v:?}");
    v
}

fn rel_l2(a: &[f32], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len(), "logit vector lengths differ");
    let num: f64 = a.iter().zip(b).map(|(x, y)| (*x as f64 - y).powi(2)).sum();
    let den: f64 = b.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id list")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn floats(v: &Value) -> Vec<f64> {
    v.as_array()
        .expect("float list")
        .iter()
        .map(|x| x.as_f64().expect("float"))
        .collect()
}

struct CaseResult {
    max_rel_l2: f64,
    ids_equal: bool,
}

fn run_case(case: &Path, backbone: StoredDtype, experts: StoredDtype, budget: u64) -> CaseResult {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let opts = ConvertOptions {
        backbone,
        experts,
        force: false,
    };
    convert(case, &out, &opts, &NoProgress).unwrap_or_else(|e| panic!("convert {}: {e}", case.display()));
    let dir = ModelDir::open(&out).unwrap();
    let model = DeepseekV3::load(&dir, budget).unwrap();
    let expected: Value = serde_json::from_slice(&std::fs::read(case.join("expected.json")).unwrap()).unwrap();
    let mut worst = 0f64;
    let mut ids_equal = true;
    for p in expected["prompts"].as_array().expect("prompts") {
        let prompt = ids(&p["prompt_ids"]);
        let want_ids = ids(&p["generated_ids"]);
        let want_logits: Vec<Vec<f64>> = p["step_logits"].as_array().unwrap().iter().map(floats).collect();
        let opts = GenerateOptions {
            max_new_tokens: want_ids.len(),
            eos_token_ids: vec![],
            ignore_eos: true,
            record_logits: true,
            trace_routes: None,
            ..Default::default()
        };
        let got = generate(&model, &prompt, &opts, |_| true).unwrap();
        if got.generated_ids != want_ids {
            ids_equal = false;
        }
        // Compare logits step by step while the ids agree (after a divergence the inputs differ).
        for (k, (g, w)) in got.step_logits.iter().zip(&want_logits).enumerate() {
            let e = rel_l2(g, w);
            worst = worst.max(e);
            if k < want_ids.len() && got.generated_ids[k] != want_ids[k] {
                break;
            }
        }
    }
    CaseResult {
        max_rel_l2: worst,
        ids_equal,
    }
}

#[test]
fn lossless_layout_matches_transformers() {
    for case in cases() {
        let r = run_case(&case, StoredDtype::F32, StoredDtype::F32, 1 << 30);
        eprintln!("{}: lossless max rel L2 {:.3e}", case.display(), r.max_rel_l2);
        assert!(r.ids_equal, "{}: greedy ids differ from the reference", case.display());
        assert!(
            r.max_rel_l2 < LOSSLESS_REL_L2,
            "{}: logits rel L2 {:.3e} ≥ {LOSSLESS_REL_L2}",
            case.display(),
            r.max_rel_l2
        );
    }
}

#[test]
fn quantized_layout_stays_within_documented_bound() {
    for case in cases() {
        let r = run_case(&case, StoredDtype::Int8, StoredDtype::Mxfp4, 1 << 30);
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
}

#[test]
fn output_is_bit_identical_at_any_cache_budget() {
    let case = &cases()[0];
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    convert(case, &out, &ConvertOptions::default(), &NoProgress).unwrap();
    let dir = ModelDir::open(&out).unwrap();
    let expected: Value = serde_json::from_slice(&std::fs::read(case.join("expected.json")).unwrap()).unwrap();
    let prompt = ids(expected["prompts"].as_array().unwrap().last().unwrap()["prompt_ids"]
        .clone()
        .as_array()
        .map(|_| &expected["prompts"].as_array().unwrap().last().unwrap()["prompt_ids"])
        .unwrap());
    let opts = GenerateOptions {
        max_new_tokens: 8,
        eos_token_ids: vec![],
        ignore_eos: true,
        record_logits: true,
        trace_routes: None,
        ..Default::default()
    };
    let mut runs = Vec::new();
    for budget in [0u64, 1, 64 << 10, 1 << 30] {
        let model = DeepseekV3::load(&dir, budget).unwrap();
        let g = generate(&model, &prompt, &opts, |_| true).unwrap();
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
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("model");
    let opts = ConvertOptions {
        backbone: StoredDtype::F32,
        experts: StoredDtype::F32,
        force: false,
    };
    convert(case, &out, &opts, &NoProgress).unwrap();
    let model = DeepseekV3::load(&ModelDir::open(&out).unwrap(), 1 << 30).unwrap();
    let expected: Value = serde_json::from_slice(&std::fs::read(case.join("expected.json")).unwrap()).unwrap();
    let p = &expected["prompts"].as_array().unwrap()[1];
    let want = ids(&p["generated_ids"]);
    // Declare the reference's third generated token an end-of-sequence id: generation must stop
    // right after producing it (unless an earlier token has the same id).
    let eos = want[2];
    let stop_at = want.iter().position(|&t| t == eos).unwrap();
    let g = generate(
        &model,
        &ids(&p["prompt_ids"]),
        &GenerateOptions {
            max_new_tokens: 8,
            eos_token_ids: vec![eos],
            ignore_eos: false,
            record_logits: false,
            trace_routes: None,
            ..Default::default()
        },
        |_| true,
    )
    .unwrap();
    assert_eq!(g.generated_ids, want[..=stop_at].to_vec());
    assert_eq!(g.stats.finish_reason, "eos");
    // With ignore_eos the same model runs to the limit.
    let g = generate(
        &model,
        &ids(&p["prompt_ids"]),
        &GenerateOptions {
            max_new_tokens: 8,
            eos_token_ids: vec![eos],
            ignore_eos: true,
            record_logits: false,
            trace_routes: None,
            ..Default::default()
        },
        |_| true,
    )
    .unwrap();
    assert_eq!(g.generated_ids, want);
    assert_eq!(g.stats.finish_reason, "length");
}

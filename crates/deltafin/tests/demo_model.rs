//! The embedded trained demo model (crates/deltafin/demo-model/, made by train/demo_model/)
//! against transformers' `DeepseekV3ForCausalLM` on the same weights
//! (tests/fixtures/demo_model/expected.json, written by train/demo_model/export.py).
//!
//! The committed model is the int8-backbone / MXFP4-expert layout `deltafin convert` writes;
//! the weights were rounded onto exactly those grids before export, so the layout is lossless
//! here and the reference's float32 logits are reproduced to f32 rounding: identical greedy ids,
//! identical expert sets at every position and MoE layer, logits within relative L2 1e-4 (the
//! lossless bound of tests/reference_fixtures.rs).

use std::path::{Path, PathBuf};

use deltafin_engine::experts::StoreOptions;
use deltafin_engine::generate::{generate, GenerateOptions};
use deltafin_engine::traces::Trace;
use deltafin_engine::{load_model, CausalLm};
use deltafin_format::ModelDir;
use serde_json::Value;

mod common;
use common::{floats, greedy, ids, read_json, rel_l2_f32};

/// Relative L2 error allowed between our logits and the reference's (as the lossless layout in
/// tests/reference_fixtures.rs).
const REL_L2: f64 = 1e-4;

fn model_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("demo-model")
}

fn expected() -> Value {
    read_json(&Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/demo_model/expected.json"))
}

#[test]
fn trained_demo_model_matches_transformers() {
    let dir = ModelDir::open(&model_dir()).unwrap();
    assert_eq!(dir.manifest.experts.dtype.name(), "mxfp4");
    let cfg = dir.manifest.config.clone();
    // A budget below the pack: experts stream while the reference is reproduced.
    let model: Box<dyn CausalLm> = load_model(&dir, StoreOptions::new(4 << 20)).unwrap();
    let exp = expected();
    let prompts = exp["prompts"].as_array().expect("prompts");
    assert!(prompts.len() >= 3);
    let tmp = tempfile::tempdir().unwrap();
    for (pi, p) in prompts.iter().enumerate() {
        let prompt = ids(&p["prompt_ids"]);
        let want = ids(&p["generated_ids"]);
        let trace = tmp.path().join(format!("p{pi}.routes"));
        let opts = GenerateOptions {
            trace_routes: Some(trace.clone()),
            ..greedy(want.len())
        };
        let got = generate(model.as_ref(), &prompt, &opts, |_| true).unwrap();
        assert_eq!(got.generated_ids, want, "prompt {pi}: greedy ids");
        let mut worst = 0f64;
        for (k, w) in p["step_logits"].as_array().unwrap().iter().enumerate() {
            worst = worst.max(rel_l2_f32(&got.step_logits[k], &floats(w)));
        }
        eprintln!("prompt {pi} ({} tokens): max rel L2 {worst:.3e}", prompt.len());
        assert!(worst <= REL_L2, "prompt {pi}: rel L2 {worst:.3e} > {REL_L2}");

        // Routing: trace records (one per position) against the reference router's choices.
        let t = Trace::read_for(&trace, &cfg).unwrap();
        let k = t.shape.top_k as usize;
        let first = t.shape.first_moe as usize;
        let mut records = t.records.clone();
        records.sort_by_key(|r| r.0);
        let routing = p["routing"].as_object().expect("routing");
        let n_pos = prompt.len() + want.len() - 1;
        assert_eq!(records.len(), n_pos, "prompt {pi}: trace records");
        for (layer, rows) in routing {
            let l: usize = layer.parse().unwrap();
            let rows = rows.as_array().unwrap();
            assert_eq!(rows.len(), n_pos);
            for (pos, row) in rows.iter().enumerate() {
                let want_set = ids(row);
                let got_set: Vec<u32> = records[pos].1[(l - first) * k..(l - first + 1) * k]
                    .iter()
                    .map(|&e| e as u32)
                    .collect();
                assert_eq!(got_set, want_set, "prompt {pi}, layer {l}, position {pos}: experts");
            }
        }
    }
}

//! Quantized source checkpoints, converted and generated from through the real command line.
//!
//! The cases in `tests/fixtures/quantized/` (see the README and `make_fixtures.py` there) are
//! tiny DeepSeek-V3-architecture checkpoints stored as the real models ship them:
//! - `dsv3_fp8`: block FP8 (`float8_e4m3fn` + `<name>_scale_inv` per [16, 16] block, partial edge
//!   blocks), as DeepSeek-V3 and Kimi K2;
//! - `kimi_int4`: compressed-tensors int4 `pack-quantized` routed experts, as Kimi K2 Thinking.
//!
//! Their expected ids and float32 logits come from transformers run on the weights dequantized by
//! the reference code. `deltafin convert --backbone f32 --experts f32` must read the quantized
//! tensors exactly, so generation matches: ids identical, logits within relative L2 1e-4.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use assert_cmd::Command;
use safetensors::tensor::TensorView;
use safetensors::SafeTensors;
use serde_json::Value;

/// Relative L2 error allowed in the lossless layout (issue #2).
const LOSSLESS_REL_L2: f64 = 1e-4;

mod common;
use common::{floats, ids, ok, rel_l2, text};

fn deltafin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("deltafin"));
    c.timeout(Duration::from_secs(120));
    c
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/quantized")
        .join(case)
}

fn convert_lossless(hf: &Path, out: &Path) -> Output {
    deltafin()
        .arg("convert")
        .arg(hf)
        .arg(out)
        .args(["--backbone", "f32", "--experts", "f32"])
        .output()
        .expect("running deltafin")
}

/// Converts `case` losslessly and checks every reference prompt; returns the worst logits error.
fn check_case(case: &str) -> f64 {
    let hf = fixture(case);
    let expected: Value = serde_json::from_slice(&std::fs::read(hf.join("expected.json")).unwrap()).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("model");
    ok(convert_lossless(&hf, &model));
    let mut worst = 0f64;
    for (pi, p) in expected["prompts"].as_array().expect("prompts").iter().enumerate() {
        let prompt = ids(&p["prompt_ids"]);
        let want_ids = ids(&p["generated_ids"]);
        let logits = tmp.path().join(format!("logits{pi}.json"));
        let joined: Vec<String> = prompt.iter().map(|x| x.to_string()).collect();
        ok(deltafin()
            .args(["run", "--model"])
            .arg(&model)
            .args(["--prompt-ids", &joined.join(",")])
            .args(["--max-new-tokens", &want_ids.len().to_string(), "--ignore-eos"])
            .args(["--ram-budget", "64MiB", "--logits-out"])
            .arg(&logits)
            .output()
            .expect("running deltafin"));
        let got: Value = serde_json::from_slice(&std::fs::read(&logits).unwrap()).unwrap();
        assert_eq!(ids(&got["prompt_ids"]), prompt);
        assert_eq!(
            ids(&got["generated_ids"]),
            want_ids,
            "{case} prompt {pi}: greedy ids differ from the reference"
        );
        let got_steps = got["step_logits"].as_array().expect("step_logits");
        let want_steps = p["step_logits"].as_array().expect("step_logits");
        assert_eq!(got_steps.len(), want_steps.len());
        for (k, (g, w)) in got_steps.iter().zip(want_steps).enumerate() {
            let e = rel_l2(&floats(g), &floats(w));
            assert!(
                e <= LOSSLESS_REL_L2,
                "{case} prompt {pi} step {k}: logits rel L2 {e:.3e} > {LOSSLESS_REL_L2}"
            );
            worst = worst.max(e);
        }
    }
    worst
}

#[test]
fn block_fp8_checkpoint_generates_like_transformers() {
    let worst = check_case("dsv3_fp8");
    eprintln!("dsv3_fp8: max rel L2 {worst:.3e}");
}

#[test]
fn int4_pack_quantized_checkpoint_generates_like_transformers() {
    let worst = check_case("kimi_int4");
    eprintln!("kimi_int4: max rel L2 {worst:.3e}");
}

/// Rewrites `case`'s model.safetensors into `dir` with `edit` applied to the tensor list.
fn edited_copy(case: &str, dir: &Path, edit: impl Fn(&mut Vec<(String, TensorView<'_>)>)) {
    let src = fixture(case);
    for f in ["config.json", "expected.json"] {
        std::fs::copy(src.join(f), dir.join(f)).unwrap();
    }
    let bytes = std::fs::read(src.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut tensors: Vec<(String, TensorView<'_>)> = st.tensors();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut tensors);
    safetensors::serialize_to_file(tensors, None, &dir.join("model.safetensors")).unwrap();
}

/// Asserts a clean one-line failure of `convert` containing every needle, and no output left.
fn expect_convert_error(hf: &Path, needles: &[&str]) {
    let out_dir = hf.join("out");
    let out = convert_lossless(hf, &out_dir);
    let stderr = text(&out.stderr);
    assert!(!out.status.success(), "expected a failure, got success: {stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "one error line expected:\n{stderr}");
    assert!(
        needles.iter().all(|n| lines[0].contains(n)),
        "{needles:?} not in: {}",
        lines[0]
    );
    assert!(!out_dir.exists(), "a failed convert must not leave an output directory");
}

/// A copy of fixture `case` without the tensor `missing` fails to convert
/// ([`expect_convert_error`]: one error line holding every needle).
fn refused_without_tensor(case: &str, missing: &str, needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    edited_copy(case, tmp.path(), |t| t.retain(|(n, _)| n != missing));
    expect_convert_error(tmp.path(), needles);
}

#[test]
fn fp8_weight_without_its_scale_is_an_error_naming_it() {
    let name = "model.layers.1.mlp.experts.3.down_proj.weight";
    refused_without_tensor("dsv3_fp8", &format!("{name}_scale_inv"), &[name, "_scale_inv", "FP8"]);
}

#[test]
fn int4_expert_without_its_scale_is_an_error_naming_it() {
    let module = "model.layers.2.mlp.experts.5.gate_proj";
    refused_without_tensor(
        "kimi_int4",
        &format!("{module}.weight_scale"),
        &[module, "weight_scale"],
    );
}

#[test]
fn int4_module_listed_in_ignore_is_an_error() {
    let tmp = tempfile::tempdir().unwrap();
    edited_copy("kimi_int4", tmp.path(), |_| {});
    let cfg_path = tmp.path().join("config.json");
    let mut cfg: Value = serde_json::from_slice(&std::fs::read(&cfg_path).unwrap()).unwrap();
    cfg["quantization_config"]["ignore"]
        .as_array_mut()
        .unwrap()
        .push(Value::from("re:.*experts\\.7\\..*"));
    std::fs::write(&cfg_path, serde_json::to_vec(&cfg).unwrap()).unwrap();
    expect_convert_error(tmp.path(), &["experts.7", "ignore"]);
}

//! Hostile and unusual inputs to `info`, `convert`, `run` and `cache verify` (issue #19, items
//! 1, 3, 4, 5, 13 and 14): a `config.json` or `manifest.json` with values no model has, a FIFO
//! in place of an input file, NaN weights, transformers 5 spellings, a checkpoint without a
//! tokenizer. Each bad input must give exactly one error line naming what is wrong, promptly,
//! with no panic and nothing written; each unusual but valid one must work.

use std::path::{Path, PathBuf};
use std::process::Output;

use assert_cmd::Command;
use safetensors::Dtype;
mod common;
use common::{
    assert_no_output, deltafin_within, edit_json, exec, expect_error, ok, read_json, rewrite_safetensors, text,
    with_model, RawTensor,
};
use serde_json::{json, Value};

fn deltafin() -> Command {
    // Every case here must answer at once; a hang (the FIFO cases before the fix) is a failure.
    deltafin_within(60)
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// A writable copy of fixture `case` (e.g. `deepseek_v3/dsv3_a`) in `tmp/hf`.
fn copy_case(case: &str, tmp: &Path) -> PathBuf {
    let hf = tmp.join("hf");
    std::fs::create_dir_all(&hf).unwrap();
    for e in std::fs::read_dir(fixtures().join(case)).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), hf.join(e.file_name())).unwrap();
        }
    }
    hf
}

fn convert(hf: &Path, out: &Path, extra: &[&str]) -> Output {
    exec(deltafin().arg("convert").arg(hf).arg(out).args(extra))
}

fn run_ids(model: &Path, ids: &str, extra: &[&str]) -> Output {
    exec(
        with_model(
            deltafin(),
            "run",
            model,
            &["--prompt-ids", ids, "--max-new-tokens", "3", "--ignore-eos"],
        )
        .args(extra),
    )
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
    // SAFETY: a valid NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0, "mkfifo {}", p.display());
}

/// Sets every value of f32 tensor `name` to `x`.
fn fill_f32(ts: &mut [RawTensor], name: &str, x: f32) {
    let t = ts
        .iter_mut()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("no {name}"));
    assert_eq!(t.1, Dtype::F32, "{name} is not f32");
    for c in t.3.chunks_exact_mut(4) {
        c.copy_from_slice(&x.to_le_bytes());
    }
}

// ---------------------------------------------------------------------------------------------
// Item 1: counts and sizes are bounded before anything is allocated
// ---------------------------------------------------------------------------------------------

/// `num_hidden_layers` of 2^63 panicked ("capacity overflow") and 10^7 grew `info` to 14 GB:
/// every count is bounded at parse time, for `info` on a config and a checkpoint and for
/// `convert`, naming the field; a config whose tensors would not fit any machine is refused.
#[test]
fn huge_counts_and_sizes_are_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
    let cfg = hf.join("config.json");
    let original = read_json(&cfg);
    for layers in [json!(10_000_000u64), json!(1u64 << 63), json!(u32::MAX)] {
        edit_json(&cfg, |v| v["num_hidden_layers"] = layers.clone());
        for target in [cfg.clone(), hf.clone()] {
            let out = exec(deltafin().arg("info").arg(&target));
            expect_error(&out, &["config.json", "num_hidden_layers", "at most 4096"]);
        }
        let m = tmp.path().join("m");
        expect_error(&convert(&hf, &m, &[]), &["num_hidden_layers", "at most 4096"]);
        assert_no_output(&m);
    }
    std::fs::write(&cfg, serde_json::to_vec(&original).unwrap()).unwrap();
    edit_json(&cfg, |v| v["n_routed_experts"] = json!(1u64 << 40));
    expect_error(
        &exec(deltafin().arg("info").arg(&cfg)),
        &["n_routed_experts", "at most 65536"],
    );
    // Every field within its bound, but one routed expert would hold 3 × 2^40 weights.
    std::fs::write(&cfg, serde_json::to_vec(&original).unwrap()).unwrap();
    edit_json(&cfg, |v| {
        v["hidden_size"] = json!(1 << 20);
        v["moe_intermediate_size"] = json!(1 << 20);
    });
    expect_error(
        &exec(deltafin().arg("info").arg(&cfg)),
        &["config.json", "routed expert", "larger than deltafin can hold"],
    );
}

// ---------------------------------------------------------------------------------------------
// Item 3: values that make the math meaningless
// ---------------------------------------------------------------------------------------------

/// Values that gave NaN logits with exit 0 (or a manifest that cannot be read back) are refused
/// at convert with one line naming the field.
#[test]
fn meaningless_values_are_refused_naming_the_field() {
    let cases: Vec<(&str, Value, &str)> = vec![
        ("rope_theta", json!(0), "rope_theta"),
        ("rope_theta", json!(-10000.0), "rope_theta"),
        ("rms_norm_eps", json!(-1e-6), "rms_norm_eps"),
        ("routed_scaling_factor", json!(1e39), "routed_scaling_factor"),
        ("rope_scaling", json!("x"), "rope_scaling"),
        (
            "rope_scaling",
            json!({"type": "yarn", "factor": 0, "original_max_position_embeddings": 32}),
            "rope_scaling.factor",
        ),
        (
            "rope_parameters",
            json!({"rope_type": "default", "rope_theta": -1.0}),
            "rope_parameters.rope_theta",
        ),
    ];
    for (key, value, field) in cases {
        let tmp = tempfile::tempdir().unwrap();
        let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
        edit_json(&hf.join("config.json"), |v| v[key] = value.clone());
        let m = tmp.path().join("m");
        let line = expect_error(&convert(&hf, &m, &[]), &["config.json", field]);
        assert!(
            line.contains("out of range") || line.contains("expected an object"),
            "{line}"
        );
        assert_no_output(&m);
    }
    // The same checks hold for another family's config.
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("qwen3_moe/qwen3_moe_a", tmp.path());
    edit_json(&hf.join("config.json"), |v| v["rms_norm_eps"] = json!(-0.5));
    expect_error(&convert(&hf, &tmp.path().join("m"), &[]), &["rms_norm_eps"]);
}

/// A NaN or infinite weight is refused at convert, naming the tensor.
#[test]
fn non_finite_weights_are_refused_at_convert() {
    for x in [f32::NAN, f32::INFINITY] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
        rewrite_safetensors(&hf.join("model.safetensors"), |ts| {
            fill_f32(ts, "model.layers.1.post_attention_layernorm.weight", x)
        });
        let m = tmp.path().join("m");
        expect_error(
            &convert(&hf, &m, &[]),
            &["model.layers.1.post_attention_layernorm.weight", "not finite"],
        );
        assert_no_output(&m);
    }
}

/// Finite weights whose products overflow f32 make NaN logits: the step fails with an error
/// naming the position, instead of exiting 0 with tokens sampled from NaN.
#[test]
fn non_finite_logits_fail_the_step() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
    rewrite_safetensors(&hf.join("model.safetensors"), |ts| {
        fill_f32(ts, "model.layers.0.self_attn.o_proj.weight", 3.0e38)
    });
    let m = tmp.path().join("m");
    ok(convert(&hf, &m, &["--backbone", "f32", "--experts", "f32"]));
    let logits = tmp.path().join("logits.json");
    let out = run_ids(&m, "1,2,3", &["--logits-out", logits.to_str().unwrap()]);
    expect_error(&out, &["non-finite logit", "position"]);
    assert!(
        std::fs::metadata(&logits).is_err(),
        "--logits-out written by a failed run"
    );
}

// ---------------------------------------------------------------------------------------------
// Item 4: manifest fields are validated at load
// ---------------------------------------------------------------------------------------------

type ManifestEdit = Box<dyn Fn(&mut Value)>;

/// `experts.record_align` 0 divided by zero in `run` and `cache verify`, and an embedding shape
/// that disagrees with `hidden_size` hit an assertion: both are load errors naming the field.
#[test]
fn manifest_values_are_checked_at_load() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    ok(convert(&fixtures().join("deepseek_v3/dsv3_a"), &m, &[]));
    let mpath = m.join("manifest.json");
    let original = read_json(&mpath);
    let cases: Vec<(ManifestEdit, Vec<&str>)> = vec![
        (
            Box::new(|v| v["experts"]["record_align"] = json!(0)),
            vec!["experts.record_align", "power of two"],
        ),
        (
            Box::new(|v| {
                v["backbone"]["tensors"]["model.embed_tokens.weight"]["shape"] = json!([512, 65]);
            }),
            vec!["model.embed_tokens.weight", "shape"],
        ),
        (
            Box::new(|v| v["config"]["deepseek_v3"]["hidden_size"] = json!(96)),
            vec!["manifest.json", "shape"],
        ),
        (
            Box::new(|v| v["config"]["deepseek_v3"]["num_hidden_layers"] = json!(1u64 << 40)),
            vec!["num_hidden_layers", "at most"],
        ),
        (
            Box::new(|v| v["experts"]["records"][0]["offset"] = json!(u64::MAX - 10)),
            vec!["experts.records"],
        ),
        (
            Box::new(|v| v["config"]["deepseek_v3"]["rms_norm_eps"] = json!(-1.0)),
            vec!["rms_norm_eps", "out of range"],
        ),
    ];
    for (edit, needles) in cases {
        let mut v = original.clone();
        edit(&mut v);
        std::fs::write(&mpath, serde_json::to_vec(&v).unwrap()).unwrap();
        expect_error(&run_ids(&m, "1", &[]), &needles);
        expect_error(&exec(deltafin().args(["cache", "verify"]).arg(&m)), &needles);
        expect_error(&exec(deltafin().arg("info").arg(&m)), &needles);
    }
}

// ---------------------------------------------------------------------------------------------
// Item 5: only regular files are opened
// ---------------------------------------------------------------------------------------------

/// A FIFO in place of `model.safetensors` or `config.json` blocked `convert` forever (and one
/// in place of `manifest.json` blocked a load): each is now an error naming the file.
#[test]
fn a_fifo_in_place_of_an_input_file_is_an_error_not_a_hang() {
    for file in ["model.safetensors", "config.json"] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
        std::fs::remove_file(hf.join(file)).unwrap();
        mkfifo(&hf.join(file));
        let m = tmp.path().join("m");
        expect_error(&convert(&hf, &m, &[]), &[file, "not a regular file"]);
        assert_no_output(&m);
        if file == "config.json" {
            // (info reads only the config, never the shards.)
            expect_error(&exec(deltafin().arg("info").arg(&hf)), &[file, "not a regular file"]);
        }
    }
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    ok(convert(&fixtures().join("deepseek_v3/dsv3_a"), &m, &[]));
    std::fs::remove_file(m.join("manifest.json")).unwrap();
    mkfifo(&m.join("manifest.json"));
    expect_error(&run_ids(&m, "1", &[]), &["manifest.json", "not a regular file"]);
    expect_error(
        &exec(deltafin().arg("info").arg(&m)),
        &["manifest.json", "not a regular file"],
    );
}

/// A FIFO in place of a tokenizer or generation file: `convert` left it out silently, and `run`,
/// `chat` and `serve` blocked forever reading it. Each command now names the file at once.
#[test]
fn a_fifo_in_place_of_a_tokenizer_file_is_an_error_not_a_hang() {
    let tmp = tempfile::tempdir().unwrap();
    let good = tmp.path().join("good");
    ok(convert(&fixtures().join("deepseek_v3/dsv3_a"), &good, &[]));
    for file in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
        "chat_template.jinja",
        "tiktoken.model",
    ] {
        let needles = [file, "not a regular file"];
        let case = tempfile::tempdir().unwrap();
        let hf = copy_case("deepseek_v3/dsv3_a", case.path());
        let _ = std::fs::remove_file(hf.join(file));
        mkfifo(&hf.join(file));
        let m = case.path().join("m");
        expect_error(&convert(&hf, &m, &[]), &needles);
        assert_no_output(&m);
        // The same FIFO inside a converted model directory, for every command that reads it.
        let m = case.path().join("m2");
        std::fs::create_dir(&m).unwrap();
        for e in std::fs::read_dir(&good).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), m.join(e.file_name())).unwrap();
        }
        let _ = std::fs::remove_file(m.join(file));
        if file == "tiktoken.model" {
            // (read only when there is no tokenizer.json)
            std::fs::remove_file(m.join("tokenizer.json")).unwrap();
        }
        mkfifo(&m.join(file));
        let chat = exec(&mut with_model(
            deltafin(),
            "run",
            &m,
            &["--prompt", "hi", "--max-new-tokens", "1"],
        ));
        expect_error(&chat, &needles);
        let serve = exec(deltafin().arg("serve").arg(&m).args(["--port", "0"]));
        expect_error(&serve, &needles);
    }
}

// ---------------------------------------------------------------------------------------------
// Item 13: every spelling transformers reads
// ---------------------------------------------------------------------------------------------

/// transformers 5 saves Qwen3-MoE's expert count as `num_local_experts` (its `attribute_map`
/// maps `num_experts` to it); Mixtral and gpt-oss accept `num_experts`. Both spellings convert
/// and `info` shows the real count; two spellings that disagree are an error naming both.
#[test]
fn transformers_attribute_map_spellings_are_accepted() {
    for (case, from, to) in [
        ("qwen3_moe/qwen3_moe_a", "num_experts", "num_local_experts"),
        ("mixtral/mixtral_a", "num_local_experts", "num_experts"),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = copy_case(case, tmp.path());
        let cfg = hf.join("config.json");
        let n = read_json(&cfg)[from]
            .as_u64()
            .expect("the fixture names its expert count");
        edit_json(&cfg, |v| {
            let x = v.as_object_mut().unwrap().remove(from).unwrap();
            v[to] = x;
        });
        let info = text(&ok(exec(deltafin().arg("info").arg(&hf))).stdout);
        assert!(
            info.contains(&format!("routed experts             {n} per")),
            "{case}: {info}"
        );
        let m = tmp.path().join("m");
        ok(convert(&hf, &m, &[]));
        ok(run_ids(&m, "1,2", &[]));
        edit_json(&cfg, |v| v[from] = json!(n + 2));
        expect_error(&exec(deltafin().arg("info").arg(&hf)), &[from, to, "disagrees"]);
    }
}

// ---------------------------------------------------------------------------------------------
// Item 14: a checkpoint without a tokenizer
// ---------------------------------------------------------------------------------------------

/// `convert` without a tokenizer warned "runs only with --prompt-ids", and then `run
/// --prompt-ids` failed with "no tokenizer". It now runs, printing the generated ids (the same
/// ids `--logits-out` records); `--prompt` text still needs a tokenizer and says so.
#[test]
fn a_model_without_a_tokenizer_runs_on_token_ids() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("deepseek_v3/dsv3_a", tmp.path());
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::remove_file(hf.join(f)).unwrap();
    }
    let m = tmp.path().join("m");
    let out = ok(convert(&hf, &m, &[]));
    let warning = text(&out.stderr);
    assert!(warning.contains("run --prompt-ids"), "{warning}");
    let logits = tmp.path().join("logits.json");
    let out = ok(run_ids(&m, "5,6,7", &["--logits-out", logits.to_str().unwrap()]));
    let generated: Vec<String> = read_json(&logits)["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap().to_string())
        .collect();
    assert_eq!(generated.len(), 3);
    assert_eq!(text(&out.stdout).trim_end(), generated.join(","));
    let out = exec(&mut with_model(
        deltafin(),
        "run",
        &m,
        &["--prompt", "hello", "--max-new-tokens", "2"],
    ));
    expect_error(&out, &["no tokenizer", "--prompt-ids"]);
}

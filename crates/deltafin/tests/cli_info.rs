//! `deltafin info` end to end: what it reports for a checkpoint and for a model directory.
//!
//! Shared helpers: `tests/cli_support/mod.rs`.

mod cli_support;

use cli_support::*;

/// `deltafin info` on the Qwen3-Next and Qwen3.5-MoE configs: family, model type, layer and expert
/// counts, and the fixed DeltaNet state (qwen3_next_a: 3 DeltaNet layers × (4 value heads × 8 × 12
/// recurrent + 3 × 80 conv values) × 4 bytes = 7488; one attention layer keeps 2 × 2 × 16 f32 per
/// token = 256 bytes).
#[test]
fn info_reports_qwen3_next_and_qwen3_5_moe() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    let out = ok(exec(deltafin().arg("info").arg(root.join("qwen3_next/qwen3_next_a"))));
    let t = text(&out.stdout);
    for needle in [
        "qwen3_next (qwen3_next)",
        "4 (3 MoE)",
        "8 per MoE layer, top-2",
        "(7488 bytes) per sequence",
        "(256 bytes) of context",
    ] {
        assert!(t.contains(needle), "missing {needle:?} in:\n{t}");
    }
    let out = ok(exec(deltafin().arg("info").arg(root.join("qwen3_5_moe/qwen3_5_moe_a"))));
    let t = text(&out.stdout);
    for needle in ["qwen3_next (qwen3_5_moe)", "4 (4 MoE)"] {
        assert!(t.contains(needle), "missing {needle:?} in:\n{t}");
    }
}

/// `deltafin info` on a converted directory reports the layout it was converted with (here the
/// lossless f32 one), and its backbone and pack sizes equal the files'; on the source checkpoint
/// its int8 backbone estimate equals the default convert's `backbone.bin` to the byte.
#[test]
fn info_reports_a_model_directory_as_stored() {
    let tmp = tempfile::tempdir().unwrap();
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_moe/qwen3_5_moe_a");
    let f32_dir = tmp.path().join("f32");
    ok(convert(&src, &f32_dir, &["--backbone", "f32", "--experts", "f32"]));
    let len = |p: &Path| std::fs::metadata(p).unwrap().len();
    let t = text(&ok(exec(deltafin().arg("info").arg(&f32_dir))).stdout);
    for needle in [
        format!("({} bytes) (f32 matrices", len(&f32_dir.join("backbone.bin"))),
        "one expert (f32)".to_string(),
        format!("({} bytes) in 32 records", len(&f32_dir.join("experts.pack"))),
    ] {
        assert!(t.contains(&needle), "missing {needle:?} in:\n{t}");
    }
    let default_dir = tmp.path().join("default");
    ok(convert(&src, &default_dir, &[]));
    let t = text(&ok(exec(deltafin().arg("info").arg(&src))).stdout);
    let needle = format!("({} bytes)", len(&default_dir.join("backbone.bin")));
    let line = t.lines().find(|l| l.starts_with("resident backbone (int8)")).unwrap();
    assert!(line.contains(&needle), "{line:?} vs backbone.bin {needle}");
    // A damaged config.json copy is named by info as by run.
    std::fs::write(default_dir.join("config.json"), "{\"model_type\": ").unwrap();
    for cmd in [vec!["info"], vec!["run", "--prompt-ids", "0", "--model"]] {
        let out = exec(deltafin().args(&cmd).arg(&default_dir));
        expect_error(&out, &["config.json", "malformed JSON"]);
    }
}

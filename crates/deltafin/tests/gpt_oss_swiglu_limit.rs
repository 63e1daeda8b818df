//! Issue #19 item 2: gpt-oss `swiglu_limit` ≤ 0 made every expert computation panic
//! (`f32::clamp` with crossed bounds) on the compute pool, and `run` never exited. `convert`
//! refuses it, and so does loading a model directory whose manifest was edited after convert:
//! one error line naming the field, non-zero exit, no panic, no hang.

use std::path::{Path, PathBuf};
use std::process::Output;
use std::time::Duration;

use assert_cmd::Command;
use serde_json::Value;

fn deltafin() -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("deltafin"));
    c.timeout(Duration::from_secs(120));
    c
}

fn fixture() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gpt_oss/gpt_oss_a")
}

fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// Sets every `swiglu_limit` inside `v` to `limit`; returns how many it set.
fn set_limit(v: &mut Value, limit: f64) -> usize {
    match v {
        Value::Object(o) => {
            let mut n = 0;
            for (k, x) in o.iter_mut() {
                if k == "swiglu_limit" {
                    *x = serde_json::json!(limit);
                    n += 1;
                } else {
                    n += set_limit(x, limit);
                }
            }
            n
        }
        Value::Array(a) => a.iter_mut().map(|x| set_limit(x, limit)).sum(),
        _ => 0,
    }
}

fn edit_json(p: &Path, limit: f64) {
    let mut v: Value = serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap();
    assert!(set_limit(&mut v, limit) > 0, "no swiglu_limit in {}", p.display());
    std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// Non-zero exit (not a signal), no panic, one `error:` line naming `swiglu_limit`.
fn expect_one_line_error(out: &Output) {
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && out.status.code().is_some(),
        "{:?}: {stderr}",
        out.status
    );
    assert!(!stderr.contains("panicked"), "{stderr}");
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(
        lines[0].starts_with("error: ") && lines[0].contains("swiglu_limit"),
        "{stderr}"
    );
}

#[test]
fn convert_refuses_a_non_positive_swiglu_limit() {
    for limit in [-1.0, 0.0] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        copy_dir(&fixture(), &hf);
        edit_json(&hf.join("config.json"), limit);
        let out = deltafin()
            .arg("convert")
            .arg(&hf)
            .arg(tmp.path().join("out"))
            .output()
            .unwrap();
        expect_one_line_error(&out);
        assert!(!tmp.path().join("out").exists());
    }
}

#[test]
fn run_refuses_a_manifest_edited_to_a_negative_swiglu_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let conv = deltafin().arg("convert").arg(fixture()).arg(&out).output().unwrap();
    assert!(conv.status.success(), "{}", String::from_utf8_lossy(&conv.stderr));
    edit_json(&out.join("manifest.json"), -1.0);
    let run = deltafin()
        .args(["run", "--model"])
        .arg(&out)
        .args(["--prompt-ids", "1,2,3", "--max-new-tokens", "2"])
        .output()
        .unwrap();
    expect_one_line_error(&run);
}

//! Helpers shared by the CLI test files that drive the real `deltafin` binary and demand clean
//! one-line failures (`hostile_inputs.rs`, `integrity.rs`, and through `cli_support` the
//! `cli_*.rs` files), the greedy-ids runs of `k3_layout.rs` and `cuda_fixtures.rs`, and the
//! safetensors rewriting of the broken-checkpoint tests, the local HTTP servers of `pull.rs`
//! and `user_cli.rs`.

#![allow(dead_code)]

use std::net::{TcpListener, TcpStream};
use std::os::unix::process::ExitStatusExt;
use std::path::Path;
use std::process::Output;
use std::sync::Arc;
use std::time::Duration;

use assert_cmd::Command;
use safetensors::tensor::TensorView;
use safetensors::{Dtype, SafeTensors};

/// The `deltafin` binary with a wall-clock limit of `secs` (a hang fails the test).
pub fn deltafin_within(secs: u64) -> Command {
    let mut c = Command::new(assert_cmd::cargo::cargo_bin!("deltafin"));
    c.timeout(Duration::from_secs(secs));
    c
}

/// The `deltafin` command line `cmd` (as [`deltafin_within`] gives) with `<command> --model
/// <model> <args>` appended; more arguments or stdin may follow.
pub fn with_model(mut cmd: Command, command: &str, model: &Path, args: &[&str]) -> Command {
    cmd.args([command, "--model"]).arg(model).args(args);
    cmd
}

/// Runs `cmd` and returns its output.
pub fn exec(cmd: &mut Command) -> Output {
    cmd.output().expect("running deltafin")
}

/// Starts a server on a free port of 127.0.0.1 that hands each connection to `handle` on a
/// thread of its own, for as long as the test runs; returns the port.
pub fn serve_connections(handle: impl Fn(TcpStream) + Send + Sync + 'static) -> u16 {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = l.local_addr().unwrap().port();
    let handle = Arc::new(handle);
    std::thread::spawn(move || {
        for c in l.incoming().flatten() {
            let handle = handle.clone();
            std::thread::spawn(move || handle(c));
        }
    });
    port
}

/// Bytes as text, lossily.
pub fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Asserts the command succeeded, showing its output otherwise.
pub fn ok(out: Output) -> Output {
    assert!(
        out.status.success(),
        "deltafin failed ({}):\nstdout: {}\nstderr: {}",
        out.status,
        text(&out.stdout),
        text(&out.stderr)
    );
    out
}

/// Asserts a clean failure: a non-zero exit (not a signal: a timeout kills), no panic, exactly
/// one `error:` line on stderr containing every needle. Returns that line.
pub fn expect_error(out: &Output, needles: &[&str]) -> String {
    expect_error_with(out, needles, false)
}

/// [`expect_error`], with clap's usage hint ("For more information, try '--help'.") allowed as
/// a second line when `usage_hint` (command-line parse errors). Prints the error line (shown
/// with `--nocapture`, to review the messages).
pub fn expect_error_with(out: &Output, needles: &[&str], usage_hint: bool) -> String {
    let stderr = text(&out.stderr);
    assert!(
        !out.status.success(),
        "expected a failure, got success\nstdout: {}\nstderr: {stderr}",
        text(&out.stdout)
    );
    assert!(
        out.status.code().is_some(),
        "deltafin died from signal {:?} (killed by the timeout?)\nstderr: {stderr}",
        out.status.signal()
    );
    assert!(
        !stderr.contains("panicked") && !stderr.contains("RUST_BACKTRACE"),
        "deltafin panicked:\n{stderr}"
    );
    let lines: Vec<&str> = stderr
        .lines()
        .map(str::trim_end)
        .filter(|l| !l.trim().is_empty())
        .filter(|l| !usage_hint || !l.starts_with("For more information"))
        .collect();
    assert_eq!(lines.len(), 1, "expected one error line, got:\n{stderr}");
    let line = lines[0];
    eprintln!("{line}");
    assert!(line.starts_with("error: "), "not an error line: {line}");
    for n in needles {
        assert!(line.contains(n), "error line lacks {n:?}: {line}");
    }
    line.to_string()
}

/// `deltafin synth --preset <preset> --out <out>`, which must succeed.
pub fn synth(preset: &str, out: &Path) {
    Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
        .args(["synth", "--preset", preset, "--out"])
        .arg(out)
        .assert()
        .success();
}

/// The prompt of the K3 runs (`synth --preset k3-tiny` models), as `run` arguments.
pub const K3_PROMPT: [&str; 2] = ["--prompt", "ka mi lo ka mi lo ka mi lo ka mi"];

/// The greedy ids of `deltafin run --model <model> <prompt> --max-new-tokens 24 --ignore-eos
/// <extra> --stats-json <stats>`, which must succeed, read from its stats file.
pub fn generated_ids(model: &Path, prompt: [&str; 2], extra: &[&str], stats: &Path) -> Vec<u64> {
    Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
        .args(["run", "--model"])
        .arg(model)
        .args([prompt[0], prompt[1], "--max-new-tokens", "24", "--ignore-eos"])
        .args(extra)
        .arg("--stats-json")
        .arg(stats)
        .assert()
        .success();
    let s: serde_json::Value = serde_json::from_slice(&std::fs::read(stats).unwrap()).unwrap();
    s["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect()
}

pub type RawTensor = (String, Dtype, Vec<usize>, Vec<u8>);

/// Rewrites a safetensors file after letting `edit` change its tensors.
pub fn rewrite_safetensors(path: &Path, edit: impl FnOnce(&mut Vec<RawTensor>)) {
    let bytes = std::fs::read(path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<RawTensor> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    ts.sort_by(|a, b| a.0.cmp(&b.0));
    edit(&mut ts);
    let views: Vec<(String, TensorView<'_>)> = ts
        .iter()
        .map(|(n, d, s, b)| (n.clone(), TensorView::new(*d, s.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, path).unwrap();
}

/// Asserts a failed convert left neither the output nor its partial directory behind.
pub fn assert_no_output(out: &Path) {
    assert!(!out.exists(), "{} was created", out.display());
    let partial = out
        .parent()
        .unwrap()
        .join(format!(".{}.partial", out.file_name().unwrap().to_string_lossy()));
    assert!(!partial.exists(), "{} was left behind", partial.display());
}

// ---------------------------------------------------------------------------------------------
// Reference expectations (`expected.json` of a fixture: ids and float32 logits)
// ---------------------------------------------------------------------------------------------

/// The JSON file at `p` (its path named in a failure).
pub fn read_json(p: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display())))
        .unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Rewrites the JSON file at `p` (pretty-printed) with `edit` applied.
pub fn edit_json(p: &Path, edit: impl FnOnce(&mut serde_json::Value)) {
    let mut v = read_json(p);
    edit(&mut v);
    std::fs::write(p, serde_json::to_vec_pretty(&v).unwrap()).unwrap();
}

/// The names of the entries of directory `dir` other than `keep` (what a command left beside
/// its output).
pub fn entries_except(dir: &Path, keep: &str) -> Vec<std::ffi::OsString> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .filter(|n| n != keep)
        .collect()
}

/// A list of token ids.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .expect("an id list")
        .iter()
        .map(|x| x.as_u64().expect("an id") as u32)
        .collect()
}

/// A list of floats (a logits vector).
pub fn floats(v: &serde_json::Value) -> Vec<f64> {
    v.as_array()
        .expect("a float list")
        .iter()
        .map(|x| x.as_f64().expect("a float"))
        .collect()
}

/// Relative L2 error `|a - reference| / |reference|` of two logit vectors of the same length.
pub fn rel_l2(a: &[f64], reference: &[f64]) -> f64 {
    assert_eq!(a.len(), reference.len(), "logit vector lengths differ");
    let num: f64 = a.iter().zip(reference).map(|(x, y)| (x - y).powi(2)).sum();
    let den: f64 = reference.iter().map(|y| y * y).sum();
    (num / den).sqrt()
}

/// [`rel_l2`] of the engine's f32 logits `a` against the reference's.
pub fn rel_l2_f32(a: &[f32], reference: &[f64]) -> f64 {
    rel_l2(&a.iter().map(|&x| f64::from(x)).collect::<Vec<_>>(), reference)
}

/// Greedy generation of `n` tokens, past any end-of-sequence id, recording the step logits.
pub fn greedy(n: usize) -> deltafin_engine::generate::GenerateOptions {
    deltafin_engine::generate::GenerateOptions {
        max_new_tokens: n,
        eos_token_ids: vec![],
        ignore_eos: true,
        record_logits: true,
        trace_routes: None,
        ..Default::default()
    }
}

//! Helpers of the end-to-end tests of the `deltafin` binary (`cli_convert.rs`, `cli_run.rs`,
//! `cli_chat.rs`, `cli_info.rs`, `cli_demo.rs`): `convert`, `run`, `chat`, `info` and `demo` as
//! a user runs them.
//!
//! The reference fixtures in `tests/fixtures/deepseek_v3/` (tiny checkpoints written by
//! transformers, with its greedy ids and float32 logits in `expected.json`) are converted into
//! temporary directories and generated from through the real command line. Error paths build
//! broken copies of a fixture (edited config, rewritten or cut safetensors, corrupted expert
//! pack) and check that the binary exits non-zero with one clear line naming what is wrong, and
//! never panics.

// Each test file uses a subset of these helpers and re-exports.
#![allow(dead_code, unused_imports)]

pub use std::os::unix::process::ExitStatusExt;
pub use std::path::{Path, PathBuf};
pub use std::process::Output;
pub use std::time::{Duration, Instant};

pub use assert_cmd::Command;
pub use safetensors::tensor::TensorView;
pub use safetensors::{Dtype, SafeTensors};
pub use serde_json::Value;

#[path = "../common/mod.rs"]
mod common;
pub use common::{
    assert_no_output, edit_json, entries_except, exec, floats, ids, ok, read_json, rel_l2, rewrite_safetensors, text,
    RawTensor,
};

/// Relative L2 error allowed between our logits and the reference's in the lossless layout
/// (issue #2, section 7).
pub const LOSSLESS_REL_L2: f64 = 1e-4;

/// The statistics lines `deltafin run` prints to stderr (issue #2, section 4).
pub const STAT_KEYS: &[&str] = &[
    "prompt tokens",
    "time to first token",
    "prefill",
    "steady decode",
    "routed-expert bytes",
    "expert hit rate",
    "peak resident memory",
];

// ---------------------------------------------------------------------------------------------
// Helpers
// ---------------------------------------------------------------------------------------------

/// The `deltafin` binary with a two-minute wall-clock limit.
pub fn deltafin() -> Command {
    common::deltafin_within(120)
}

/// `deltafin <command> --model <model> <args>` ([`common::with_model`]); more arguments or
/// stdin may follow.
pub fn on_model(command: &str, model: &Path, args: &[&str]) -> Command {
    common::with_model(deltafin(), command, model, args)
}

pub fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(case)
}

/// Asserts a clean failure ([`common::expect_error_with`]): non-zero exit (not a signal), no
/// panic, and exactly one error line that contains every needle; clap's usage hint is the only
/// other line allowed. Returns the error line.
pub fn expect_error(out: &Output, needles: &[&str]) -> String {
    common::expect_error_with(out, needles, true)
}

pub fn copy_dir(src: &Path, dst: &Path) {
    std::fs::create_dir_all(dst).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
    }
}

/// A writable copy of a fixture checkpoint in `tmp/hf`.
pub fn copy_case(case: &str, tmp: &Path) -> PathBuf {
    let hf = tmp.join("hf");
    copy_dir(&fixture(case), &hf);
    hf
}

pub fn convert(hf: &Path, out: &Path, extra: &[&str]) -> Output {
    exec(deltafin().arg("convert").arg(hf).arg(out).args(extra))
}

/// The `convert` arguments of the lossless reference layout (f32 backbone and experts).
pub const LOSSLESS: [&str; 4] = ["--backbone", "f32", "--experts", "f32"];

pub fn convert_lossless(hf: &Path, out: &Path) {
    ok(convert(hf, out, &LOSSLESS));
}

/// Fixture `case` converted (with the `convert` arguments `extra`, which must succeed) into
/// `m` of a new temporary directory. Returns the directory (removed when dropped) and the model.
pub fn converted(case: &str, extra: &[&str]) -> (tempfile::TempDir, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    ok(convert(&fixture(case), &model, extra));
    (tmp, model)
}

pub fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(|i| i.to_string()).collect::<Vec<_>>().join(",")
}

/// `deltafin run --model <m> --prompt-ids <ids> --ignore-eos --logits-out <f>` plus `extra`.
pub fn run_ids(model: &Path, prompt: &[u32], new_tokens: usize, logits: &Path, extra: &[&str]) -> Output {
    exec(
        deltafin()
            .args(["run", "--model"])
            .arg(model)
            .args(["--prompt-ids", &join_ids(prompt)])
            .args(["--max-new-tokens", &new_tokens.to_string(), "--ignore-eos"])
            .arg("--logits-out")
            .arg(logits)
            .args(extra),
    )
}

/// The rest of the stderr line that starts with `key`.
pub fn stat<'a>(stderr: &'a str, key: &str) -> &'a str {
    stderr
        .lines()
        .find_map(|l| l.strip_prefix(key))
        .unwrap_or_else(|| panic!("no {key:?} line in stderr:\n{stderr}"))
        .trim()
}

/// Parses a human size such as `336.0 KiB` or `12 B`, returning bytes and the printed unit.
pub fn parse_human(s: &str) -> (f64, f64) {
    let mut it = s.split_whitespace();
    let v: f64 = it
        .next()
        .and_then(|x| x.parse().ok())
        .unwrap_or_else(|| panic!("size {s:?}"));
    let unit = match it.next().unwrap_or_else(|| panic!("size {s:?}")) {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1024.0 * 1024.0,
        "GiB" => 1024.0 * 1024.0 * 1024.0,
        u => panic!("unknown unit {u:?} in {s:?}"),
    };
    (v * unit, unit)
}

/// The number just before `word` in `s`, e.g. `count_before("(14 misses, 3 hits", "misses")`.
pub fn count_before(s: &str, word: &str) -> u64 {
    let toks: Vec<&str> = s.split(|c: char| c.is_whitespace() || c == '(' || c == ',').collect();
    let i = toks
        .iter()
        .position(|t| t.starts_with(word))
        .unwrap_or_else(|| panic!("no {word:?} in {s:?}"));
    toks[..i]
        .iter()
        .rev()
        .find(|t| !t.is_empty())
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no count before {word:?} in {s:?}"))
}

/// Expert-store counters from the `routed-expert bytes` line: (bytes, misses, hits, evictions).
pub fn expert_counters(stderr: &str) -> (f64, u64, u64, u64) {
    let l = stat(stderr, "routed-expert bytes");
    let (bytes, _) = parse_human(l.split(" read from").next().unwrap());
    (
        bytes,
        count_before(l, "misses"),
        count_before(l, "hits"),
        count_before(l, "evictions"),
    )
}

/// Checks the statistics block of a successful run with `prompt_len` prompt tokens and
/// `generated` new tokens on a model whose manifest is `manifest`.
pub fn check_stats(stderr: &str, prompt_len: usize, generated: usize, manifest: &Value) {
    for k in STAT_KEYS {
        stat(stderr, k);
    }
    assert_eq!(stat(stderr, "prompt tokens"), prompt_len.to_string(), "{stderr}");
    let ttft: f64 = stat(stderr, "time to first token")
        .trim_end_matches(" s")
        .parse()
        .unwrap();
    assert!(ttft > 0.0 && ttft < 60.0, "ttft {ttft}");
    let prefill: f64 = stat(stderr, "prefill").trim_end_matches(" tok/s").parse().unwrap();
    assert!(prefill > 0.0, "prefill rate {prefill}");
    // The first decode step is excluded from the steady rate.
    let steady = stat(stderr, "steady decode");
    assert!(
        steady.ends_with(&format!("({} steps)", generated - 2)),
        "steady decode line: {steady}"
    );
    // Every (position, MoE layer) asks for top-k experts; each is a hit or a miss, and each miss
    // reads one padded record.
    let cfg = &manifest["config"]["deepseek_v3"];
    let layers = cfg["num_hidden_layers"].as_u64().unwrap();
    let dense = cfg["first_k_dense_replace"].as_u64().unwrap();
    let k = cfg["num_experts_per_tok"].as_u64().unwrap();
    // Prefill: one request per distinct (layer, expert) of each chunk (expert-major), so with
    // the whole prompt in one chunk exactly the distinct pairs; token at a time, top-k per
    // position. Decode: top-k per position.
    let pf = stat(stderr, "prefill experts");
    let num_before = |marker: &str| -> u64 {
        let head = &pf[..pf.find(marker).unwrap_or_else(|| panic!("prefill experts line: {pf}"))];
        head.split_whitespace().last().unwrap().parse().unwrap()
    };
    let distinct = num_before(" distinct");
    let chunk: usize = if pf.ends_with("one token at a time") {
        1
    } else {
        pf.rsplit("chunks of ")
            .next()
            .unwrap()
            .trim_end_matches(" tokens")
            .parse()
            .unwrap()
    };
    let prefill_requests = if chunk >= prompt_len {
        distinct
    } else {
        assert_eq!(chunk, 1, "{pf}");
        (layers - dense) * k * prompt_len as u64
    };
    let decode_positions = (generated - 1) as u64;
    let (bytes, misses, hits, _) = expert_counters(stderr);
    assert_eq!(
        misses + hits,
        prefill_requests + (layers - dense) * k * decode_positions,
        "{stderr}"
    );
    // Reads are whole 4 KiB-aligned records (O_DIRECT), so each miss reads the padded length.
    let record = manifest["experts"]["records"][0]["length"]
        .as_u64()
        .unwrap()
        .div_ceil(4096) as f64
        * 4096.0;
    let (_, unit) = parse_human(stat(stderr, "routed-expert bytes"));
    assert!(
        (bytes - misses as f64 * record).abs() <= 0.051 * unit,
        "bytes read {bytes} vs {misses} misses × {record}"
    );
    let rate: f64 = stat(stderr, "expert hit rate").trim_end_matches('%').parse().unwrap();
    let want = 100.0 * hits as f64 / (hits + misses) as f64;
    assert!((rate - want).abs() <= 0.051, "hit rate {rate}% vs {want}%");
    let (peak, _) = parse_human(stat(stderr, "peak resident memory"));
    assert!(peak > 1e6, "peak resident memory {peak}");
}

/// Checks the `--logits-out` JSON's schema and returns (prompt_ids, generated_ids, step_logits).
pub fn check_logits_file(p: &Path, vocab: usize, generated: usize) -> (Vec<u32>, Vec<u32>, Vec<Vec<f64>>) {
    let v = read_json(p);
    let obj = v.as_object().expect("--logits-out holds a JSON object");
    let mut keys: Vec<&str> = obj.keys().map(|s| s.as_str()).collect();
    keys.sort();
    assert_eq!(
        keys,
        ["first_step_logits", "generated_ids", "prompt_ids", "step_logits"]
    );
    let gen = ids(&v["generated_ids"]);
    assert_eq!(gen.len(), generated);
    let steps: Vec<Vec<f64>> = v["step_logits"].as_array().unwrap().iter().map(floats).collect();
    assert_eq!(steps.len(), generated, "one logit vector per generated token");
    for (k, s) in steps.iter().enumerate() {
        assert_eq!(s.len(), vocab, "step {k}: logits over the whole vocabulary");
        // Greedy: each step's argmax is the token it produced.
        let argmax = s.iter().enumerate().max_by(|a, b| a.1.total_cmp(b.1)).unwrap().0;
        assert_eq!(argmax as u32, gen[k], "step {k}: the generated id is the argmax");
    }
    assert_eq!(
        v["first_step_logits"], v["step_logits"][0],
        "first_step_logits == step_logits[0]"
    );
    (ids(&v["prompt_ids"]), gen, steps)
}

pub fn tokenizer(dir: &Path) -> deltafin_tokenizer::Tokenizer {
    deltafin_tokenizer::Tokenizer::from_dir(dir).unwrap()
}

/// What `run` must print to stdout: the decode of the generated ids, then a newline.
pub fn expected_stdout(dir: &Path, generated: &[u32]) -> String {
    format!("{}\n", tokenizer(dir).decode(generated, true).unwrap())
}

pub fn find<'a>(ts: &'a mut [RawTensor], name: &str) -> &'a mut RawTensor {
    ts.iter_mut()
        .find(|t| t.0 == name)
        .unwrap_or_else(|| panic!("fixture lacks {name}"))
}

/// `convert hf out` fails cleanly (one error line holding every needle: [`expect_error`]) and
/// leaves nothing at `out` ([`assert_no_output`]). Returns the error line.
pub fn convert_refused(hf: &Path, out: &Path, needles: &[&str]) -> String {
    let line = expect_error(&convert(hf, out, &[]), needles);
    assert_no_output(out);
    line
}

/// Rewrites `hf/config.json` with `edit` applied.
pub fn edit_config(hf: &Path, edit: impl FnOnce(&mut Value)) {
    edit_json(&hf.join("config.json"), edit);
}

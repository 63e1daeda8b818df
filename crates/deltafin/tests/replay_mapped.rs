//! `deltafin replay --map-experts` end to end on the `tiny` preset (2 MoE layers × 8 experts,
//! top-2): a hand-written trace of a smaller model (2 MoE layers × 4 experts, top-2) replayed
//! through the real expert store. Bytes read, hits, pinning with idle warm-up and prediction
//! recall are checked exactly against what the mapping implies; and `run --trace-predictions`
//! replays to the recall `run --prefetch on` measures.

use std::path::{Path, PathBuf};

use assert_cmd::Command;
use serde_json::Value;

fn deltafin() -> Command {
    Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
}

/// A trace file: header (n_layers, first_moe, n_experts, top_k), then one (position, ids)
/// record for each of the `n` tokens at positions 0 to n - 1, the token at `p` picking the
/// experts `picks(p)`.
fn write_trace(path: &Path, shape: [u32; 4], n: u32, picks: impl Fn(u32) -> Vec<u16>) {
    let mut b = b"DFROUTE1".to_vec();
    for v in shape {
        b.extend_from_slice(&v.to_le_bytes());
    }
    for pos in 0..n {
        b.extend_from_slice(&pos.to_le_bytes());
        for e in picks(pos) {
            b.extend_from_slice(&e.to_le_bytes());
        }
    }
    std::fs::write(path, b).unwrap();
}

/// Runs `deltafin replay` on `model` with `args`; its stats JSON.
fn replay(model: &Path, work: &Path, args: &[&str]) -> Value {
    let json = work.join("stats.json");
    let out = deltafin()
        .args(["replay", "--model"])
        .arg(model)
        .args(args)
        .arg("--stats-json")
        .arg(&json)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap()
}

/// `deltafin replay --map-experts` of the trace `trace` on `model` with the further `args`;
/// its stats JSON.
fn replay_mapped(model: &Path, work: &Path, trace: &str, args: &[&str]) -> Value {
    replay(model, work, &[&["--trace", trace, "--map-experts"], args].concat())
}

/// `synth --preset tiny` into `dir/tiny`; returns that path.
fn tiny_model(dir: &Path) -> PathBuf {
    let model = dir.join("tiny");
    deltafin()
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .assert()
        .success();
    model
}

/// A `tiny` model in a fresh temporary directory and, beside it, the trace `name` of `n` tokens
/// (as [`write_trace`] writes it): the directory, the model and the trace's path.
fn tiny_and_trace(
    name: &str,
    shape: [u32; 4],
    n: u32,
    picks: impl Fn(u32) -> Vec<u16>,
) -> (tempfile::TempDir, PathBuf, String) {
    let t = tempfile::tempdir().unwrap();
    let model = tiny_model(t.path());
    let trace = t.path().join(name);
    write_trace(&trace, shape, n, picks);
    let trace = trace.to_str().unwrap().to_string();
    (t, model, trace)
}

fn u(v: &Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} missing in {v}"))
}

#[test]
fn mapped_replay_counts_bytes_hits_pinning_and_recall() {
    // Source: 3 layers (MoE from 1: 2 MoE layers) × 4 experts, top-2; every token picks
    // {0, 1} in MoE layer 0 and {2, 3} in MoE layer 1. Mapped onto tiny (8 experts, top-2)
    // each source expert owns 2 target experts used in turn: 2 layers × 2 picks × 2 members
    // = 8 distinct records, each token requests 2 × 2 = 4.
    let n = 20u32;
    let (t, model, tr) = tiny_and_trace("src.routes", [3, 1, 4, 2], n, |_| vec![0, 1, 2, 3]);
    let (w, tr) = (t.path(), tr.as_str());

    // Without --map-experts the other model's trace is refused, naming the flag.
    let out = deltafin()
        .args(["replay", "--model"])
        .arg(&model)
        .args(["--trace", tr])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("--map-experts"), "{err}");

    // No cache: every request is read, exactly the no-cache need.
    let s = replay_mapped(&model, w, tr, &[]);
    let rec = u(&s, "record_bytes");
    assert_eq!(u(&s, "requests_per_token"), 4);
    assert_eq!(u(&s, "need_bytes_per_token"), 4 * rec);
    assert_eq!(u(&s, "expert_bytes_read_demand"), u64::from(n) * 4 * rec);
    assert_eq!(s["demand_over_need"].as_f64(), Some(1.0));
    assert_eq!(u(&s, "hits"), 0);

    // A cache of the 8 records: cold misses only.
    let budget = format!("{}", 8 * rec);
    let s = replay_mapped(&model, w, tr, &["--ram-budget", &budget]);
    assert_eq!(u(&s, "expert_bytes_read_demand"), 8 * rec);
    assert_eq!((u(&s, "misses"), u(&s, "hits")), (8, u64::from(n) * 4 - 8));

    // A cache of 2 records under LRU: the 4 requests of a token cycle through 8 records, so
    // every request misses again.
    let small = format!("{}", 2 * rec);
    let s = replay_mapped(&model, w, tr, &["--ram-budget", &small]);
    assert_eq!(u(&s, "hits"), 0);

    // Pinned from the same (mapped) trace, the whole budget, warmed before the first token:
    // no demand read at all, the 8 records read once by the warm-up.
    let s = replay_mapped(
        &model,
        w,
        tr,
        &[
            "--ram-budget",
            &budget,
            "--cache-policy",
            "pinned",
            "--pin-from",
            tr,
            "--pinned-fraction",
            "1",
            "--warm-idle",
        ],
    );
    assert_eq!(u(&s, "expert_bytes_read_demand"), 0);
    assert_eq!(u(&s, "warm_bytes"), 8 * rec);
    assert_eq!(s["all_over_need"].as_f64().unwrap(), 8.0 / (f64::from(n) * 4.0));

    // Predictions for MoE layer 1: right on even tokens, {0, 1} (both wrong) on odd ones:
    // recall over the requests of layer 1 is exactly one half.
    let pred = w.join("src.pred");
    write_trace(
        &pred,
        [3, 2, 4, 2],
        n,
        |p| if p % 2 == 0 { vec![2, 3] } else { vec![0, 1] },
    );
    let s = replay_mapped(&model, w, tr, &["--predictions", pred.to_str().unwrap()]);
    assert_eq!(s["prefetch_recall"].as_f64(), Some(0.5));
    assert_eq!(u(&s, "prefetch_issued"), 0, "prefetch off: recall only");
    // --prefetch on without predictions is refused.
    let out = deltafin()
        .args(["replay", "--prefetch", "on", "--map-experts", "--model"])
        .arg(&model)
        .args(["--trace", tr])
        .output()
        .unwrap();
    assert!(!out.status.success() && String::from_utf8_lossy(&out.stderr).contains("--predictions"));
}

/// `run --trace-predictions` writes one record per one-token pass, and replaying it against
/// the run's own route trace gives the recall `run --prefetch on` reports.
#[test]
fn traced_predictions_replay_to_the_runs_recall() {
    let t = tempfile::tempdir().unwrap();
    let (model, w) = (tiny_model(t.path()), t.path());
    let (routes, pred, stats) = (w.join("r.routes"), w.join("r.pred"), w.join("run.json"));
    let run = |extra: &[&std::ffi::OsStr]| {
        let out = deltafin()
            .args([
                "run",
                "--prompt-ids",
                "1,2,3",
                "--max-new-tokens",
                "12",
                "--ignore-eos",
                "--model",
            ])
            .arg(&model)
            .args(extra)
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    };
    run(&[
        "--trace-routes".as_ref(),
        routes.as_os_str(),
        "--trace-predictions".as_ref(),
        pred.as_os_str(),
    ]);
    // tiny: 2 MoE layers, top-2, so one predicted layer: 4 + 2 × 2 bytes a record; the prompt
    // is one batched pass (no prediction), then 11 one-token decode passes.
    assert_eq!(std::fs::metadata(&pred).unwrap().len(), 24 + 11 * 8);
    run(&[
        "--prefetch".as_ref(),
        "on".as_ref(),
        "--stats-json".as_ref(),
        stats.as_os_str(),
    ]);
    let st: Value = serde_json::from_slice(&std::fs::read(&stats).unwrap()).unwrap();
    let s = replay(
        &model,
        w,
        &[
            "--trace",
            routes.to_str().unwrap(),
            "--predictions",
            pred.to_str().unwrap(),
        ],
    );
    assert_eq!(s["prefetch_recall"].as_f64(), st["prefetch_recall"].as_f64());
    assert!(s["prefetch_recall"].as_f64().unwrap() > 0.0);
    // A trace taken with --experts-per-token 1 replays one expert per layer, not the model's 2.
    let one = w.join("one.routes");
    run(&[
        "--experts-per-token".as_ref(),
        "1".as_ref(),
        "--trace-routes".as_ref(),
        one.as_os_str(),
    ]);
    let s = replay(&model, w, &["--trace", one.to_str().unwrap()]);
    assert_eq!(u(&s, "requests_per_token"), 2);
    assert_eq!(
        u(&s, "expert_bytes_read_demand"),
        u(&s, "tokens") * 2 * u(&s, "record_bytes")
    );
}

/// A trace whose picks × (target experts ÷ trace experts) fall short of the target's top-k:
/// 2 MoE layers × 8 experts, top-1, onto `tiny` (8 experts, top-2). Each trace expert owns a
/// fixed block of ⌈2/1⌉ = 2 target experts (the blocks overlap: 8 × 2 positions on 8 experts),
/// and every token requests `tiny`'s own 2 × 2 records.
#[test]
fn mapped_replay_with_overlapping_blocks() {
    // MoE layer 0 alternates experts 0 and 1 (blocks at positions 0–1 and 2–3: disjoint),
    // MoE layer 1 always picks 5: 2 + 2 + 2 = 6 distinct records.
    let n = 20u32;
    let (t, model, tr) = tiny_and_trace("top1.routes", [3, 1, 8, 1], n, |p| vec![(p % 2) as u16, 5]);
    let (w, tr) = (t.path(), tr.as_str());
    let s = replay_mapped(&model, w, tr, &[]);
    let rec = u(&s, "record_bytes");
    assert_eq!(u(&s, "requests_per_token"), 4);
    assert_eq!(u(&s, "expert_bytes_read_demand"), u64::from(n) * 4 * rec);
    // A cache of 6 records: each read once.
    let budget = format!("{}", 6 * rec);
    let s = replay_mapped(&model, w, tr, &["--ram-budget", &budget]);
    assert_eq!((u(&s, "misses"), u(&s, "hits")), (6, u64::from(n) * 4 - 6));
    // One record fewer under LRU. A layer's hits are taken before its misses are read, so
    // after the first two tokens (6 cold misses) a token's layer-0 pair has one record left
    // from two tokens before (a hit) and misses the other, evicting the record the last token
    // left: one miss per token, and layer 1's two records always hit.
    let five = format!("{}", 5 * rec);
    let s = replay_mapped(&model, w, tr, &["--ram-budget", &five, "--cache-policy", "lru"]);
    let misses = 6 + u64::from(n - 2);
    assert_eq!((u(&s, "misses"), u(&s, "hits")), (misses, u64::from(n) * 4 - misses));
}

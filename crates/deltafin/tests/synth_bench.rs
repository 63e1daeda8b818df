//! `deltafin synth` and `deltafin bench` end to end: the `tiny` preset is written twice (byte-
//! identical), loaded and generated from, and benchmarked with two configurations.

use std::path::Path;
use std::process::Output;

use assert_cmd::Command;
use serde_json::Value;

fn deltafin() -> Command {
    Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
}

fn synth(out: &Path) {
    deltafin()
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(out)
        .assert()
        .success();
}

/// The (stdout, stderr) of a finished command, as text.
fn texts(out: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Runs `c`, which must fail; its (stdout, stderr).
fn fails(c: &mut Command) -> (String, String) {
    texts(c.assert().failure().get_output())
}

/// Runs `c`, which must succeed; its (stdout, stderr).
fn succeeds(c: &mut Command) -> (String, String) {
    texts(c.assert().success().get_output())
}

#[test]
fn synth_tiny_is_deterministic_and_runs() {
    let t = tempfile::tempdir().unwrap();
    let (a, b) = (t.path().join("a"), t.path().join("b"));
    synth(&a);
    synth(&b);
    let mut names: Vec<String> = std::fs::read_dir(&a)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    for f in [
        "manifest.json",
        "backbone.bin",
        "experts.pack",
        "config.json",
        "tokenizer.json",
    ] {
        assert!(names.iter().any(|n| n == f), "{f} missing from {names:?}");
    }
    for f in &names {
        let (x, y) = (std::fs::read(a.join(f)).unwrap(), std::fs::read(b.join(f)).unwrap());
        assert!(x == y, "{f} differs between two synth runs");
    }
    // No scratch or partial directories are left beside the output.
    let left: Vec<_> = std::fs::read_dir(t.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with('.'))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");

    // An existing model is kept unless --force.
    let (_, err) = fails(deltafin().args(["synth", "--preset", "tiny", "--out"]).arg(&a));
    assert!(err.contains("--force"));
    deltafin()
        .args(["synth", "--preset", "tiny", "--force", "--out"])
        .arg(&a)
        .assert()
        .success();

    // The engine loads and runs it, from ids and from text.
    let (_, err) = succeeds(
        deltafin()
            .args(["run", "--prompt-ids", "1,2,3", "--max-new-tokens", "4", "--model"])
            .arg(&a),
    );
    assert!(err.contains("generated tokens     4"));
    deltafin()
        .args([
            "run",
            "--prompt",
            "Routed experts",
            "--max-new-tokens",
            "3",
            "--ram-budget",
            "0",
            "--model",
        ])
        .arg(&a)
        .assert()
        .success();
}

#[test]
fn bench_on_tiny() {
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("tiny");
    synth(&model);
    let (help, _) = succeeds(deltafin().args(["run", "--help"]));
    if !help.contains("--stats-json") {
        eprintln!("SKIPPED: `deltafin run` has no --stats-json yet; deltafin bench needs it");
        return;
    }
    // `bench` of 5 new tokens after the prompt 1,2,3, `runs` times per configuration.
    let bench = |runs: &str| {
        let mut c = deltafin();
        c.args(["bench", "--runs", runs, "--new-tokens", "5", "--prompt-ids", "1,2,3"])
            .arg("--model")
            .arg(&model);
        c
    };
    let (json, svg) = (t.path().join("bench.json"), t.path().join("bench.svg"));
    let (stdout, _) = succeeds(
        bench("2")
            .args([
                "--config",
                "a=",
                "--config",
                "b=--ram-budget 0",
                "--floor-bandwidth",
                "1.0",
            ])
            .arg("--json")
            .arg(&json)
            .arg("--plot")
            .arg(&svg),
    );
    assert!(stdout.contains("steady decode tok/s"), "{stdout}");
    assert!(stdout.contains("identical in every run"), "{stdout}");
    let r: Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    assert_eq!(r["ids_verified"], true);
    assert_eq!(r["generated_ids"].as_array().unwrap().len(), 5);
    let order: Vec<&str> = r["protocol"]["order"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_str().unwrap())
        .collect();
    assert_eq!(order, ["a", "b", "b", "a"]);
    assert_eq!(r["runs"].as_array().unwrap().len(), 4);
    for c in r["configs"].as_array().unwrap() {
        assert!(c["steady_decode_tokens_per_s"]["median"].as_f64().unwrap() > 0.0);
        assert!(c["storage_floor_s_per_token"].is_number());
    }
    // With no cache the second configuration reads at least as many bytes per token.
    let demand = |i: usize| r["configs"][i]["demand_bytes_per_token"]["median"].as_f64().unwrap();
    assert!(demand(1) >= demand(0));
    let svg = std::fs::read_to_string(&svg).unwrap();
    assert!(svg.starts_with("<svg") && svg.contains("io wait") && svg.trim_end().ends_with("</svg>"));

    // Wrong expected ids: the bench refuses to report timings.
    let ids: Vec<String> = r["generated_ids"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| (v.as_u64().unwrap() + 1).to_string())
        .collect();
    let (stdout, err) = fails(bench("1").arg("--expected-ids").arg(ids.join(",")));
    assert!(err.contains("no timing is reported"), "{err}");
    assert!(!stdout.contains("steady decode tok/s"));
}

/// A configuration whose `run` arguments do not parse fails before any run starts, naming the
/// configuration, even when it comes after a valid one.
#[test]
fn bench_rejects_bad_config_before_running() {
    let t = tempfile::tempdir().unwrap();
    let model = t.path().join("m");
    synth(&model);
    for (config, want) in [
        ("bad=--bogus-flag", "--config bad: unexpected argument '--bogus-flag'"),
        ("bad=--io sideways", "--config bad: invalid value 'sideways' for '--io"),
    ] {
        let (stdout, stderr) = fails(
            deltafin()
                .args(["bench", "--runs", "1", "--new-tokens", "3"])
                .args(["--config", "ok=--io buffered", "--config", config, "--model"])
                .arg(&model),
        );
        assert!(stderr.contains(want), "{config}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{config}: one line: {stderr}");
        assert!(
            !stdout.contains("run 1") && !stderr.contains("run 1"),
            "{config}: something ran: {stdout}"
        );
    }
    // --new-tokens past the context is named in the bench's terms before any run.
    let (_, stderr) = fails(
        deltafin()
            .args(["bench", "--runs", "1", "--new-tokens", "100000", "--model"])
            .arg(&model),
    );
    assert!(
        stderr.contains("--new-tokens 100000") && stderr.contains("context length") && !stderr.contains("run 1"),
        "{stderr}"
    );
}

/// `--pin-from` refuses a router trace recorded for another model, as `replay` does, naming
/// the trace and both shapes; the same trace pins its own model.
#[test]
fn pin_from_rejects_a_trace_of_another_model() {
    let t = tempfile::tempdir().unwrap();
    let (tiny, k3, trace) = (t.path().join("tiny"), t.path().join("k3"), t.path().join("t.bin"));
    synth(&tiny);
    deltafin()
        .args(["synth", "--preset", "k3-tiny", "--out"])
        .arg(&k3)
        .assert()
        .success();
    let run = |model: &Path, extra: &[&str]| {
        let mut c = deltafin();
        c.args(["run", "--prompt-ids", "1,2,3", "--max-new-tokens", "3", "--model"])
            .arg(model)
            .args(extra);
        c
    };
    run(&tiny, &["--trace-routes", trace.to_str().unwrap()])
        .assert()
        .success();
    let pin = ["--cache-policy", "pinned", "--pin-from", trace.to_str().unwrap()];
    run(&tiny, &pin).assert().success();
    let (_, err) = fails(&mut run(&k3, &pin));
    assert!(
        err.contains("--pin-from") && err.contains("recorded for another model") && err.contains("8 experts"),
        "{err}"
    );
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    // replay cannot prefetch (no hidden states): refused rather than ignored.
    let (_, err) = fails(
        deltafin()
            .args(["replay", "--prefetch", "on", "--model"])
            .arg(&tiny)
            .arg("--trace")
            .arg(&trace),
    );
    assert!(err.contains("--prefetch on"), "{err}");
    // warm and cache stats read their traces even on a full install: a missing file or another
    // model's trace is an error there too.
    for (cmd, model, tr) in [
        ("warm", &k3, trace.clone()),
        ("warm", &tiny, t.path().join("missing.bin")),
        ("stats", &k3, trace.clone()),
    ] {
        let mut c = deltafin();
        if cmd == "stats" {
            c.args(["cache", "stats"]);
        } else {
            c.arg("warm");
        }
        let (_, err) = fails(c.arg(model).arg("--traces").arg(&tr));
        assert!(err.contains("--traces"), "{cmd}: {err}");
    }
    deltafin()
        .arg("warm")
        .arg(&tiny)
        .arg("--traces")
        .arg(&trace)
        .assert()
        .success();
}

//! `deltafin demo` end to end: the embedded trained model and the random one stream an expert
//! pack larger than their budget.
//!
//! Shared helpers: `tests/cli_support/mod.rs`.

mod cli_support;

use cli_support::*;

#[test]
fn demo_streams_an_expert_pack_larger_than_its_budget() {
    // The trained default answers its question in the words of the docstring it learned.
    let tmp = tempfile::tempdir().unwrap();
    let out = ok(exec(
        deltafin()
            .args(["demo", "--dir"])
            .arg(tmp.path())
            .args(["--max-new-tokens", "6"]),
    ));
    let stdout = String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8");
    assert!(stdout.starts_with("Serialize ``obj`` to"), "{stdout:?}");
    assert!(
        !stdout.chars().any(|c| c.is_control() && c != '\n'),
        "control characters in {stdout:?}"
    );
    let stderr = text(&out.stderr);
    assert!(stderr.contains("trained on Python and Rust documentation"), "{stderr}");
    assert!(stderr.contains("generated tokens     6"), "{stderr}");
    check_demo_streams(&out, tmp.path());
}

#[test]
fn random_demo_streams_an_expert_pack_larger_than_its_budget() {
    let tmp = tempfile::tempdir().unwrap();
    let out = ok(exec(
        deltafin()
            .args(["demo", "--random", "--dir"])
            .arg(tmp.path())
            .args(["--max-new-tokens", "4"]),
    ));
    let stderr = text(&out.stderr);
    assert!(
        stderr.to_lowercase().contains("random weights"),
        "the demo says its weights are random:\n{stderr}"
    );
    assert!(stderr.contains("generated tokens     4"), "{stderr}");
    String::from_utf8(out.stdout.clone()).expect("stdout is UTF-8");
    check_demo_streams(&out, tmp.path());
    let out = exec(deltafin().args(["demo", "--random", "--prompt", "hi"]));
    expect_error(&out, &["--prompt", "--random"]);
}

/// The demo's statistics show an expert pack at least 4× the cache budget that really streamed,
/// and a peak resident memory of backbone + budget + a small constant.
fn check_demo_streams(out: &Output, dir: &Path) {
    let stderr = text(&out.stderr);
    for k in STAT_KEYS {
        stat(&stderr, k);
    }
    let tmp = dir;

    // "memory  backbone X resident, expert cache budget B, expert pack P on disk (mxfp4, R×budget)"
    let mem = stat(&stderr, "memory");
    let budget_text = mem
        .split("expert cache budget ")
        .nth(1)
        .and_then(|s| s.split(',').next())
        .unwrap_or_else(|| panic!("no budget in {mem:?}"));
    let (budget, _) = parse_human(budget_text);
    assert!(budget > 0.0, "budget {budget_text}");
    let pack = std::fs::metadata(tmp.join("model/experts.pack")).unwrap().len() as f64;
    assert!(pack >= 4.0 * budget, "expert pack {pack} B < 4 × budget {budget} B");
    let ratio: f64 = mem
        .rsplit('(')
        .next()
        .and_then(|s| s.split(", ").nth(1))
        .and_then(|s| s.split('×').next())
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("no ratio in {mem:?}"));
    assert!(ratio >= 4.0, "reported pack/budget ratio {ratio}");
    // Experts really streamed: reads exceeded what the cache can hold, so it evicted.
    let (bytes, misses, _, evictions) = expert_counters(&stderr);
    assert!(misses > 0 && evictions > 0, "{stderr}");
    assert!(bytes > budget, "read {bytes} B with a budget of {budget} B");
    // Issue #2 section 5: peak resident memory stays within backbone + budget + a small constant
    // (KV cache, buffers, the executable), well below backbone + expert pack.
    let backbone_text = mem
        .strip_prefix("backbone ")
        .and_then(|s| s.split(" resident").next())
        .unwrap_or_else(|| panic!("no backbone size in {mem:?}"));
    let (backbone, _) = parse_human(backbone_text);
    let (peak, _) = parse_human(stat(&stderr, "peak resident memory"));
    let slack = 32.0 * 1024.0 * 1024.0;
    assert!(
        peak <= backbone + budget + slack,
        "peak resident {peak} B > backbone {backbone} B + budget {budget} B + 32 MiB"
    );
    // Where the pack is larger than that constant (the random demo's 63.8 MiB), peak memory alone
    // shows it was not loaded whole; the trained demo's 22.8 MiB pack is below the constant, and
    // the evictions and the bytes read beyond the budget above show the streaming instead.
    if pack > slack {
        assert!(
            peak < backbone + pack,
            "peak resident {peak} B: the expert pack was loaded whole"
        );
    }
}

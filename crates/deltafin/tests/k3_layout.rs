//! A Kimi K3-layout model end to end through the CLI (`synth --preset k3-tiny`: KDA, gated NoPE
//! MLA, attention residuals, LatentMoE, SiTU, MXFP4 experts): `run --chat` renders the chat
//! template and generates; speculative decoding (which rolls the KDA states back) gives the same
//! greedy ids as plain decoding; `info` and `convert --dry-run` report it.

use std::path::Path;

use assert_cmd::Command;

mod common;

fn deltafin() -> Command {
    Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
}

fn generated(model: &Path, extra: &[&str], stats: &Path) -> Vec<u64> {
    common::generated_ids(model, common::K3_PROMPT, extra, stats)
}

#[test]
fn k3_layout_chat_speculation_and_info() {
    let t = tempfile::tempdir().unwrap();
    let m = t.path().join("k3");
    common::synth("k3-tiny", &m);
    let out = deltafin()
        .args(["run", "--model"])
        .arg(&m)
        .args(["--chat", "--prompt", "Hello there", "--max-new-tokens", "4"])
        .assert()
        .success();
    let err = String::from_utf8_lossy(&out.get_output().stderr).into_owned();
    assert!(err.contains("generated tokens     4"), "{err}");

    let stats = t.path().join("s.json");
    let plain = generated(&m, &["--speculate", "off"], &stats);
    assert_eq!(plain.len(), 24);
    for mode in ["lookup", "self", "auto"] {
        assert_eq!(
            generated(&m, &["--speculate", mode], &stats),
            plain,
            "--speculate {mode}"
        );
    }
    // Prefill token at a time and batched agree too.
    assert_eq!(generated(&m, &["--prefill-chunk", "1"], &stats), plain);

    let info = deltafin().args(["info"]).arg(&m).assert().success();
    let text = String::from_utf8_lossy(&info.get_output().stdout).into_owned();
    assert!(
        text.contains("kimi_linear (kimi_k3)") && text.contains("top-4"),
        "{text}"
    );
}

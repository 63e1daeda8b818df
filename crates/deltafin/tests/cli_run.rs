//! `deltafin run` end to end: the lossless layout reproduces the reference fixtures' logits,
//! load-time integrity errors (corrupted, truncated, missing model files), bad prompts and
//! budgets, the research `--batch-form`, output files, context overflow, and a budget that
//! changes I/O but never results.
//!
//! Shared helpers: `tests/cli_support/mod.rs`.

mod cli_support;

use cli_support::*;

#[test]
fn lossless_convert_and_run_match_the_reference() {
    for case in ["dsv3_a", "dsv3_b", "dsv3_c"] {
        let (tmp, model) = converted(case, &LOSSLESS);
        let manifest = read_json(&model.join("manifest.json"));
        let vocab = manifest["config"]["deepseek_v3"]["vocab_size"].as_u64().unwrap() as usize;
        let expected = read_json(&fixture(case).join("expected.json"));
        for (i, p) in expected["prompts"].as_array().unwrap().iter().enumerate() {
            let prompt = ids(&p["prompt_ids"]);
            let want = ids(&p["generated_ids"]);
            let f = tmp.path().join(format!("logits{i}.json"));
            let out = ok(run_ids(&model, &prompt, want.len(), &f, &[]));
            let (got_prompt, got, steps) = check_logits_file(&f, vocab, want.len());
            assert_eq!(got_prompt, prompt, "{case} prompt {i}: prompt_ids");
            assert_eq!(got, want, "{case} prompt {i}: generated ids");
            for (k, s) in steps.iter().enumerate() {
                let e = rel_l2(s, &floats(&p["step_logits"][k]));
                assert!(
                    e <= LOSSLESS_REL_L2,
                    "{case} prompt {i} step {k}: logits rel L2 {e:.2e} > {LOSSLESS_REL_L2:e}"
                );
            }
            let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
            assert_eq!(stdout, expected_stdout(&model, &got), "{case} prompt {i}: stdout");
            check_stats(&text(&out.stderr), prompt.len(), want.len(), &manifest);
        }
    }
}

#[test]
fn corrupted_expert_record_fails_its_checksum_naming_layer_and_expert() {
    let (tmp, model) = converted("dsv3_a", &LOSSLESS);
    let expected = read_json(&fixture("dsv3_a").join("expected.json"));
    let prompt = ids(&expected["prompts"][0]["prompt_ids"]);
    let f = tmp.path().join("l.json");
    ok(run_ids(&model, &prompt, 1, &f, &[]));

    // The first expert the reference routes the first position to in MoE layer 1.
    let layer = 1u64;
    let expert = expected["routing"]["prompts"][0]["layers"]["1"]["experts"][0][0]
        .as_u64()
        .unwrap();
    let manifest = read_json(&model.join("manifest.json"));
    let rec = manifest["experts"]["records"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["layer"] == layer && r["expert"] == expert)
        .expect("record of the routed expert");
    let at = rec["offset"].as_u64().unwrap() + rec["length"].as_u64().unwrap() / 2;
    let pack = model.join("experts.pack");
    let mut bytes = std::fs::read(&pack).unwrap();
    bytes[at as usize] ^= 0x40;
    std::fs::write(&pack, &bytes).unwrap();

    let out = run_ids(&model, &prompt, 1, &f, &[]);
    expect_error(
        &out,
        &["experts.pack", &format!("layer {layer}, expert {expert}"), "checksum"],
    );
    // `cache verify` names the record and, for a converted model (nothing to fetch from),
    // says to convert again rather than to `cache gc`.
    let out = exec(deltafin().args(["cache", "verify"]).arg(&model));
    assert!(
        text(&out.stdout).contains(&format!("FAILED layer {layer} expert {expert}")),
        "{}",
        text(&out.stdout)
    );
    let err = expect_error(&out, &["failed verification", "deltafin convert"]);
    assert!(!err.contains("cache gc"), "{err}");
}

#[test]
fn truncated_model_files_fail_at_load() {
    let (tmp, model) = converted("dsv3_a", &LOSSLESS);
    let f = tmp.path().join("l.json");
    for file in ["experts.pack", "backbone.bin"] {
        let p = model.join(file);
        let full = std::fs::read(&p).unwrap();
        std::fs::write(&p, &full[..full.len() / 2]).unwrap();
        let out = run_ids(&model, &[0], 2, &f, &[]);
        expect_error(&out, &[file, "truncated"]);
        assert!(out.stdout.is_empty(), "nothing generated from a truncated model");
        // Longer than the manifest says (another conversion's file): also refused.
        let mut longer = full.clone();
        longer.extend_from_slice(&[0u8; 4096]);
        std::fs::write(&p, &longer).unwrap();
        let out = run_ids(&model, &[0], 2, &f, &[]);
        expect_error(&out, &[file, "longer"]);
        assert!(out.stdout.is_empty(), "nothing generated from a mismatched model");
        std::fs::write(&p, &full).unwrap();
    }
    ok(run_ids(&model, &[0], 2, &f, &[]));
}

#[test]
fn missing_model_files_are_named_once() {
    let (tmp, model) = converted("dsv3_a", &LOSSLESS);
    std::fs::remove_file(model.join("experts.pack")).unwrap();
    let line = expect_error(
        &run_ids(&model, &[0], 2, &tmp.path().join("l.json"), &[]),
        &["experts.pack", "No such file"],
    );
    assert_eq!(line.matches("No such file").count(), 1, "cause repeated: {line}");
}

#[test]
fn prompt_ids_outside_the_vocabulary_are_rejected() {
    let (tmp, model) = converted("dsv3_a", &[]);
    let out = run_ids(&model, &[0, 12, 512], 2, &tmp.path().join("l.json"), &[]);
    expect_error(
        &out,
        &["--prompt-ids", "token id 512", "vocabulary", "512 tokens, ids 0 to 511"],
    );
    assert!(out.stdout.is_empty());
    let out = run_ids(&model, &[0, 1_000_000], 2, &tmp.path().join("l.json"), &[]);
    expect_error(&out, &["--prompt-ids", "1000000", "vocabulary"]);
    // Not a number at all: clap names the flag.
    let out = exec(&mut on_model("run", &model, &["--prompt-ids", "1,two,3"]));
    expect_error(&out, &["--prompt-ids", "two"]);
}

#[test]
fn bad_ram_budget_is_rejected() {
    let (tmp, model) = converted("dsv3_a", &[]);
    for bad in ["lots", "12X", "-5", "1.5.2G"] {
        let out = exec(on_model("run", &model, &["--prompt-ids", "0"]).arg(format!("--ram-budget={bad}")));
        expect_error(&out, &["--ram-budget", bad]);
    }
    // A negative value as a separate argument is a bad size, not an unknown flag.
    let out = exec(&mut on_model(
        "run",
        &model,
        &["--prompt-ids", "0", "--ram-budget", "-5"],
    ));
    expect_error(&out, &["--ram-budget", "invalid size \"-5\""]);
    // Units are accepted.
    ok(run_ids(
        &model,
        &[0],
        2,
        &tmp.path().join("l.json"),
        &["--ram-budget", "1.5MiB"],
    ));
}

/// `--batch-form` (research; `DELTAFIN_BATCH_FORM` without the flag): an unknown value is a
/// one-line error naming the flag or the variable; `fast` is labelled on the stats lines, in
/// the stats JSON (the default says `exact`) and in a warning of `run` and `chat`, and keeps the
/// greedy ids of the fixture with a whole-prompt chunk of 40 tokens (decompressed MLA), from the
/// flag and from the variable alike.
#[test]
fn batch_form_override_is_checked_and_labelled() {
    let (tmp, model) = converted("dsv3_a", &[]);
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 + 5) % 300).collect();
    let out = exec(
        deltafin()
            .env("DELTAFIN_BATCH_FORM", "quick")
            .args(["run", "--model"])
            .arg(&model)
            .args(["--prompt-ids", "0"]),
    );
    expect_error(&out, &["DELTAFIN_BATCH_FORM", "quick"]);
    let out = exec(&mut on_model(
        "run",
        &model,
        &["--prompt-ids", "0", "--batch-form", "quick"],
    ));
    expect_error(&out, &["--batch-form", "quick"]);
    let out = ok(exec(
        on_model("chat", &model, &["--max-tokens", "1", "--batch-form", "fast"]).write_stdin("hi\n"),
    ));
    assert!(
        text(&out.stderr).contains("--batch-form fast (research)"),
        "{}",
        text(&out.stderr)
    );
    let mut runs = Vec::new();
    let mut logits = Vec::new();
    for (form, from_env) in [(None, false), (Some("fast"), false), (Some("fast"), true)] {
        let stats = tmp.path().join(format!("{form:?}{from_env}.json"));
        let lg = tmp.path().join(format!("{form:?}{from_env}.logits.json"));
        let mut cmd = deltafin();
        cmd.args(["run", "--model"]).arg(&model);
        match (form, from_env) {
            (Some(f), true) => {
                cmd.env("DELTAFIN_BATCH_FORM", f);
            }
            (Some(f), false) => {
                cmd.args(["--batch-form", f]);
            }
            (None, _) => {}
        }
        let out = ok(exec(
            cmd.args(["--prompt-ids", &join_ids(&prompt)])
                .args(["--max-new-tokens", "4", "--ignore-eos", "--stats-json"])
                .arg(&stats)
                .arg("--logits-out")
                .arg(&lg),
        ));
        logits.push(check_logits_file(&lg, 512, 4).2);
        let v = read_json(&stats);
        let err = text(&out.stderr);
        match form {
            None => {
                assert_eq!(v["batch_form"], "exact");
                assert!(!err.contains("batched arithmetic"), "{err}");
            }
            Some(f) => {
                assert_eq!(v["batch_form"], f);
                assert!(err.contains("batched arithmetic   fast"), "{err}");
                assert!(err.contains("warning: --batch-form fast (research)"), "{err}");
            }
        }
        runs.push(ids(&v["generated_ids"]));
    }
    assert_eq!(runs[1], runs[2], "--batch-form fast and DELTAFIN_BATCH_FORM=fast");
    assert_eq!(logits[1], logits[2], "--batch-form fast and DELTAFIN_BATCH_FORM=fast");
    assert_eq!(runs[0], runs[1], "greedy ids with --batch-form fast");
    // The first generated token's logits come from the prompt pass: within rounding, not equal
    // (so the decompressed form did run).
    let rel = rel_l2(&logits[1][0], &logits[0][0]);
    assert!(
        rel > 0.0 && rel < 1e-5,
        "prompt-pass logits, fast vs exact: rel L2 {rel:e}"
    );
}

#[test]
fn run_on_a_directory_that_is_not_a_model() {
    let tmp = tempfile::tempdir().unwrap();
    let out = exec(deltafin().args(["run", "--model", "/nonexistent/deltafin-model", "--prompt-ids", "0"]));
    expect_error(&out, &["/nonexistent/deltafin-model", "no such directory"]);
    // A Hugging Face checkpoint is not a converted model.
    let out = exec(
        deltafin()
            .args(["run", "--model"])
            .arg(fixture("dsv3_a"))
            .args(["--prompt-ids", "0"]),
    );
    expect_error(&out, &["manifest.json", "Hugging Face checkpoint", "deltafin convert"]);
    // --chat needs text.
    let model = tmp.path().join("m");
    ok(convert(&fixture("dsv3_a"), &model, &[]));
    let out = exec(&mut on_model("run", &model, &["--chat", "--prompt-ids", "0"]));
    expect_error(&out, &["--chat", "--prompt"]);
    // A file given as the model, and a converted model whose manifest was deleted.
    let out = exec(
        deltafin()
            .args(["run", "--model"])
            .arg(model.join("config.json"))
            .args(["--prompt-ids", "0"]),
    );
    expect_error(&out, &["config.json", "a file, not a model directory"]);
    std::fs::remove_file(model.join("manifest.json")).unwrap();
    let out = exec(&mut on_model("run", &model, &["--prompt-ids", "0"]));
    let err = expect_error(&out, &["manifest.json not found", "damaged"]);
    assert!(!err.contains("Hugging Face"), "{err}");
}

/// A prompt plus --max-new-tokens past the context is refused, naming both sizes and the
/// override; with --allow-context-overflow it runs, with a warning.
#[test]
fn context_overflow_is_refused_unless_allowed() {
    let (tmp, model) = converted("dsv3_a", &[]);
    let ctx = read_json(&model.join("config.json"))["max_position_embeddings"]
        .as_u64()
        .unwrap() as usize;
    let prompt: Vec<u32> = (0..ctx as u32 - 2).map(|i| i % 100).collect();
    let logits = tmp.path().join("l.json");
    let out = run_ids(&model, &prompt, 4, &logits, &[]);
    expect_error(
        &out,
        &[
            "exceed the model's context length",
            &format!("({ctx}"),
            "--allow-context-overflow",
        ],
    );
    assert!(out.stdout.is_empty());
    let out = ok(run_ids(&model, &prompt, 4, &logits, &["--allow-context-overflow"]));
    assert!(
        text(&out.stderr).contains("warning: the prompt"),
        "{}",
        text(&out.stderr)
    );
    ok(run_ids(&model, &prompt, 2, &logits, &[]));
}

#[test]
fn unwritable_output_files_fail_before_generating() {
    let (tmp, model) = converted("dsv3_a", &[]);
    let bad = tmp.path().join("no-such-dir/logits.json");
    let out = run_ids(&model, &[0], 4, &bad, &[]);
    expect_error(&out, &["--logits-out", "no-such-dir/logits.json", "No such file"]);
    assert!(out.stdout.is_empty(), "failed before generating anything");
    // The same for --stats-json.
    let logits = tmp.path().join("l.json");
    let out = run_ids(&model, &[0], 4, &logits, &["--stats-json", bad.to_str().unwrap()]);
    expect_error(&out, &["--stats-json", "no-such-dir/logits.json", "No such file"]);
    assert!(out.stdout.is_empty(), "failed before generating anything");
    assert!(!logits.exists(), "the claimed --logits-out file is removed again");
    // A failed run keeps an existing output file as it was; a successful one replaces it.
    let stats = tmp.path().join("stats.json");
    std::fs::write(&stats, "old").unwrap();
    let out = run_ids(
        &model,
        &[0, 100_000],
        4,
        &logits,
        &["--stats-json", stats.to_str().unwrap()],
    );
    expect_error(&out, &["--prompt-ids", "vocabulary"]);
    assert_eq!(std::fs::read_to_string(&stats).unwrap(), "old");
    ok(run_ids(
        &model,
        &[0],
        4,
        &logits,
        &["--stats-json", stats.to_str().unwrap()],
    ));
    assert!(read_json(&stats)["steady_decode_tokens_per_s"].is_number());
    // bench claims --json before its runs, and demo checks its token count before synthesizing.
    let out = exec(
        deltafin()
            .args([
                "bench",
                "--runs",
                "1",
                "--new-tokens",
                "3",
                "--json",
                bad.to_str().unwrap(),
                "--model",
            ])
            .arg(&model),
    );
    let err = expect_error(&out, &["--json", "no-such-dir/logits.json"]);
    assert!(!text(&out.stderr).contains("run 1"), "{err}");
    let out = exec(deltafin().args(["demo", "--max-new-tokens", "0"]));
    expect_error(&out, &["--max-new-tokens", "at least 1"]);
}

#[test]
fn ram_budget_changes_io_but_not_results() {
    let (tmp, model) = converted("dsv3_b", &[]); // default layout: int8 + MXFP4
    let manifest = read_json(&model.join("manifest.json"));
    assert_eq!(manifest["experts"]["dtype"], "mxfp4");
    let expected = read_json(&fixture("dsv3_b").join("expected.json"));
    let prompt = ids(&expected["prompts"][2]["prompt_ids"]);
    let (f0, f1) = (tmp.path().join("zero.json"), tmp.path().join("large.json"));
    let zero = ok(run_ids(&model, &prompt, 8, &f0, &["--ram-budget", "0"]));
    let large = ok(run_ids(&model, &prompt, 8, &f1, &["--ram-budget", "1G"]));
    assert_eq!(zero.stdout, large.stdout, "same text");
    let (a, b) = (std::fs::read(&f0).unwrap(), std::fs::read(&f1).unwrap());
    assert!(a == b, "--logits-out differs between --ram-budget 0 and 1G");
    check_logits_file(&f0, 448, 8);
    let (zero_err, large_err) = (text(&zero.stderr), text(&large.stderr));
    check_stats(&zero_err, prompt.len(), 8, &manifest);
    check_stats(&large_err, prompt.len(), 8, &manifest);
    let (zb, _, zh, _) = expert_counters(&zero_err);
    let (lb, lm, lh, le) = expert_counters(&large_err);
    assert_eq!(zh, 0, "a zero budget caches nothing:\n{zero_err}");
    let n_records = manifest["experts"]["records"].as_array().unwrap().len() as u64;
    assert!(lm <= n_records && le == 0 && lh > 0, "{large_err}");
    assert!(zb > lb, "a zero budget reads more ({zb} vs {lb})");
}

//! Text prompts and chat templates end to end: `run --prompt` encodes and streams like the
//! reference, `run --chat` and `chat` apply the template (DeepSeek-V3, Qwen3-MoE, Mixtral), a
//! broken template fails only chat, and the sampling flags of `run` and `chat`.
//!
//! Shared helpers: `tests/cli_support/mod.rs`.

mod cli_support;

use cli_support::*;

#[test]
fn text_prompt_encodes_like_the_reference_and_streams_the_decoded_text() {
    let (tmp, model) = converted("dsv3_a", &LOSSLESS);
    let expected = read_json(&fixture("dsv3_a").join("expected.json"));
    // Prompt 1 is a short text encoded with add_special_tokens=True.
    let p = &expected["prompts"][1];
    let prompt_text = p["prompt_info"]["text"].as_str().unwrap();
    let f = tmp.path().join("logits.json");
    let out = ok(exec(
        on_model("run", &model, &["--prompt", prompt_text])
            .args(["--max-new-tokens", "8", "--ignore-eos", "--logits-out"])
            .arg(&f),
    ));
    let (prompt, gen, _) = check_logits_file(&f, 512, 8);
    assert_eq!(
        prompt,
        ids(&p["prompt_ids"]),
        "--prompt encodes with the BOS like transformers"
    );
    assert_eq!(gen, ids(&p["generated_ids"]));
    let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
    assert_eq!(stdout, expected_stdout(&model, &gen));
}

/// A chat template that does not compile blocks only what needs it: `run --prompt` works,
/// `run --chat` and `chat` fail with one line naming the template.
#[test]
fn a_broken_chat_template_only_fails_chat() {
    let (_tmp, model) = converted("dsv3_a", &[]);
    edit_json(&model.join("tokenizer_config.json"), |cfg| {
        cfg["chat_template"] = "{% if %}".into()
    });
    let _ = std::fs::remove_file(model.join("chat_template.jinja"));
    let run = |extra: &[&str]| exec(on_model("run", &model, &["--prompt", "hi", "--max-new-tokens", "2"]).args(extra));
    ok(run(&[]));
    let err = expect_error(&run(&["--chat"]), &["--chat", "chat_template"]);
    assert_eq!(err.lines().count(), 1, "{err}");
    let out = exec(on_model("chat", &model, &[]).write_stdin(""));
    expect_error(&out, &["chat_template"]);
}

#[test]
fn chat_wraps_the_prompt_with_the_chat_template() {
    for case in ["dsv3_a", "dsv3_b"] {
        let (tmp, model) = converted(case, &LOSSLESS);
        let tok_expected = read_json(&fixture(case).join("tokenizer_expected.json"));
        let render = tok_expected["chat_template_renders"]
            .as_array()
            .unwrap()
            .iter()
            .find(|r| r["name"] == "one_turn" && r["add_generation_prompt"] == true)
            .expect("a one-turn render with add_generation_prompt");
        let question = render["messages"][0]["content"].as_str().unwrap();
        let f = tmp.path().join("logits.json");
        // Enough tokens that byte-level pieces of multi-byte characters are likely to appear.
        let out = ok(exec(
            on_model("run", &model, &["--chat", "--prompt", question])
                .args(["--max-new-tokens", "24", "--ignore-eos", "--logits-out"])
                .arg(&f),
        ));
        let vocab = tok_expected["vocab_size"].as_u64().unwrap() as usize;
        let (prompt, gen, _) = check_logits_file(&f, vocab, 24);
        assert_eq!(
            prompt,
            ids(&render["ids_of_rendered_no_special_tokens"]),
            "{case}: --chat prompt ids"
        );
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        assert_eq!(stdout, expected_stdout(&model, &gen), "{case}: stdout");
        check_stats(
            &text(&out.stderr),
            prompt.len(),
            24,
            &read_json(&model.join("manifest.json")),
        );
    }
}

/// Qwen3-MoE, Mixtral, Qwen3-Next and Qwen3.5-MoE end to end through the binary: `convert`
/// (lossless and default layouts), then `run --chat` on the user message of each case's chat
/// prompt reproduces the reference's prompt ids, greedy ids and logits; the default layout runs a
/// text prompt. (Fixture folder, case, family the manifest names.)
#[test]
fn qwen3_moe_and_mixtral_convert_and_run_with_chat() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for (folder, case, family) in [
        ("qwen3_moe", "qwen3_moe_a", "qwen3_moe"),
        ("qwen3_moe", "qwen3_moe_b", "qwen3_moe"),
        ("mixtral", "mixtral_a", "mixtral"),
        ("mixtral", "mixtral_b", "mixtral"),
        ("qwen3_next", "qwen3_next_a", "qwen3_next"),
        ("qwen3_5_moe", "qwen3_5_moe_b", "qwen3_next"),
    ] {
        let src = root.join(folder).join(case);
        let tmp = tempfile::tempdir().unwrap();
        let model = tmp.path().join("m");
        convert_lossless(&src, &model);
        let manifest = read_json(&model.join("manifest.json"));
        assert_eq!(manifest["family"], family, "{case}");
        let vocab = manifest["config"][family]["vocab_size"].as_u64().unwrap() as usize;
        let expected = read_json(&src.join("expected.json"));
        let p = &expected["prompts"][2];
        let messages = p["prompt_info"]["messages"].as_array().unwrap();
        assert_eq!(messages.len(), 1, "{case}: one user message");
        let question = messages[0]["content"].as_str().unwrap();
        let want = ids(&p["generated_ids"]);
        let f = tmp.path().join("logits.json");
        let out = ok(exec(
            on_model("run", &model, &["--chat", "--prompt", question])
                .args([
                    "--max-new-tokens",
                    &want.len().to_string(),
                    "--ignore-eos",
                    "--logits-out",
                ])
                .arg(&f),
        ));
        let (prompt, gen, steps) = check_logits_file(&f, vocab, want.len());
        assert_eq!(prompt, ids(&p["prompt_ids"]), "{case}: --chat prompt ids");
        assert_eq!(gen, want, "{case}: generated ids");
        for (k, s) in steps.iter().enumerate() {
            let e = rel_l2(s, &floats(&p["step_logits"][k]));
            assert!(e <= LOSSLESS_REL_L2, "{case} step {k}: logits rel L2 {e:.2e}");
        }
        let stdout = String::from_utf8(out.stdout).expect("stdout is UTF-8");
        assert_eq!(stdout, expected_stdout(&model, &gen), "{case}: stdout");

        let q = tmp.path().join("q");
        ok(convert(&src, &q, &[]));
        let text_prompt = expected["prompts"][1]["prompt_info"]["text"].as_str().unwrap();
        let f = tmp.path().join("q.json");
        ok(exec(
            on_model("run", &q, &["--prompt", text_prompt])
                .args(["--max-new-tokens", "4", "--ignore-eos", "--logits-out"])
                .arg(&f),
        ));
        let (prompt, gen, _) = check_logits_file(&f, vocab, 4);
        assert_eq!(
            prompt,
            ids(&expected["prompts"][1]["prompt_ids"]),
            "{case}: --prompt ids"
        );
        assert_eq!(gen.len(), 4);
    }
}

/// `run` and `chat` honour every sampling flag as the server's fields (hand-worked below: the
/// fixture's logits are at most 11.1 in magnitude, so a bias lead above 22.2 decides a step;
/// closer calls are calibrated on the raw logits) and refuse values out of range, naming the
/// flag.
#[test]
fn run_and_chat_sampling_flags() {
    let (tmp, model) = converted("dsv3_a", &[]);
    let f = tmp.path().join("logits.json");
    let gen = |n: usize, extra: &[&str]| {
        ok(run_ids(&model, &[0, 5, 6], n, &f, extra));
        ids(&read_json(&f)["generated_ids"])
    };
    let greedy = gen(4, &[]);
    // +100 forces a token; -100 on the greedy first token changes it.
    assert_eq!(gen(4, &["--logit-bias", "300=100"]), [300; 4]);
    assert_eq!(
        gen(4, &["--logit-bias=300=100", "--temperature", "1.5", "--seed", "2"]),
        [300; 4]
    );
    let ban = format!("{}=-100", greedy[0]);
    assert_ne!(gen(4, &["--logit-bias", &ban])[0], greedy[0]);
    // frequency 2 per use: 300 +100 leads 301 +75 by 25, more than any two logits of the
    // fixture differ (|logit| ≤ 11.1), so without a penalty 301 never comes; the lead is gone
    // after at most 24 uses. presence (once per token) never closes it.
    let far = ["--logit-bias", "300=100", "--logit-bias", "301=75"];
    assert_eq!(gen(30, &far), [300; 30]);
    assert_eq!(gen(30, &[&far[..], &["--presence-penalty", "2"]].concat()), [300; 30]);
    let f2 = gen(30, &[&far[..], &["--frequency-penalty", "2"]].concat());
    assert!(
        f2[..2] == [300, 300] && f2.contains(&301) && f2.iter().all(|&i| i == 300 || i == 301),
        "{f2:?}"
    );
    // presence 2, calibrated on the raw logits (--logits-out) of the steps after the prompt and
    // after 300: with d = logit(300) - logit(U) at the second step, biases making
    // bias(U) - bias(300) = d - 1 give 300, 300 without the penalty and 300, U with it.
    assert_eq!(gen(2, &["--logit-bias", "300=100"]), [300, 300]);
    let steps: Vec<Vec<f64>> = read_json(&f)["step_logits"]
        .as_array()
        .unwrap()
        .iter()
        .map(floats)
        .collect();
    let (u, x) = (2..512usize)
        .filter(|u| ![0, 5, 6, 300].contains(u))
        .find_map(|u| {
            let d1 = steps[0][300] - steps[0][u];
            let d = steps[1][300] - steps[1][u];
            (d1 - d + 1.0 >= 0.5).then_some((u as u32, d - 1.0))
        })
        .expect("a token that 300 beats at the first step");
    let (b300, bu) = if x <= 0.0 {
        (100.0, 100.0 + x)
    } else {
        (100.0 - x, 100.0)
    };
    let pair = [format!("--logit-bias=300={b300}"), format!("--logit-bias={u}={bu}")];
    let pair: Vec<&str> = pair.iter().map(String::as_str).collect();
    assert_eq!(gen(2, &pair), [300, 300]);
    assert_eq!(gen(2, &[&pair[..], &["--presence-penalty", "2"]].concat()), [300, u]);
    // repetition 4: 300 (+100) once seen is (100 + l) / 4 ≤ 27.8, below 301's 50 + l ≥ 38.9.
    assert_eq!(
        gen(
            2,
            &[
                "--logit-bias",
                "300=100",
                "--logit-bias",
                "301=50",
                "--repetition-penalty",
                "4"
            ]
        ),
        [300, 301]
    );
    // min-p 1 (or top-k 1) keeps only the most likely token: the greedy output.
    let sampled = ["--temperature", "1.5", "--seed", "3"];
    assert_ne!(gen(4, &sampled), greedy);
    assert_eq!(gen(4, &[&sampled[..], &["--min-p", "1"]].concat()), greedy);

    // chat: +100 on token 300 makes every answer token 300.
    let out = ok(exec(
        on_model("chat", &model, &["--max-tokens", "3", "--logit-bias", "300=100"]).write_stdin("hi\n"),
    ));
    let t = deltafin_tokenizer::Tokenizer::from_dir(&model).unwrap();
    let want = t.decode(&[300, 300, 300], true).unwrap();
    assert_eq!(text(&out.stdout), format!("{want}\n"));

    let m = model.to_str().unwrap();
    for (cmd, flag, value, needles) in [
        (
            "run",
            "--presence-penalty",
            "3",
            vec!["--presence-penalty 3", "between -2 and 2"],
        ),
        (
            "run",
            "--frequency-penalty",
            "-2.5",
            vec!["--frequency-penalty -2.5", "between -2 and 2"],
        ),
        (
            "run",
            "--repetition-penalty",
            "0",
            vec!["--repetition-penalty 0", "greater than 0"],
        ),
        ("run", "--min-p", "1.5", vec!["--min-p 1.5", "between 0 and 1"]),
        (
            "run",
            "--logit-bias",
            "512=1",
            vec!["--logit-bias 512=1", "outside the vocabulary"],
        ),
        ("run", "--logit-bias", "5", vec!["--logit-bias", "ID=BIAS"]),
        ("run", "--logit-bias", "5=101", vec!["--logit-bias", "-100 to 100"]),
        (
            "chat",
            "--frequency-penalty",
            "3",
            vec!["--frequency-penalty 3", "between -2 and 2"],
        ),
        ("chat", "--logit-bias", "x=1", vec!["--logit-bias", "not a token id"]),
    ] {
        let mut c = deltafin();
        c.args([cmd, "--model", m, flag, value]);
        if cmd == "run" {
            c.args(["--prompt-ids", "0,5"]);
        }
        expect_error(&exec(c.write_stdin("")), &needles);
    }
}

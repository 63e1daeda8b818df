//! `deltafin convert` end to end: its error paths on broken checkpoints (edited config,
//! rewritten or cut safetensors) exit non-zero with one line naming what is wrong and leave no
//! model behind, `--force`, `--dry-run`, a killed convert, and the flags' numeric checks.
//!
//! Shared helpers: `tests/cli_support/mod.rs`.

mod cli_support;

use cli_support::*;

/// Converting a deltafin model directory says what it is; `--dry-run` into an occupied output
/// directory says the real convert would need `--force`, and writes nothing.
#[test]
fn convert_names_a_model_directory_and_dry_run_notes_force() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("dsv3_a", tmp.path());
    let m = tmp.path().join("m");
    ok(convert(&hf, &m, &[]));
    let again = tmp.path().join("again");
    expect_error(
        &convert(&m, &again, &[]),
        &["deltafin model directory", "manifest.json"],
    );
    assert_no_output(&again);
    let before: Vec<_> = std::fs::read_dir(&m).unwrap().map(|e| e.unwrap().file_name()).collect();
    let out = ok(exec(deltafin().arg("convert").arg("--dry-run").arg(&hf).arg(&m)));
    assert!(text(&out.stderr).contains("needs --force"), "{}", text(&out.stderr));
    let after: Vec<_> = std::fs::read_dir(&m).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(before, after);
}

#[test]
fn convert_rejects_an_unknown_model_type() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("dsv3_a", tmp.path());
    edit_config(&hf, |cfg| cfg["model_type"] = "llama".into());
    let out = tmp.path().join("m");
    convert_refused(&hf, &out, &["config.json", "model_type", "llama"]);
}

/// A context of 0 positions (or any other zero-sized hyperparameter) is refused at convert,
/// naming the field, instead of making a model that answers every request with an overflow.
#[test]
fn convert_rejects_a_zero_context() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures");
    for case in ["deepseek_v3/dsv3_a", "qwen3_moe/qwen3_moe_a", "mixtral/mixtral_a"] {
        let tmp = tempfile::tempdir().unwrap();
        let hf = tmp.path().join("hf");
        copy_dir(&root.join(case), &hf);
        edit_config(&hf, |cfg| cfg["max_position_embeddings"] = 0.into());
        let out = tmp.path().join("m");
        convert_refused(&hf, &out, &["config.json", "max_position_embeddings", "greater than 0"]);
    }
}

/// A negative number for a numeric flag gets that flag's own error (range or type), not clap's
/// "unexpected argument '-5'"; `chat --top-k -1` means off, as the server's `top_k`.
#[test]
fn negative_numbers_get_the_flags_error() {
    let (_tmp, model) = converted("dsv3_a", &[]);
    let m = model.to_str().unwrap();
    for (args, needles) in [
        (
            vec!["run", "--model", m, "--prompt", "hi", "--max-new-tokens", "-5"],
            vec!["--max-new-tokens", "-5"],
        ),
        (
            vec!["chat", "--model", m, "--temperature", "-1"],
            vec!["--temperature -1", "between 0 and 2"],
        ),
        (
            vec!["chat", "--model", m, "--top-k", "-2"],
            vec!["--top-k", "-2", "-1 = off"],
        ),
        (vec!["info", m, "--bandwidth", "-1"], vec!["--bandwidth -1", "positive"]),
        (
            vec!["bench", "--model", m, "--floor-bandwidth", "-3"],
            vec!["--floor-bandwidth -3", "positive"],
        ),
        (vec!["serve", "--model", m, "--port", "-1"], vec!["--port", "-1"]),
        (
            vec!["serve", "--model", m, "--half-close", "sometimes"],
            vec!["--half-close", "sometimes", "probe, answer, disconnect"],
        ),
    ] {
        let out = exec(deltafin().args(&args).write_stdin(""));
        let err = expect_error(&out, &needles);
        assert!(!err.contains("unexpected argument"), "{args:?}: {err}");
    }
    // -1 is "off" for chat's top-k: it starts and ends on end of input.
    let out = exec(
        deltafin()
            .args(["chat", "--model", m, "--top-k", "-1", "--max-tokens", "2"])
            .write_stdin(""),
    );
    assert!(out.status.success(), "{}", text(&out.stderr));
}

#[test]
fn convert_rejects_a_missing_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("dsv3_a", tmp.path());
    let st = hf.join("model.safetensors");
    // Control: an unedited rewrite converts, so the failure below is the missing tensor's.
    rewrite_safetensors(&st, |_| {});
    ok(convert(&hf, &tmp.path().join("control"), &[]));

    for missing in [
        "model.layers.2.self_attn.kv_b_proj.weight",
        "model.layers.1.mlp.experts.5.down_proj.weight",
    ] {
        copy_dir(&fixture("dsv3_a"), &hf);
        rewrite_safetensors(&st, |ts| ts.retain(|t| t.0 != missing));
        let out = tmp.path().join("m");
        convert_refused(&hf, &out, &["missing tensor", missing]);
    }
}

/// `convert` of a copy of `dsv3_a` whose tensor `name` in `model.safetensors` was changed by
/// `edit` fails cleanly naming the file, the tensor and every needle ([`convert_refused`]).
fn refused_with_edited_tensor(name: &str, edit: impl FnOnce(&mut RawTensor), needles: &[&str]) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case("dsv3_a", tmp.path());
    rewrite_safetensors(&hf.join("model.safetensors"), |ts| edit(find(ts, name)));
    let out = tmp.path().join("m");
    convert_refused(&hf, &out, &[&["model.safetensors", name], needles].concat());
}

#[test]
fn convert_rejects_a_shape_mismatch() {
    let name = "model.layers.0.self_attn.q_a_proj.weight";
    refused_with_edited_tensor(
        name,
        |t| {
            assert_eq!(t.2, [32, 64]);
            t.2 = vec![64, 32];
        },
        &["[64, 32]", "[32, 64]"],
    );
}

#[test]
fn convert_rejects_fp8_weights() {
    let name = "model.layers.1.mlp.experts.3.up_proj.weight";
    refused_with_edited_tensor(
        name,
        |t| {
            let n: usize = t.2.iter().product();
            t.1 = Dtype::F8_E4M3;
            t.3 = vec![0x38; n];
        },
        &["F8_E4M3", "FP8"],
    );
}

/// A copy of fixture `case` in a fresh temporary directory, to be broken in its weight file
/// `file`: the directory, the copy, the path of the copy's `file` and the output path of a
/// convert (`m` in the directory, not created).
fn case_to_break(case: &str, file: &str) -> (tempfile::TempDir, PathBuf, PathBuf, PathBuf) {
    let tmp = tempfile::tempdir().unwrap();
    let hf = copy_case(case, tmp.path());
    let (st, out) = (hf.join(file), tmp.path().join("m"));
    (tmp, hf, st, out)
}

#[test]
fn convert_rejects_a_truncated_safetensors_file() {
    let (_tmp, hf, st, out) = case_to_break("dsv3_a", "model.safetensors");
    let full = std::fs::read(&st).unwrap();
    // Cut in the tensor data, one byte short, and inside the header.
    for cut in [full.len() / 2, full.len() - 1, 100] {
        std::fs::write(&st, &full[..cut]).unwrap();
        let line = convert_refused(&hf, &out, &["model.safetensors"]);
        assert!(line.contains("truncated"), "cut at {cut}: {line}");
    }
}

#[test]
fn convert_rejects_a_shard_of_the_index_that_is_truncated() {
    let (_tmp, hf, st, out) = case_to_break("dsv3_b", "model-00002-of-00002.safetensors");
    let full = std::fs::read(&st).unwrap();
    std::fs::write(&st, &full[..full.len() - 4096]).unwrap();
    convert_refused(&hf, &out, &["model-00002-of-00002.safetensors", "truncated"]);
}

#[test]
fn convert_rejects_a_garbage_safetensors_header() {
    let (_tmp, hf, st, out) = case_to_break("dsv3_a", "model.safetensors");
    // Not a safetensors file at all: the first 8 bytes read as an absurd header length.
    std::fs::write(&st, b"this is not a safetensors file, just some text\n").unwrap();
    convert_refused(&hf, &out, &["model.safetensors", "header"]);
    // A plausible header length followed by bytes that are not JSON.
    let mut bad = 24u64.to_le_bytes().to_vec();
    bad.extend_from_slice(b"{\"oops\": not json at all");
    bad.extend_from_slice(&[0u8; 64]);
    std::fs::write(&st, &bad).unwrap();
    convert_refused(&hf, &out, &["model.safetensors"]);
    // Valid JSON whose offsets point past the data.
    let header = br#"{"lm_head.weight":{"dtype":"F32","shape":[512,64],"data_offsets":[0,131072]}}"#;
    let mut bad = (header.len() as u64).to_le_bytes().to_vec();
    bad.extend_from_slice(header);
    bad.extend_from_slice(&[0u8; 16]);
    std::fs::write(&st, &bad).unwrap();
    convert_refused(&hf, &out, &["model.safetensors"]);
}

#[test]
fn convert_refuses_a_non_empty_output_without_force_and_force_replaces_it() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    std::fs::write(out.join("precious.txt"), "keep me").unwrap();
    let line = expect_error(&convert(&fixture("dsv3_a"), &out, &[]), &["--force"]);
    assert!(line.contains(&*out.to_string_lossy()), "names the directory: {line}");
    assert_eq!(std::fs::read_to_string(out.join("precious.txt")).unwrap(), "keep me");
    // --force replaces only a model directory: a directory without manifest.json survives.
    let line = expect_error(&convert(&fixture("dsv3_a"), &out, &["--force"]), &["manifest.json"]);
    assert!(line.contains("not a deltafin model"), "{line}");
    assert_eq!(std::fs::read_to_string(out.join("precious.txt")).unwrap(), "keep me");
    std::fs::remove_file(out.join("precious.txt")).unwrap();

    // An existing model is replaced by --force.
    ok(convert(&fixture("dsv3_c"), &out, &[]));
    ok(convert(
        &fixture("dsv3_a"),
        &out,
        &["--force", "--backbone", "f32", "--experts", "f32"],
    ));
    assert!(out.join("manifest.json").is_file());
    let leftovers = entries_except(tmp.path(), "m");
    assert!(leftovers.is_empty(), "no .partial/.old left: {leftovers:?}");
    let p = &read_json(&fixture("dsv3_a").join("expected.json"))["prompts"][0];
    let f = tmp.path().join("l.json");
    ok(run_ids(&out, &ids(&p["prompt_ids"]), 8, &f, &[]));
    assert_eq!(ids(&read_json(&f)["generated_ids"]), ids(&p["generated_ids"]));
}

#[test]
fn convert_never_writes_over_its_source() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("outer").join("hf");
    std::fs::create_dir_all(&src).unwrap();
    for f in std::fs::read_dir(fixture("dsv3_a")).unwrap() {
        let f = f.unwrap().path();
        std::fs::copy(&f, src.join(f.file_name().unwrap())).unwrap();
    }
    for target in [src.clone(), tmp.path().join("outer")] {
        let line = expect_error(&convert(&src, &target, &["--force"]), &["source"]);
        assert!(line.contains("source checkpoint"), "{line}");
        assert!(src.join("model.safetensors").is_file(), "the source survives");
    }
}

#[test]
fn an_empty_existing_output_directory_is_fine_without_force() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    std::fs::create_dir(&out).unwrap();
    ok(convert(&fixture("dsv3_c"), &out, &[]));
    assert!(out.join("manifest.json").is_file());
}

/// What an interrupted convert leaves: the sibling `.m.partial` without a manifest. The target
/// must not load, and re-running convert must complete.
#[test]
fn stale_partial_directory_is_not_a_model_and_rerun_completes() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    let partial = tmp.path().join(".m.partial");
    std::fs::create_dir(&partial).unwrap();
    std::fs::write(partial.join("backbone.bin"), vec![7u8; 10_000]).unwrap();
    std::fs::write(partial.join("experts.pack"), vec![9u8; 5_000]).unwrap();
    let p = &read_json(&fixture("dsv3_a").join("expected.json"))["prompts"][1];
    let prompt = ids(&p["prompt_ids"]);
    let f = tmp.path().join("l.json");
    expect_error(
        &run_ids(&out, &prompt, 8, &f, &[]),
        &["not a deltafin model directory", "interrupted `deltafin convert`"],
    );
    expect_error(
        &run_ids(&partial, &prompt, 8, &f, &[]),
        &["not a deltafin model directory", "manifest.json not found"],
    );
    convert_lossless(&fixture("dsv3_a"), &out);
    assert!(!partial.exists(), "the stale partial directory is gone");
    ok(run_ids(&out, &prompt, 8, &f, &[]));
    assert_eq!(ids(&read_json(&f)["generated_ids"]), ids(&p["generated_ids"]));
}

/// Starts `deltafin convert hf out [extra]` and SIGKILLs it as soon as its partial output
/// directory holds a file (writing is under way). Returns whether it died from the kill, i.e.
/// was interrupted mid-way rather than finishing first.
fn kill_convert_midway(hf: &Path, out: &Path, extra: &[&str]) -> bool {
    let partial = out.with_file_name(format!(".{}.partial", out.file_name().unwrap().to_string_lossy()));
    let mut child = std::process::Command::new(assert_cmd::cargo::cargo_bin!("deltafin"))
        .arg("convert")
        .arg(hf)
        .arg(out)
        .args(extra)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    let mut killed = false;
    while t0.elapsed() < Duration::from_secs(60) {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if std::fs::read_dir(&partial)
            .map(|mut d| d.next().is_some())
            .unwrap_or(false)
        {
            child.kill().unwrap();
            killed = true;
            break;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let status = child.wait().unwrap();
    killed && status.signal() == Some(9)
}

/// Kills a real convert mid-way (on a synthetic checkpoint large enough to take a while), first
/// into a new directory, then with `--force` over an existing model.
#[test]
fn killed_convert_leaves_no_model_and_rerun_completes() {
    use deltafin_format::synth::{write_checkpoint, SynthSpec};
    let tmp = tempfile::tempdir().unwrap();
    let hf = tmp.path().join("hf");
    let mut spec = SynthSpec::demo(512);
    spec.hidden_size = 256;
    spec.moe_intermediate_size = 128;
    spec.intermediate_size = 512;
    spec.num_hidden_layers = 4;
    spec.q_lora_rank = Some(128);
    spec.n_routed_experts = 64;
    write_checkpoint(&hf, &spec, 0, 1).unwrap();
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fixture("dsv3_a").join(f), hf.join(f)).unwrap();
    }
    let out = tmp.path().join("m");
    let partial = tmp.path().join(".m.partial");
    let f = tmp.path().join("l.json");
    let prompt = [0, 5, 6];

    // A few attempts in case a loaded machine lets the convert finish before the kill lands.
    let interrupted = (0..3).any(|_| {
        let _ = std::fs::remove_dir_all(&out);
        kill_convert_midway(&hf, &out, &[])
    });
    assert!(
        interrupted,
        "convert was never interrupted: make the synthetic checkpoint larger"
    );
    assert!(!out.exists(), "a killed convert created {}", out.display());
    assert!(partial.is_dir(), "killed mid-way: its partial output is still there");
    assert!(!partial.join("manifest.json").exists(), "the manifest is written last");
    expect_error(
        &run_ids(&out, &prompt, 2, &f, &[]),
        &["not a deltafin model directory", "interrupted `deltafin convert`"],
    );

    // Re-running completes, without --force: nothing of the interrupted run is in the way.
    ok(convert(&hf, &out, &[]));
    assert!(
        !partial.exists(),
        "the partial directory is gone after a completed convert"
    );
    ok(run_ids(&out, &prompt, 3, &f, &[]));
    let first = std::fs::read(&f).unwrap();
    assert_eq!(ids(&read_json(&f)["generated_ids"]).len(), 3);

    // Killing a --force convert over that model leaves the old model whole.
    let interrupted = (0..3).any(|_| kill_convert_midway(&hf, &out, &["--force", "--experts", "bf16"]));
    assert!(interrupted, "--force convert was never interrupted");
    let manifest = read_json(&out.join("manifest.json"));
    assert_eq!(manifest["experts"]["dtype"], "mxfp4", "the old model is still in place");
    ok(run_ids(&out, &prompt, 3, &f, &[]));
    assert!(
        std::fs::read(&f).unwrap() == first,
        "the old model still gives the same logits"
    );
}

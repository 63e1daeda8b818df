//! Integrity and data-loss cases of issue #19 (items 6, 8, 9), driven through the real binary:
//! a damaged `backbone.bin` is detected at load and by `cache verify`; older directories without
//! backbone checksums still load and are reported as unverified; `--force` never deletes files
//! deltafin did not write; a manifest cannot make deltafin read or write outside its directory.

use std::path::{Path, PathBuf};
use std::process::Output;

use assert_cmd::Command;
mod common;
use common::{deltafin_within, entries_except, exec, expect_error, ok, read_json, text, with_model};
use serde_json::Value;

fn deltafin() -> Command {
    deltafin_within(120)
}

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(case)
}

fn convert(hf: &Path, out: &Path, extra: &[&str]) -> Output {
    exec(deltafin().arg("convert").arg(hf).arg(out).args(extra))
}

fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

fn run(model: &Path) -> Output {
    exec(&mut with_model(
        deltafin(),
        "run",
        model,
        &["--prompt-ids", "5,17,42", "--max-new-tokens", "3", "--ignore-eos"],
    ))
}

// ---------------------------------------------------------------------------------------------
// Item 6: backbone checksums
// ---------------------------------------------------------------------------------------------

#[test]
fn a_flipped_backbone_byte_fails_at_load_and_in_cache_verify() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    ok(convert(&fixture("dsv3_a"), &model, &[]));
    let manifest = read_json(&model.join("manifest.json"));
    let tensors = manifest["backbone"]["tensors"].as_object().unwrap();
    assert!(
        tensors
            .values()
            .all(|t| t["xxh3"].as_str().is_some_and(|h| h.len() == 16)),
        "convert writes a checksum for every backbone tensor"
    );
    let good = ok(run(&model)).stdout;
    let info = text(&ok(exec(deltafin().arg("info").arg(&model))).stdout);
    assert!(
        info.contains("backbone checksums") && info.contains("verified at load"),
        "{info}"
    );

    // One byte inside a matrix (not padding): every tensor the engine uses is covered.
    let name = "model.layers.0.self_attn.o_proj.weight";
    let t = &tensors[name];
    let at = t["offset"].as_u64().unwrap() + t["bytes"].as_u64().unwrap() / 3;
    let bb = model.join("backbone.bin");
    let orig = std::fs::read(&bb).unwrap();
    let mut bytes = orig.clone();
    bytes[at as usize] ^= 0x01;
    std::fs::write(&bb, &bytes).unwrap();

    let out = run(&model);
    expect_error(&out, &["backbone.bin", name, "checksum", "damaged"]);
    assert!(out.stdout.is_empty(), "nothing generated from a damaged backbone");
    let out = exec(deltafin().args(["cache", "verify"]).arg(&model));
    assert!(
        text(&out.stdout).contains(&format!("FAILED backbone tensor {name}")),
        "{}",
        text(&out.stdout)
    );
    expect_error(&out, &["backbone.bin", "failed verification"]);

    std::fs::write(&bb, &orig).unwrap();
    assert_eq!(ok(run(&model)).stdout, good);
    let v = text(&ok(exec(deltafin().args(["cache", "verify"]).arg(&model))).stdout);
    assert!(v.contains("backbone: ") && v.contains("tensors verified"), "{v}");
}

#[test]
fn a_directory_without_backbone_checksums_loads_and_says_unverified() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    ok(convert(&fixture("dsv3_a"), &model, &[]));
    let good = ok(run(&model)).stdout;
    // As written by a deltafin before backbone checksums.
    let mpath = model.join("manifest.json");
    let mut m = read_json(&mpath);
    for t in m["backbone"]["tensors"].as_object_mut().unwrap().values_mut() {
        t.as_object_mut().unwrap().remove("xxh3");
    }
    write_json(&mpath, &m);
    assert_eq!(ok(run(&model)).stdout, good);
    let info = text(&ok(exec(deltafin().arg("info").arg(&model))).stdout);
    assert!(info.contains("unverified"), "{info}");
    let v = text(&ok(exec(deltafin().args(["cache", "verify"]).arg(&model))).stdout);
    assert!(
        v.contains("backbone: unverified") && v.contains("deltafin convert"),
        "{v}"
    );
}

// ---------------------------------------------------------------------------------------------
// Item 8: --force replaces only a model directory holding nothing else
// ---------------------------------------------------------------------------------------------

#[test]
fn convert_force_refuses_a_model_directory_holding_other_files() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("m");
    ok(convert(&fixture("dsv3_c"), &out, &[]));
    std::fs::create_dir(out.join("src")).unwrap();
    std::fs::write(out.join("src/main.rs"), "fn main() {}").unwrap();
    std::fs::write(out.join("notes.txt"), "keep me").unwrap();
    let before = std::fs::read(out.join("backbone.bin")).unwrap();

    let line = expect_error(
        &convert(&fixture("dsv3_a"), &out, &["--force"]),
        &["src", "notes.txt", "--force"],
    );
    assert!(line.contains("did not write"), "{line}");
    assert_eq!(
        std::fs::read_to_string(out.join("src/main.rs")).unwrap(),
        "fn main() {}"
    );
    assert_eq!(std::fs::read_to_string(out.join("notes.txt")).unwrap(), "keep me");
    assert!(
        std::fs::read(out.join("backbone.bin")).unwrap() == before,
        "the model is untouched"
    );
    let leftovers = entries_except(tmp.path(), "m");
    assert!(leftovers.is_empty(), "nothing staged: {leftovers:?}");

    // Files deltafin writes (a leftover temp file included) do not stop a replace.
    std::fs::remove_dir_all(out.join("src")).unwrap();
    std::fs::remove_file(out.join("notes.txt")).unwrap();
    std::fs::write(out.join("manifest.json.tmp"), "x").unwrap();
    ok(convert(&fixture("dsv3_a"), &out, &["--force"]));
    assert!(std::fs::read(out.join("backbone.bin")).unwrap() != before, "replaced");
}

// ---------------------------------------------------------------------------------------------
// Item 9: every manifest path stays inside the model directory
// ---------------------------------------------------------------------------------------------

/// For each way out (absolute path, `..`, a symbolic link), every command that opens the model
/// refuses it naming the field, and the file outside is neither read as the model nor written.
#[test]
fn manifest_paths_leading_out_of_the_model_directory_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let model = tmp.path().join("m");
    ok(convert(&fixture("dsv3_a"), &model, &[]));
    let mpath = model.join("manifest.json");
    let orig = read_json(&mpath);
    // Victims outside the directory: copies of the real files, so that without the check the
    // model would load from them.
    let victim_pack = tmp.path().join("victim.pack");
    let victim_bb = tmp.path().join("victim.bin");
    std::fs::copy(model.join("experts.pack"), &victim_pack).unwrap();
    std::fs::copy(model.join("backbone.bin"), &victim_bb).unwrap();
    let pack_bytes = std::fs::read(&victim_pack).unwrap();

    let abs = victim_pack.to_str().unwrap().to_string();
    let cases: Vec<(&str, &str, String)> = vec![
        ("experts", "experts.file", abs),
        ("experts", "experts.file", "../victim.pack".into()),
        ("backbone", "backbone.file", "../victim.bin".into()),
        ("backbone", "backbone.file", victim_bb.to_str().unwrap().into()),
    ];
    for (section, field, path) in &cases {
        let mut m = orig.clone();
        m[section]["file"] = Value::String(path.clone());
        write_json(&mpath, &m);
        for args in [vec!["info"], vec!["cache", "verify"], vec!["cache", "gc"], vec!["warm"]] {
            let out = exec(deltafin().args(&args).arg(&model));
            expect_error(&out, &[field, "model directory"]);
        }
        expect_error(&run(&model), &[field, "model directory"]);
    }

    // A symbolic link in place of the pack, leading out.
    write_json(&mpath, &orig);
    std::fs::remove_file(model.join("experts.pack")).unwrap();
    std::os::unix::fs::symlink(&victim_pack, model.join("experts.pack")).unwrap();
    for args in [vec!["cache", "gc"], vec!["warm"]] {
        expect_error(
            &exec(deltafin().args(&args).arg(&model)),
            &["experts.file", "symbolic link"],
        );
    }
    expect_error(&run(&model), &["experts.file", "symbolic link"]);
    assert!(
        std::fs::read(&victim_pack).unwrap() == pack_bytes,
        "the victim is untouched"
    );

    // A link that stays inside the directory is fine.
    std::fs::remove_file(model.join("experts.pack")).unwrap();
    std::fs::rename(&victim_pack, model.join("real.pack")).unwrap();
    std::os::unix::fs::symlink("real.pack", model.join("experts.pack")).unwrap();
    ok(run(&model));
}

//! `deltafin info` names the CUDA device a GPU run would use, or why there is none, in one line.

use assert_cmd::Command;

mod common;

#[test]
fn info_reports_cuda_devices_or_why_none() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::synth("tiny", &model);
    let out = Command::cargo_bin("deltafin")
        .unwrap()
        .arg("info")
        .arg(&model)
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout).unwrap();
    let cuda: Vec<&str> = text.lines().filter(|l| l.starts_with("CUDA")).collect();
    assert!(!cuda.is_empty(), "no CUDA line in:\n{text}");
    match deltafin_cuda::probe() {
        Err(e) => assert_eq!(cuda, [format!("CUDA                       {e}")]),
        Ok(devs) => {
            assert!(cuda[0].contains(&devs[0].name), "{text}");
            assert!(
                cuda.iter().any(|l| l.starts_with("CUDA memory plan (cuda:0)")),
                "{text}"
            );
        }
    }
}

/// `--gpu-budget` and `--gpu-preload` without a GPU device are refused in one line naming the
/// flag (never ignored), and `--device cuda` on a machine without CUDA says why, for `run` and
/// `serve`; with a device, a budget larger than its free memory is refused naming both sizes.
#[test]
fn gpu_flags_are_refused_clearly_where_they_cannot_apply() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    common::synth("tiny", &model);
    let fails = |args: &[&str], want: &str| {
        let out = Command::cargo_bin("deltafin")
            .unwrap()
            .args(args)
            .arg("--model")
            .arg(&model)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded");
        let line = err.lines().rfind(|l| l.starts_with("error:")).unwrap_or_default();
        assert!(line.contains(want), "{args:?}: {err}");
    };
    let run = ["run", "--prompt-ids", "1,2", "--max-new-tokens", "2"];
    fails(
        &[&run[..], &["--gpu-budget", "1GiB"]].concat(),
        "--gpu-budget 1073741824: the model computes on the CPU",
    );
    fails(
        &[&run[..], &["--gpu-preload"]].concat(),
        "--gpu-preload: the model computes on the CPU",
    );
    fails(
        &["serve", "--port", "0", "--gpu-budget", "1GiB"],
        "--gpu-budget 1073741824: the model computes on the CPU",
    );
    match deltafin_cuda::probe() {
        Err(e) => {
            fails(&[&run[..], &["--device", "cuda"]].concat(), &e.to_string());
            // The demo passes --device to its run, which refuses in the same words.
            let out = Command::cargo_bin("deltafin")
                .unwrap()
                .args(["demo", "--device", "cuda", "--max-new-tokens", "2"])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success() && err.contains(&e.to_string()), "{err}");
        }
        Ok(_) => fails(
            &[&run[..], &["--device", "cuda", "--gpu-budget", "100000GiB"]].concat(),
            "bytes free after the backbone",
        ),
    }
}

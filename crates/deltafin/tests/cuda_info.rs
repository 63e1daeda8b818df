//! `deltafin info` names the CUDA device a GPU run would use, or why there is none, in one line.

use assert_cmd::Command;

#[test]
fn info_reports_cuda_devices_or_why_none() {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    Command::cargo_bin("deltafin")
        .unwrap()
        .args(["synth", "--preset", "tiny", "--out"])
        .arg(&model)
        .assert()
        .success();
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

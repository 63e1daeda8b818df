//! `deltafin convert` onto a full file system: a clear error, non-zero exit, nothing left behind.
//!
//! Needs a small tmpfs, which only root can mount; where mounting is refused the test says so on
//! stderr and returns (CI runs as root, where it runs for real).

use std::path::Path;
use std::process::Command;

struct Mount(std::path::PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

#[test]
fn convert_on_a_full_disk_fails_cleanly() {
    let tmp = tempfile::tempdir().unwrap();
    let mnt = tmp.path().join("tiny");
    std::fs::create_dir(&mnt).unwrap();
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=512k", "tmpfs"])
        .arg(&mnt)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        eprintln!("SKIPPED: cannot mount a tmpfs here (needs root)");
        return;
    }
    let _guard = Mount(mnt.clone());
    let case = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
    let out = Command::new(env!("CARGO_BIN_EXE_deltafin"))
        .arg("convert")
        .arg(&case)
        .arg(mnt.join("m"))
        .args(["--backbone", "f32", "--experts", "f32"])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "convert onto a 512 KiB file system must fail");
    assert!(stderr.contains("No space left on device"), "{stderr}");
    assert!(!stderr.contains("panicked"), "{stderr}");
    assert_eq!(
        stderr.matches("No space left on device").count(),
        1,
        "the cause is printed once: {stderr}"
    );
    let left: Vec<_> = std::fs::read_dir(&mnt)
        .unwrap()
        .filter_map(|e| e.ok())
        .map(|e| e.file_name())
        .collect();
    assert!(left.is_empty(), "partial output left behind: {left:?}");
}

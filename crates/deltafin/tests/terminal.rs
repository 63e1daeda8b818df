//! The binary on a terminal (a pseudo-terminal made with `openpty`): model text with control
//! characters is shown escaped, `chat` edits lines with the cursor keys (issue #19, items 18
//! and 19). Piped output and input stay exact, as the other tests check.

use std::io::{Read, Write};
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_deltafin"))
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// A pseudo-terminal: (master, slave), 24×80.
fn openpty() -> (OwnedFd, OwnedFd) {
    let (mut m, mut sl) = (-1, -1);
    let ws = libc::winsize {
        ws_row: 24,
        ws_col: 80,
        ws_xpixel: 0,
        ws_ypixel: 0,
    };
    // SAFETY: valid out-pointers; a null name and termios are allowed.
    let rc = unsafe { libc::openpty(&mut m, &mut sl, std::ptr::null_mut(), std::ptr::null(), &ws) };
    assert_eq!(rc, 0, "openpty: {}", std::io::Error::last_os_error());
    // SAFETY: openpty returned two fresh descriptors that nothing else owns.
    unsafe { (OwnedFd::from_raw_fd(m), OwnedFd::from_raw_fd(sl)) }
}

/// Everything the terminal shows, collected by a thread until the last slave closes.
fn collect(master: &OwnedFd) -> Arc<Mutex<Vec<u8>>> {
    let buf = Arc::new(Mutex::new(Vec::new()));
    let mut f = std::fs::File::from(master.try_clone().unwrap());
    let b = buf.clone();
    std::thread::spawn(move || {
        let mut chunk = [0u8; 4096];
        // Linux answers EIO once no slave is open: the end.
        while let Ok(n) = f.read(&mut chunk) {
            if n == 0 {
                break;
            }
            b.lock().unwrap().extend_from_slice(&chunk[..n]);
        }
    });
    buf
}

fn wait(child: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let t0 = Instant::now();
    while t0.elapsed() < limit {
        if let Some(st) = child.try_wait().unwrap() {
            return Some(st);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

fn tiny(t: &Path) -> PathBuf {
    let m = t.join("tiny");
    let st = Command::new(bin())
        .args(["synth", "--preset", "tiny", "--out", s(&m)])
        .stderr(Stdio::null())
        .status()
        .unwrap();
    assert!(st.success());
    m
}

/// `run` with stdout on a terminal; returns what the terminal showed, with the terminal's
/// CR LF newlines back to LF.
fn run_on_terminal(args: &[&str]) -> Vec<u8> {
    let (master, slave) = openpty();
    let shown = collect(&master);
    let mut child = Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::from(slave))
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let st = wait(&mut child, Duration::from_secs(60)).expect("run on a terminal did not end");
    assert!(st.success());
    let t0 = Instant::now();
    // The reader thread sees EIO right after the child's exit; give it a moment.
    let mut last = 0;
    while t0.elapsed() < Duration::from_secs(2) {
        std::thread::sleep(Duration::from_millis(50));
        let n = shown.lock().unwrap().len();
        if n == last && n > 0 {
            break;
        }
        last = n;
    }
    let out = shown.lock().unwrap().clone();
    String::from_utf8_lossy(&out).replace("\r\n", "\n").into_bytes()
}

/// Whether `b` holds a byte that changes a terminal rather than printing.
fn has_control(b: &[u8]) -> bool {
    b.iter().any(|&c| (c < 0x20 && c != b'\n' && c != b'\t') || c == 0x7f)
}

#[test]
fn model_text_with_control_characters_is_escaped_on_a_terminal_only() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let args = [
        "run",
        "--model",
        s(&m),
        "--prompt-ids",
        "1,2,3,4",
        "--max-new-tokens",
        "40",
        "--ignore-eos",
        "--ram-budget",
        "0",
    ];
    // Piped: the exact text, which for this random model holds control characters.
    let piped = Command::new(bin()).args(args).output().unwrap();
    assert!(piped.status.success());
    assert!(
        has_control(&piped.stdout),
        "the test needs control characters in the output: {:?}",
        String::from_utf8_lossy(&piped.stdout)
    );
    // On a terminal: escaped, otherwise the same text.
    let shown = run_on_terminal(&args);
    assert!(!has_control(&shown), "{:?}", String::from_utf8_lossy(&shown));
    let text = String::from_utf8_lossy(&piped.stdout);
    let mut want = String::new();
    for c in text.chars() {
        if c.is_control() && c != '\n' && c != '\t' {
            want.extend(c.escape_default());
        } else {
            want.push(c);
        }
    }
    assert_eq!(String::from_utf8_lossy(&shown), want);
    // --raw-output: the exact bytes even on a terminal.
    let mut raw_args = args.to_vec();
    raw_args.push("--raw-output");
    let raw = run_on_terminal(&raw_args);
    assert!(has_control(&raw), "{:?}", String::from_utf8_lossy(&raw));
}

#[test]
fn chat_on_a_terminal_edits_lines_with_the_cursor_keys() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let (master, slave) = openpty();
    let shown = collect(&master);
    let mut child = Command::new(bin())
        .args(["chat", s(&m), "--max-tokens", "4", "--ram-budget", "0"])
        .env("TERM", "xterm")
        .stdin(Stdio::from(slave.try_clone().unwrap()))
        .stdout(Stdio::from(slave))
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while !String::from_utf8_lossy(&shown.lock().unwrap()).contains("> ") {
        assert!(t0.elapsed() < Duration::from_secs(60), "no prompt on the terminal");
        std::thread::sleep(Duration::from_millis(20));
    }
    // "/ext", cursor left, "i", Enter: "/exit" with line editing; "/ext^[[Di" without.
    let mut input = std::fs::File::from(master.try_clone().unwrap());
    input.write_all(b"/ext\x1b[Di\r").unwrap();
    let st = match wait(&mut child, Duration::from_secs(20)) {
        Some(st) => st,
        None => {
            // Not understood as /exit: end the input (Ctrl-D) to see what happened.
            input.write_all(b"\x04").unwrap();
            wait(&mut child, Duration::from_secs(20)).expect("chat did not end")
        }
    };
    let mut err = String::new();
    child.stderr.take().unwrap().read_to_string(&mut err).unwrap();
    assert!(st.success(), "{err}");
    assert!(
        !err.contains("unknown command"),
        "the cursor keys reached the input: {err}"
    );
}

/// With stderr on a terminal, `pull` shows each retry on its progress line (and as a warning
/// line above it), not only in the summary at the end.
#[test]
fn pull_shows_retries_on_the_progress_line() {
    let tmp = tempfile::tempdir().unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (master, slave) = openpty();
    let shown = collect(&master);
    let mut child = Command::new(bin())
        .args([
            "pull",
            &format!("http://127.0.0.1:{port}/org/m"),
            s(&tmp.path().join("m")),
            "--full",
        ])
        .env("DELTAFIN_HTTP_RETRIES", "2")
        .env("DELTAFIN_HTTP_BACKOFF_MS", "300")
        .env_remove("RUST_LOG")
        .env("TERM", "xterm")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::from(slave))
        .spawn()
        .unwrap();
    let st = wait(&mut child, Duration::from_secs(60)).expect("pull did not end");
    assert!(!st.success());
    std::thread::sleep(Duration::from_millis(300));
    let screen = String::from_utf8_lossy(&shown.lock().unwrap()).into_owned();
    assert!(screen.contains("manifest.json: retry 1/2 ("), "{screen:?}");
    assert!(screen.contains("retrying in 0.3 s (1/2)"), "{screen:?}");
}

//! `deltafin chat` and `deltafin serve` through the real binary on the tiny `dsv3_a` fixture.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command as StdCommand, Stdio};
use std::time::{Duration, Instant};

use assert_cmd::Command;

fn bin() -> PathBuf {
    PathBuf::from(assert_cmd::cargo::cargo_bin!("deltafin"))
}

fn converted(tmp: &Path) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
    let out = tmp.join("dsv3-a");
    Command::new(bin())
        .arg("convert")
        .arg(&src)
        .arg(&out)
        .assert()
        .success();
    out
}

/// The stderr of `deltafin <args> <model> <extra>` (`args` ending in `--model`), which must
/// fail within 30 seconds.
fn failed_stderr(args: &[&str], model: &Path, extra: &[&str]) -> String {
    let out = Command::new(bin())
        .args(args)
        .arg(model)
        .args(extra)
        .timeout(Duration::from_secs(30))
        .assert()
        .failure()
        .get_output()
        .clone();
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// A refusal at startup: one line, and the server never listened (`what` prefixes the failure
/// message).
fn assert_one_line_refusal(err: &str, what: &str) {
    assert_eq!(err.trim_end().lines().count(), 1, "{what}{err}");
    assert!(!err.contains("listening"), "{what}{err}");
}

#[test]
fn chat_streams_answers_reuses_the_cache_and_prints_stats() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path());
    let out = Command::new(bin())
        .args(["chat", "--max-tokens", "6", "--model"])
        .arg(&model)
        .write_stdin("Hello there\n/stats\nAnd again?\n/stats\n/reset\n/exit\n")
        .timeout(Duration::from_secs(60))
        .assert()
        .success()
        .get_output()
        .clone();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("--- deltafin chat: last answer ---").count(), 2, "{err}");
    assert!(err.contains("reused prompt tokens 0 of"), "{err}");
    // The second turn starts with the first turn's prompt: those tokens are reused.
    assert!(
        err.lines()
            .filter(|l| l.starts_with("reused prompt tokens"))
            .nth(1)
            .is_some_and(|l| !l.starts_with("reused prompt tokens 0 ")),
        "{err}"
    );
    assert!(err.contains("(new conversation)"), "{err}");
}

struct Server(Child);

/// `deltafin serve --port PORT --model MODEL` with its stderr piped; the server is killed when
/// the returned guard drops.
fn spawn_serve(model: &std::path::Path, port: u16) -> (Server, BufReader<std::process::ChildStderr>) {
    let child = StdCommand::new(bin())
        .args(["serve", "--port", &port.to_string(), "--model"])
        .arg(model)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(child);
    let stderr = BufReader::new(server.0.stderr.take().unwrap());
    (server, stderr)
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn serve_answers_on_loopback_and_reports_bad_flags() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path());
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let (server, mut stderr) = spawn_serve(&model, port);
    let mut banner = String::new();
    stderr.read_line(&mut banner).unwrap();
    assert!(banner.contains(&format!("127.0.0.1:{port}")), "{banner}");
    assert!(banner.contains("dsv3-a"), "{banner}");
    let t0 = Instant::now();
    let body = r#"{"model":"dsv3-a","messages":[{"role":"user","content":"Hi"}],"max_tokens":3}"#;
    let resp = loop {
        if let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)) {
            write!(
                s,
                "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
                body.len()
            )
            .unwrap();
            let mut r = String::new();
            s.read_to_string(&mut r).unwrap();
            break r;
        }
        assert!(t0.elapsed() < Duration::from_secs(30), "server did not start");
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(resp.starts_with("HTTP/1.1 200"), "{resp}");
    assert!(resp.contains("\"chat.completion\""), "{resp}");
    // A client that shuts down its sending side after the request (as `nc -N` does) gets the
    // answer too, after at most one interim 100 Continue (the default `--half-close probe`).
    let mut s = TcpStream::connect(("127.0.0.1", port)).unwrap();
    write!(
        s,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
    .unwrap();
    s.shutdown(std::net::Shutdown::Write).unwrap();
    let mut half = String::new();
    s.read_to_string(&mut half).unwrap();
    let fin = half.strip_prefix("HTTP/1.1 100 Continue\r\n\r\n").unwrap_or(&half);
    assert!(fin.starts_with("HTTP/1.1 200"), "{half}");
    assert!(fin.contains("\"chat.completion\""), "{half}");
    drop(server);

    // A port in use is a one-line error, not a panic.
    let busy = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let p = busy.local_addr().unwrap().port().to_string();
    let err = failed_stderr(&["serve", "--port", &p, "--model"], &model, &[]);
    assert!(err.contains("listening on 127.0.0.1"), "{err}");
}

/// Flag values that would start a server unable to work as asked are refused at startup with
/// one line, before the model loads or the port opens.
#[test]
fn serve_refuses_unusable_flags_at_startup() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path());
    let cases: [(&[&str], &str); 7] = [
        (&["--max-tokens", "0"], "--max-tokens must be at least 1"),
        (&["--max-connections", "0"], "--max-connections must be at least 1"),
        (&["--idle-timeout", "0"], "--idle-timeout must be at least 1 second"),
        (&["--body-timeout", "0"], "--body-timeout must be at least 1 second"),
        (&["--api-key", ""], "--api-key is empty"),
        (
            &["--api-key", " key "],
            "--api-key must not start or end with whitespace",
        ),
        (&["--model-id", ""], "--model-id is empty"),
    ];
    for (flags, want) in cases {
        let err = failed_stderr(&["serve", "--port", "0", "--model"], &model, flags);
        assert!(err.contains(want), "{flags:?}: {err}");
        assert_one_line_refusal(&err, &format!("{flags:?}: "));
    }
}

/// Turns a converted model into a streaming install whose records `missing(i)` are absent (the
/// manifest has a `stream` section and no checksum for them, and there is no presence
/// journal), as `pull --stream` leaves one before `warm`. Returns the number of records.
fn make_streaming(model: &Path, missing: impl Fn(usize) -> bool) -> usize {
    let path = model.join("manifest.json");
    let mut m: serde_json::Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    m["stream"] = serde_json::json!({"url": "http://127.0.0.1:9/none", "revision": "main",
        "index": "stream-index.json"});
    let records = m["experts"]["records"].as_array_mut().unwrap();
    for (i, r) in records.iter_mut().enumerate() {
        if missing(i) {
            r["xxh3"] = serde_json::json!("");
        }
    }
    let n = records.len();
    std::fs::write(&path, serde_json::to_vec_pretty(&m).unwrap()).unwrap();
    n
}

/// `serve` on a streaming install without network use: it says at startup how many expert
/// records are missing (requests needing them would fail), and refuses to start when none is
/// local (every request would fail).
#[test]
fn serve_warns_about_missing_records_of_a_streaming_install() {
    let tmp = tempfile::tempdir().unwrap();
    let model = converted(tmp.path());
    let total = make_streaming(&model, |i| i % 2 == 0);
    let missing = total.div_ceil(2);
    let (server, mut stderr) = spawn_serve(&model, 0);
    let mut before = Vec::new();
    loop {
        let mut line = String::new();
        assert!(stderr.read_line(&mut line).unwrap() > 0, "server exited: {before:?}");
        if line.contains("listening on") {
            break;
        }
        before.push(line);
    }
    drop(server);
    let warning: Vec<&String> = before.iter().filter(|l| l.contains("not local")).collect();
    assert_eq!(warning.len(), 1, "{before:?}");
    assert!(
        warning[0].starts_with(&format!("warning: {missing} of {total} expert records")),
        "{warning:?}"
    );
    assert!(warning[0].contains("--allow-network"), "{warning:?}");

    // No record at all: refused with one line.
    make_streaming(&model, |_| true);
    let err = failed_stderr(&["serve", "--port", "0", "--model"], &model, &[]);
    assert!(err.contains(&format!("none of the {total} expert records")), "{err}");
    assert!(err.contains("--allow-network"), "{err}");
    assert_one_line_refusal(&err, "");
    // `run` warns the same way, then fails naming the first record it needs.
    let err = failed_stderr(
        &["run", "--prompt-ids", "1,2", "--max-new-tokens", "2", "--model"],
        &model,
        &[],
    );
    assert!(
        err.contains(&format!("warning: {total} of {total} expert records")),
        "{err}"
    );
}

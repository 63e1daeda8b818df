//! What a new user meets on the command line (issue #19, items 15, 17 and 18): `pull` says what
//! it retries, takes a Hugging Face repository id and a token, every command takes its model
//! directory positionally or with `--model`, and `bench --memory-limit` works without the
//! source tree. HTTP here is a small recording server on 127.0.0.1 written with `std::net`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Arc, Mutex};

mod common;
use common::serve_connections;

fn bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_deltafin"))
}

fn deltafin() -> Command {
    let mut c = Command::new(bin());
    c.env("DELTAFIN_HTTP_BACKOFF_MS", "20")
        .env("DELTAFIN_HTTP_TIMEOUT_S", "10")
        .env("DELTAFIN_HTTP_RETRIES", "2")
        .env_remove("HF_TOKEN")
        .env_remove("HF_ENDPOINT")
        .env_remove("RUST_LOG");
    c
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

fn run(c: &mut Command) -> (Output, String) {
    let out = c.output().expect("running deltafin");
    let err = text(&out.stderr);
    assert!(!err.contains("panicked"), "{err}");
    (out, err)
}

/// `deltafin pull REPO DIR MODE --endpoint ENDPOINT`, which must fail: its stderr.
fn pull_refused(repo: &str, dir: &Path, mode: &str, endpoint: &str) -> String {
    let (out, err) = run(deltafin().args(["pull", repo, s(dir), mode, "--endpoint", endpoint]));
    assert!(!out.status.success(), "{err}");
    err
}

/// A request as the recording server saw it: the request line and the headers, lowercased names.
#[derive(Debug, Clone)]
struct Seen {
    line: String,
    headers: Vec<(String, String)>,
}

impl Seen {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers.iter().find(|(k, _)| k == name).map(|(_, v)| v.as_str())
    }
}

/// An HTTP server on 127.0.0.1 answering every request with `status` and an empty body,
/// recording what it was sent.
struct Recorder {
    port: u16,
    seen: Arc<Mutex<Vec<Seen>>>,
}

impl Recorder {
    fn start(status: &'static str) -> Recorder {
        Self::start_with(status, String::new())
    }

    /// Also sends the header line `extra` (e.g. `Location: …`) when not empty.
    fn start_with(status: &'static str, extra: String) -> Recorder {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let log = seen.clone();
        let port = serve_connections(move |c| {
            let _ = answer(c, status, &extra, &log);
        });
        Recorder { port, seen }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().unwrap().clone()
    }
}

fn answer(c: TcpStream, status: &str, extra: &str, log: &Mutex<Vec<Seen>>) -> std::io::Result<()> {
    let mut r = BufReader::new(c.try_clone()?);
    let mut line = String::new();
    r.read_line(&mut line)?;
    let mut headers = Vec::new();
    loop {
        let mut h = String::new();
        if r.read_line(&mut h)? == 0 || h.trim().is_empty() {
            break;
        }
        if let Some((k, v)) = h.split_once(':') {
            headers.push((k.trim().to_ascii_lowercase(), v.trim().to_string()));
        }
    }
    log.lock().unwrap().push(Seen {
        line: line.trim().to_string(),
        headers,
    });
    let mut c = c;
    let extra = if extra.is_empty() {
        String::new()
    } else {
        format!("{extra}\r\n")
    };
    c.write_all(format!("HTTP/1.1 {status}\r\n{extra}Content-Length: 0\r\nConnection: close\r\n\r\n").as_bytes())?;
    let _ = c.read(&mut [0u8; 1]);
    Ok(())
}

/// A port nothing listens on (connections are refused).
fn refused_port() -> u16 {
    TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port()
}

// ---------------------------------------------------------------------------------------------
// Item 15: retries are reported, not silent
// ---------------------------------------------------------------------------------------------

#[test]
fn pull_reports_each_retry_on_stderr() {
    let tmp = tempfile::tempdir().unwrap();
    // A refused connection: each retry is a warning line naming the URL, then one error line.
    let url = format!("http://127.0.0.1:{}/org/m", refused_port());
    let (out, err) = run(deltafin().args(["pull", &url, s(&tmp.path().join("a")), "--full"]));
    assert!(!out.status.success(), "{err}");
    let retries: Vec<&str> = err.lines().filter(|l| l.starts_with("warning: ")).collect();
    assert_eq!(retries.len(), 2, "{err}");
    assert!(
        retries[0].contains("/org/m/resolve/main/")
            && retries[0].contains("retrying in")
            && retries[0].contains("(1/2)"),
        "{err}"
    );
    let last = err.lines().last().unwrap_or_default();
    assert!(
        last.starts_with("error: ") && last.contains("gave up after 3 attempts"),
        "{err}"
    );

    // A server answering 503: the status is in each warning.
    let srv = Recorder::start("503 Service Unavailable");
    let (out, err) = run(deltafin().args([
        "pull",
        &format!("{}/org/m", srv.url()),
        s(&tmp.path().join("b")),
        "--stream",
    ]));
    assert!(!out.status.success(), "{err}");
    assert_eq!(err.matches("HTTP 503; retrying in").count(), 2, "{err}");
    assert_eq!(srv.seen().len(), 3);

    // RUST_LOG replaces the default level: errors only, so no warnings.
    let (_, err) = run(deltafin().env("RUST_LOG", "error").args([
        "pull",
        &format!("{}/org/m", srv.url()),
        s(&tmp.path().join("c")),
        "--stream",
    ]));
    assert!(!err.contains("retrying"), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
}

// ---------------------------------------------------------------------------------------------
// Item 17: Hugging Face repository ids, endpoints and tokens
// ---------------------------------------------------------------------------------------------

#[test]
fn pull_resolves_repository_ids_against_the_endpoint() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let hub = Recorder::start("404 Not Found");
    // --endpoint, with a revision after @.
    let err = pull_refused("some-org/Some.Model_1@v2.0", &t.join("a"), "--stream", &hub.url());
    assert!(err.contains("no config.json here"), "{err}");
    let seen = hub.seen();
    assert!(
        seen.iter()
            .all(|r| r.line.starts_with("GET /some-org/Some.Model_1/resolve/v2.0/"))
            && seen
                .iter()
                .any(|r| r.line == "GET /some-org/Some.Model_1/resolve/v2.0/config.json HTTP/1.1"),
        "{seen:?}"
    );
    assert!(seen.iter().all(|r| r.header("authorization").is_none()), "{seen:?}");

    // HF_ENDPOINT, --revision, and HF_TOKEN sent to the endpoint as a bearer token; the token
    // appears nowhere in the output, even at trace level.
    let token = "hf_Zq9sEcretT0ken";
    let (out, err) = run(deltafin()
        .env("HF_ENDPOINT", hub.url())
        .env("HF_TOKEN", token)
        .env("RUST_LOG", "trace")
        .args(["pull", "org/name", s(&t.join("b")), "--full", "--revision", "refs/pr/1"]));
    assert!(!out.status.success());
    assert!(
        !err.contains(token) && !text(&out.stdout).contains(token),
        "token leaked: {err}"
    );
    let last = hub.seen().last().cloned().unwrap();
    assert_eq!(last.line, "GET /org/name/resolve/refs%2Fpr%2F1/config.json HTTP/1.1");
    assert_eq!(last.header("authorization"), Some(format!("Bearer {token}").as_str()));

    // --token is sent to the source's host; HF_TOKEN is never sent to a host other than the
    // hub endpoint's.
    let other = Recorder::start("404 Not Found");
    run(deltafin().env("HF_ENDPOINT", hub.url()).env("HF_TOKEN", token).args([
        "pull",
        &format!("{}/org/name", other.url()),
        s(&t.join("c")),
        "--full",
    ]));
    assert!(other.seen()[0].header("authorization").is_none(), "{:?}", other.seen());
    run(deltafin().args([
        "pull",
        &format!("{}/org/name", other.url()),
        s(&t.join("d")),
        "--full",
        "--token",
        "tok2",
    ]));
    assert_eq!(
        other.seen().last().unwrap().header("authorization"),
        Some("Bearer tok2")
    );

    // A redirect to another host (the hub's CDN): followed without the token.
    let cdn = Recorder::start("404 Not Found");
    let redirecting = Recorder::start_with("302 Found", format!("Location: {}/cdn/file", cdn.url()));
    run(deltafin()
        .env("HF_ENDPOINT", redirecting.url())
        .env("HF_TOKEN", token)
        .args(["pull", "org/name", s(&t.join("r")), "--full"]));
    assert_eq!(
        redirecting.seen()[0].header("authorization"),
        Some(format!("Bearer {token}").as_str())
    );
    let at_cdn = cdn.seen();
    assert!(
        !at_cdn.is_empty() && at_cdn.iter().all(|r| r.line.starts_with("GET /cdn/file ")),
        "{at_cdn:?}"
    );
    assert!(at_cdn.iter().all(|r| r.header("authorization").is_none()), "{at_cdn:?}");

    // A gated repository without a token: the error says how to give one.
    let gated = Recorder::start("401 Unauthorized");
    let err = pull_refused("org/gated", &t.join("e"), "--full", &gated.url());
    assert!(
        err.contains("HTTP 401") && err.contains("HF_TOKEN") && err.contains("--token"),
        "{err}"
    );
    let (_, err) = run(deltafin().env("HF_TOKEN", token).env("HF_ENDPOINT", gated.url()).args([
        "pull",
        "org/gated",
        s(&t.join("e")),
        "--full",
    ]));
    assert!(err.contains("token was refused") && !err.contains(token), "{err}");

    // What is neither a URL nor a repository id, and flags that do not apply: one line each.
    let local = t.join("a-local-dir");
    std::fs::create_dir(&local).unwrap();
    for (args, needle) in [
        (vec!["pull", "not a repo", "x", "--full"], "org/name[@revision]"),
        (vec!["pull", s(&local), "x", "--full"], "deltafin convert"),
        (
            vec!["pull", "org/name@v1", "x", "--full", "--revision", "v2"],
            "--revision",
        ),
        (vec!["pull", "org/name", "x", "--full", "--flat"], "--flat"),
        (
            vec!["pull", "http://h/o/n", "x", "--full", "--endpoint", "http://h"],
            "--endpoint",
        ),
        (
            vec!["pull", "org/name", "x", "--full", "--endpoint", "ftp://h"],
            "--endpoint",
        ),
    ] {
        let (out, err) = run(deltafin().current_dir(t).args(&args));
        assert!(!out.status.success(), "{args:?}");
        assert_eq!(err.lines().count(), 1, "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{args:?}: {err}");
    }
    assert!(!t.join("x").exists());
}

// ---------------------------------------------------------------------------------------------
// Item 18: the model directory positionally or with --model, everywhere
// ---------------------------------------------------------------------------------------------

fn tiny(t: &Path) -> PathBuf {
    let m = t.join("tiny");
    let (out, err) = run(deltafin().args(["synth", "--preset", "tiny", "--out", s(&m)]));
    assert!(out.status.success(), "{err}");
    m
}

#[test]
fn every_command_takes_the_model_positionally_or_with_model() {
    let tmp = tempfile::tempdir().unwrap();
    let m = tiny(tmp.path());
    let m = s(&m);
    let gen = ["--prompt-ids", "5,17", "--max-new-tokens", "2", "--ram-budget", "0"];
    let want = run(deltafin().args(["run", "--model", m]).args(gen)).0;
    assert!(want.status.success());
    let got = run(deltafin().args(["run", m]).args(gen)).0;
    assert!(got.status.success(), "{}", text(&got.stderr));
    assert_eq!(want.stdout, got.stdout);
    for cmd in [vec!["info"], vec!["cache", "stats"], vec!["cache", "verify"]] {
        let a = run(deltafin().args(&cmd).arg(m)).0;
        let b = run(deltafin().args(&cmd).args(["--model", m])).0;
        assert!(a.status.success() && b.status.success(), "{cmd:?}: {}", text(&a.stderr));
        assert_eq!(a.stdout, b.stdout, "{cmd:?}");
    }
    // chat and serve read it positionally too (their own flag checks run after parsing).
    let (out, err) = run(deltafin().args(["chat", m, "--max-tokens", "0"]));
    assert!(
        !out.status.success() && err.contains("--max-tokens must be at least 1"),
        "{err}"
    );
    let (out, err) = run(deltafin().args(["serve", m, "--max-tokens", "0"]));
    assert!(
        !out.status.success() && err.contains("--max-tokens must be at least 1"),
        "{err}"
    );
    // Both, or neither: a usage error naming the argument.
    for cmd in ["run", "chat", "serve", "info", "warm", "replay", "bench"] {
        let (out, err) = run(deltafin().args([cmd, m, "--model", m]));
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(err.contains("cannot be used with"), "{cmd}: {err}");
        let (out, err) = run(deltafin().arg(cmd));
        assert_eq!(out.status.code(), Some(2), "{cmd}: {err}");
        assert!(err.contains("MODEL_DIR"), "{cmd}: {err}");
    }
}

#[test]
fn bench_memory_limit_needs_no_source_tree() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let m = tiny(t);
    // An installed binary: a copy far from the source tree, run from an empty directory.
    let installed = t.join("bin/deltafin");
    std::fs::create_dir_all(t.join("bin")).unwrap();
    std::fs::copy(bin(), &installed).unwrap();
    let cwd = t.join("elsewhere");
    std::fs::create_dir(&cwd).unwrap();
    let mut cmd = Command::new(&installed);
    cmd.current_dir(&cwd)
        .args([
            "bench",
            s(&m),
            "--memory-limit",
            "1G",
            "--runs",
            "1",
            "--new-tokens",
            "3",
        ])
        .args(["--prompt-ids", "5,17", "--work-dir", s(&t.join("work"))]);
    // A test thread that forks while the copy's write descriptor is open lends it to its child
    // until that child execs: executing the new file then fails with ETXTBSY for a moment.
    let out = (0..50)
        .find_map(|_| match cmd.output() {
            Err(e) if e.kind() == std::io::ErrorKind::ExecutableFileBusy => {
                std::thread::sleep(std::time::Duration::from_millis(20));
                None
            }
            other => Some(other),
        })
        .expect("the copied binary stayed busy for a second")
        .unwrap();
    let err = text(&out.stderr);
    assert!(!err.contains("not found"), "{err}");
    // The shipped script ran: it either did its job or said why it could not (not root, no
    // cgroup memory controller here).
    assert!(out.status.success() || err.contains("with-memory-limit"), "{err}");
    let script = std::fs::read_to_string(t.join("work/with-memory-limit.sh")).unwrap();
    assert!(script.contains("cgroup"), "{script}");
}

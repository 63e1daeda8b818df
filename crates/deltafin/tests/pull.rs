//! `deltafin pull`, on-demand expert fetching, `warm` and `cache` against a real HTTP server: nginx
//! on 127.0.0.1 (CI installs it; `.ci/run`), serving the reference fixtures in the Hugging Face
//! layout (`<repo>/resolve/main/<file>`, with the hub's `X-Linked-Etag` sha256 on weight files).
//! Faults (500s, a flipped byte, a server ignoring Range, a slow link to kill a transfer in) come
//! from a small proxy in front of nginx written here with `std::net`; nginx serves every byte.
//!
//! Without nginx a test prints `SKIPPED <test>: <reason>` past the test harness's output
//! capture (so it shows in `cargo test`'s output) and returns; with the environment variable
//! `CI` set it fails instead, since CI (`.ci/run`) installs nginx.

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

mod common;
use common::serve_connections;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/deepseek_v3")
        .join(case)
}

/// Says a test is skipped and why, on the real stderr (libtest captures only `eprintln!`), or
/// fails it when `CI` is set and `required_in_ci`.
fn skip(reason: &str, required_in_ci: bool) {
    if required_in_ci && std::env::var_os("CI").is_some() {
        panic!("{reason}, but CI is set: CI must run this test (.ci/run installs nginx)");
    }
    let name = std::thread::current().name().unwrap_or("?").to_string();
    let _ = writeln!(std::io::stderr(), "SKIPPED {name}: {reason}");
}

fn nginx_binary() -> Option<PathBuf> {
    ["/usr/sbin/nginx", "/usr/local/sbin/nginx", "/usr/bin/nginx"]
        .iter()
        .map(PathBuf::from)
        .find(|p| p.is_file())
}

fn sha256_hex(path: &Path) -> String {
    let out = Command::new("sha256sum").arg(path).output().expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap_or("")
        .to_string()
}

/// nginx serving `root` on a free loopback port, stopped on drop.
struct Nginx {
    child: Child,
    port: u16,
    _dir: tempfile::TempDir,
}

impl Drop for Nginx {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Nginx {
    /// Serves the fixture `cases` at `/<case>/resolve/main/<file>`, with `X-Linked-Etag`
    /// (quoted sha256) on `.safetensors` files as the Hugging Face hub sends it.
    fn start(cases: &[&str]) -> Option<Nginx> {
        Self::start_with(cases, &[])
    }

    /// Also serves the files of each `(name, dir)` at `/<name>/<file>` (a flat source).
    fn start_with(cases: &[&str], flat: &[(&str, &Path)]) -> Option<Nginx> {
        Self::start_conf(cases, flat, "", "")
    }

    /// As [`Nginx::start_with`], the cases at `/<prefix><case>/resolve/main/<file>`, with
    /// `server_extra` added to the server block (e.g. an authorization check).
    fn start_conf(cases: &[&str], flat: &[(&str, &Path)], prefix: &str, server_extra: &str) -> Option<Nginx> {
        let bin = match nginx_binary() {
            Some(b) => b,
            None => {
                skip(
                    "nginx is not installed (.ci/run installs it: apt-get install nginx-light)",
                    true,
                );
                return None;
            }
        };
        let dir = tempfile::tempdir().unwrap();
        let srv = dir.path().join("srv");
        let mut map = String::new();
        for case in cases {
            let served = format!("{prefix}{case}");
            let to = srv.join(&served).join("resolve/main");
            std::fs::create_dir_all(&to).unwrap();
            for e in std::fs::read_dir(fixture(case)).unwrap().flatten() {
                let name = e.file_name().to_string_lossy().into_owned();
                std::fs::copy(e.path(), to.join(&name)).unwrap();
                if name.ends_with(".safetensors") {
                    map.push_str(&format!(
                        "    /{served}/resolve/main/{name} \"\\\"{}\\\"\";\n",
                        sha256_hex(&e.path())
                    ));
                }
            }
        }
        for (name, from) in flat {
            std::fs::create_dir_all(srv.join(name)).unwrap();
            for e in std::fs::read_dir(from).unwrap().flatten() {
                std::fs::copy(e.path(), srv.join(name).join(e.file_name())).unwrap();
            }
        }
        for _ in 0..5 {
            let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
            let d = dir.path().display();
            let conf = format!(
                "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\n\
                 events {{ worker_connections 256; }}\n\
                 http {{\n  access_log {d}/access.log;\n  client_body_temp_path {d}/t_body;\n  proxy_temp_path {d}/t_proxy;\n\
                   fastcgi_temp_path {d}/t_fcgi;\n  uwsgi_temp_path {d}/t_uwsgi;\n  scgi_temp_path {d}/t_scgi;\n\
                   default_type application/octet-stream;\n  keepalive_timeout 5;\n  map_hash_bucket_size 256;\n\
                   map $uri $linked_etag {{\n    default \"\";\n{map}  }}\n\
                   server {{\n    listen 127.0.0.1:{port};\n    root {srv};\n    add_header X-Linked-Etag $linked_etag always;\n{server_extra}\n  }}\n}}\n",
                srv = srv.display()
            );
            std::fs::write(dir.path().join("nginx.conf"), conf).unwrap();
            let mut child = Command::new(&bin)
                .arg("-p")
                .arg(dir.path())
                .arg("-e")
                .arg(dir.path().join("error.log"))
                .arg("-c")
                .arg(dir.path().join("nginx.conf"))
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn nginx");
            let t0 = Instant::now();
            while t0.elapsed() < Duration::from_secs(5) {
                if let Ok(Some(_)) = child.try_wait() {
                    break; // port taken or bad config: try another port
                }
                if TcpStream::connect(("127.0.0.1", port)).is_ok() {
                    return Some(Nginx { child, port, _dir: dir });
                }
                std::thread::sleep(Duration::from_millis(20));
            }
            let _ = child.kill();
            let _ = child.wait();
        }
        let log = std::fs::read_to_string(dir.path().join("error.log")).unwrap_or_default();
        panic!("nginx did not start: {log}");
    }

    fn url(&self, case: &str) -> String {
        format!("http://127.0.0.1:{}/{case}", self.port)
    }
}

/// What the proxy does to the next requests.
#[derive(Default)]
struct Faults {
    /// Answer this many requests with 500 without forwarding them.
    fail_next: usize,
    /// Remove `Range` and `If-Range` (the server then answers 200 with the whole file).
    strip_range: bool,
    /// Flip one byte in the body of the next response with at least this many body bytes.
    flip_next_over: Option<usize>,
    /// Send responses at about this many bytes per second.
    throttle: Option<usize>,
    /// `GET <path> [<range>]` of every request.
    log: Vec<String>,
}

/// A fault-injecting HTTP/1.1 proxy in front of nginx (one request per connection).
struct Proxy {
    port: u16,
    faults: Arc<Mutex<Faults>>,
}

impl Proxy {
    fn start(upstream: u16) -> Proxy {
        let faults = Arc::new(Mutex::new(Faults::default()));
        let f = faults.clone();
        let port = serve_connections(move |c| {
            let _ = serve(c, upstream, &f);
        });
        Proxy { port, faults }
    }

    fn url(&self, case: &str) -> String {
        format!("http://127.0.0.1:{}/{case}", self.port)
    }

    fn with<T>(&self, f: impl FnOnce(&mut Faults) -> T) -> T {
        f(&mut self.faults.lock().unwrap())
    }
}

fn serve(mut c: TcpStream, upstream: u16, faults: &Mutex<Faults>) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut b = [0u8; 1];
    while !head.ends_with(b"\r\n\r\n") {
        if c.read(&mut b)? == 0 {
            return Ok(());
        }
        head.push(b[0]);
    }
    let text = String::from_utf8_lossy(&head).into_owned();
    let mut lines: Vec<&str> = text.split("\r\n").filter(|l| !l.is_empty()).collect();
    let path = lines[0].split_whitespace().nth(1).unwrap_or("").to_string();
    let range = lines
        .iter()
        .find(|l| l.to_ascii_lowercase().starts_with("range:"))
        .map(|l| l[6..].trim().to_string())
        .unwrap_or_default();
    let (fail, strip, throttle) = {
        let mut f = faults.lock().unwrap();
        f.log.push(format!("GET {path} {range}"));
        let fail = f.fail_next > 0;
        if fail {
            f.fail_next -= 1;
        }
        (fail, f.strip_range, f.throttle)
    };
    if fail {
        c.write_all(b"HTTP/1.1 500 Internal Server Error\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")?;
        return Ok(());
    }
    lines.retain(|l| {
        let k = l.to_ascii_lowercase();
        !k.starts_with("connection:") && !(strip && (k.starts_with("range:") || k.starts_with("if-range:")))
    });
    let mut req = lines.join("\r\n");
    req.push_str("\r\nConnection: close\r\n\r\n");
    let mut up = TcpStream::connect(("127.0.0.1", upstream))?;
    up.write_all(req.as_bytes())?;
    let mut resp = Vec::new();
    up.read_to_end(&mut resp)?;
    let body_at = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .map_or(resp.len(), |p| p + 4);
    {
        let mut f = faults.lock().unwrap();
        if let Some(min) = f.flip_next_over {
            if resp.len() - body_at >= min {
                let i = body_at + (resp.len() - body_at) / 2;
                resp[i] ^= 0x10;
                f.flip_next_over = None;
            }
        }
    }
    match throttle {
        None => c.write_all(&resp)?,
        Some(bps) => {
            let chunk = (bps / 20).max(1);
            for part in resp.chunks(chunk) {
                c.write_all(part)?;
                std::thread::sleep(Duration::from_millis(50));
            }
        }
    }
    Ok(())
}

fn deltafin() -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_deltafin"));
    c.env("DELTAFIN_HTTP_BACKOFF_MS", "20")
        .env("DELTAFIN_HTTP_TIMEOUT_S", "10");
    c
}

fn run_ok(args: &[&str]) -> Output {
    let out = deltafin().args(args).output().unwrap();
    assert!(out.status.success(), "deltafin {args:?} failed:\n{}", stderr_of(&out));
    out
}

/// `deltafin args`, whatever its exit status.
fn run_any(args: &[&str]) -> Output {
    deltafin().args(args).output().unwrap()
}

fn stdout_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn stderr_of(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// The number that follows the first `label` in `text` (up to the next white space).
fn number_after(text: &str, label: &str) -> Option<usize> {
    text.split(label)
        .nth(1)
        .and_then(|x| x.split_whitespace().next())
        .and_then(|x| x.parse().ok())
}

/// The lines of `stderr` that start with `error:`.
fn error_lines(stderr: &str) -> Vec<&str> {
    stderr.lines().filter(|l| l.starts_with("error:")).collect()
}

/// The one `error:` line of a command that failed (nonzero exit code, no panic), and its whole
/// stderr; `what` starts the assertion messages.
fn the_error_line(out: &Output, what: &str) -> (String, String) {
    let err = stderr_of(out);
    assert!(
        out.status.code().is_some_and(|c| c != 0) && !err.contains("panicked"),
        "{what}{err}"
    );
    let lines = error_lines(&err);
    assert_eq!(lines.len(), 1, "{what}{err}");
    (lines[0].to_string(), err)
}

/// Fetches a record of the streaming install `model` on demand (a run's logits into `json`)
/// while `px` flips a byte of the next body over 10,000 bytes: the record arrives corrupted.
fn fetch_a_corrupted_record(px: &Proxy, model: &Path, json: &Path) {
    px.with(|f| f.flip_next_over = Some(10_000));
    logits(model, &["--allow-network"], json);
    assert!(px.with(|f| f.flip_next_over.is_none()), "no body was corrupted");
}

/// `cache verify` of `model` succeeds and says `ok: `.
fn assert_cache_verifies(model: &Path) {
    let v = stdout_of(&run_ok(&["cache", "verify", s(model)]));
    assert!(v.contains("ok: "), "{v}");
}

/// `cache verify` of a streaming install succeeds, and `cache stats` says some records are
/// present but not all 48.
fn assert_verified_and_partly_cached(model: &Path) {
    assert_cache_verifies(model);
    let stats = stdout_of(&run_ok(&["cache", "stats", s(model)]));
    assert!(
        !stats.contains("total: 0 of") && !stats.contains("total: 48 of"),
        "{stats}"
    );
}

/// Flips 4,096 bytes in the middle of the first shard that `ng` serves for `dsv3_b` and keeps
/// its size and modification time, so that nginx sends the same ETag; returns the shard's name.
fn replace_served_shard_under_the_same_etag(ng: &Nginx) -> &'static str {
    let shard = "model-00001-of-00002.safetensors";
    let served = ng._dir.path().join("srv/dsv3_b/resolve/main").join(shard);
    let mtime = std::fs::metadata(&served).unwrap().modified().unwrap();
    let mut b = read(&served);
    let n = b.len();
    for x in &mut b[n / 2..n / 2 + 4096] {
        *x ^= 0x10;
    }
    std::fs::write(&served, &b).unwrap();
    // Same size and modification time: nginx sends the same ETag.
    std::fs::File::options()
        .write(true)
        .open(&served)
        .unwrap()
        .set_modified(mtime)
        .unwrap();
    shard
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

/// Expert records and backbone of two model directories are byte-identical.
fn assert_same_model(a: &Path, b: &Path) {
    assert!(
        read(&a.join("backbone.bin")) == read(&b.join("backbone.bin")),
        "backbone.bin differs"
    );
    assert!(
        read(&a.join("experts.pack")) == read(&b.join("experts.pack")),
        "experts.pack differs"
    );
    let m = |p: &Path| {
        let v: serde_json::Value = serde_json::from_slice(&read(&p.join("manifest.json"))).unwrap();
        (v["experts"].clone(), v["backbone"].clone())
    };
    assert_eq!(m(a), m(b), "manifests differ");
}

fn local_convert(case: &str, out: &Path) {
    run_ok(&["convert", s(&fixture(case)), s(out)]);
}

/// `deltafin run` of a fixed prompt on `model` (the further flags `extra`), which must succeed,
/// its per-step logits written to `json`: the bytes of `json`.
fn logits(model: &Path, extra: &[&str], json: &Path) -> Vec<u8> {
    logits_and_stderr(model, extra, json).0
}

/// [`logits`], and the run's stderr.
fn logits_and_stderr(model: &Path, extra: &[&str], json: &Path) -> (Vec<u8>, String) {
    let mut args = vec![
        "run",
        "--model",
        s(model),
        "--prompt-ids",
        "5,17,42,7,3",
        "--max-new-tokens",
        "6",
        "--ignore-eos",
        "--ram-budget",
        "0",
        "--logits-out",
        s(json),
    ];
    args.extend_from_slice(extra);
    let out = run_ok(&args);
    (read(json), stderr_of(&out))
}

#[test]
fn full_and_streaming_installs_match_a_local_convert() {
    let Some(ng) = Nginx::start(&["dsv3_b"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    local_convert("dsv3_b", &t.join("ref"));

    // Full: downloaded (two shards + index, sha256-verified), converted.
    let out = run_ok(&["pull", &ng.url("dsv3_b"), s(&t.join("full")), "--full"]);
    assert!(stderr_of(&out).contains("pulled (full)"));
    assert_same_model(&t.join("ref"), &t.join("full"));
    assert!(!t.join(".full.download").exists(), "download directory left behind");

    // Streaming: backbone identical, expert pack sparse and empty.
    run_ok(&["pull", &ng.url("dsv3_b"), s(&t.join("st")), "--stream"]);
    assert!(read(&t.join("ref/backbone.bin")) == read(&t.join("st/backbone.bin")));
    assert_eq!(
        std::fs::metadata(t.join("ref/experts.pack")).unwrap().len(),
        std::fs::metadata(t.join("st/experts.pack")).unwrap().len()
    );
    assert!(!t.join(".st.stream-src").exists());
    let stats = stdout_of(&run_ok(&["cache", "stats", s(&t.join("st"))]));
    assert!(
        stats.contains("streaming install") && stats.contains("total: 0 of 48 records"),
        "{stats}"
    );

    // Without network permission: a clear error naming the expert and the fix.
    let out = run_any(&[
        "run",
        "--model",
        s(&t.join("st")),
        "--prompt-ids",
        "5,17",
        "--max-new-tokens",
        "1",
    ]);
    let err = stderr_of(&out);
    assert!(!out.status.success());
    assert!(
        err.contains("layer ")
            && err.contains("expert ")
            && err.contains("deltafin warm")
            && err.contains("--allow-network"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    // With it: experts fetched on demand; ids and logits identical to the full install.
    let want = logits(&t.join("full"), &[], &t.join("full.json"));
    let (got, err) = logits_and_stderr(&t.join("st"), &["--allow-network"], &t.join("st.json"));
    assert!(err.contains("expert records on demand"), "{err}");
    assert!(want == got, "streaming run differs from the full install");
    // A second run needs no network: the fetched records are local now.
    assert!(want == logits(&t.join("st"), &[], &t.join("st2.json")));

    assert_verified_and_partly_cached(&t.join("st"));

    // Upgrade to full: keeps what is cached, fetches the rest, ends identical to a full convert.
    let out = run_ok(&["pull", &ng.url("dsv3_b"), s(&t.join("st")), "--full"]);
    let err = stderr_of(&out);
    assert!(
        err.contains("pulled (upgrade)") && err.contains("already cached and kept"),
        "{err}"
    );
    assert!(!err.contains(" 0 already cached"), "{err}");
    assert_same_model(&t.join("ref"), &t.join("st"));
    assert!(!t.join("st/experts.present").exists() && !t.join("st/stream-index.json").exists());
    let v: serde_json::Value = serde_json::from_slice(&read(&t.join("st/manifest.json"))).unwrap();
    assert!(v.get("stream").is_none());
}

#[test]
fn retries_500s_refetches_a_corrupted_body_and_names_a_server_ignoring_range() {
    behind_proxy("dsv3_a", |_, px, t| {
        local_convert("dsv3_a", &t.join("ref"));

        // 500s, then the server recovers.
        px.with(|f| f.fail_next = 3);
        let out = run_ok(&["pull", &px.url("dsv3_a"), s(&t.join("a")), "--full"]);
        let err = stderr_of(&out);
        assert!(err.contains("3 retries"), "{err}");
        assert_same_model(&t.join("ref"), &t.join("a"));

        // A flipped byte in the weights: sha256 (X-Linked-Etag) catches it, the file is fetched again.
        px.with(|f| {
            f.flip_next_over = Some(100_000);
            f.log.clear();
        });
        run_ok(&["pull", &px.url("dsv3_a"), s(&t.join("b")), "--full"]);
        assert_same_model(&t.join("ref"), &t.join("b"));
        let gets = px.with(|f| f.log.iter().filter(|l| l.contains("model.safetensors ")).count());
        assert_eq!(
            gets,
            2,
            "the corrupted download must be fetched again: {:?}",
            px.with(|f| f.log.clone())
        );

        // A server that ignores Range: a streaming install says so and leaves no model behind.
        px.with(|f| f.strip_range = true);
        let out = run_any(&["pull", &px.url("dsv3_a"), s(&t.join("c")), "--stream"]);
        let err = stderr_of(&out);
        assert!(!out.status.success());
        assert!(
            err.contains("ignored the Range request") && err.contains("--full"),
            "{err}"
        );
        assert!(!t.join("c").exists());
        // What it fetched stays for a resume; the error says where, and `cache gc` removes it
        // although no model directory exists.
        let left = t.join(".c.stream-src");
        assert!(
            left.exists() && err.contains(".c.stream-src") && err.contains("cache gc"),
            "{err}"
        );
        let out = run_ok(&["cache", "gc", s(&t.join("c"))]);
        assert!(stdout_of(&out).contains("removed"));
        assert!(!left.exists());
        // A source that is not there: nothing fetched, nothing left behind to resume.
        px.with(|f| f.strip_range = false);
        let out = run_any(&["pull", &px.url("no-such-repo"), s(&t.join("e")), "--stream"]);
        let err = stderr_of(&out);
        assert!(!out.status.success() && !err.contains("resumes"), "{err}");
        assert!(!t.join("e").exists() && !t.join(".e.stream-src").exists(), "{err}");
        // A full install does not need Range.
        run_ok(&["pull", &px.url("dsv3_a"), s(&t.join("d")), "--full"]);
        assert_same_model(&t.join("ref"), &t.join("d"));
    });
}

/// Runs `test(ng, px, t)` with nginx `ng` serving fixture `case`, the fault proxy `px` in front
/// of it, and a temporary directory `t`; without nginx the test is skipped ([`Nginx::start`]).
fn behind_proxy(case: &str, test: impl FnOnce(&Nginx, &Proxy, &Path)) {
    let Some(ng) = Nginx::start(&[case]) else { return };
    let px = Proxy::start(ng.port);
    let tmp = tempfile::tempdir().unwrap();
    test(&ng, &px, tmp.path());
}

/// Runs `test(px, t)` with a `synth --preset tiny` model in `t/src` (`t` a temporary
/// directory), served flat at `/mirror/<file>` by nginx with the fault proxy `px` in front;
/// without nginx the test is skipped ([`Nginx::start`]).
fn behind_mirror_proxy(test: impl FnOnce(&Proxy, &Path)) {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    run_ok(&["synth", "--preset", "tiny", "--out", s(&t.join("src"))]);
    let Some(ng) = Nginx::start_with(&[], &[("mirror", &t.join("src"))]) else {
        return;
    };
    let px = Proxy::start(ng.port);
    test(&px, t);
}

fn wait_for(what: &str, limit: Duration, mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < limit, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn a_killed_download_resumes_with_range() {
    behind_proxy("dsv3_a", |_, px, t| {
        local_convert("dsv3_a", &t.join("ref"));
        let size = std::fs::metadata(fixture("dsv3_a").join("model.safetensors"))
            .unwrap()
            .len();

        px.with(|f| f.throttle = Some(200_000));
        let mut child = deltafin()
            .args(["pull", &px.url("dsv3_a"), s(&t.join("m")), "--full"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let part = t.join(".m.download/model.safetensors.part");
        wait_for("a partial download", Duration::from_secs(60), || {
            std::fs::metadata(&part).map(|m| m.len() > 100_000).unwrap_or(false)
        });
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let have = std::fs::metadata(&part).unwrap().len();
        assert!(have < size, "killed too late");

        px.with(|f| {
            f.throttle = None;
            f.log.clear();
        });
        run_ok(&["pull", &px.url("dsv3_a"), s(&t.join("m")), "--full"]);
        assert_same_model(&t.join("ref"), &t.join("m"));
        let log = px.with(|f| f.log.clone());
        let resumed = log
            .iter()
            .find(|l| l.contains("model.safetensors "))
            .cloned()
            .unwrap_or_default();
        let from: u64 = resumed
            .split("bytes=")
            .nth(1)
            .and_then(|r| r.trim_end_matches('-').parse().ok())
            .unwrap_or(0);
        assert!(
            from > 0 && from <= have,
            "expected a resumed Range request, got {log:?}"
        );
    });
}

fn journal_entries(model: &Path) -> u64 {
    std::fs::metadata(model.join("experts.present"))
        .map(|m| m.len().saturating_sub(16) / 40)
        .unwrap_or(0)
}

#[test]
fn warm_killed_then_verified_and_resumed() {
    behind_proxy("dsv3_b", |_, px, t| {
        local_convert("dsv3_b", &t.join("ref"));
        let m = t.join("m");
        run_ok(&["pull", &px.url("dsv3_b"), s(&m), "--stream"]);

        // Warm without permission: refused, nothing fetched.
        let out = run_any(&["warm", s(&m)]);
        assert!(!out.status.success());
        assert!(stderr_of(&out).contains("--allow-network"));

        // Slow link, killed mid-way.
        px.with(|f| f.throttle = Some(40_000));
        let mut child = deltafin()
            .args(["warm", s(&m), "--allow-network", "--concurrency", "1"])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        wait_for("some warmed records", Duration::from_secs(60), || {
            journal_entries(&m) >= 3
        });
        child.kill().unwrap();
        child.wait().unwrap();
        assert_verified_and_partly_cached(&m);

        // Resume: everything present, byte-identical to a full convert; gc finds nothing to fix.
        px.with(|f| f.throttle = None);
        let out = run_ok(&["warm", s(&m), "--allow-network"]);
        assert!(stderr_of(&out).contains("48 of 48 records present"));
        run_ok(&["cache", "verify", s(&m)]);
        let gc = stdout_of(&run_ok(&["cache", "gc", s(&m)]));
        assert!(gc.contains("0 incomplete records freed"), "{gc}");
        assert!(read(&t.join("ref/experts.pack")) == read(&m.join("experts.pack")));
    });
}

struct Mount(PathBuf);
impl Drop for Mount {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.0).status();
    }
}

fn disk_usage(dir: &Path) -> u64 {
    use std::os::unix::fs::MetadataExt;
    std::fs::read_dir(dir)
        .unwrap()
        .flatten()
        .map(|e| e.metadata().unwrap().blocks() * 512)
        .sum()
}

#[test]
fn a_full_disk_during_warm_leaves_a_consistent_cache() {
    let Some(ng) = Nginx::start(&["dsv3_b"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    run_ok(&["pull", &ng.url("dsv3_b"), s(&t.join("st")), "--stream"]);
    // A file system holding the streaming install and about two more records.
    let mnt = t.join("tiny");
    std::fs::create_dir(&mnt).unwrap();
    let size = disk_usage(&t.join("st")) + 4 * 4096 + 8192;
    let ok = Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
        .arg(&mnt)
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !ok {
        skip("cannot mount a tmpfs here (needs root)", false);
        return;
    }
    let _guard = Mount(mnt.clone());
    let m = mnt.join("m");
    let cp = Command::new("cp")
        .args(["-a", "--sparse=always"])
        .arg(t.join("st"))
        .arg(&m)
        .status()
        .unwrap();
    assert!(cp.success());
    let out = run_any(&["warm", s(&m), "--allow-network", "--concurrency", "1"]);
    let err = stderr_of(&out);
    assert!(!out.status.success(), "warm onto a full disk must fail: {err}");
    assert!(err.contains("No space left on device"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
    assert_cache_verifies(&m);
    let stats = stdout_of(&run_ok(&["cache", "stats", s(&m)]));
    assert!(!stats.contains("total: 48 of"), "{stats}");
    // gc frees the blocks of the record that did not fit.
    run_ok(&["cache", "gc", s(&m)]);
    run_ok(&["cache", "verify", s(&m)]);
}

#[test]
fn a_mirror_of_a_full_install_streams_checksummed_records() {
    behind_mirror_proxy(|px, t| {
        let st = t.join("st");
        run_ok(&["pull", &px.url("mirror"), s(&st), "--stream", "--flat"]);
        assert!(read(&t.join("src/backbone.bin")) == read(&st.join("backbone.bin")));

        // Two 500s, then one record body corrupted in transit: retried, then caught by its checksum
        // and fetched again.
        px.with(|f| {
            f.fail_next = 2;
            f.flip_next_over = Some(13_000);
            f.log.clear();
        });
        let want = logits(&t.join("src"), &[], &t.join("a.json"));
        assert!(want == logits(&st, &["--allow-network"], &t.join("b.json")));
        let gets = px.with(|f| f.log.iter().filter(|l| l.contains("experts.pack")).count());
        let present = deltafin()
            .args(["cache", "stats", s(&st)])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap();
        let n = number_after(&present, "total: ").unwrap_or(0);
        assert!(n > 0 && gets == n + 3, "{n} records, {gets} range requests: {present}");
        run_ok(&["cache", "verify", s(&st)]);

        // Full install from the mirror, and upgrading the streaming one: identical to the source.
        run_ok(&["pull", &px.url("mirror"), s(&t.join("full")), "--full", "--flat"]);
        assert_same_model(&t.join("src"), &t.join("full"));
        run_ok(&["pull", &px.url("mirror"), s(&st), "--full", "--flat"]);
        assert_same_model(&t.join("src"), &st);
        // A mirror serves converted files: convert options are refused, not ignored.
        for mode in ["--stream", "--full"] {
            let out = run_any(&[
                "pull",
                &px.url("mirror"),
                s(&t.join("bf")),
                mode,
                "--flat",
                "--backbone",
                "bf16",
            ]);
            let err = stderr_of(&out);
            assert!(
                !out.status.success() && err.contains("mirror") && err.contains("--backbone"),
                "{err}"
            );
            assert!(!t.join("bf").exists());
        }
    });
}

#[test]
fn a_killed_streaming_pull_resumes_the_ranges_it_has() {
    behind_proxy("dsv3_b", |_, px, t| {
        let shard_ranges = |px: &Proxy| px.with(|f| f.log.iter().filter(|l| l.contains(".safetensors bytes=")).count());
        run_ok(&["pull", &px.url("dsv3_b"), s(&t.join("fresh")), "--stream"]);
        let fresh = shard_ranges(px);
        assert!(
            fresh >= 8,
            "the test needs several backbone ranges to interrupt, got {fresh}"
        );

        px.with(|f| {
            f.throttle = Some(60_000);
            f.log.clear();
        });
        let mut child = deltafin()
            .args([
                "pull",
                &px.url("dsv3_b"),
                s(&t.join("m")),
                "--stream",
                "--concurrency",
                "1",
            ])
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let done = t.join(".m.stream-src/ranges.done");
        wait_for("some backbone ranges", Duration::from_secs(60), || {
            std::fs::read_to_string(&done)
                .map(|s| s.lines().count() >= 2)
                .unwrap_or(false)
        });
        child.kill().unwrap();
        child.wait().unwrap();
        assert!(
            !t.join("m").exists(),
            "an interrupted pull must not leave a model directory"
        );
        let had = std::fs::read_to_string(&done).unwrap().lines().count();

        px.with(|f| {
            f.throttle = None;
            f.log.clear();
        });
        run_ok(&["pull", &px.url("dsv3_b"), s(&t.join("m")), "--stream"]);
        let again = shard_ranges(px);
        assert!(
            again + had <= fresh,
            "resumed pull made {again} range requests, a fresh one {fresh}, {had} were done"
        );
        assert!(read(&t.join("fresh/backbone.bin")) == read(&t.join("m/backbone.bin")));
        assert!(read(&t.join("fresh/manifest.json")) == read(&t.join("m/manifest.json")));
    });
}

/// Kimi K3 as shipped: compressed-tensors MXFP4 experts stream bit for bit (codes and E8M0 scales
/// fetched by range, copied into the records), so a streaming install runs exactly like a full
/// one and upgrades to the same files as a local convert.
#[test]
fn a_k3_checkpoint_with_mxfp4_experts_streams_bit_for_bit() {
    let k3 = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/kimi_k3/k3_a");
    let Some(ng) = Nginx::start_with(&[], &[("k3_a", &k3)]) else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    run_ok(&["convert", s(&k3), s(&t.join("ref"))]);
    run_ok(&["pull", &ng.url("k3_a"), s(&t.join("st")), "--stream", "--flat"]);
    let want = logits(&t.join("ref"), &[], &t.join("ref.json"));
    let got = logits(&t.join("st"), &["--allow-network"], &t.join("st.json"));
    assert!(want == got, "streaming K3 run differs from the local convert");
    assert_cache_verifies(&t.join("st"));
    run_ok(&["pull", &ng.url("k3_a"), s(&t.join("st")), "--full", "--flat"]);
    assert_same_model(&t.join("ref"), &t.join("st"));
}

/// Every file under `dir` (recursively) that contains `needle`.
fn files_containing(dir: &Path, needle: &[u8]) -> Vec<PathBuf> {
    let mut found = Vec::new();
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            found.extend(files_containing(&p, needle));
        } else if std::fs::read(&p).is_ok_and(|b| b.windows(needle.len()).any(|w| w == needle)) {
            found.push(p);
        }
    }
    found
}

/// A gated repository by Hugging Face repository id against a loopback endpoint that refuses
/// requests without the right `Authorization: Bearer` header: refused without a token, with the
/// fix named; installed with `HF_TOKEN` (full) or `--token` (streaming) identically to a local
/// convert; the streaming install's on-demand fetches use `HF_TOKEN` too; the token is never
/// printed (even at trace level) nor written to any file.
#[test]
fn a_gated_repository_installs_by_repository_id_with_a_token() {
    let token = "hf_gAt3dT0kenXYZ";
    let check = format!("    if ($http_authorization != \"Bearer {token}\") {{ return 401; }}");
    let Some(ng) = Nginx::start_conf(&["dsv3_b"], &[], "acme/", &check) else {
        return;
    };
    let endpoint = format!("http://127.0.0.1:{}", ng.port);
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    local_convert("dsv3_b", &t.join("ref"));
    let hub = |c: &mut Command| {
        c.env_remove("HF_TOKEN").env("HF_ENDPOINT", &endpoint);
    };

    let mut c = deltafin();
    hub(&mut c);
    let out = c
        .args(["pull", "acme/dsv3_b", s(&t.join("no")), "--full"])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(
        !out.status.success() && err.contains("HTTP 401") && err.contains("HF_TOKEN"),
        "{err}"
    );
    assert!(!t.join("no").exists());

    let mut c = deltafin();
    hub(&mut c);
    let out = c
        .env("HF_TOKEN", token)
        .env("RUST_LOG", "trace")
        .args([
            "pull",
            "acme/dsv3_b@main",
            s(&t.join("full")),
            "--full",
            "--keep-download",
        ])
        .output()
        .unwrap();
    let err = stderr_of(&out);
    assert!(out.status.success(), "{err}");
    assert!(!err.contains(token), "the token was logged");
    assert_same_model(&t.join("ref"), &t.join("full"));

    let mut c = deltafin();
    hub(&mut c);
    let out = c
        .args(["pull", "acme/dsv3_b", s(&t.join("st")), "--stream", "--token", token])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let want = logits(&t.join("full"), &[], &t.join("full.json"));
    let gen = |json: &Path| {
        let mut c = deltafin();
        hub(&mut c);
        c.args([
            "run",
            "--model",
            s(&t.join("st")),
            "--prompt-ids",
            "5,17,42,7,3",
            "--max-new-tokens",
            "6",
        ])
        .args([
            "--ignore-eos",
            "--ram-budget",
            "0",
            "--allow-network",
            "--logits-out",
            s(json),
        ]);
        c
    };
    let out = gen(&t.join("no.json")).output().unwrap();
    let err = stderr_of(&out);
    assert!(!out.status.success() && err.contains("HTTP 401"), "{err}");
    let out = gen(&t.join("st.json")).env("HF_TOKEN", token).output().unwrap();
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    assert!(
        want == read(&t.join("st.json")),
        "the streaming install differs from the full one"
    );
    assert!(
        files_containing(t, token.as_bytes()).is_empty(),
        "{:?}",
        files_containing(t, token.as_bytes())
    );
}
/// Issue #19, item 7: a record corrupted in transit from a Hugging Face layout (no per-record
/// checksum) and fetched on demand is stored as received; `pull`, `info` and `cache verify` say
/// such records are unverifiable, and `cache verify --source` finds the bad one and replaces it
/// from the source.
#[test]
fn records_streamed_from_a_hugging_face_layout_are_compared_with_the_source_on_request() {
    behind_proxy("dsv3_b", |_, px, t| {
        // bf16 records hold the bf16 source values exactly: any flipped source byte shows.
        run_ok(&["convert", s(&fixture("dsv3_b")), s(&t.join("ref")), "--experts", "bf16"]);
        let m = t.join("m");
        let out = run_ok(&["pull", &px.url("dsv3_b"), s(&m), "--stream", "--experts", "bf16"]);
        let err = stderr_of(&out);
        assert!(
            err.contains("unverifiable") && err.contains("cache verify --source"),
            "{err}"
        );
        let info = stdout_of(&run_ok(&["info", s(&m)]));
        assert!(info.contains("expert record checksums    unverifiable"), "{info}");
        // The backbone tensors came by range too: their checksums were computed on arrival.
        assert!(info.contains("unverifiable against the source"), "{info}");

        // On-demand fetches by range (a `warm` completing a file would check its sha256).
        fetch_a_corrupted_record(px, &m, &t.join("l.json"));
        assert!(
            read(&t.join("ref/experts.pack")) != read(&m.join("experts.pack")),
            "the corrupted record was stored"
        );
        let v = stdout_of(&run_ok(&["cache", "verify", s(&m)]));
        let n = number_after(&v, "unverifiable: ").unwrap_or_else(|| panic!("{v}"));
        assert!(n > 1, "{v}");

        let out = run_any(&["cache", "verify", s(&m), "--source"]);
        let (so, se) = (stdout_of(&out), stderr_of(&out));
        assert!(!out.status.success(), "{so}{se}");
        assert_eq!(so.matches("replaced by the source's bytes").count(), 1, "{so}");
        assert!(se.contains(&format!("1 of {n} present records differed")), "{se}");
        assert!(!se.contains("panicked"), "{se}");
        assert!(
            logits(&m, &[], &t.join("l2.json")) == logits(&t.join("ref"), &[], &t.join("l3.json")),
            "repaired"
        );
        let v = stdout_of(&run_ok(&["cache", "verify", s(&m), "--source", "--whole-files"]));
        assert!(
            v.contains(&format!("source: {n} present records equal the source's"))
                && v.contains("sha256 as published at install"),
            "{v}"
        );
    });
}

/// Issue #19, item 7: a source file replaced on the server under the same size and ETag gives
/// records of another checkpoint; `cache verify --source --whole-files` hashes the source files
/// and says which one changed.
#[test]
fn a_source_file_replaced_under_the_same_etag_is_found_by_whole_file_verification() {
    let Some(ng) = Nginx::start(&["dsv3_b"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let m = tmp.path().join("m");
    run_ok(&["pull", &ng.url("dsv3_b"), s(&m), "--stream"]);
    let shard = replace_served_shard_under_the_same_etag(&ng);
    logits(&m, &["--allow-network"], &tmp.path().join("l.json"));
    let out = run_any(&["cache", "verify", s(&m), "--source", "--whole-files"]);
    let (so, se) = (stdout_of(&out), stderr_of(&out));
    assert!(!out.status.success(), "{so}{se}");
    assert!(so.contains(&format!("FAILED source file {shard}")), "{so}");
    assert!(
        se.contains("changed since the install") && !se.contains("panicked"),
        "{se}"
    );
}

/// Issue #19, item 8: `pull --full --force` onto a model directory that also holds other files
/// is refused before anything is downloaded, and nothing is lost.
#[test]
fn pull_force_refuses_a_model_directory_holding_other_files() {
    let Some(ng) = Nginx::start(&["dsv3_a"]) else { return };
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let m = t.join("m");
    local_convert("dsv3_c", &m);
    std::fs::create_dir(m.join("src")).unwrap();
    std::fs::write(m.join("src/lib.rs"), "// mine").unwrap();
    for mode in ["--full", "--stream"] {
        let out = run_any(&["pull", &ng.url("dsv3_a"), s(&m), mode, "--force"]);
        let err = stderr_of(&out);
        assert!(
            !out.status.success() && err.contains("did not write") && err.contains("src"),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(m.join("src/lib.rs")).unwrap(), "// mine");
        assert!(!t.join(".m.download").exists() && !t.join(".m.stream-src").exists());
    }
    std::fs::remove_dir_all(m.join("src")).unwrap();
    run_ok(&["pull", &ng.url("dsv3_a"), s(&m), "--full", "--force"]);
}

/// Issue #19, item 6: a mirror's `backbone.bin` corrupted in transit is caught by the backbone
/// checksums of the mirror's manifest and downloaded again.
#[test]
fn a_mirror_backbone_corrupted_in_transit_is_downloaded_again() {
    behind_mirror_proxy(|px, t| {
        let bb = std::fs::metadata(t.join("src/backbone.bin")).unwrap().len() as usize;
        let biggest_before = [
            "manifest.json",
            "tokenizer.json",
            "config.json",
            "tokenizer_config.json",
        ]
        .iter()
        .filter_map(|f| std::fs::metadata(t.join("src").join(f)).ok())
        .map(|m| m.len() as usize)
        .max()
        .unwrap_or(0);
        assert!(biggest_before < bb, "the flip must land in backbone.bin");
        for (mode, dir) in [("--stream", "st"), ("--full", "full")] {
            px.with(|f| {
                f.flip_next_over = Some(bb);
                f.log.clear();
            });
            run_ok(&["pull", &px.url("mirror"), s(&t.join(dir)), mode, "--flat"]);
            assert!(read(&t.join("src/backbone.bin")) == read(&t.join(dir).join("backbone.bin")));
            let gets = px.with(|f| f.log.iter().filter(|l| l.contains("backbone.bin")).count());
            assert_eq!(gets, 2, "{:?}", px.with(|f| f.log.clone()));
        }
    });
}

/// Issue #19, items 3, 4 and 9 for a mirror: a `manifest.json` served by a mirror is as
/// untrusted as one on disk. Values no model has, records out of range, a zero record
/// alignment or a path out of the model directory are one error line naming the manifest,
/// before anything is fetched or written, for `--full` and `--stream` alike.
#[test]
fn a_hostile_mirror_manifest_is_refused_before_anything_is_written() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    run_ok(&["synth", "--preset", "tiny", "--out", s(&t.join("src"))]);
    let good: serde_json::Value = serde_json::from_slice(&read(&t.join("src/manifest.json"))).unwrap();
    type Edit = fn(&mut serde_json::Value);
    // The manifest's config is `{"<family>": {...}}`.
    fn cfg(m: &mut serde_json::Value) -> &mut serde_json::Value {
        m["config"].as_object_mut().unwrap().values_mut().next().unwrap()
    }
    let cases: [(&str, Edit, &str); 6] = [
        ("align0", |m| m["experts"]["record_align"] = 0.into(), "record_align"),
        (
            "layers",
            |m| cfg(m)["num_hidden_layers"] = 10_000_000.into(),
            "num_hidden_layers",
        ),
        ("eps", |m| cfg(m)["rms_norm_eps"] = (-1.0).into(), "rms_norm_eps"),
        (
            "range",
            |m| m["experts"]["records"][0]["offset"] = (u64::MAX - 4095).into(),
            "experts.records",
        ),
        (
            "missing",
            |m| {
                m["experts"]["records"].as_array_mut().unwrap().pop();
            },
            "missing expert records",
        ),
        (
            "escape",
            |m| m["experts"]["file"] = "../../victim".into(),
            "experts.file",
        ),
    ];
    let mut dirs = Vec::new();
    for (name, edit, _) in &cases {
        let d = t.join(format!("mirror-{name}"));
        std::fs::create_dir(&d).unwrap();
        for e in std::fs::read_dir(t.join("src")).unwrap().flatten() {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        let mut m = good.clone();
        edit(&mut m);
        std::fs::write(d.join("manifest.json"), serde_json::to_vec(&m).unwrap()).unwrap();
        dirs.push((format!("mirror-{name}"), d));
    }
    let flat: Vec<(&str, &Path)> = dirs.iter().map(|(n, d)| (n.as_str(), d.as_path())).collect();
    let Some(ng) = Nginx::start_with(&[], &flat) else {
        return;
    };
    for ((name, _, needle), (served, _)) in cases.iter().zip(&dirs) {
        for mode in ["--full", "--stream"] {
            let m = t.join(format!("m-{name}"));
            let out = run_any(&["pull", &ng.url(served), s(&m), mode, "--flat"]);
            let (line, err) = the_error_line(&out, &format!("{name} {mode}: "));
            assert!(
                line.contains("manifest.json") && line.contains(needle),
                "{name} {mode}: {err}"
            );
            assert!(!m.exists(), "{name} {mode}: {} was written", m.display());
            for side in ["download", "stream-src"] {
                let w = t.join(format!(".m-{name}.{side}"));
                assert!(!w.exists(), "{name} {mode}: {} was written", w.display());
            }
        }
    }
}

/// Issue #19, item 7: a `warm` that completes a source file of a Hugging Face layout streams it
/// whole and checks the published sha256 before its records count as present. A body with a
/// flipped byte is fetched again; a record fetched earlier by range with a flipped byte is
/// found and replaced; a file the server replaced under the same size and ETag fails loudly
/// and none of its records is stored.
#[test]
fn a_warm_that_completes_a_source_file_checks_its_published_sha256() {
    behind_proxy("dsv3_b", |ng, px, t| {
        run_ok(&["convert", s(&fixture("dsv3_b")), s(&t.join("ref")), "--experts", "bf16"]);
        let m = t.join("m");
        run_ok(&["pull", &px.url("dsv3_b"), s(&m), "--stream", "--experts", "bf16"]);
        // A record fetched on demand by range, corrupted on the way: stored as received.
        fetch_a_corrupted_record(px, &m, &t.join("l.json"));

        // The full warm: every source file completes. Its first body is corrupted too.
        px.with(|f| {
            f.flip_next_over = Some(10_000);
            f.log.clear();
        });
        let out = run_ok(&["warm", s(&m), "--allow-network"]);
        let err = stderr_of(&out);
        assert!(px.with(|f| f.flip_next_over.is_none()), "no body was corrupted");
        assert!(
            err.contains("2 source files streamed whole, sha256 as published: 48 records"),
            "{err}"
        );
        assert_eq!(err.matches("; replaced").count(), 1, "{err}");
        assert!(!err.contains("unverifiable"), "{err}");
        assert!(
            read(&t.join("ref/experts.pack")) == read(&m.join("experts.pack")),
            "the warm stored other bytes than a local convert"
        );
        let v = stdout_of(&run_ok(&["cache", "verify", s(&m)]));
        assert!(
            v.contains("source: 48 present records") && !v.contains("unverifiable"),
            "{v}"
        );
        let info = stdout_of(&run_ok(&["info", s(&m)]));
        assert!(
            info.contains("unverifiable: 0 present records") && info.contains("48 verified"),
            "{info}"
        );
        assert!(info.contains("matched the source files' published sha256"), "{info}");

        // A backbone range corrupted at install: backbone.bin's checksums are computed on arrival,
        // so `cache verify` cannot tell; the warm that verifies the file names it.
        let m3 = t.join("m3");
        px.with(|f| f.flip_next_over = Some(30_000));
        run_ok(&["pull", &px.url("dsv3_b"), s(&m3), "--stream", "--experts", "bf16"]);
        assert!(px.with(|f| f.flip_next_over.is_none()), "no body was corrupted");
        run_ok(&["cache", "verify", s(&m3)]);
        let (line, se) = the_error_line(&run_any(&["warm", s(&m3), "--allow-network"]), "");
        assert!(
            line.contains("backbone.bin") && line.contains("corrupted") && line.contains("install it again"),
            "{se}"
        );

        // A second install, then the server's shard is replaced under the same size and ETag.
        let m2 = t.join("m2");
        run_ok(&["pull", &ng.url("dsv3_b"), s(&m2), "--stream", "--experts", "bf16"]);
        let shard = replace_served_shard_under_the_same_etag(ng);
        let out = run_any(&["warm", s(&m2), "--allow-network"]);
        let (line, se) = the_error_line(&out, &stdout_of(&out));
        assert!(
            line.contains(shard) && line.contains("sha256") && line.contains("were not stored"),
            "{se}"
        );
        // What was stored is intact and equal to the local convert; the refused records are absent.
        let v = stdout_of(&run_ok(&["cache", "verify", s(&m2)]));
        assert!(!v.contains("FAILED"), "{v}");
        let verified = number_after(&v, "source: ").unwrap_or(0);
        assert!(verified < 48, "{v}");
    });
}

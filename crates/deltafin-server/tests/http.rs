//! The server over real HTTP on loopback, against the tiny `dsv3_a` fixture model (random
//! weights: these tests check protocol and semantics, not prose). Each test starts its own
//! server; requests go through a minimal HTTP/1.1 client on `std::net::TcpStream`.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Barrier, OnceLock};
use std::time::{Duration, Instant};

use deltafin_engine::models::DeepseekV3;
use deltafin_engine::session::Session;
use deltafin_engine::CausalLm;
use deltafin_format::convert::{convert, ConvertOptions, NoProgress};
use deltafin_format::ModelDir;
use deltafin_server::ServerConfig;
use deltafin_tokenizer::Tokenizer;
use serde_json::{json, Value};

const MODEL: &str = "dsv3-a";

fn model_dir() -> &'static Path {
    static DIR: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    &DIR.get_or_init(|| {
        let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
        let tmp = tempfile::tempdir().unwrap();
        let out = tmp.path().join(MODEL);
        convert(&src, &out, &ConvertOptions::default(), &NoProgress).unwrap();
        (tmp, out)
    })
    .1
}

/// Starts a server on a free loopback port; it runs until the test process exits.
fn start(configure: impl FnOnce(&mut ServerConfig)) -> SocketAddr {
    let dir = model_dir();
    let tokenizer = Arc::new(Tokenizer::from_dir(dir).unwrap());
    let eos = deltafin_tokenizer::eos_token_ids_union(dir, &tokenizer).unwrap();
    let model: Arc<dyn CausalLm> = Arc::new(DeepseekV3::load(&ModelDir::open(dir).unwrap(), 1 << 20).unwrap());
    let session = Session::new(model, tokenizer, eos);
    let mut config = ServerConfig::new(MODEL);
    configure(&mut config);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .unwrap();
        rt.block_on(async move {
            let listener = tokio::net::TcpListener::from_std(listener).unwrap();
            let router = deltafin_server::router(config, session).unwrap();
            deltafin_server::serve(listener, router, std::future::pending())
                .await
                .unwrap();
        });
    });
    addr
}

struct Resp {
    status: u16,
    headers: Vec<(String, String)>,
    body: String,
}

impl Resp {
    fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    /// `data:` payloads of an SSE body.
    fn sse_data(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

fn send(addr: SocketAddr, method: &str, path: &str, body: &[u8], headers: &[(&str, &str)]) -> TcpStream {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    s.write_all(req.as_bytes()).unwrap();
    s.write_all(body).unwrap();
    s
}

fn read_response(s: TcpStream) -> Resp {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line.split_whitespace().nth(1).unwrap().parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.trim().to_string(), v.trim().to_string()));
    }
    let chunked = headers
        .iter()
        .any(|(k, v)| k.eq_ignore_ascii_case("transfer-encoding") && v.contains("chunked"));
    let mut body = Vec::new();
    if chunked {
        loop {
            line.clear();
            r.read_line(&mut line).unwrap();
            let n = usize::from_str_radix(line.trim(), 16).unwrap();
            if n == 0 {
                break;
            }
            let mut buf = vec![0u8; n + 2];
            r.read_exact(&mut buf).unwrap();
            body.extend_from_slice(&buf[..n]);
        }
    } else {
        r.read_to_end(&mut body).unwrap();
    }
    Resp {
        status,
        headers,
        body: String::from_utf8(body).expect("every response is valid UTF-8"),
    }
}

fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    read_response(send(addr, "POST", path, body.to_string().as_bytes(), &[]))
}

fn get(addr: SocketAddr, path: &str) -> Resp {
    read_response(send(addr, "GET", path, b"", &[]))
}

fn metric(addr: SocketAddr, name: &str) -> f64 {
    let text = get(addr, "/metrics").body;
    text.lines()
        .find_map(|l| l.strip_prefix(name).and_then(|r| r.strip_prefix(' ')))
        .unwrap_or_else(|| panic!("{name} not in /metrics"))
        .parse()
        .unwrap()
}

/// `deltafin_requests_total{endpoint,status}` (0 when absent).
fn requests(addr: SocketAddr, endpoint: &str, status: u16) -> f64 {
    let name = format!("deltafin_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}}");
    let text = get(addr, "/metrics").body;
    text.lines()
        .find_map(|l| l.strip_prefix(name.as_str()).and_then(|r| r.strip_prefix(' ')))
        .map_or(0.0, |v| v.parse().unwrap())
}

/// Waits up to 5 s for the request counts of `endpoint` to be `want` (status, count) and
/// nothing else among 200 and 499.
fn wait_for_requests(addr: SocketAddr, endpoint: &str, want: &[(u16, f64)]) {
    let t0 = Instant::now();
    loop {
        let got: Vec<(u16, f64)> = [200, 499]
            .iter()
            .map(|&st| (st, requests(addr, endpoint, st)))
            .collect();
        let expected: Vec<(u16, f64)> = [200, 499]
            .iter()
            .map(|&st| (st, want.iter().find(|w| w.0 == st).map_or(0.0, |w| w.1)))
            .collect();
        if got == expected {
            return;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "{endpoint}: {got:?}, want {expected:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

fn assert_openai_error(r: &Resp, status: u16) {
    assert_eq!(r.status, status, "{}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    for k in ["type", "param", "code"] {
        assert!(e.get(k).is_some(), "{v}");
    }
}

fn hello() -> Value {
    json!([{"role": "user", "content": "Hello, who are you?"}])
}

/// `body` with the fields of the object `extra` set over it.
fn with(mut body: Value, extra: Value) -> Value {
    for (k, v) in extra.as_object().unwrap() {
        body[k] = v.clone();
    }
    body
}

fn chat_body(max_tokens: usize) -> Value {
    json!({"model": MODEL, "messages": hello(), "max_tokens": max_tokens, "ignore_eos": true})
}

#[test]
fn models_health_metrics() {
    let a = start(|_| {});
    assert_eq!(get(a, "/health").json()["status"], "ok");
    let m = get(a, "/v1/models").json();
    assert_eq!(m["object"], "list");
    assert_eq!(m["data"][0]["id"], MODEL);
    assert_eq!(get(a, &format!("/v1/models/{MODEL}")).json()["object"], "model");
    assert_openai_error(&get(a, "/v1/models/other"), 404);
    assert_openai_error(&get(a, "/nowhere"), 404);
    let metrics = get(a, "/metrics");
    assert!(metrics.header("content-type").unwrap().starts_with("text/plain"));
    assert!(metrics.body.contains("# TYPE deltafin_expert_cache_hit_rate gauge"));
}

#[test]
fn chat_stream_equals_non_stream_and_ends_with_done() {
    let a = start(|_| {});
    let full = post(a, "/v1/chat/completions", &chat_body(12)).json();
    let text = full["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert_eq!(full["choices"][0]["finish_reason"], "length");
    assert_eq!(full["usage"]["completion_tokens"], 12);
    let mut body = chat_body(12);
    body["stream"] = json!(true);
    body["stream_options"] = json!({"include_usage": true});
    let r = post(a, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/event-stream"));
    let data = r.sse_data();
    assert_eq!(data.last().unwrap(), "[DONE]");
    let chunks: Vec<Value> = data[..data.len() - 1]
        .iter()
        .map(|d| serde_json::from_str(d).unwrap())
        .collect();
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 12);
    let content = &chunks[..chunks.len() - 1];
    let streamed: String = content
        .iter()
        .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
        .collect();
    assert_eq!(streamed, text);
    let last = content.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert!(last["choices"][0]["delta"]["content"]
        .as_str()
        .is_some_and(|c| !c.is_empty()));
    assert!(content[..content.len() - 1]
        .iter()
        .all(|c| c["choices"][0]["finish_reason"].is_null()));
}

#[test]
fn stop_strings_never_leak() {
    let a = start(|_| {});
    let body = json!({"model": MODEL, "prompt": "Tell me a story", "max_tokens": 30, "ignore_eos": true});
    let text = post(a, "/v1/completions", &body).json()["choices"][0]["text"]
        .as_str()
        .unwrap()
        .to_string();
    let chars: Vec<(usize, char)> = text.char_indices().collect();
    // A 3-character ASCII window whose first occurrence is where we cut.
    let (at, stop) = (2..chars.len().saturating_sub(3))
        .map(|i| (chars[i].0, text[chars[i].0..chars[i + 3].0].to_string()))
        .find(|(at, w)| w.is_ascii() && text.find(w.as_str()) == Some(*at))
        .expect("an ASCII window");
    let mut with_stop = body.clone();
    with_stop["stop"] = json!([stop, "☃never"]);
    let r = post(a, "/v1/completions", &with_stop).json();
    assert_eq!(r["choices"][0]["text"], text[..at]);
    assert_eq!(r["choices"][0]["finish_reason"], "stop");
    with_stop["stream"] = json!(true);
    let data = post(a, "/v1/completions", &with_stop).sse_data();
    let streamed: String = data[..data.len() - 1]
        .iter()
        .map(|d| {
            serde_json::from_str::<Value>(d).unwrap()["choices"][0]["text"]
                .as_str()
                .unwrap()
                .to_string()
        })
        .collect();
    assert_eq!(streamed, text[..at]);
}

#[test]
fn seeds_reproduce_and_logprobs_are_reported() {
    let a = start(|_| {});
    let mut body = chat_body(16);
    body["temperature"] = json!(1.0);
    body["seed"] = json!(7);
    let x = post(a, "/v1/chat/completions", &body).json()["choices"][0]["message"]["content"].clone();
    let y = post(a, "/v1/chat/completions", &body).json()["choices"][0]["message"]["content"].clone();
    assert_eq!(x, y);
    let mut lp = chat_body(4);
    lp["logprobs"] = json!(true);
    lp["top_logprobs"] = json!(3);
    let r = post(a, "/v1/chat/completions", &lp).json();
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for t in content {
        let top = t["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        assert_eq!(top[0]["token"], t["token"]);
        assert!(t["logprob"].as_f64().unwrap() <= 0.0);
    }
}

#[test]
fn client_errors_are_openai_shaped_4xx() {
    let a = start(|c| c.max_request_bytes = 4096);
    let raw = |body: &[u8]| read_response(send(a, "POST", "/v1/chat/completions", body, &[]));
    assert_openai_error(&raw(b"{\"model\": "), 400);
    assert_openai_error(&raw(b"\"just a string\""), 400);
    assert_openai_error(&raw(&vec![b' '; 10_000]), 413);
    let cases = [
        json!({"model": MODEL, "messages": []}),
        json!({"model": MODEL, "messages": hello(), "max_tokens": "many"}),
        json!({"model": MODEL, "messages": hello(), "max_tokens": 0}),
        json!({"model": MODEL, "messages": hello(), "max_tokens": -1}),
        json!({"model": MODEL, "messages": hello(), "n": 3}),
        json!({"model": MODEL, "messages": hello(), "top_logprobs": 30, "logprobs": true}),
        json!({"model": MODEL, "messages": [{"role": "user"}]}),
    ];
    for c in &cases {
        assert_openai_error(&post(a, "/v1/chat/completions", c), 400);
    }
    // A field of the wrong type is named in the message and in `param`.
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": hello(), "max_tokens": "four"}),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "max_tokens", "{}", r.body);
    assert!(r.body.contains("`max_tokens`"), "{}", r.body);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": 7, "content": "x"}]}),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "messages[0]", "{}", r.body);
    let too_long = post(a, "/v1/chat/completions", &chat_body(1000));
    assert_openai_error(&too_long, 400);
    assert!(too_long.body.contains("128"), "{}", too_long.body);
    assert_eq!(too_long.json()["error"]["code"], "context_length_exceeded");
    assert_openai_error(
        &post(a, "/v1/completions", &json!({"model": MODEL, "prompt": [5, 512]})),
        400,
    );
    assert_openai_error(&post(a, "/v1/completions", &json!({"model": MODEL, "prompt": ""})), 400);
    assert_openai_error(
        &post(
            a,
            "/v1/chat/completions",
            &json!({"model": "gpt-4", "messages": hello()}),
        ),
        404,
    );
    // unknown fields are ignored
    let mut ok = chat_body(2);
    ok["some_future_field"] = json!({"a": 1});
    assert_eq!(post(a, "/v1/chat/completions", &ok).status, 200);
}

#[test]
fn api_key_is_required_when_configured() {
    let a = start(|c| c.api_key = Some("sekrit".into()));
    assert_eq!(get(a, "/health").status, 200);
    assert_openai_error(&get(a, "/v1/models"), 401);
    let ok = read_response(send(a, "GET", "/v1/models", b"", &[("Authorization", "Bearer sekrit")]));
    assert_eq!(ok.status, 200);
    let body = json!({"model": MODEL, "max_tokens": 2, "messages": hello()}).to_string();
    let anth = read_response(send(
        a,
        "POST",
        "/v1/messages",
        body.as_bytes(),
        &[("x-api-key", "nope")],
    ));
    assert_eq!(anth.status, 401);
    assert_eq!(anth.json()["type"], "error");
    assert_eq!(anth.json()["error"]["type"], "authentication_error");
    let anth = read_response(send(
        a,
        "POST",
        "/v1/messages",
        body.as_bytes(),
        &[("x-api-key", "sekrit")],
    ));
    assert_eq!(anth.status, 200, "{}", anth.body);
}

#[test]
fn anthropic_messages_and_event_sequence() {
    let a = start(|_| {});
    let body = json!({"model": MODEL, "max_tokens": 6, "system": "Be brief.", "messages": hello()});
    let m = post(a, "/v1/messages", &body).json();
    assert_eq!(m["type"], "message");
    assert_eq!(m["content"][0]["type"], "text");
    let mut sbody = body.clone();
    sbody["stream"] = json!(true);
    let r = post(a, "/v1/messages", &sbody);
    let names: Vec<&str> = r.body.lines().filter_map(|l| l.strip_prefix("event: ")).collect();
    assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
    assert_eq!(
        names[names.len() - 3..],
        ["content_block_stop", "message_delta", "message_stop"]
    );
    assert!(names[3..names.len() - 3].iter().all(|n| *n == "content_block_delta"));
    let text: String = r
        .sse_data()
        .iter()
        .map(|d| serde_json::from_str::<Value>(d).unwrap())
        .filter(|v| v["type"] == "content_block_delta")
        .map(|v| v["delta"]["text"].as_str().unwrap().to_string())
        .collect();
    assert_eq!(text, m["content"][0]["text"].as_str().unwrap());
    let err = post(a, "/v1/messages", &json!({"model": MODEL, "messages": hello()}));
    assert_eq!(err.status, 400);
    assert_eq!(err.json()["error"]["type"], "invalid_request_error");
}

#[test]
fn twenty_concurrent_requests_one_runs_the_rest_get_429() {
    let a = start(|c| c.step_delay = Duration::from_millis(5));
    let barrier = Arc::new(Barrier::new(20));
    let handles: Vec<_> = (0..20)
        .map(|_| {
            let b = Arc::clone(&barrier);
            std::thread::spawn(move || {
                b.wait();
                post(a, "/v1/chat/completions", &chat_body(80))
            })
        })
        .collect();
    let resps: Vec<Resp> = handles.into_iter().map(|h| h.join().unwrap()).collect();
    let ok = resps.iter().filter(|r| r.status == 200).count();
    let busy: Vec<&Resp> = resps.iter().filter(|r| r.status == 429).collect();
    assert_eq!((ok, busy.len()), (1, 19));
    for r in busy {
        assert_openai_error(r, 429);
        assert!(r.header("retry-after").is_some());
    }
    assert_eq!(get(a, "/health").status, 200);
    assert_eq!(post(a, "/v1/chat/completions", &chat_body(2)).status, 200);
}

#[test]
fn disconnect_cancels_within_a_step_and_frees_the_slot() {
    let a = start(|c| c.step_delay = Duration::from_millis(20));
    let mut body = chat_body(100);
    body["stream"] = json!(true);
    let s = send(a, "POST", "/v1/chat/completions", body.to_string().as_bytes(), &[]);
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        r.read_line(&mut line).unwrap();
    }
    // The role chunk can be sent before the compute thread picks the job up: wait for it.
    let t_active = Instant::now();
    while metric(a, "deltafin_generation_active") != 1.0 {
        assert!(
            t_active.elapsed() < Duration::from_secs(5),
            "the generation never became active"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    drop(r);
    let t0 = Instant::now();
    let next = post(a, "/v1/chat/completions", &chat_body(2));
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(t0.elapsed() < Duration::from_secs(2));
    assert_eq!(metric(a, "deltafin_generations_cancelled_total"), 1.0);
    // 100 tokens at 20 ms would take 2 s; far fewer were produced.
    assert!(metric(a, "deltafin_completion_tokens_total") < 50.0);
    // The abandoned stream counts as 499 (client closed request), the answered one as 200.
    wait_for_requests(a, "/v1/chat/completions", &[(200, 1.0), (499, 1.0)]);
}

#[test]
fn conversation_reuse_is_exact() {
    let a = start(|_| {});
    let turn1 = json!([{"role": "user", "content": "Tell me about the sea."}]);
    let r1 = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": turn1, "max_tokens": 8, "ignore_eos": true}),
    )
    .json();
    let answer = r1["choices"][0]["message"]["content"].clone();
    let turn2 = json!([
        {"role": "user", "content": "Tell me about the sea."},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": "And the mountains?"},
    ]);
    let req = json!({"model": MODEL, "messages": turn2, "max_tokens": 12, "ignore_eos": true});
    let reused = post(a, "/v1/chat/completions", &req).json();
    assert!(
        reused["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 5
    );
    // A fresh server computes the same request from scratch.
    let b = start(|_| {});
    let fresh = post(b, "/v1/chat/completions", &req).json();
    assert_eq!(fresh["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    assert_eq!(
        fresh["choices"][0]["message"]["content"],
        reused["choices"][0]["message"]["content"]
    );
    // And the same request again reuses everything but the last prompt token.
    let again = post(a, "/v1/chat/completions", &req).json();
    assert_eq!(
        again["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            + 1,
        again["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(
        again["choices"][0]["message"]["content"],
        reused["choices"][0]["message"]["content"]
    );
}

#[test]
fn non_streaming_disconnect_also_cancels() {
    let a = start(|c| c.step_delay = Duration::from_millis(20));
    let s = send(
        a,
        "POST",
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": true})
            .to_string()
            .as_bytes(),
        &[],
    );
    let t0 = Instant::now();
    while metric(a, "deltafin_generation_active") != 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(5));
        std::thread::sleep(Duration::from_millis(5));
    }
    s.shutdown(std::net::Shutdown::Both).unwrap();
    drop(s);
    let t0 = Instant::now();
    let next = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "y", "max_tokens": 2}),
    );
    assert_eq!(next.status, 200, "{}", next.body);
    assert!(t0.elapsed() < Duration::from_secs(1), "{:?}", t0.elapsed());
    assert_eq!(metric(a, "deltafin_generations_cancelled_total"), 1.0);
    // The abandoned request is counted once, as 499; the answered one as 200.
    wait_for_requests(a, "/v1/completions", &[(200, 1.0), (499, 1.0)]);
}

/// Every chat logprobs entry's `bytes` and whether its `token` text is a lossy rendering.
fn check_entry_bytes(e: &Value) -> (Vec<u8>, bool) {
    let token = e["token"].as_str().unwrap();
    let bytes: Vec<u8> = e["bytes"]
        .as_array()
        .unwrap()
        .iter()
        .map(|b| u8::try_from(b.as_u64().unwrap()).unwrap())
        .collect();
    assert_eq!(String::from_utf8_lossy(&bytes), token, "{e}");
    let partial = token.contains('\u{FFFD}');
    if partial {
        // A U+FFFD token text comes from bytes that are not UTF-8 alone: `bytes` must be them,
        // not the UTF-8 of U+FFFD.
        assert!(std::str::from_utf8(&bytes).is_err(), "{e}");
    }
    (bytes, partial)
}

/// `bytes` of chat logprobs (chosen and top entries, plain and streamed) are the tokens' exact
/// bytes, also for byte-level tokens holding part of a multi-byte character; the chosen
/// tokens' bytes concatenate to the answer.
#[test]
fn logprob_bytes_are_the_tokens_exact_bytes() {
    let a = start(|_| {});
    let mut body = chat_body(24);
    body["messages"] = json!([{"role": "user", "content": "Ünïcödé: 日本語 ☃ 🎉 — ëèê"}]);
    body["logprobs"] = json!(true);
    body["top_logprobs"] = json!(20);
    let r = post(a, "/v1/chat/completions", &body).json();
    let content = r["choices"][0]["logprobs"]["content"].as_array().unwrap();
    let mut partial = 0;
    let mut joined = Vec::new();
    for t in content {
        let (bytes, p) = check_entry_bytes(t);
        partial += usize::from(p);
        joined.extend(bytes);
        for top in t["top_logprobs"].as_array().unwrap() {
            partial += usize::from(check_entry_bytes(top).1);
        }
    }
    assert!(partial > 0, "no partial-character token to check: {r}");
    let text = r["choices"][0]["message"]["content"].as_str().unwrap();
    assert_eq!(String::from_utf8_lossy(&joined), text);

    body["stream"] = json!(true);
    let data = post(a, "/v1/chat/completions", &body).sse_data();
    let mut streamed = Vec::new();
    for d in &data[..data.len() - 1] {
        let c: Value = serde_json::from_str(d).unwrap();
        if let Some(entries) = c["choices"][0]["logprobs"]["content"].as_array() {
            for t in entries {
                streamed.extend(check_entry_bytes(t).0);
            }
        }
    }
    assert_eq!(streamed, joined);
}

/// A context overflow names the prompt's field of the endpoint: `prompt` on completions,
/// `messages` on chat; the budget's field when the request set one that does not fit.
#[test]
fn context_overflow_names_the_endpoints_prompt_field() {
    let a = start(|_| {});
    let long: Vec<u32> = (0..200).map(|i| 5 + i % 50).collect();
    for body in [
        json!({"model": MODEL, "prompt": long}),
        json!({"model": MODEL, "prompt": long, "max_tokens": 4}),
    ] {
        let r = post(a, "/v1/completions", &body);
        assert_openai_error(&r, 400);
        assert_eq!(r.json()["error"]["code"], "context_length_exceeded", "{}", r.body);
        assert_eq!(r.json()["error"]["param"], "prompt", "{}", r.body);
    }
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 200}),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "max_tokens", "{}", r.body);
    let words = "word ".repeat(300);
    let r = post(
        a,
        "/v1/chat/completions",
        &json!({"model": MODEL, "messages": [{"role": "user", "content": words}]}),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "messages", "{}", r.body);
}

/// `response_format`, `best_of` and `suffix` are honoured where deltafin can (plain text, one
/// candidate, no suffix) and refused with the parameter named otherwise, never ignored.
#[test]
fn unsupported_options_are_refused_not_ignored() {
    let a = start(|_| {});
    let chat = |extra: Value| post(a, "/v1/chat/completions", &with(chat_body(2), extra));
    let cmpl = |extra: Value| {
        post(
            a,
            "/v1/completions",
            &with(json!({"model": MODEL, "prompt": "Hi", "max_tokens": 2}), extra),
        )
    };
    let refused = [
        (
            chat(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
            "response_format",
        ),
        (chat(json!({"response_format": "json"})), "response_format"),
        (chat(json!({"best_of": 2})), "best_of"),
        (
            cmpl(json!({"response_format": {"type": "json_object"}})),
            "response_format",
        ),
        (cmpl(json!({"best_of": 3})), "best_of"),
        (cmpl(json!({"suffix": "tail"})), "suffix"),
        (cmpl(json!({"echo": true})), "echo"),
    ];
    for (r, param) in &refused {
        assert_openai_error(r, 400);
        assert_eq!(r.json()["error"]["param"], *param, "{}", r.body);
        assert!(r.body.contains(&format!("`{param}`")), "{}", r.body);
    }
    for r in [
        chat(json!({"response_format": {"type": "text"}, "best_of": 1})),
        chat(json!({"response_format": null})),
        cmpl(json!({"response_format": {"type": "text"}, "best_of": 1, "suffix": "", "echo": false})),
        cmpl(json!({"suffix": null})),
    ] {
        assert_eq!(r.status, 200, "{}", r.body);
    }
}

/// An integer too large for its field names the parameter and its range instead of serde's
/// "invalid type: floating point".
#[test]
fn huge_integers_name_the_parameter_and_range() {
    let a = start(|_| {});
    let raw = |path: &str, body: &str| read_response(send(a, "POST", path, body.as_bytes(), &[]));
    let huge = "99999999999999999999999";
    let r = raw(
        "/v1/chat/completions",
        &format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":{huge}}}"#),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "max_tokens", "{}", r.body);
    let m = r.json()["error"]["message"].as_str().unwrap().to_string();
    assert!(m.starts_with("`max_tokens` must be a positive integer"), "{m}");
    assert!(!m.contains("floating point"), "{m}");
    let r = raw(
        "/v1/completions",
        &format!(r#"{{"model":"{MODEL}","prompt":"Hi","logprobs":{huge}}}"#),
    );
    assert_openai_error(&r, 400);
    assert_eq!(r.json()["error"]["param"], "logprobs", "{}", r.body);
    assert!(r.body.contains("from 0 to 20"), "{}", r.body);
    let r = raw(
        "/v1/messages",
        &format!(r#"{{"model":"{MODEL}","messages":[{{"role":"user","content":"Hi"}}],"max_tokens":{huge}}}"#),
    );
    assert_eq!(r.status, 400, "{}", r.body);
    assert!(r.body.contains("`max_tokens` must be a positive integer"), "{}", r.body);
}

/// `tools` and `tool_choice` are checked against OpenAI's schema: a malformed one is 400 naming
/// the field at fault, never silently passed to the template or dropped; valid forms work.
#[test]
fn chat_tools_and_tool_choice_are_type_checked() {
    let a = start(|_| {});
    let chat = |extra: Value| post(a, "/v1/chat/completions", &with(chat_body(2), extra));
    let tool = json!({"type": "function", "function": {"name": "get_weather", "description": "Weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}});
    let refused = [
        (json!({"tools": "x"}), "tools"),
        (json!({"tools": {"a": 1}}), "tools"),
        (json!({"tools": [1]}), "tools[0]"),
        (json!({"tools": [{"type": "function"}]}), "tools[0].function"),
        (
            json!({"tools": [tool, {"type": "function", "function": {}}]}),
            "tools[1].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": ""}}]}),
            "tools[0].function.name",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": 3}}]}),
            "tools[0].function.name",
        ),
        (json!({"tools": [{"function": {"name": "f"}}]}), "tools[0].type"),
        (
            json!({"tools": [{"type": "retrieval", "function": {"name": "f"}}]}),
            "tools[0].type",
        ),
        (
            json!({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]}),
            "tools[0].function.parameters",
        ),
        (json!({"tool_choice": 5}), "tool_choice"),
        (json!({"tool_choice": "sometimes"}), "tool_choice"),
        (json!({"tool_choice": "required"}), "tool_choice"),
        // Checked, then refused: a tool call cannot be forced.
        (json!({"tools": [tool], "tool_choice": "required"}), "tool_choice"),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            "tool_choice",
        ),
        (
            json!({"tools": [tool], "tool_choice": {"type": "other"}}),
            "tool_choice.type",
        ),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {}}}),
            "tool_choice.function.name",
        ),
        (
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "nope"}}}),
            "tool_choice.function.name",
        ),
    ];
    for (extra, param) in &refused {
        let r = chat(extra.clone());
        assert_openai_error(&r, 400);
        assert_eq!(r.json()["error"]["param"], *param, "{extra}: {}", r.body);
        assert_eq!(r.json()["error"]["message"].as_str().unwrap().lines().count(), 1);
    }
    for extra in [
        json!({"tools": [tool]}),
        json!({"tools": [tool], "tool_choice": "auto"}),
        json!({"tools": [tool], "tool_choice": "none"}),
        json!({"tools": [], "tool_choice": "auto"}),
        json!({"tools": null, "tool_choice": null}),
    ] {
        let r = chat(extra.clone());
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
}

/// `/v1/messages` takes custom tools (rendered to the template in OpenAI's shape): a malformed
/// tool, a server tool, or a `tool_choice` that would force a call (`any`, `tool`) is an
/// Anthropic-shaped 400 naming the field, never silently dropped; `auto` and `none` work.
#[test]
fn anthropic_tools_are_checked_and_accepted() {
    let a = start(|_| {});
    let msg = |extra: Value| {
        post(
            a,
            "/v1/messages",
            &with(json!({"model": MODEL, "max_tokens": 2, "messages": hello()}), extra),
        )
    };
    let tool = json!({"name": "get_weather", "description": "Wetter in München", "input_schema": {"type": "object"}});
    for (extra, names) in [
        (json!({"tools": "x"}), "tools"),
        (json!({"tools": {"name": "f"}}), "tools"),
        (json!({"tools": [1]}), "tools[0]"),
        (json!({"tools": [{"input_schema": {}}]}), "tools[0].name"),
        (json!({"tools": [{"name": "f"}]}), "tools[0].input_schema"),
        (
            json!({"tools": [tool, {"name": "g", "input_schema": 1}]}),
            "tools[1].input_schema",
        ),
        (
            json!({"tools": [{"type": "bash_20250124", "name": "bash"}]}),
            "tools[0]",
        ),
        (json!({"tools": [tool], "tool_choice": {"type": "any"}}), "tool_choice"),
        (
            json!({"tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}),
            "tool_choice",
        ),
        (json!({"tool_choice": "auto"}), "tool_choice"),
    ] {
        let r = msg(extra.clone());
        assert_eq!(r.status, 400, "{extra}: {}", r.body);
        let v = r.json();
        assert_eq!(v["type"], "error", "{v}");
        assert_eq!(v["error"]["type"], "invalid_request_error", "{v}");
        let m = v["error"]["message"].as_str().unwrap();
        assert!(m.starts_with(&format!("{names}:")), "{extra}: {m}");
        assert_eq!(m.lines().count(), 1, "{m}");
    }
    for extra in [
        json!({"tools": [tool]}),
        json!({"tools": [tool], "tool_choice": {"type": "auto"}}),
        json!({"tools": [tool], "tool_choice": {"type": "none"}}),
        json!({"tools": []}),
        json!({"tools": null}),
        json!({"tool_choice": {"type": "auto"}}),
        json!({"tool_choice": {"type": "none"}}),
    ] {
        let r = msg(extra.clone());
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
}

/// Anthropic `thinking` is accepted (enabled with a budget, or disabled) and checked; a bad one
/// is a 400 naming `thinking`. OpenAI `reasoning_effort` and `chat_template_kwargs` reach the
/// template (a kwarg the template reads changes the prompt) and are type-checked.
#[test]
fn thinking_reasoning_effort_and_template_kwargs() {
    let a = start(|_| {});
    let msg = |extra: Value| {
        post(
            a,
            "/v1/messages",
            &with(json!({"model": MODEL, "max_tokens": 2, "messages": hello()}), extra),
        )
    };
    for ok in [
        json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
        json!({"thinking": {"type": "disabled"}}),
    ] {
        let r = msg(ok.clone());
        assert_eq!(r.status, 200, "{ok}: {}", r.body);
    }
    for bad in [
        json!({"thinking": {"type": "enabled"}}),
        json!({"thinking": {"type": "enabled", "budget_tokens": 100}}),
        json!({"thinking": {"type": "sometimes"}}),
        json!({"thinking": "on"}),
    ] {
        let r = msg(bad.clone());
        assert_eq!(r.status, 400, "{bad}: {}", r.body);
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.starts_with("thinking:"), "{bad}: {m}");
    }
    let chat = |extra: Value| post(a, "/v1/chat/completions", &with(chat_body(2), extra));
    assert_eq!(chat(json!({"reasoning_effort": "high"})).status, 200);
    assert_eq!(
        chat(json!({"chat_template_kwargs": {"enable_thinking": false}})).status,
        200
    );
    for (bad, param) in [
        (json!({"reasoning_effort": 3}), "reasoning_effort"),
        (json!({"chat_template_kwargs": "x"}), "chat_template_kwargs"),
    ] {
        let r = chat(bad.clone());
        assert_openai_error(&r, 400);
        assert_eq!(r.json()["error"]["param"], param, "{}", r.body);
    }
    // The fixture's template reads `bos_token`: a kwarg overriding it changes the prompt.
    let usage = |extra: Value| chat(extra).json()["usage"]["prompt_tokens"].as_i64().unwrap();
    let plain = usage(json!({}));
    let more = usage(json!({"chat_template_kwargs": {"bos_token": "<｜begin▁of▁sentence｜> one two three"}}));
    assert!(more > plain, "{more} vs {plain}");
}

/// `/v1/messages/count_tokens` counts the prompt `/v1/messages` would run (same rendering, so
/// the same `input_tokens`), tools included; errors are Anthropic-shaped.
#[test]
fn anthropic_count_tokens() {
    let a = start(|_| {});
    let body = json!({"model": MODEL, "system": "Be brief.", "messages": hello()});
    let n = post(a, "/v1/messages/count_tokens", &body).json()["input_tokens"]
        .as_u64()
        .unwrap();
    let mut run = body.clone();
    run["max_tokens"] = json!(1);
    let m = post(a, "/v1/messages", &run).json();
    assert_eq!(m["usage"]["input_tokens"].as_u64(), Some(n));
    let tool = json!({"name": "get_weather", "input_schema": {"type": "object"}});
    let r = post(
        a,
        "/v1/messages/count_tokens",
        &with(body.clone(), json!({"tools": [tool]})),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let bad = post(a, "/v1/messages/count_tokens", &json!({"model": MODEL}));
    assert_eq!(bad.status, 400);
    assert_eq!(bad.json()["error"]["type"], "invalid_request_error");
    let bad = post(a, "/v1/messages/count_tokens", &with(body, json!({"model": "other"})));
    assert_eq!(bad.status, 404);
    assert_eq!(bad.json()["type"], "error");
}

/// Bytes of a legacy completions token: `bytes:\xNN...` decoded, else the text's UTF-8.
fn completion_token_bytes(t: &str) -> Vec<u8> {
    match t.strip_prefix("bytes:") {
        Some(esc) => esc
            .split("\\x")
            .skip(1)
            .map(|h| u8::from_str_radix(h, 16).unwrap_or_else(|e| panic!("{t}: {e}")))
            .collect(),
        None => t.as_bytes().to_vec(),
    }
}

/// Legacy completions `logprobs: N`: a token that is not valid UTF-8 alone is written
/// `bytes:\xNN`, so each `top_logprobs` map has N distinct keys even when several byte-level
/// tokens would all render as U+FFFD; the tokens' bytes rebuild the text and `text_offset`
/// counts its characters.
#[test]
fn completion_logprobs_keep_partial_character_tokens_distinct() {
    let a = start(|_| {});
    let body = json!({"model": MODEL, "prompt": "Ünïcödé: 日本語 ☃ 🎉 — ëèê", "max_tokens": 24,
        "ignore_eos": true, "logprobs": 20});
    let r = post(a, "/v1/completions", &body).json();
    let choice = &r["choices"][0];
    let lp = &choice["logprobs"];
    let tokens: Vec<&str> = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    let mut escaped = 0;
    for (i, top) in lp["top_logprobs"].as_array().unwrap().iter().enumerate() {
        let top = top.as_object().unwrap();
        assert_eq!(top.len(), 20, "position {i}: {top:?}");
        for k in top.keys() {
            assert!(!k.contains('\u{FFFD}'), "{k}");
            escaped += usize::from(k.starts_with("bytes:"));
        }
    }
    assert!(escaped > 0, "no partial-character token to check: {r}");
    let text = choice["text"].as_str().unwrap();
    let joined: Vec<u8> = tokens.iter().flat_map(|t| completion_token_bytes(t)).collect();
    assert_eq!(String::from_utf8_lossy(&joined), text);
    // text_offset: where each token starts in `text`, in characters.
    let offsets: Vec<usize> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|o| o.as_u64().unwrap() as usize)
        .collect();
    let mut before = Vec::new();
    for (t, &off) in tokens.iter().zip(&offsets) {
        let prefix = String::from_utf8_lossy(&before).into_owned();
        let complete = prefix.trim_end_matches('\u{FFFD}').chars().count();
        assert!(
            off == complete || off == prefix.chars().count(),
            "{t}: {off} vs {prefix:?}"
        );
        assert!(off <= text.chars().count());
        before.extend(completion_token_bytes(t));
    }
}

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
use deltafin_server::{HalfClose, ServerConfig};
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
    let model: Arc<dyn CausalLm> = Arc::new(load_model());
    start_with(model, configure)
}

fn load_model() -> DeepseekV3 {
    DeepseekV3::load(&ModelDir::open(model_dir()).unwrap(), 1 << 20).unwrap()
}

/// [`start`] with steps of 10 ms (a generation is still running when the next request comes)
/// and room for `max_queue` waiting requests.
fn start_slow(max_queue: usize) -> SocketAddr {
    start(|c| {
        c.step_delay = Duration::from_millis(10);
        c.max_queue = max_queue;
    })
}

/// [`start`] serving `model`.
fn start_with(model: Arc<dyn CausalLm>, configure: impl FnOnce(&mut ServerConfig)) -> SocketAddr {
    serve_dir(model_dir(), model, configure)
}

/// Starts a server for `model` with the tokenizer of the model directory `dir`.
fn serve_dir(dir: &Path, model: Arc<dyn CausalLm>, configure: impl FnOnce(&mut ServerConfig)) -> SocketAddr {
    let tokenizer = Arc::new(Tokenizer::from_dir(dir).unwrap());
    let eos = deltafin_tokenizer::eos_token_ids_union(dir, &tokenizer).unwrap();
    let session = Session::new(model, tokenizer, eos);
    let mut config = ServerConfig::new(MODEL);
    configure(&mut config);
    let conn = config.conn.clone();
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
            deltafin_server::serve(listener, router, &conn, std::future::pending())
                .await
                .unwrap();
        });
    });
    addr
}

struct Resp {
    /// Interim (1xx) statuses received before the final response, in order.
    interim: Vec<u16>,
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

/// Reads a response as HTTP/1.1 clients do: interim 1xx responses (RFC 9110 §15.2) are
/// skipped (and recorded), then the final one is read to its end.
fn read_response(s: TcpStream) -> Resp {
    let mut r = BufReader::new(s);
    let mut line = String::new();
    let mut interim = Vec::new();
    let (status, headers) = loop {
        line.clear();
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
        if (100..200).contains(&status) {
            interim.push(status);
        } else {
            break (status, headers);
        }
    };
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
        interim,
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

/// Starts a streaming chat generation of `tokens` tokens and returns its reader once the first
/// `data:` line has been read.
fn stream_to_first_data(a: SocketAddr, tokens: usize) -> BufReader<TcpStream> {
    let mut body = chat_body(tokens);
    body["stream"] = json!(true);
    let s = send(a, "POST", "/v1/chat/completions", body.to_string().as_bytes(), &[]);
    let mut r = BufReader::new(s);
    let mut line = String::new();
    while !line.starts_with("data: ") {
        line.clear();
        r.read_line(&mut line).unwrap();
    }
    r
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

/// `POST /v1/chat/completions` of [`chat_body`]`(max_tokens)` with the fields of `extra` set.
fn chat_with(a: SocketAddr, max_tokens: usize, extra: Value) -> Resp {
    post(a, "/v1/chat/completions", &with(chat_body(max_tokens), extra))
}

/// `POST /v1/completions` of the prompt "Hi" for `max_tokens`, with the fields of `extra` set.
fn cmpl_with(a: SocketAddr, max_tokens: usize, extra: Value) -> Resp {
    post(
        a,
        "/v1/completions",
        &with(json!({"model": MODEL, "prompt": "Hi", "max_tokens": max_tokens}), extra),
    )
}

/// `POST /v1/messages` of [`hello`] for `max_tokens`, with the fields of `extra` set.
fn messages_with(a: SocketAddr, max_tokens: usize, extra: Value) -> Resp {
    post(
        a,
        "/v1/messages",
        &with(
            json!({"model": MODEL, "max_tokens": max_tokens, "messages": hello()}),
            extra,
        ),
    )
}

/// `send` answers every body of `extras` with a 200.
fn assert_accepted(send: impl Fn(Value) -> Resp, extras: impl IntoIterator<Item = Value>) {
    for extra in extras {
        let r = send(extra.clone());
        assert_eq!(r.status, 200, "{extra}: {}", r.body);
    }
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
    assert_eq!(r.json()["error"]["param"], "messages[0].role", "{}", r.body);
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
fn without_a_queue_twenty_concurrent_requests_one_runs_the_rest_get_429() {
    let a = start(|c| {
        c.step_delay = Duration::from_millis(5);
        c.max_queue = 0;
    });
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
    let r = stream_to_first_data(a, 100);
    // The role chunk can be sent before the compute thread picks the job up: wait for it.
    wait_for_metric(a, "deltafin_generation_active", 1.0);
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

/// Sends a non-streaming 100-token completion with `headers` and returns its socket once the
/// generation runs.
fn running_completion(a: SocketAddr, headers: &[(&str, &str)]) -> TcpStream {
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 100, "ignore_eos": true});
    let s = send(a, "POST", "/v1/completions", body.to_string().as_bytes(), headers);
    wait_for_metric(a, "deltafin_generation_active", 1.0);
    s
}

/// A client that closes its socket (the server reads its end of stream; the default
/// `--half-close probe` then sees the reset its interim response draws) is cancelled.
#[test]
fn non_streaming_disconnect_also_cancels() {
    let a = start(|c| c.step_delay = Duration::from_millis(20));
    let s = running_completion(a, &[]);
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
    let chat = |extra: Value| chat_with(a, 2, extra);
    let cmpl = |extra: Value| cmpl_with(a, 2, extra);
    let refused = [
        (chat(json!({"response_format": {"type": "xml"}})), "response_format"),
        (
            chat(json!({"response_format": {"type": "json_schema"}})),
            "response_format.json_schema",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}})),
            "response_format.json_schema.name",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": 3}}})),
            "response_format.json_schema.schema",
        ),
        (
            chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": "yes"}}})),
            "response_format.json_schema.strict",
        ),
        // A schema llguidance cannot enforce (a remote reference).
        (
            chat(
                json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "https://example.com/s.json"}}}}),
            ),
            "response_format",
        ),
        (chat(json!({"response_format": "json"})), "response_format"),
        (chat(json!({"best_of": 2})), "best_of"),
        (cmpl(json!({"response_format": {"type": "json"}})), "response_format"),
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
        chat(json!({"response_format": {"type": "json_object"}})),
        chat(json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}})),
        cmpl(json!({"response_format": {"type": "json_object"}})),
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
    let chat = |extra: Value| chat_with(a, 2, extra);
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
        (
            json!({"tools": [tool], "tool_choice": "required", "parallel_tool_calls": "no"}),
            "parallel_tool_calls",
        ),
        (
            json!({"tools": [tool], "tool_choice": "required", "response_format": {"type": "json_object"}}),
            "response_format",
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
    assert_accepted(
        chat,
        [
            json!({"tools": [tool]}),
            json!({"tools": [tool], "tool_choice": "required"}),
            json!({"tools": [tool], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}),
            json!({"tools": [tool], "tool_choice": "auto"}),
            json!({"tools": [tool], "tool_choice": "none"}),
            json!({"tools": [], "tool_choice": "auto"}),
            json!({"tools": null, "tool_choice": null}),
        ],
    );
}

/// `/v1/messages` takes custom tools (rendered to the template in OpenAI's shape): a malformed
/// tool, a server tool, or a `tool_choice` naming no tool is an Anthropic-shaped 400 naming the
/// field, never silently dropped; `auto`, `none`, `any` and `tool` work.
#[test]
fn anthropic_tools_are_checked_and_accepted() {
    let a = start(|_| {});
    let msg = |extra: Value| messages_with(a, 2, extra);
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
        (json!({"tool_choice": {"type": "any"}}), "tool_choice"),
        (
            json!({"tools": [tool], "tool_choice": {"type": "tool", "name": "get_time"}}),
            "tool_choice.name",
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
    assert_accepted(
        msg,
        [
            json!({"tools": [tool]}),
            json!({"tools": [tool], "tool_choice": {"type": "auto"}}),
            json!({"tools": [tool], "tool_choice": {"type": "none"}}),
            json!({"tools": [tool], "tool_choice": {"type": "any"}}),
            json!({"tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"}}),
            json!({"tools": []}),
            json!({"tools": null}),
            json!({"tool_choice": {"type": "auto"}}),
            json!({"tool_choice": {"type": "none"}}),
        ],
    );
}

/// Anthropic `thinking` is accepted (enabled with a budget, or disabled) and checked; a bad one
/// is a 400 naming `thinking`. OpenAI `reasoning_effort` and `chat_template_kwargs` reach the
/// template (a kwarg the template reads changes the prompt) and are type-checked.
#[test]
fn thinking_reasoning_effort_and_template_kwargs() {
    let a = start(|_| {});
    let msg = |extra: Value| messages_with(a, 2, extra);
    assert_accepted(
        msg,
        [
            json!({"thinking": {"type": "enabled", "budget_tokens": 1024}}),
            json!({"thinking": {"type": "disabled"}}),
        ],
    );
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
    let chat = |extra: Value| chat_with(a, 2, extra);
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

/// The bytes of every token of the fixture's vocabulary (index = id).
fn vocab_bytes() -> Vec<Vec<u8>> {
    let t = Tokenizer::from_dir(model_dir()).unwrap();
    (0..t.vocab_size() as u32)
        .map(|id| t.token_bytes(id).unwrap_or_default())
        .collect()
}

/// Token ids absent from `prompt` whose bytes are plain text no other token has, so a
/// generated token's bytes name its id.
fn fresh_tokens(vocab: &[Vec<u8>], prompt: &[u32]) -> Vec<u32> {
    (2..vocab.len() as u32)
        .filter(|&id| {
            let b = &vocab[id as usize];
            !prompt.contains(&id)
                && !b.is_empty()
                && b.iter().all(u8::is_ascii_alphanumeric)
                && vocab.iter().filter(|o| *o == b).count() == 1
        })
        .collect()
}

/// Two [`fresh_tokens`] of the prompt of [`hello`].
fn two_fresh_tokens(vocab: &[Vec<u8>]) -> (u32, u32) {
    let t = Tokenizer::from_dir(model_dir()).unwrap();
    let rendered = t
        .chat_template()
        .unwrap()
        .render(hello().as_array().unwrap(), true, &Value::Null)
        .unwrap();
    let fresh = fresh_tokens(vocab, &t.encode(&rendered, false).unwrap());
    (fresh[0], fresh[1])
}

/// The bytes of each token a chat completion of [`hello`] generates (`max_tokens` of them:
/// end-of-sequence ignored), greedy unless `extra` says otherwise.
fn generated_bytes(a: SocketAddr, extra: Value, max_tokens: usize) -> Vec<Vec<u8>> {
    let body = with(with(chat_body(max_tokens), json!({"logprobs": true})), extra);
    let r = post(a, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.body);
    r.json()["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| check_entry_bytes(e).0)
        .collect()
}

/// Each sampling field changes what is generated exactly as its hand-worked rule says. The
/// fixture's logits are at most 11.1 in magnitude (its `expected.json` `max_abs_logit`), so a
/// bias lead above 22.2 decides a step whatever the model says; closer calls are calibrated on
/// the model's raw log-probabilities.
#[test]
fn every_sampling_field_has_its_effect() {
    let a = start(|_| {});
    let vocab = vocab_bytes();
    let (t, u) = two_fresh_tokens(&vocab);
    let (tb, ub) = (vocab[t as usize].clone(), vocab[u as usize].clone());
    let gen = |extra: Value| generated_bytes(a, extra, 6);
    let bias = |pairs: &[(u32, f64)]| {
        let m: serde_json::Map<String, Value> = pairs.iter().map(|(id, b)| (id.to_string(), json!(b))).collect();
        json!({"logit_bias": m})
    };

    // logit_bias: +100 forces a token, greedy or sampled; -100 on the greedy token changes it.
    let greedy = gen(json!({}));
    assert_eq!(gen(bias(&[(t, 100.0)])), vec![tb.clone(); 6]);
    assert_eq!(
        gen(with(bias(&[(t, 100.0)]), json!({"temperature": 1.5, "seed": 4}))),
        vec![tb.clone(); 6]
    );
    let banned: Vec<(u32, f64)> = (0..vocab.len() as u32)
        .filter(|&id| vocab[id as usize] == greedy[0])
        .map(|id| (id, -100.0))
        .collect();
    assert_ne!(gen(bias(&banned))[0], greedy[0]);
    // Completions too.
    let r = post(
        a,
        "/v1/completions",
        &with(
            json!({"model": MODEL, "prompt": [0, 5, 6], "max_tokens": 3, "ignore_eos": true}),
            bias(&[(t, 100.0)]),
        ),
    );
    assert_eq!(r.status, 200, "{}", r.body);
    let tt = String::from_utf8(tb.clone()).unwrap();
    assert_eq!(r.json()["choices"][0]["text"], tt.repeat(3));

    // repetition_penalty 4: T (+100) is seen after the first step, (100 + l) / 4 ≤ 27.8 < 38.9 ≤
    // 50 + l: U (+50) comes next; without the penalty T always wins (lead 50 > 22.2).
    let forced = bias(&[(t, 100.0), (u, 50.0)]);
    assert_eq!(gen(forced.clone()), vec![tb.clone(); 6]);
    let r = gen(with(forced, json!({"repetition_penalty": 4.0})));
    assert_eq!(r[..2], [tb.clone(), ub.clone()]);

    // frequency_penalty grows with each use. T +100, U +75: a lead of 25, more than any two
    // logits of this fixture differ (|logit| ≤ 11.1), so without a penalty T always wins; at 2
    // per use T's lead is gone after at most 24 uses and U appears. presence_penalty (once per
    // token) never closes it.
    let far = bias(&[(t, 100.0), (u, 75.0)]);
    let n = 30;
    assert_eq!(generated_bytes(a, far.clone(), n), vec![tb.clone(); n]);
    assert_eq!(
        generated_bytes(a, with(far.clone(), json!({"presence_penalty": 2})), n),
        vec![tb.clone(); n]
    );
    let f = generated_bytes(a, with(far, json!({"frequency_penalty": 2})), n);
    assert_eq!(
        f[..2],
        [tb.clone(), tb.clone()],
        "T leads by 25 ± 22.2 for its first two uses"
    );
    assert!(f.contains(&ub) && f.iter().all(|b| *b == tb || *b == ub), "{f:?}");

    // presence_penalty, calibrated on the model's raw logits (a forced token's reported
    // log-probability is the raw model's): with d = logit(T) - logit(U) after the prompt and T,
    // biases making bias(U) - bias(T) = d - 1 give T, T without the penalty (T leads by 1 at the
    // second step) and T, U with presence 2 (T trails by 1), provided T also wins the first step.
    let p = [0u32, 5, 6];
    let raw_lp = |prompt: &[u32], id: u32| -> f64 {
        let body = json!({"model": MODEL, "prompt": prompt, "max_tokens": 1, "logprobs": 0, "ignore_eos": true});
        let r = post(a, "/v1/completions", &with(body, bias(&[(id, 100.0)])));
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["logprobs"]["token_logprobs"][0]
            .as_f64()
            .unwrap()
    };
    let fresh = fresh_tokens(&vocab, &p);
    let (t2, u2, x) = fresh
        .iter()
        .take(6)
        .flat_map(|&t| fresh.iter().take(6).map(move |&u| (t, u)))
        .filter(|(t, u)| t != u)
        .find_map(|(t, u)| {
            let d1 = raw_lp(&p, t) - raw_lp(&p, u);
            let pt = [&p[..], &[t]].concat();
            let d = raw_lp(&pt, t) - raw_lp(&pt, u);
            // First step: T leads U by d1 - (d - 1).
            (d1 - d + 1.0 >= 0.5).then_some((t, u, d - 1.0))
        })
        .expect("a token pair whose first step T wins");
    let (bt, bu) = if x <= 0.0 {
        (100.0, 100.0 + x)
    } else {
        (100.0 - x, 100.0)
    };
    let two = |extra: Value| {
        let body = json!({"model": MODEL, "prompt": p, "max_tokens": 2, "ignore_eos": true});
        let r = post(
            a,
            "/v1/completions",
            &with(with(body, bias(&[(t2, bt), (u2, bu)])), extra),
        );
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["choices"][0]["text"].as_str().unwrap().to_string()
    };
    let word = |id: u32| String::from_utf8(vocab[id as usize].clone()).unwrap();
    assert_eq!(two(json!({})), word(t2).repeat(2));
    assert_eq!(two(json!({"presence_penalty": 2})), word(t2) + &word(u2));

    // min_p 1 keeps only the most likely token: sampling gives the greedy output, while the same
    // seed without it samples something else.
    let sampled = json!({"temperature": 1.5, "seed": 3});
    assert_ne!(gen(sampled.clone()), greedy);
    assert_eq!(gen(with(sampled.clone(), json!({"min_p": 1.0}))), greedy);
    assert_eq!(gen(with(sampled, json!({"top_k": 1}))), greedy);

    // Anthropic `top_k` 1 at temperature 1 is the greedy answer.
    let msg = |extra: Value| {
        let r = messages_with(a, 8, extra);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["content"][0]["text"].clone()
    };
    assert_eq!(msg(json!({"temperature": 1.0, "top_k": 1})), msg(json!({})));
}

/// Out-of-range sampling fields are 400 naming the field (never accepted and ignored); the
/// range limits themselves and nulls are accepted.
#[test]
fn sampling_fields_out_of_range_are_400_naming_the_field() {
    let a = start(|_| {});
    let chat = |extra: &Value| chat_with(a, 1, extra.clone());
    let cmpl = |extra: &Value| cmpl_with(a, 1, extra.clone());
    for (extra, param, needle) in [
        (json!({"logit_bias": {"7": 101}}), "logit_bias", "from -100 to 100"),
        (json!({"logit_bias": {"7": -100.5}}), "logit_bias", "from -100 to 100"),
        (json!({"logit_bias": {"7": "up"}}), "logit_bias", "from -100 to 100"),
        (json!({"logit_bias": {"512": 1}}), "logit_bias", "out of range"),
        (json!({"logit_bias": {"-1": 1}}), "logit_bias", "out of range"),
        (json!({"logit_bias": {"x": 1}}), "logit_bias", "not a token id"),
        (json!({"logit_bias": [7, 1]}), "logit_bias", "must be an object"),
        (json!({"presence_penalty": 2.5}), "presence_penalty", "between -2 and 2"),
        (
            json!({"presence_penalty": -2.01}),
            "presence_penalty",
            "between -2 and 2",
        ),
        (json!({"frequency_penalty": 3}), "frequency_penalty", "between -2 and 2"),
        (
            json!({"frequency_penalty": "x"}),
            "frequency_penalty",
            "frequency_penalty",
        ),
        (json!({"repetition_penalty": 0}), "repetition_penalty", "greater than 0"),
        (
            json!({"repetition_penalty": -1.5}),
            "repetition_penalty",
            "greater than 0",
        ),
        (json!({"min_p": 1.5}), "min_p", "between 0 and 1"),
        (json!({"min_p": -0.1}), "min_p", "between 0 and 1"),
    ] {
        for r in [chat(&extra), cmpl(&extra)] {
            assert_openai_error(&r, 400);
            let e = &r.json()["error"];
            assert_eq!(e["param"], param, "{extra}: {}", r.body);
            let m = e["message"].as_str().unwrap();
            assert!(
                m.contains(needle) && m.contains(param) && !m.contains('\n'),
                "{extra}: {m}"
            );
        }
    }
    for extra in [
        json!({"logit_bias": {"511": -100, "0": 100}, "presence_penalty": -2, "frequency_penalty": 2}),
        json!({"logit_bias": {}, "presence_penalty": 2, "frequency_penalty": -2, "min_p": 1}),
        json!({"logit_bias": null, "presence_penalty": null, "frequency_penalty": null,
               "repetition_penalty": null, "min_p": null}),
        json!({"repetition_penalty": 1.0, "min_p": 0}),
    ] {
        for r in [chat(&extra), cmpl(&extra)] {
            assert_eq!(r.status, 200, "{extra}: {}", r.body);
        }
    }
}
// ---------------------------------------------------------------------------------------------
// Issue #19: queueing, limits, timeouts, panics, request-body fuzzing
// ---------------------------------------------------------------------------------------------

/// Waits up to 10 s for `/metrics` `name` to equal `want`.
fn wait_for_metric(addr: SocketAddr, name: &str, want: f64) {
    let t0 = Instant::now();
    loop {
        let v = metric(addr, name);
        if v == want {
            return;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "{name} is {v}, want {want}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Starts a streaming generation of `tokens` tokens and returns once it runs (its reader).
fn start_running(a: SocketAddr, tokens: usize) -> BufReader<TcpStream> {
    let r = stream_to_first_data(a, tokens);
    wait_for_metric(a, "deltafin_generation_active", 1.0);
    r
}

#[test]
fn requests_queue_in_arrival_order_and_429_only_when_the_queue_is_full() {
    let a = start_slow(2);
    let running = start_running(a, 60);
    let done = Arc::new(std::sync::Mutex::new(Vec::new()));
    let mut waiting = Vec::new();
    for (i, depth) in [(1, 1.0), (2, 2.0)] {
        let done = Arc::clone(&done);
        waiting.push(std::thread::spawn(move || {
            let r = post(a, "/v1/chat/completions", &chat_body(3));
            done.lock().unwrap().push(i);
            r
        }));
        wait_for_metric(a, "deltafin_queue_depth", depth);
    }
    // One runs and two wait: the next gets 429 naming the queue, at once.
    let busy = post(a, "/v1/chat/completions", &chat_body(3));
    assert_openai_error(&busy, 429);
    assert!(busy.header("retry-after").is_some());
    assert!(busy.json()["error"]["message"]
        .as_str()
        .unwrap()
        .contains("--max-queue"));
    let anthropic_busy = post(
        a,
        "/v1/messages",
        &json!({"model": MODEL, "messages": hello(), "max_tokens": 2}),
    );
    assert_eq!(anthropic_busy.status, 429, "{}", anthropic_busy.body);
    assert_eq!(anthropic_busy.json()["type"], "error");
    drop(running);
    for w in waiting {
        let r = w.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.body);
    }
    // First in, first out.
    assert_eq!(*done.lock().unwrap(), vec![1, 2]);
    assert_eq!(metric(a, "deltafin_queue_depth"), 0.0);
}

#[test]
fn a_queued_request_whose_client_leaves_gives_its_place_back_and_never_runs() {
    let a = start_slow(1);
    let running = start_running(a, 100);
    let queued = send(
        a,
        "POST",
        "/v1/completions",
        json!({"model": MODEL, "prompt": "x", "max_tokens": 50})
            .to_string()
            .as_bytes(),
        &[],
    );
    wait_for_metric(a, "deltafin_queue_depth", 1.0);
    queued.shutdown(std::net::Shutdown::Both).unwrap();
    drop(queued);
    wait_for_metric(a, "deltafin_queue_depth", 0.0);
    // Its place is free again: this one queues instead of getting 429.
    let next = std::thread::spawn(move || post(a, "/v1/chat/completions", &chat_body(2)));
    wait_for_metric(a, "deltafin_queue_depth", 1.0);
    drop(running);
    assert_eq!(next.join().unwrap().status, 200);
    // Two generations ran (the streamed one, cancelled, and the last); the abandoned one never did.
    assert_eq!(metric(a, "deltafin_generations_total"), 2.0);
    wait_for_requests(a, "/v1/completions", &[(499, 1.0)]);
}

#[test]
fn metrics_report_queue_depth_and_latency_histograms() {
    let a = start(|_| {});
    let r = post(a, "/v1/chat/completions", &chat_body(5));
    assert_eq!(r.status, 200, "{}", r.body);
    let text = get(a, "/metrics").body;
    for line in [
        "# TYPE deltafin_queue_depth gauge",
        "# TYPE deltafin_time_to_first_token_seconds histogram",
        "# TYPE deltafin_inter_token_latency_seconds histogram",
        // The names kept from before.
        "# TYPE deltafin_requests_total counter",
        "# TYPE deltafin_completion_tokens_total counter",
    ] {
        assert!(text.lines().any(|l| l == line), "{line} missing:\n{text}");
    }
    assert!(!text.contains("# EOF"), "{text}");
    assert_eq!(metric(a, "deltafin_time_to_first_token_seconds_count"), 1.0);
    assert_eq!(metric(a, "deltafin_inter_token_latency_seconds_count"), 4.0);
    assert!(metric(a, "deltafin_time_to_first_token_seconds_sum") > 0.0);
    assert!(
        text.contains("deltafin_time_to_first_token_seconds_bucket{le=\"+Inf\"} 1"),
        "{text}"
    );
}

#[test]
fn an_over_long_prompt_is_refused_by_bytes_before_it_is_queued_or_tokenized() {
    let a = start_slow(0);
    // The fixture's context is 128 tokens: at most 128 × 16 bytes of prompt text.
    let max = deltafin_server::limits::max_prompt_bytes(128);
    let long = "a".repeat(max + 1);
    // While a generation runs and nothing may queue, the size is still checked first: 400, not 429.
    let running = start_running(a, 100);
    for (path, body, param) in [
        ("/v1/completions", json!({"model": MODEL, "prompt": long}), "prompt"),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": [{"role": "user", "content": long}]}),
            "messages",
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": long}]}),
            "messages",
        ),
    ] {
        let r = post(a, path, &body);
        assert_eq!(r.status, 400, "{path}: {}", r.body);
        let m = r.json()["error"]["message"].as_str().unwrap().to_string();
        assert!(m.contains(&format!("`{param}`")) && m.contains("bytes"), "{path}: {m}");
        if path != "/v1/messages" {
            assert_eq!(r.json()["error"]["code"], "context_length_exceeded");
            assert_eq!(r.json()["error"]["param"], param);
        }
    }
    // A prompt within the bound waits for its turn like any other: 429 here (no queue).
    assert_eq!(
        post(a, "/v1/completions", &json!({"model": MODEL, "prompt": "hi"})).status,
        429
    );
    drop(running);
}

#[test]
fn the_bearer_scheme_is_case_insensitive() {
    let a = start(|c| c.api_key = Some("sekret".into()));
    for auth in ["Bearer sekret", "bearer sekret", "BEARER sekret", "bEaReR  sekret"] {
        let r = read_response(send(a, "GET", "/v1/models", b"", &[("Authorization", auth)]));
        assert_eq!(r.status, 200, "{auth}: {}", r.body);
    }
    for auth in ["Basic sekret", "Bearer other", "Bearersekret", "sekret"] {
        let r = read_response(send(a, "GET", "/v1/models", b"", &[("Authorization", auth)]));
        assert_eq!(r.status, 401, "{auth}: {}", r.body);
    }
}

/// A request whose client then shuts down its sending side, after a few decode steps have run
/// (so the end of stream reaches the server before any of the answer is ready).
fn half_closed_request(a: SocketAddr, stream: bool) -> TcpStream {
    let mut body = chat_body(20);
    body["stream"] = json!(stream);
    let s = send(a, "POST", "/v1/chat/completions", body.to_string().as_bytes(), &[]);
    wait_for_metric(a, "deltafin_generation_active", 1.0);
    s.shutdown(std::net::Shutdown::Write).unwrap();
    s
}

#[test]
fn a_client_that_shuts_down_its_sending_side_gets_the_answer() {
    // The default (`probe`): a 100 Continue before a non-streaming answer, none in a stream
    // whose headers went out before the end of stream arrived; nothing cancelled.
    let a = start(|c| c.step_delay = Duration::from_millis(10));
    for stream in [false, true] {
        let r = read_response(half_closed_request(a, stream));
        assert_eq!(r.status, 200, "stream {stream}: {}", r.body);
        assert!(r.body.contains("chat.completion"), "{}", r.body);
        // A stream's headers usually go out before the end of stream arrives (then no probe).
        if stream {
            assert!(r.interim.len() <= 1, "{:?}", r.interim);
        } else {
            assert_eq!(r.interim, [100]);
        }
    }
    assert_eq!(metric(a, "deltafin_generations_cancelled_total"), 0.0);
    wait_for_requests(a, "/v1/chat/completions", &[(200, 2.0)]);
    // `answer`: the same answers, never a probe.
    let a = start(|c| {
        c.step_delay = Duration::from_millis(10);
        c.conn.half_close = HalfClose::Answer;
    });
    for stream in [false, true] {
        let r = read_response(half_closed_request(a, stream));
        assert_eq!((r.status, r.interim.len()), (200, 0), "stream {stream}: {}", r.body);
    }
}

#[test]
fn a_request_half_closed_at_once_is_answered() {
    // The end of stream right behind the request: hyper can have the whole body off the wire
    // before the handler reads it, and the end of stream must wait for that (it once passed
    // to hyper as a body cut short: no answer). Many times, to meet the race.
    let a = start(|_| {});
    let body = json!({"model": MODEL, "prompt": "x", "max_tokens": 1});
    for i in 0..60 {
        let s = send(a, "POST", "/v1/completions", body.to_string().as_bytes(), &[]);
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let r = read_response(s);
        assert_eq!(r.status, 200, "request {i}: {}", r.body);
        assert!(r.body.contains("text_completion"), "request {i}: {}", r.body);
    }
}

#[test]
fn half_close_disconnect_mode_cancels_at_the_end_of_stream() {
    let a = start(|c| {
        c.step_delay = Duration::from_millis(10);
        c.conn.half_close = HalfClose::Disconnect;
    });
    let mut s = half_closed_request(a, false);
    let mut got = Vec::new();
    s.read_to_end(&mut got).unwrap();
    assert!(got.is_empty(), "{}", String::from_utf8_lossy(&got));
    wait_for_requests(a, "/v1/chat/completions", &[(499, 1.0)]);
    wait_for_metric(a, "deltafin_generations_cancelled_total", 1.0);
}

#[test]
fn a_client_that_sent_expect_100_continue_and_closed_is_cancelled() {
    // hyper answers the Expect with its own 100 Continue; that is not the response, so the end
    // of stream is still probed and the client's reset cancels the generation.
    let a = start(|c| c.step_delay = Duration::from_millis(20));
    let mut s = running_completion(a, &[("Expect", "100-continue")]);
    // Read hyper's 100 (as curl does): a socket closed with unread data would send a reset
    // at once, which cancels without any probe.
    let mut interim = [0u8; 25];
    s.read_exact(&mut interim).unwrap();
    assert_eq!(&interim, b"HTTP/1.1 100 Continue\r\n\r\n");
    drop(s);
    wait_for_requests(a, "/v1/completions", &[(499, 1.0)]);
    wait_for_metric(a, "deltafin_generations_cancelled_total", 1.0);
    assert!(metric(a, "deltafin_completion_tokens_total") < 50.0);
}

#[test]
fn a_body_cut_short_by_a_half_close_fails_at_once() {
    // The end of stream inside a body: 400 now, not 408 after the body timeout (30 s here).
    let a = start(|_| {});
    for mode_expect in [false, true] {
        let mut s = TcpStream::connect(a).unwrap();
        s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let expect = if mode_expect { "Expect: 100-continue\r\n" } else { "" };
        write!(
            s,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n{expect}Content-Length: 100\r\n\r\n{{\"model\":"
        )
        .unwrap();
        s.shutdown(std::net::Shutdown::Write).unwrap();
        let t0 = Instant::now();
        let r = read_response(s);
        assert_eq!(r.status, 400, "{}", r.body);
        assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    }
}

#[test]
fn idle_and_stalled_connections_are_closed() {
    let a = start(|c| {
        c.conn.idle_timeout = Duration::from_millis(500);
        c.conn.body_timeout = Duration::from_millis(500);
    });
    // A connection that sends nothing, one that stops inside its headers, and a keep-alive one
    // after its answer: each is closed by the server (read returns end of stream).
    let idle = TcpStream::connect(a).unwrap();
    let mut partial = TcpStream::connect(a).unwrap();
    partial.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let mut keep = TcpStream::connect(a).unwrap();
    keep.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").unwrap();
    for (name, mut s) in [("idle", idle), ("partial headers", partial), ("keep-alive", keep)] {
        s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
        let mut buf = Vec::new();
        let r = s.read_to_end(&mut buf);
        assert!(r.is_ok(), "{name}: the server never closed the connection: {r:?}");
        if name == "keep-alive" {
            assert!(String::from_utf8_lossy(&buf).starts_with("HTTP/1.1 200"), "{name}");
        }
    }
    // A body shorter than its Content-Length: 408 once it stalls, then the connection closes.
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n{\"model\":")
        .unwrap();
    let r = read_response(s);
    assert_openai_error(&r, 408);
    // A declared 10 GB body: 413 at once, before any of it is sent.
    let mut s = TcpStream::connect(a).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    s.write_all(b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 10000000000\r\n\r\n")
        .unwrap();
    let r = read_response(s);
    assert_eq!(r.status, 413, "{}", r.body);
    assert_eq!(r.json()["error"]["type"], "request_too_large", "{}", r.body);
    // Counted like any other answered request.
    assert_eq!(requests(a, "/v1/messages", 413), 1.0);
    assert_eq!(get(a, "/health").status, 200);
}

#[test]
fn connections_beyond_the_cap_wait_until_one_closes() {
    let a = start(|c| c.conn.max_connections = 1);
    let holder = TcpStream::connect(a).unwrap();
    // Give the server the time to accept the first connection.
    std::thread::sleep(Duration::from_millis(200));
    let mut waiting = send(a, "GET", "/health", b"", &[]);
    waiting.set_read_timeout(Some(Duration::from_millis(500))).unwrap();
    let mut byte = [0u8; 1];
    let r = waiting.read(&mut byte);
    assert!(r.is_err(), "answered beyond the connection cap: {r:?}");
    drop(holder);
    waiting.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    let mut rest = Vec::new();
    waiting.read_to_end(&mut rest).unwrap();
    assert!(
        String::from_utf8_lossy(&rest).starts_with("HTTP/1.1 200"),
        "{}",
        String::from_utf8_lossy(&rest)
    );
}

/// The fixture model with what a test changes: a longer context ([`long_context`]), or panics
/// ([`panicky`]).
struct TestModel {
    inner: DeepseekV3,
    /// The context length instead of the configuration's.
    context_length: Option<usize>,
    /// Whether passes over [`PANIC_TOKEN`] and [`FATAL_TOKEN`] panic.
    panics: bool,
    /// Set by a pass over [`FATAL_TOKEN`].
    fatal: std::sync::atomic::AtomicBool,
}

const PANIC_TOKEN: u32 = 511;
const FATAL_TOKEN: u32 = 510;

impl TestModel {
    fn check(&self, tokens: &[u32]) {
        if !self.panics {
            return;
        }
        if tokens.contains(&FATAL_TOKEN) {
            self.fatal.store(true, std::sync::atomic::Ordering::SeqCst);
        }
        if tokens.contains(&PANIC_TOKEN) || tokens.contains(&FATAL_TOKEN) {
            // As `f32::clamp` does with swiglu_limit < 0, on a rayon worker.
            rayon::scope(|s| s.spawn(|_| panic!("min > max, or either was NaN. min = 7.0, max = -7.0")));
        }
    }
}

impl CausalLm for TestModel {
    fn config(&self) -> &deltafin_format::ModelConfig {
        self.inner.config()
    }
    fn context_length(&self) -> usize {
        self.context_length
            .unwrap_or_else(|| self.config().max_position_embeddings())
    }
    fn new_state(&self) -> Box<dyn deltafin_engine::DecodeState> {
        assert!(
            !self.fatal.load(std::sync::atomic::Ordering::SeqCst),
            "cannot allocate a new state"
        );
        self.inner.new_state()
    }
    fn forward(
        &self,
        state: &mut dyn deltafin_engine::DecodeState,
        token: u32,
    ) -> Result<(Vec<f32>, deltafin_engine::LayerRoutes), deltafin_engine::EngineError> {
        self.check(&[token]);
        self.inner.forward(state, token)
    }
    fn forward_batch(
        &self,
        state: &mut dyn deltafin_engine::DecodeState,
        tokens: &[u32],
        all_logits: bool,
    ) -> Result<deltafin_engine::model::BatchOutput, deltafin_engine::EngineError> {
        self.check(tokens);
        self.inner.forward_batch(state, tokens, all_logits)
    }
    fn routed(&self) -> &deltafin_engine::model::RoutedExperts {
        self.inner.routed()
    }
    fn routed_mut(&mut self) -> &mut deltafin_engine::model::RoutedExperts {
        self.inner.routed_mut()
    }
    fn backbone_bytes(&self) -> usize {
        self.inner.backbone_bytes()
    }
}

/// A model that panics on a forward pass over [`PANIC_TOKEN`] (the way a kernel bug or a bad
/// hyperparameter would), on a compute-pool thread as the engine's expert tasks do; after a
/// pass over [`FATAL_TOKEN`] it also panics in `new_state`, so that the compute thread's own
/// recovery (resetting the cache) fails and the thread dies.
fn panicky() -> Arc<dyn CausalLm> {
    Arc::new(TestModel {
        inner: load_model(),
        context_length: None,
        panics: true,
        fatal: Default::default(),
    })
}

#[test]
fn a_panicking_generation_gets_500_naming_it_and_the_server_keeps_serving() {
    let a = start_with(panicky(), |_| {});
    for (path, stream) in [("/v1/completions", false), ("/v1/completions", true)] {
        let r = post(
            a,
            path,
            &json!({"model": MODEL, "prompt": [5, PANIC_TOKEN], "max_tokens": 2, "stream": stream}),
        );
        if stream {
            // The status was sent with the first event; the error comes in the stream.
            assert!(
                r.body.contains("panicked") && r.body.contains("min > max"),
                "{}",
                r.body
            );
            assert!(r.body.contains("data: [DONE]"), "{}", r.body);
        } else {
            assert_openai_error(&r, 500);
            let m = r.json()["error"]["message"].as_str().unwrap().to_string();
            assert!(m.contains("panicked") && m.contains("min > max"), "{m}");
        }
    }
    assert_eq!(get(a, "/health").json()["status"], "ok");
    let ok = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [5, 6], "max_tokens": 2}),
    );
    assert_eq!(ok.status, 200, "{}", ok.body);
    assert_eq!(metric(a, "deltafin_generations_failed_total"), 2.0);
}

#[test]
fn a_dead_compute_thread_shows_in_health_and_fails_requests_at_once() {
    let a = start_with(panicky(), |c| c.max_queue = 4);
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": [FATAL_TOKEN], "max_tokens": 2}),
    );
    assert!(r.status >= 500, "{}", r.body);
    let t0 = Instant::now();
    loop {
        let h = get(a, "/health");
        if h.status == 503 {
            assert_eq!(h.json()["status"], "error");
            assert!(h.json()["error"].as_str().unwrap().contains("compute thread"));
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(10), "/health still says {}", h.body);
        std::thread::sleep(Duration::from_millis(10));
    }
    for (path, body) in [
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": [5, 6], "max_tokens": 2}),
        ),
        ("/v1/chat/completions", chat_body(2)),
        (
            "/v1/messages",
            json!({"model": MODEL, "messages": hello(), "max_tokens": 2}),
        ),
    ] {
        let r = post(a, path, &body);
        assert_eq!(r.status, 503, "{path}: {}", r.body);
    }
}

/// A value likely to break a parser or a bound.
fn nasty(rng: &mut impl rand::Rng) -> Value {
    let n = rng.random_range(0..24);
    match n {
        0 => Value::Null,
        1 => json!(true),
        2 => json!(-1),
        3 => json!(0),
        4 => json!(1e308),
        5 => json!(-1e308),
        6 => json!(i64::MAX),
        7 => json!(u64::MAX),
        8 => json!(0.5),
        9 => json!(""),
        10 => json!("x".repeat(rng.random_range(1..5000))),
        11 => json!([]),
        12 => json!({}),
        13 => json!([[[[1]]]]),
        14 => json!("\u{0}\u{ffff}é\u{1F600}"),
        15 => json!([1, "a", null, {}]),
        16 => json!(rng.random::<u32>()),
        17 => json!(-(rng.random::<u32>() as i64)),
        18 => json!([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]),
        19 => json!([{"role": "tool", "content": null}]),
        20 => json!({"type": "function", "function": {"name": ""}}),
        21 => json!(["stop", "", "x"]),
        22 => {
            let mut v = json!(1);
            for _ in 0..rng.random_range(1..200) {
                v = json!([v]);
            }
            v
        }
        _ => json!({"role": "user", "content": "hi"}),
    }
}

/// Mutates a random place inside `v` (objects and arrays, possibly `v` itself).
fn mutate_json(rng: &mut impl rand::Rng, v: &mut Value) {
    if rng.random_bool(0.5) {
        match v {
            Value::Object(o) if !o.is_empty() => {
                let k = o.keys().nth(rng.random_range(0..o.len())).unwrap().clone();
                return mutate_json(rng, o.get_mut(&k).unwrap());
            }
            Value::Array(a) if !a.is_empty() => {
                let i = rng.random_range(0..a.len());
                return mutate_json(rng, &mut a[i]);
            }
            _ => {}
        }
    }
    let at = v;
    match at {
        Value::Object(o) if !o.is_empty() && rng.random_bool(0.4) => {
            let k = o.keys().nth(rng.random_range(0..o.len())).unwrap().clone();
            if rng.random_bool(0.5) {
                o.remove(&k);
            } else {
                o.insert(k, nasty(rng));
            }
        }
        Value::Object(o) if rng.random_bool(0.3) => {
            let keys = [
                "max_tokens",
                "stream",
                "logprobs",
                "top_logprobs",
                "n",
                "stop",
                "temperature",
                "top_p",
                "top_k",
                "seed",
                "tools",
                "tool_choice",
                "system",
                "stream_options",
                "echo",
                "prompt",
                "messages",
                "max_completion_tokens",
                "ignore_eos",
                "response_format",
                "best_of",
            ];
            o.insert(keys[rng.random_range(0..keys.len())].to_string(), nasty(rng));
        }
        Value::Array(a) if rng.random_bool(0.5) => a.push(nasty(rng)),
        other => *other = nasty(rng),
    }
}

/// `body` with a few bytes flipped, inserted, removed or the end cut.
fn mutate_bytes(rng: &mut impl rand::Rng, body: &mut Vec<u8>) {
    for _ in 0..rng.random_range(1..4) {
        if body.is_empty() {
            body.push(b'{');
        }
        let i = rng.random_range(0..body.len());
        match rng.random_range(0..4) {
            0 => body[i] = rng.random(),
            1 => {
                const PIECES: &[u8] = b"{}[]\",:0-e\\u";
                body.insert(i, PIECES[rng.random_range(0..PIECES.len())])
            }
            2 => {
                body.remove(i);
            }
            _ => body.truncate(i),
        }
    }
}

/// The request-body fuzzer of issue #19: seeded mutations of valid bodies for every
/// generation endpoint (structure-aware and byte-level), each sent on a fresh connection with a
/// client timeout. No response may be a 5xx (this server documents none for client input), none
/// may hang, and the server answers normally afterwards.
#[test]
fn fuzzed_request_bodies_never_get_a_5xx_or_hang() {
    use rand::{Rng, SeedableRng};
    let a = start(|c| c.max_tokens = Some(4));
    let seeds: [(&str, Value); 4] = [
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "max_tokens": 2, "stream": false}),
        ),
        (
            "/v1/chat/completions",
            json!({"model": MODEL, "messages": hello(), "max_tokens": 2, "stream": true, "logprobs": true, "top_logprobs": 2, "stop": ["x"]}),
        ),
        (
            "/v1/completions",
            json!({"model": MODEL, "prompt": "Once upon", "max_tokens": 2, "logprobs": 1}),
        ),
        (
            "/v1/messages",
            json!({"model": MODEL, "max_tokens": 2, "system": "Be brief.", "messages": [{"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
        ),
    ];
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x19);
    let mut statuses = std::collections::BTreeMap::<u16, usize>::new();
    for i in 0..3000 {
        let (path, seed) = &seeds[i % seeds.len()];
        let mut v = seed.clone();
        for _ in 0..rng.random_range(0..3) {
            mutate_json(&mut rng, &mut v);
        }
        let mut body = v.to_string().into_bytes();
        if rng.random_bool(0.2) {
            mutate_bytes(&mut rng, &mut body);
        }
        let r = read_response(send(a, "POST", path, &body, &[]));
        *statuses.entry(r.status).or_default() += 1;
        assert!(
            r.status < 500,
            "{path} answered {} to {}: {}",
            r.status,
            String::from_utf8_lossy(&body),
            r.body
        );
    }
    // Both accepted and refused bodies were exercised.
    assert!(statuses.get(&200).copied().unwrap_or(0) > 300, "{statuses:?}");
    assert!(statuses.get(&400).copied().unwrap_or(0) > 300, "{statuses:?}");
    assert_eq!(get(a, "/health").json()["status"], "ok");
    assert_eq!(post(a, "/v1/chat/completions", &chat_body(2)).status, 200);
}

/// Kimi K2's tool-call and turn tokens (special tokens, as in its tokenizer).
const K2_SPECIALS: &[&str] = &[
    "<|im_user|>",
    "<|im_assistant|>",
    "<|im_middle|>",
    "<|im_end|>",
    "<|tool_calls_section_begin|>",
    "<|tool_calls_section_end|>",
    "<|tool_call_begin|>",
    "<|tool_call_argument_begin|>",
    "<|tool_call_end|>",
];

/// A `tiny`-preset model (random weights, context 1024) with a byte-level tokenizer: with
/// Kimi K2's tool-call tokens (`k2`) or with no tool markup at all (`plain`: forced calls then
/// use the Hermes `<tool_call>` text).
fn tiny_model_dir(k2: bool) -> &'static Path {
    static K2: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    static PLAIN: OnceLock<(tempfile::TempDir, PathBuf)> = OnceLock::new();
    let make = || {
        let tmp = tempfile::tempdir().unwrap();
        let tok_dir = tmp.path().join("tokenizer");
        let (bos, eos) = ("<|bos|>", "<|eos|>");
        let mut specials = vec![bos, eos];
        if k2 {
            specials.extend_from_slice(K2_SPECIALS);
        }
        let template = "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}";
        let corpus = "{\"city\": \"Paris\", \"days\": 3, \"unit\": \"celsius\", \"hourly\": false} get_weather";
        deltafin_tokenizer::synth::write_byte_level_tokenizer(&tok_dir, corpus, 64, &specials, bos, eos, template)
            .unwrap();
        let tok = Tokenizer::from_dir(&tok_dir).unwrap();
        let files = deltafin_format::synth::TokenizerFiles {
            bos: tok.token_to_id(bos).unwrap(),
            eos: tok.token_to_id(eos).unwrap(),
            dir: tok_dir,
        };
        let preset = deltafin_format::synth::Preset::by_name("tiny", tok.vocab_size()).unwrap();
        let out = tmp.path().join("model");
        deltafin_format::synth::write_model_dir(&out, &preset, &files, false, &NoProgress).unwrap();
        (tmp, out)
    };
    &if k2 {
        K2.get_or_init(make)
    } else {
        PLAIN.get_or_init(make)
    }
    .1
}

fn start_tiny(k2: bool) -> SocketAddr {
    let dir = tiny_model_dir(k2);
    let model = DeepseekV3::load(&ModelDir::open(dir).unwrap(), 1 << 20).unwrap();
    serve_dir(dir, Arc::new(model), |_| {})
}

/// The schema of the structured-output tests: every value bounded, so that even a
/// random-weight model reaches the end of the grammar.
fn weather_schema() -> Value {
    json!({
        "type": "object",
        "properties": {
            "city": {"type": "string", "minLength": 1, "maxLength": 12},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "unit": {"enum": ["celsius", "fahrenheit"]},
            "hourly": {"type": "boolean"},
        },
        "required": ["city", "days", "unit", "hourly"],
        "additionalProperties": false,
    })
}

/// Checks `v` against [`weather_schema`] (by hand: the schema is fixed).
fn check_weather(v: &Value) {
    let o = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
    assert_eq!(o.len(), 4, "{v}");
    let city = o["city"].as_str().unwrap_or_else(|| panic!("city: {v}"));
    assert!((1..=12).contains(&city.chars().count()), "{v}");
    let days = o["days"].as_i64().unwrap_or_else(|| panic!("days: {v}"));
    assert!((1..=14).contains(&days), "{v}");
    assert!(matches!(o["unit"].as_str(), Some("celsius" | "fahrenheit")), "{v}");
    assert!(o["hourly"].is_boolean(), "{v}");
}

fn weather_tools() -> Value {
    json!([
        {"type": "function", "function": {"name": "get_weather", "description": "Weather", "parameters": weather_schema()}},
        {"type": "function", "function": {"name": "get_time", "description": "Time", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}},
    ])
}

/// `response_format` json_schema and json_object: the random-weight model's reply is JSON that
/// follows the schema, greedy and sampled, streamed or not, and ends with `finish_reason`
/// `"stop"` where the grammar ends.
#[test]
fn response_format_json_follows_the_schema() {
    let a = start_tiny(false);
    let schema_format =
        json!({"type": "json_schema", "json_schema": {"name": "weather", "strict": true, "schema": weather_schema()}});
    for sampling in [
        json!({}),
        json!({"temperature": 1.0, "seed": 7}),
        json!({"temperature": 0.8, "top_p": 0.9, "seed": 1}),
    ] {
        let body = with(
            with(chat_body(300), json!({"response_format": schema_format})),
            sampling.clone(),
        );
        let r = post(a, "/v1/chat/completions", &body);
        assert_eq!(r.status, 200, "{}", r.body);
        let v = r.json();
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{sampling}: {v}");
        let content = choice["message"]["content"].as_str().unwrap();
        check_weather(&serde_json::from_str(content).unwrap_or_else(|e| panic!("{e}: {content:?}")));
        // Streamed: the same reply in pieces.
        let r = post(a, "/v1/chat/completions", &with(body, json!({"stream": true})));
        let mut text = String::new();
        let mut finish = Value::Null;
        for d in r.sse_data() {
            if d == "[DONE]" {
                continue;
            }
            let c: Value = serde_json::from_str(&d).unwrap();
            if let Some(t) = c["choices"][0]["delta"]["content"].as_str() {
                text.push_str(t);
            }
            if !c["choices"][0]["finish_reason"].is_null() {
                finish = c["choices"][0]["finish_reason"].clone();
            }
        }
        assert_eq!(text, content, "{sampling}");
        assert_eq!(finish, "stop");
    }
    // json_object: any JSON object.
    let r = post(
        a,
        "/v1/chat/completions",
        &with(chat_body(400), json!({"response_format": {"type": "json_object"}})),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        serde_json::from_str::<Value>(content).unwrap().is_object(),
        "{content:?}"
    );
    // /v1/completions too.
    let r = post(
        a,
        "/v1/completions",
        &json!({"model": MODEL, "prompt": "Weather:", "max_tokens": 300, "response_format": schema_format}),
    );
    let v = r.json();
    assert_eq!(v["choices"][0]["finish_reason"], "stop", "{v}");
    check_weather(&serde_json::from_str(v["choices"][0]["text"].as_str().unwrap()).unwrap());
}

/// OpenAI `tool_choice` "required" and a named function, Anthropic `any` and `tool`: the
/// random-weight model's reply is a call, in the markup the server's parser reads (Kimi K2's
/// special tokens, or Hermes `<tool_call>` text for a tokenizer without tool markup), with
/// arguments that follow the tool's schema.
#[test]
fn forced_tool_calls_are_valid_calls() {
    for k2 in [true, false] {
        forced_calls(start_tiny(k2));
    }
}

fn forced_calls(a: SocketAddr) {
    let tools = weather_tools();
    for (choice, sampling, want) in [
        (json!("required"), json!({}), None),
        (json!("required"), json!({"temperature": 1.0, "seed": 3}), None),
        (
            json!({"type": "function", "function": {"name": "get_weather"}}),
            json!({}),
            Some("get_weather"),
        ),
        (
            json!({"type": "function", "function": {"name": "get_time"}}),
            json!({"temperature": 1.0, "seed": 5}),
            Some("get_time"),
        ),
    ] {
        let body = with(
            with(
                chat_body(300),
                json!({"tools": tools, "tool_choice": choice, "parallel_tool_calls": false}),
            ),
            sampling.clone(),
        );
        let v = post(a, "/v1/chat/completions", &body).json();
        let choice0 = &v["choices"][0];
        assert_eq!(choice0["finish_reason"], "tool_calls", "{choice} {sampling}: {v}");
        let calls = choice0["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{v}");
        let name = calls[0]["function"]["name"].as_str().unwrap();
        if let Some(w) = want {
            assert_eq!(name, w, "{v}");
        }
        let args: Value = serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        match name {
            "get_weather" => check_weather(&args),
            "get_time" => assert_eq!(args, json!({})),
            other => panic!("unknown tool {other}: {v}"),
        }
        assert!(calls[0]["id"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
        // Streamed: the call's name in its first delta, the arguments in pieces.
        let r = post(a, "/v1/chat/completions", &with(body, json!({"stream": true})));
        let mut streamed_name = String::new();
        let mut streamed_args = String::new();
        let mut finish = Value::Null;
        for d in r.sse_data().iter().filter(|d| *d != "[DONE]") {
            let c: Value = serde_json::from_str(d).unwrap();
            for tc in c["choices"][0]["delta"]["tool_calls"].as_array().into_iter().flatten() {
                if let Some(n) = tc["function"]["name"].as_str() {
                    streamed_name.push_str(n);
                }
                if let Some(x) = tc["function"]["arguments"].as_str() {
                    streamed_args.push_str(x);
                }
            }
            if !c["choices"][0]["finish_reason"].is_null() {
                finish = c["choices"][0]["finish_reason"].clone();
            }
        }
        assert_eq!(streamed_name, name);
        assert_eq!(serde_json::from_str::<Value>(&streamed_args).unwrap(), args);
        assert_eq!(finish, "tool_calls");
    }

    let anthropic_tools = json!([
        {"name": "get_weather", "description": "Weather", "input_schema": weather_schema()},
        {"name": "get_time", "input_schema": {"type": "object", "properties": {}, "additionalProperties": false}},
    ]);
    for (choice, want) in [
        (json!({"type": "any", "disable_parallel_tool_use": true}), None),
        (
            json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true}),
            Some("get_weather"),
        ),
    ] {
        let body = json!({"model": MODEL, "max_tokens": 300, "messages": hello(), "tools": anthropic_tools, "tool_choice": choice});
        let v = post(a, "/v1/messages", &body).json();
        assert_eq!(v["stop_reason"], "tool_use", "{v}");
        let uses: Vec<&Value> = v["content"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|b| b["type"] == "tool_use")
            .collect();
        assert_eq!(uses.len(), 1, "{v}");
        let name = uses[0]["name"].as_str().unwrap();
        if let Some(w) = want {
            assert_eq!(name, w);
        }
        match name {
            "get_weather" => check_weather(&uses[0]["input"]),
            "get_time" => assert_eq!(uses[0]["input"], json!({})),
            other => panic!("unknown tool {other}: {v}"),
        }
    }
}

/// The fixture model with `chat_template.jinja` set to Qwen3's real template
/// (`tests/fixtures/chat_templates/templates/qwen3.jinja`); every other file is the converted
/// model's (linked).
fn qwen3_template_dir() -> &'static Path {
    static DIR: OnceLock<tempfile::TempDir> = OnceLock::new();
    DIR.get_or_init(|| {
        let tmp = tempfile::tempdir().unwrap();
        for entry in std::fs::read_dir(model_dir()).unwrap() {
            let entry = entry.unwrap();
            if entry.file_name() != "chat_template.jinja" {
                std::os::unix::fs::symlink(entry.path(), tmp.path().join(entry.file_name())).unwrap();
            }
        }
        std::fs::copy(
            chat_fixtures().join("templates/qwen3.jinja"),
            tmp.path().join("chat_template.jinja"),
        )
        .unwrap();
        tmp
    })
    .path()
}

fn chat_fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat_templates")
}

/// The fixture model with 4,096 positions instead of its 128: a real template's tool prompt is
/// ~1,400 tokens of the fixture's 507-token vocabulary. RoPE is computed per position and the
/// cache grows as needed, so a longer context is only slower.
fn long_context() -> Arc<dyn CausalLm> {
    Arc::new(TestModel {
        inner: load_model(),
        context_length: Some(4096),
        panics: false,
        fatal: Default::default(),
    })
}

/// A fixture conversation's request body (`conversations.json`) with the model set to
/// [`MODEL`], and transformers' render of it through Qwen3's template (`expected.json`).
fn chat_fixture(name: &str) -> (Value, String) {
    let read = |f: &str| -> Value {
        serde_json::from_str(&std::fs::read_to_string(chat_fixtures().join(f)).unwrap()).unwrap()
    };
    let cases = read("conversations.json");
    let case = cases
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == name)
        .unwrap()
        .clone();
    let want = read("expected.json")["renders"]["qwen3"][name]["prompt"]
        .as_str()
        .unwrap()
        .to_string();
    let mut body = case["request"].clone();
    body["model"] = json!(MODEL);
    (body, want)
}

/// Multi-turn tool conversations over HTTP: an OpenAI one (assistant `tool_calls` with null
/// content, two `tool` results) and an Anthropic one (`tool_use` and `tool_result` blocks) are
/// accepted, and the prompt the server runs has exactly as many tokens as transformers' render
/// of the same conversation through the model's real template (Qwen3's); arguments that are not
/// JSON are a 400 naming the field.
#[test]
fn multi_turn_tool_conversations_reach_the_template_as_transformers_renders_them() {
    let dir = qwen3_template_dir();
    let a = serve_dir(dir, long_context(), |_| {});
    let tokenizer = Tokenizer::from_dir(dir).unwrap();
    let tokens = |text: &str| tokenizer.encode(text, false).unwrap().len() as u64;
    // `body` with `max_tokens` 1 posted to `path`, which must answer 200: the `usage` field `key`.
    let usage = |path: &str, mut body: Value, key: &str| {
        body["max_tokens"] = json!(1);
        let r = post(a, path, &body);
        assert_eq!(r.status, 200, "{}", r.body);
        r.json()["usage"][key].as_u64()
    };

    let (body, want) = chat_fixture("openai_tool_round_trip");
    assert_eq!(
        usage("/v1/chat/completions", body, "prompt_tokens"),
        Some(tokens(&want))
    );

    let (body, want) = chat_fixture("anthropic_tool_round_trip");
    let n = post(a, "/v1/messages/count_tokens", &body).json()["input_tokens"].as_u64();
    assert_eq!(n, Some(tokens(&want)));
    assert_eq!(usage("/v1/messages", body, "input_tokens"), Some(tokens(&want)));

    let (mut body, _) = chat_fixture("openai_tool_round_trip");
    body["messages"][2]["tool_calls"][0]["function"]["arguments"] = json!("{\"city\": ");
    let r = post(a, "/v1/chat/completions", &body);
    assert_openai_error(&r, 400);
    assert_eq!(
        r.json()["error"]["param"],
        "messages[2].tool_calls[0].function.arguments",
        "{}",
        r.body
    );
}

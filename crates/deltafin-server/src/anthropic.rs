//! Anthropic Messages API: `POST /v1/messages`, plain and streaming.
//!
//! The stream is the documented event sequence: `message_start`, `content_block_start`,
//! `ping`, `content_block_delta`…, `content_block_stop`, `message_delta` (stop reason and
//! output tokens), `message_stop`; a failure mid-stream is an `error` event. Errors use the
//! Anthropic shape `{"type":"error","error":{"type","message"}}`.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deltafin_engine::session::{FinishReason, GenerationOutput, GenerationRequest};
use futures_util::stream::{self, Stream};
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::error::{parse_body, ApiError, Flavor};
use crate::worker::JobEvent;
use crate::{chat_prompt, collect, new_id, sampling, stop_strings, AppState};

type Shared = Arc<AppState>;

#[derive(Deserialize)]
struct MessagesRequest {
    model: String,
    max_tokens: i64,
    messages: Vec<Value>,
    system: Option<Value>,
    stop_sequences: Option<Value>,
    stream: Option<bool>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
}

/// Tools are not supported on this endpoint (tool_use / tool_result blocks are refused too, and
/// there is no conversion of Anthropic tools for the chat template): `tools` must be absent,
/// null or an empty list, and `tool_choice` absent, null, `{"type": "auto"}` or
/// `{"type": "none"}`. Anything else is 400 rather than silently dropped.
fn check_tools(tools: Option<&Value>, tool_choice: Option<&Value>) -> Result<(), ApiError> {
    match tools {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) if list.is_empty() => {}
        Some(Value::Array(list)) => {
            if let Some(i) = list.iter().position(|t| !t.is_object()) {
                return Err(ApiError::invalid_param(
                    &format!("tools[{i}]"),
                    format!(
                        "tools[{i}]: each tool must be an object such as {{\"name\": ..., \"input_schema\": {{...}}}}"
                    ),
                ));
            }
            return Err(ApiError::invalid_param(
                "tools",
                "tools: tools are not supported on this endpoint (send the request without `tools`)",
            ));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tools",
                "tools: must be a list of tools (and tools are not supported on this endpoint)",
            ))
        }
    }
    match tool_choice {
        None | Some(Value::Null) => Ok(()),
        Some(c) => match c.get("type").and_then(Value::as_str) {
            Some("auto" | "none") if c.is_object() => Ok(()),
            Some("any" | "tool") => Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice: tools are not supported on this endpoint, so a tool cannot be required",
            )),
            _ => Err(ApiError::invalid_param(
                "tool_choice",
                "tool_choice: must be an object whose `type` is auto, any, tool or none",
            )),
        },
    }
}

/// Text of a `content`: a string or a list of `{"type":"text","text":..}` blocks (joined).
fn block_text(v: &Value, field: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Array(blocks) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (
                    b.get("type").and_then(Value::as_str),
                    b.get("text").and_then(Value::as_str),
                ) {
                    (Some("text"), Some(t)) => text.push_str(t),
                    (t, _) => {
                        return Err(ApiError::invalid_param(
                            field,
                            format!(
                                "{field}[{j}]: only text blocks are supported, got type {}",
                                t.unwrap_or("(none)")
                            ),
                        ))
                    }
                }
            }
            Ok(text)
        }
        _ => Err(ApiError::invalid_param(
            field,
            format!("`{field}` must be a string or a list of text blocks"),
        )),
    }
}

fn to_chat_messages(r: &MessagesRequest) -> Result<Vec<Value>, ApiError> {
    if r.messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut out = Vec::with_capacity(r.messages.len() + 1);
    if let Some(sys) = &r.system {
        if !sys.is_null() {
            out.push(json!({"role": "system", "content": block_text(sys, "system")?}));
        }
    }
    for (i, m) in r.messages.iter().enumerate() {
        let field = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some(r) => {
                return Err(ApiError::invalid_param(
                    &field,
                    format!("{field}.role `{r}` must be `user` or `assistant`"),
                ))
            }
            None => return Err(ApiError::invalid_param(&field, format!("{field}.role is required"))),
        };
        let content = m
            .get("content")
            .ok_or_else(|| ApiError::invalid_param(&field, format!("{field}.content is required")))?;
        out.push(json!({"role": role, "content": block_text(content, &format!("{field}.content"))?}));
    }
    Ok(out)
}

fn stop_reason(out: &GenerationOutput, stops: &[String]) -> (&'static str, Value) {
    match out.finish {
        FinishReason::StopString(i) => ("stop_sequence", stops.get(i).map_or(Value::Null, |s| json!(s))),
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::Eos | FinishReason::Cancelled => ("end_turn", Value::Null),
    }
}

/// `POST /v1/messages`.
pub async fn messages(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    match run(s, body).await {
        Ok(r) => r,
        Err(e) => e.anthropic().into_response(),
    }
}

async fn run(s: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse_body(body, Flavor::Anthropic)?;
    s.check_model(&r.model)?;
    check_tools(r.tools.as_ref(), r.tool_choice.as_ref())?;
    let sampling = sampling(r.temperature, r.top_p, r.top_k, None, 1.0)?;
    let stops = stop_strings(r.stop_sequences.as_ref(), "stop_sequences")?;
    let messages = to_chat_messages(&r)?;
    let (ticket, prompt) = chat_prompt(&s, messages, Value::Null).await?;
    let max_new_tokens = s.max_new_tokens(Some(r.max_tokens), "max_tokens", "messages", prompt.len())?;
    let prompt_tokens = prompt.len();
    let req = GenerationRequest {
        prompt,
        max_new_tokens,
        sampling,
        stop: stops.clone(),
        ignore_eos: false,
        logprobs: None,
    };
    let rx = s.start(ticket, req).await?;
    let id = new_id("msg_");
    let model = s.config.model_id.clone();
    if r.stream.unwrap_or(false) {
        return Ok(sse(rx, id, model, prompt_tokens, stops).into_response());
    }
    let c = collect(rx).await?;
    let (reason, seq) = stop_reason(&c.output, &stops);
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": c.output.text}],
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {"input_tokens": c.output.prompt_tokens, "output_tokens": c.output.generated_ids.len()},
    }))
    .into_response())
}

struct StreamState {
    rx: UnboundedReceiver<JobEvent>,
    queue: VecDeque<Event>,
    stops: Vec<String>,
    done: bool,
}

impl StreamState {
    fn push(&mut self, name: &str, v: Value) {
        self.queue.push_back(Event::default().event(name).data(v.to_string()));
    }

    fn on_event(&mut self, ev: Option<JobEvent>) {
        match ev {
            Some(JobEvent::Delta(d)) => {
                if !d.text.is_empty() {
                    self.push(
                        "content_block_delta",
                        json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": d.text}}),
                    );
                }
            }
            Some(JobEvent::Done(Ok(out))) => {
                let (reason, seq) = stop_reason(&out, &self.stops);
                self.push("content_block_stop", json!({"type": "content_block_stop", "index": 0}));
                self.push(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                           "usage": {"output_tokens": out.generated_ids.len()}}),
                );
                self.push("message_stop", json!({"type": "message_stop"}));
                self.done = true;
            }
            Some(JobEvent::Done(Err(e))) => self.fail(&format!("generation failed: {e}")),
            None => self.fail("the generation ended without a result"),
        }
    }

    fn fail(&mut self, message: &str) {
        let e = ApiError::internal(message).anthropic().body();
        self.push("error", e);
        self.done = true;
    }
}

fn sse(
    rx: UnboundedReceiver<JobEvent>,
    id: String,
    model: String,
    prompt_tokens: usize,
    stops: Vec<String>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut st = StreamState {
        rx,
        queue: VecDeque::new(),
        stops,
        done: false,
    };
    st.push(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }}),
    );
    st.push(
        "content_block_start",
        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
    );
    st.push("ping", json!({"type": "ping"}));
    let events = stream::unfold(st, |mut st| async move {
        loop {
            if let Some(e) = st.queue.pop_front() {
                return Some((Ok(e), st));
            }
            if st.done {
                return None;
            }
            let ev = st.rx.recv().await;
            st.on_event(ev);
        }
    });
    Sse::new(events).keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
}

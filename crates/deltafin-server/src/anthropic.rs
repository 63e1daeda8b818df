//! Anthropic Messages API: `POST /v1/messages`, plain and streaming, and
//! `POST /v1/messages/count_tokens`.
//!
//! The stream is the documented event sequence: `message_start`, `content_block_start`,
//! `ping`, `content_block_delta`…, `content_block_stop`, `message_delta` (stop reason and
//! output tokens), `message_stop`; a failure mid-stream is an `error` event. Errors use the
//! Anthropic shape `{"type":"error","error":{"type","message"}}`.
//!
//! When the model's markup family is known ([`crate::tools`]), the reply is split into
//! `thinking`, `text` and `tool_use` blocks (streamed as `thinking_delta`, `text_delta` and
//! `input_json_delta`), with `stop_reason: "tool_use"` after a call. `tools` are rendered to
//! the chat template in OpenAI's shape; `thinking` sets the template's thinking switch.

use std::convert::Infallible;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deltafin_engine::session::{Delta, FinishReason, GenerationOutput, GenerationRequest};
use futures_util::stream::Stream;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::agent::{template_vars, Reply, ReplyParser};
use crate::body::parse_body;
use crate::chat_messages;
use crate::error::{ApiError, Flavor};
use crate::sse::{sse_reply, JobStream, Outbox};
use crate::structured::{call_family, forced_tools, Constraint, Forced};
use crate::tools::Event as ParsedEvent;
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
    thinking: Option<Value>,
}

#[derive(Deserialize)]
struct CountTokensRequest {
    model: String,
    messages: Vec<Value>,
    system: Option<Value>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    thinking: Option<Value>,
}

/// Checked tools (OpenAI-shaped), whether calls are parsed, and the forced call with whether
/// several calls may follow each other.
type CheckedTools = (Option<Value>, bool, Option<(Forced, bool)>);

/// `tools` (custom tools `{"name", "description"?, "input_schema"}`) checked and converted to
/// OpenAI's shape for the chat template (`{"type": "function", "function": {"name",
/// "description", "parameters"}}`); server tools (a `type` other than `custom`, e.g.
/// `web_search_20250305`) are refused. `tool_choice`: `auto`, `none` (calls are then not
/// parsed), `any` (a call is forced: needs tools) or `{"type": "tool", "name": <one of the
/// tools>}` (a call of it is forced); `disable_parallel_tool_use: true` allows one call only.
/// Returns the converted tools (None for absent, null or empty), whether calls are parsed, and
/// the forced call with whether several calls may follow each other.
pub(crate) fn check_tools(tools: Option<&Value>, tool_choice: Option<&Value>) -> Result<CheckedTools, ApiError> {
    const SHAPE: &str = r#"{"name": ..., "input_schema": {"type": "object", ...}}"#;
    let converted = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            let mut out = Vec::with_capacity(list.len());
            for (i, t) in list.iter().enumerate() {
                let at = format!("tools[{i}]");
                let bad = |m: String| Err(ApiError::invalid_param(&at, m));
                let Some(t) = t.as_object() else {
                    return bad(format!("{at}: each tool must be an object such as {SHAPE}"));
                };
                match t.get("type") {
                    None | Some(Value::Null) => {}
                    Some(Value::String(ty)) if ty == "custom" => {}
                    Some(ty) => {
                        return bad(format!(
                            "{at}: server tools (type {ty}) are not supported; only custom tools with a `name` and an `input_schema`"
                        ))
                    }
                }
                let name = match t.get("name") {
                    Some(Value::String(n)) if !n.is_empty() => n,
                    _ => return bad(format!("{at}.name: required, a non-empty string")),
                };
                if !matches!(t.get("description"), None | Some(Value::Null) | Some(Value::String(_))) {
                    return bad(format!("{at}.description: must be a string"));
                }
                let schema = match t.get("input_schema") {
                    Some(Value::Object(o)) => Value::Object(o.clone()),
                    _ => return bad(format!("{at}.input_schema: required, a JSON Schema object")),
                };
                // vLLM's order (`FunctionDefinition`: name, description, parameters): templates
                // print the tools with `tojson`.
                let mut f = json!({"name": name});
                if let Some(d) = t.get("description").filter(|d| d.is_string()) {
                    f["description"] = d.clone();
                }
                f["parameters"] = schema;
                out.push(json!({"type": "function", "function": f}));
            }
            (!out.is_empty()).then_some(Value::Array(out))
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tools",
                format!("tools: must be a list of tools such as {SHAPE}"),
            ))
        }
    };
    let mut calls = converted.is_some();
    let mut forced = None;
    match tool_choice {
        None | Some(Value::Null) => {}
        Some(c) => match c.get("type").and_then(Value::as_str) {
            Some("auto") if c.is_object() => {}
            Some("none") if c.is_object() => calls = false,
            Some(kind @ ("any" | "tool")) => {
                let parallel = match c.get("disable_parallel_tool_use") {
                    None | Some(Value::Null) => true,
                    Some(Value::Bool(b)) => !b,
                    Some(_) => {
                        return Err(ApiError::invalid_param(
                            "tool_choice.disable_parallel_tool_use",
                            "tool_choice.disable_parallel_tool_use: must be a boolean",
                        ))
                    }
                };
                let Some(list) = &converted else {
                    return Err(ApiError::invalid_param(
                        "tool_choice",
                        format!("tool_choice: `{kind}` needs a non-empty `tools` list"),
                    ));
                };
                let f = if kind == "any" {
                    Forced::Any
                } else {
                    let Some(name) = c.get("name").and_then(Value::as_str) else {
                        return Err(ApiError::invalid_param(
                            "tool_choice.name",
                            "tool_choice.name: required with type `tool`, a string",
                        ));
                    };
                    if forced_tools(list, &Forced::Named(name.to_string())).is_empty() {
                        return Err(ApiError::invalid_param(
                            "tool_choice.name",
                            format!("tool_choice.name: \"{name}\" is not one of the `tools`"),
                        ));
                    }
                    Forced::Named(name.to_string())
                };
                forced = Some((f, parallel));
            }
            _ => {
                return Err(ApiError::invalid_param(
                    "tool_choice",
                    "tool_choice: must be an object whose `type` is auto, any, tool or none",
                ))
            }
        },
    }
    Ok((converted, calls, forced))
}

/// `thinking`: `{"type": "enabled", "budget_tokens": N}` turns the template's thinking on,
/// `{"type": "disabled"}` off (see [`crate::tools::Family::thinking_kwarg`]); absent leaves the
/// template's default. The budget is checked (an integer of at least 1024, as Anthropic
/// requires) but not enforced: `max_tokens` bounds the whole reply, thinking included.
fn check_thinking(v: Option<&Value>) -> Result<Option<bool>, ApiError> {
    let bad = |m: &str| Err(ApiError::invalid_param("thinking", format!("thinking: {m}")));
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("disabled") => Ok(Some(false)),
            Some("enabled") => {
                let budget = o.get("budget_tokens").and_then(Value::as_i64);
                match budget {
                    Some(b) if b < 1024 => bad("`budget_tokens` must be at least 1024"),
                    Some(_) => Ok(Some(true)),
                    None => bad("`budget_tokens` is required with type `enabled` and must be an integer"),
                }
            }
            _ => bad("`type` must be `enabled` or `disabled`"),
        },
        Some(_) => bad("must be an object such as {\"type\": \"enabled\", \"budget_tokens\": 2048}"),
    }
}

/// `stop_reason` and `stop_sequence`: `tool_use` when the model called a tool and stopped by
/// itself.
fn stop_reason(out: &GenerationOutput, stops: &[String], called: bool) -> (&'static str, Value) {
    match out.finish {
        FinishReason::StopString(i) => ("stop_sequence", stops.get(i).map_or(Value::Null, |s| json!(s))),
        FinishReason::Length => ("max_tokens", Value::Null),
        FinishReason::Eos if called => ("tool_use", Value::Null),
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

/// `POST /v1/messages/count_tokens`: the prompt's token count (`{"input_tokens": N}`) as
/// `/v1/messages` would render it for the same `messages`, `system`, `tools` and `thinking`.
pub async fn count_tokens(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Response {
    let counted = async {
        let r: CountTokensRequest = parse_body(body, Flavor::Anthropic)?;
        s.check_model(&r.model)?;
        let (tools, _, _) = check_tools(r.tools.as_ref(), r.tool_choice.as_ref())?;
        let thinking = check_thinking(r.thinking.as_ref())?;
        let messages = chat_messages::anthropic_messages(&r.messages, r.system.as_ref())?;
        let extra = template_vars(s.family, None, "", tools, thinking, None, "")?;
        // The queue place taken for rendering is given back at once (nothing is generated).
        let (_ticket, prompt) = chat_prompt(&s, messages, extra).await?;
        Ok::<_, ApiError>(Json(json!({"input_tokens": prompt.ids.len()})).into_response())
    };
    match counted.await {
        Ok(r) => r,
        Err(e) => e.anthropic().into_response(),
    }
}

async fn run(s: Shared, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let r: MessagesRequest = parse_body(body, Flavor::Anthropic)?;
    s.check_model(&r.model)?;
    let (tools, calls_enabled, forced) = check_tools(r.tools.as_ref(), r.tool_choice.as_ref())?;
    let thinking = check_thinking(r.thinking.as_ref())?;
    let sampling = sampling(r.temperature, r.top_p, r.top_k, None, 1.0)?;
    let stops = stop_strings(r.stop_sequences.as_ref(), "stop_sequences")?;
    let messages = chat_messages::anthropic_messages(&r.messages, r.system.as_ref())?;
    let extra = template_vars(s.family, None, "", tools.clone(), thinking, None, "")?;
    let (ticket, rendered) = chat_prompt(&s, messages, extra).await?;
    let (constraint, family) = match (forced, &tools) {
        (Some((f, parallel)), Some(t)) => {
            let c = Constraint::ToolCalls {
                tools: forced_tools(t, &f),
                parallel,
            };
            let g = s.constrain(c, rendered.tail.clone(), "tool_choice").await?;
            (Some(g), Some(call_family(s.family)))
        }
        _ => (None, s.family),
    };
    let parser = ReplyParser::new(family, calls_enabled, tools, rendered.tail);
    let prompt = rendered.ids;
    let max_new_tokens = s.max_new_tokens(Some(r.max_tokens), "max_tokens", "messages", prompt.len())?;
    let prompt_tokens = prompt.len();
    let req = GenerationRequest {
        prompt,
        max_new_tokens,
        sampling,
        stop: stops.clone(),
        ignore_eos: false,
        logprobs: None,
        keep_special_tokens: parser.active() && s.keeps_special_tokens(family),
        constraint,
    };
    let rx = s.start(ticket, req).await?;
    let id = new_id("msg_");
    let model = s.config.model_id.clone();
    if r.stream.unwrap_or(false) {
        return Ok(sse(rx, id, model, prompt_tokens, stops, parser).into_response());
    }
    let c = collect(rx).await?;
    let reply = Reply::parse(parser, &c.output.text);
    let (reason, seq) = stop_reason(&c.output, &stops, !reply.calls.is_empty());
    Ok(Json(json!({
        "id": id,
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": content_blocks(&reply),
        "stop_reason": reason,
        "stop_sequence": seq,
        "usage": {"input_tokens": c.output.prompt_tokens, "output_tokens": c.output.generated_ids.len()},
    }))
    .into_response())
}

/// A reply's content blocks: `thinking` (when the model reasoned), `text` (when it wrote any,
/// or when there is nothing else), then one `tool_use` per call with its arguments as `input`.
fn content_blocks(r: &Reply) -> Vec<Value> {
    let mut blocks = Vec::new();
    if !r.reasoning.is_empty() {
        blocks.push(json!({"type": "thinking", "thinking": r.reasoning, "signature": ""}));
    }
    if !r.content.is_empty() || (blocks.is_empty() && r.calls.is_empty()) {
        blocks.push(json!({"type": "text", "text": r.content}));
    }
    for c in &r.calls {
        // The parser only reports calls whose arguments are a JSON object.
        let input: Value = serde_json::from_str(&c.arguments).unwrap_or_else(|_| json!({}));
        blocks.push(json!({"type": "tool_use", "id": c.id, "name": c.name, "input": input}));
    }
    blocks
}

struct StreamState {
    /// The job's events in, the reply's events out.
    out: Outbox,
    stops: Vec<String>,
    /// With a family parser, blocks open as the reply needs them (else one text block).
    parser: Option<ReplyParser>,
    /// The open block: its index and type.
    open: Option<(usize, &'static str)>,
    /// Blocks started so far.
    blocks: usize,
    called: bool,
    /// Whether the `ping` went out (right after the first `content_block_start`).
    pinged: bool,
}

impl StreamState {
    fn push(&mut self, name: &str, v: Value) {
        self.out
            .queue
            .push_back(Event::default().event(name).data(v.to_string()));
    }

    fn close_block(&mut self) {
        if let Some((index, _)) = self.open.take() {
            self.push(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": index}),
            );
        }
    }

    /// The open block of type `kind`, started (after closing another) when needed.
    fn block(&mut self, kind: &'static str, start: Value) -> usize {
        if let Some((index, k)) = self.open {
            if k == kind && kind != "tool_use" {
                return index;
            }
        }
        self.close_block();
        let index = self.blocks;
        self.blocks += 1;
        self.open = Some((index, kind));
        self.push(
            "content_block_start",
            json!({"type": "content_block_start", "index": index, "content_block": start}),
        );
        if !self.pinged {
            self.pinged = true;
            self.push("ping", json!({"type": "ping"}));
        }
        index
    }

    fn delta(&mut self, index: usize, delta: Value) {
        self.push(
            "content_block_delta",
            json!({"type": "content_block_delta", "index": index, "delta": delta}),
        );
    }

    fn on_parsed(&mut self, events: Vec<ParsedEvent>) {
        for e in events {
            match e {
                ParsedEvent::Content(t) => {
                    let i = self.block("text", json!({"type": "text", "text": ""}));
                    self.delta(i, json!({"type": "text_delta", "text": t}));
                }
                ParsedEvent::Reasoning(t) => {
                    let i = self.block("thinking", json!({"type": "thinking", "thinking": "", "signature": ""}));
                    self.delta(i, json!({"type": "thinking_delta", "thinking": t}));
                }
                ParsedEvent::ToolCallStart { id, name, .. } => {
                    self.called = true;
                    self.block(
                        "tool_use",
                        json!({"type": "tool_use", "id": id, "name": name, "input": {}}),
                    );
                }
                ParsedEvent::ToolCallArgs { args, .. } => {
                    if let Some((i, "tool_use")) = self.open {
                        self.delta(i, json!({"type": "input_json_delta", "partial_json": args}));
                    }
                }
                ParsedEvent::ToolCallEnd { .. } => self.close_block(),
            }
        }
    }
}

impl JobStream for StreamState {
    fn outbox(&mut self) -> &mut Outbox {
        &mut self.out
    }

    fn on_delta(&mut self, d: Delta) {
        match self.parser.as_mut() {
            Some(p) => {
                let events = p.push(&d.text);
                self.on_parsed(events);
            }
            None if !d.text.is_empty() => self.delta(0, json!({"type": "text_delta", "text": d.text})),
            None => {}
        }
    }

    fn on_done(&mut self, out: GenerationOutput) {
        if let Some(p) = self.parser.as_mut() {
            let events = p.finish();
            self.on_parsed(events);
            if self.blocks == 0 {
                self.block("text", json!({"type": "text", "text": ""}));
            }
        }
        self.close_block();
        let (reason, seq) = stop_reason(&out, &self.stops, self.called);
        self.push(
            "message_delta",
            json!({"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": seq},
                   "usage": {"output_tokens": out.generated_ids.len()}}),
        );
        self.push("message_stop", json!({"type": "message_stop"}));
        self.out.done = true;
    }

    fn fail(&mut self, message: &str) {
        let e = ApiError::internal(message).anthropic().body();
        self.push("error", e);
        self.out.done = true;
    }
}

fn sse(
    rx: UnboundedReceiver<JobEvent>,
    id: String,
    model: String,
    prompt_tokens: usize,
    stops: Vec<String>,
    parser: ReplyParser,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut st = StreamState {
        out: Outbox::new(rx),
        stops,
        parser: Some(parser).filter(ReplyParser::active),
        open: None,
        blocks: 0,
        called: false,
        pinged: false,
    };
    st.push(
        "message_start",
        json!({"type": "message_start", "message": {
            "id": id, "type": "message", "role": "assistant", "model": model, "content": [],
            "stop_reason": null, "stop_sequence": null,
            "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
        }}),
    );
    // With a parser the first block (and the ping after it) waits for the reply's first event.
    if st.parser.is_none() {
        st.block("text", json!({"type": "text", "text": ""}));
    }
    sse_reply(st)
}

#[cfg(test)]
mod tests {
    //! The Messages SSE machinery (right below the HTTP handler) fed a fixed text stream in
    //! place of a model, with real Kimi K3 markup.
    use super::*;
    use crate::openai::stream_tests::{events, sse_events};
    use crate::tools::Family;

    const K3_TAIL: &str = "<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>";
    const K3: &str = "Weather needed.<|close|>think<|sep|><|open|>response<|sep|>Checking.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>Kyōto<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";

    /// thinking, text and tool_use blocks in order, each started, filled by its delta type and
    /// stopped; then `stop_reason: "tool_use"`. Non-streaming gives the same blocks.
    #[test]
    fn stream_has_thinking_text_and_tool_use_blocks() {
        for piece in [1, 5, 1000] {
            let parser = ReplyParser::new(Some(Family::KimiK3), true, None, K3_TAIL.into());
            let rx = events(K3, piece, FinishReason::Eos);
            let evs = sse_events(|| sse(rx, "msg_t".into(), "m".into(), 3, Vec::new(), parser).into_response());
            let names: Vec<&str> = evs.iter().map(|(n, _)| n.as_str()).collect();
            let data: Vec<Value> = evs.iter().map(|(_, d)| serde_json::from_str(d).unwrap()).collect();
            assert_eq!(names[..3], ["message_start", "content_block_start", "ping"]);
            assert_eq!(names[names.len() - 2..], ["message_delta", "message_stop"]);
            let starts: Vec<&Value> = data
                .iter()
                .filter(|d| d["type"] == "content_block_start")
                .map(|d| &d["content_block"])
                .collect();
            assert_eq!(starts.len(), 3, "{piece}");
            assert_eq!(starts[0]["type"], "thinking");
            assert_eq!(starts[1]["type"], "text");
            assert_eq!(
                starts[2],
                &json!({"type": "tool_use", "id": starts[2]["id"], "name": "get_weather", "input": {}})
            );
            let text_of = |index: usize, ty: &str, field: &str| -> String {
                data.iter()
                    .filter(|d| d["type"] == "content_block_delta" && d["index"] == index && d["delta"]["type"] == ty)
                    .filter_map(|d| d["delta"][field].as_str())
                    .collect()
            };
            assert_eq!(text_of(0, "thinking_delta", "thinking"), "Weather needed.");
            assert_eq!(text_of(1, "text_delta", "text"), "Checking.");
            let input: Value = serde_json::from_str(&text_of(2, "input_json_delta", "partial_json")).unwrap();
            assert_eq!(input, json!({"city": "Kyōto"}));
            let stops = data.iter().filter(|d| d["type"] == "content_block_stop").count();
            assert_eq!(stops, 3);
            let md = &data[data.len() - 2];
            assert_eq!(md["delta"]["stop_reason"], "tool_use");
        }
        let reply = Reply::parse(ReplyParser::new(Some(Family::KimiK3), true, None, K3_TAIL.into()), K3);
        let blocks = content_blocks(&reply);
        assert_eq!(
            blocks[0],
            json!({"type": "thinking", "thinking": "Weather needed.", "signature": ""})
        );
        assert_eq!(blocks[1], json!({"type": "text", "text": "Checking."}));
        assert_eq!(blocks[2]["input"], json!({"city": "Kyōto"}));
    }

    /// Anthropic tools become OpenAI-shaped tools for the template; `any` / `tool` choices force
    /// a call; server tools, a `tool` choice naming no tool and bad `thinking` configs are 400
    /// naming the field.
    #[test]
    fn tools_and_thinking_are_checked_and_converted() {
        let tools = json!([{"name": "get_weather", "description": "Wetter für eine Stadt", "input_schema": {"type": "object"}}]);
        let (t, on, forced) = check_tools(Some(&tools), Some(&json!({"type": "auto"}))).unwrap();
        assert!(on);
        assert_eq!(forced, None);
        assert_eq!(
            t.unwrap(),
            json!([{"type": "function", "function": {"name": "get_weather", "description": "Wetter für eine Stadt", "parameters": {"type": "object"}}}])
        );
        assert!(!check_tools(Some(&tools), Some(&json!({"type": "none"}))).unwrap().1);
        for (tools, choice) in [
            (
                json!([{"type": "web_search_20250305", "name": "web_search"}]),
                Value::Null,
            ),
            (json!([{"name": "x"}]), Value::Null),
            (tools.clone(), json!({"type": "tool", "name": "get_time"})),
            (tools.clone(), json!({"type": "tool"})),
            (
                tools.clone(),
                json!({"type": "any", "disable_parallel_tool_use": "yes"}),
            ),
            (Value::Null, json!({"type": "any"})),
        ] {
            assert!(check_tools(Some(&tools), Some(&choice)).is_err(), "{tools} {choice}");
        }
        let (_, on, forced) = check_tools(Some(&tools), Some(&json!({"type": "any"}))).unwrap();
        assert!(on);
        assert_eq!(forced, Some((Forced::Any, true)));
        let choice = json!({"type": "tool", "name": "get_weather", "disable_parallel_tool_use": true});
        let (_, _, forced) = check_tools(Some(&tools), Some(&choice)).unwrap();
        assert_eq!(forced, Some((Forced::Named("get_weather".into()), false)));
        assert_eq!(
            check_thinking(Some(&json!({"type": "enabled", "budget_tokens": 2048}))).unwrap(),
            Some(true)
        );
        assert_eq!(check_thinking(Some(&json!({"type": "disabled"}))).unwrap(), Some(false));
        for bad in [
            json!({"type": "enabled"}),
            json!({"type": "enabled", "budget_tokens": 10}),
            json!({"type": "on"}),
            json!(true),
        ] {
            assert!(check_thinking(Some(&bad)).is_err(), "{bad}");
        }
    }
}

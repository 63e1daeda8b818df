//! OpenAI-compatible endpoints: models, completions and chat completions, with streaming.
//!
//! Streams follow OpenAI's SSE protocol: `data: <chunk JSON>` events, the first chat delta
//! carrying the role, the last content chunk carrying `finish_reason` (one chunk is held back
//! until the next arrives so that it can), with `stream_options.include_usage` one more chunk
//! with empty `choices` and the `usage`, then `data: [DONE]`, also after an error (sent first
//! as `data: {"error": {...}}`).

use std::convert::Infallible;
use std::fmt::Write;
use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::{Path, State};
use axum::response::sse::{Event, Sse};
use axum::response::{IntoResponse, Response};
use axum::Json;
use deltafin_engine::session::{Delta, FinishReason, GenerationOutput, GenerationRequest, TokenLogprob};
use deltafin_tokenizer::Tokenizer;
use futures_util::stream::Stream;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use crate::agent::{template_vars, Reply, ReplyParser};
use crate::body::parse_body;
use crate::chat_messages;
use crate::error::{ApiError, Flavor};
use crate::limits::MAX_TOP_LOGPROBS;
use crate::sampling_fields::SamplingFields;
use crate::sse::{sse_reply, JobStream, Outbox};
use crate::structured::{call_family, forced_tools, Constraint, Forced};
use crate::tools::Event as ParsedEvent;
use crate::worker::{JobEvent, Ticket};
use crate::{chat_prompt, collect, new_id, sampling, stop_strings, unix_now, AppState};

type Shared = Arc<AppState>;

fn model_object(s: &AppState) -> Value {
    json!({"id": s.config.model_id, "object": "model", "created": s.created, "owned_by": "deltafin"})
}

/// `GET /v1/models`.
pub async fn list_models(State(s): State<Shared>) -> Json<Value> {
    Json(json!({"object": "list", "data": [model_object(&s)]}))
}

/// `GET /v1/models/{id}`.
pub async fn get_model(State(s): State<Shared>, Path(id): Path<String>) -> Result<Json<Value>, ApiError> {
    s.check_model(&id)?;
    Ok(Json(model_object(&s)))
}

#[derive(Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

#[derive(Deserialize)]
struct CompletionRequest {
    model: String,
    prompt: Option<Value>,
    max_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    logit_bias: Option<Value>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    min_p: Option<f64>,
    n: Option<i64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logprobs: Option<i64>,
    echo: Option<bool>,
    suffix: Option<String>,
    best_of: Option<i64>,
    response_format: Option<Value>,
    ignore_eos: Option<bool>,
}

#[derive(Deserialize)]
struct ChatRequest {
    model: String,
    messages: Option<Vec<Value>>,
    max_tokens: Option<i64>,
    max_completion_tokens: Option<i64>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
    logit_bias: Option<Value>,
    presence_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    repetition_penalty: Option<f64>,
    min_p: Option<f64>,
    n: Option<i64>,
    stop: Option<Value>,
    stream: Option<bool>,
    stream_options: Option<StreamOptions>,
    logprobs: Option<bool>,
    top_logprobs: Option<i64>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
    parallel_tool_calls: Option<Value>,
    best_of: Option<i64>,
    response_format: Option<Value>,
    ignore_eos: Option<bool>,
    reasoning_effort: Option<Value>,
    chat_template_kwargs: Option<Value>,
}

macro_rules! sampling_fields {
    ($t:ty) => {
        impl $t {
            fn sampling_fields(&self) -> SamplingFields<'_> {
                SamplingFields {
                    logit_bias: self.logit_bias.as_ref(),
                    presence_penalty: self.presence_penalty,
                    frequency_penalty: self.frequency_penalty,
                    repetition_penalty: self.repetition_penalty,
                    min_p: self.min_p,
                }
            }
        }
    };
}
sampling_fields!(CompletionRequest);
sampling_fields!(ChatRequest);

/// Every sampling field of a request, checked (400 naming the field otherwise).
fn sampling_of(
    s: &AppState,
    fields: &SamplingFields<'_>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    seed: Option<i64>,
) -> Result<deltafin_engine::sampler::SamplingParams, ApiError> {
    let mut p = sampling(temperature, top_p, top_k, seed, 2.0)?;
    fields.apply(&mut p, s.vocab_size)?;
    Ok(p)
}

fn check_n(n: Option<i64>) -> Result<(), ApiError> {
    match n {
        None | Some(1) => Ok(()),
        Some(n) => Err(ApiError::invalid_param(
            "n",
            format!("only `n` = 1 is supported, got {n}"),
        )),
    }
}

/// `best_of`: absent or 1 (one candidate per request; see [`check_n`]).
fn check_best_of(best_of: Option<i64>) -> Result<(), ApiError> {
    match best_of {
        None | Some(1) => Ok(()),
        Some(b) => Err(ApiError::invalid_param(
            "best_of",
            format!("only `best_of` = 1 is supported, got {b}"),
        )),
    }
}

/// `response_format`: absent, null or `{"type": "text"}` (no constraint); `{"type":
/// "json_object"}` (any JSON object); `{"type": "json_schema", "json_schema": {"name": ...,
/// "schema"?: {...}, "strict"?: bool}}` (a JSON value following `schema`, any JSON value
/// without one). The schema is enforced whether or not `strict` is set.
fn check_response_format(v: Option<&Value>) -> Result<Option<Constraint>, ApiError> {
    let bad = |param: &str, m: String| Err(ApiError::invalid_param(param, m));
    const TYPES: &str = "\"text\", \"json_object\" or \"json_schema\"";
    match v {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Object(o)) => match o.get("type").and_then(Value::as_str) {
            Some("text") => Ok(None),
            Some("json_object") => Ok(Some(Constraint::Json(json!({"type": "object"})))),
            Some("json_schema") => {
                let Some(js) = o.get("json_schema").and_then(Value::as_object) else {
                    return bad(
                        "response_format.json_schema",
                        "`response_format.json_schema` is required and must be an object with a `name` and a `schema`"
                            .into(),
                    );
                };
                if !matches!(js.get("name"), Some(Value::String(n)) if !n.is_empty()) {
                    return bad(
                        "response_format.json_schema.name",
                        "`response_format.json_schema.name` is required and must be a non-empty string".into(),
                    );
                }
                if !matches!(js.get("strict"), None | Some(Value::Null) | Some(Value::Bool(_))) {
                    return bad(
                        "response_format.json_schema.strict",
                        "`response_format.json_schema.strict` must be a boolean".into(),
                    );
                }
                match js.get("schema") {
                    None | Some(Value::Null) => Ok(Some(Constraint::Json(json!({})))),
                    Some(schema @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(Constraint::Json(schema.clone()))),
                    Some(_) => bad(
                        "response_format.json_schema.schema",
                        "`response_format.json_schema.schema` must be a JSON Schema object".into(),
                    ),
                }
            }
            Some(t) => bad(
                "response_format",
                format!("`response_format`: `type` must be {TYPES}, got `{t}`"),
            ),
            None => bad(
                "response_format",
                format!("`response_format`: `type` is required: {TYPES}"),
            ),
        },
        Some(_) => bad(
            "response_format",
            "`response_format` must be an object such as {\"type\": \"json_object\"}".into(),
        ),
    }
}

/// `tools` and `tool_choice` checked against OpenAI's schema: `tools` a list of
/// `{"type": "function", "function": {"name": <non-empty string>, "description"?: <string>,
/// "parameters"?: <object>}}`; `tool_choice` `"none"`, `"auto"`, `"required"` (a call is
/// forced: needs tools) or a named function (`{"type": "function", "function": {"name": <one of
/// the tools>}}`: a call of it is forced). Returns the tools to pass to the chat template (None
/// for absent, null or an empty list), whether the model's tool calls are parsed (tools given
/// and `tool_choice` not `"none"`), and the forced call if any.
pub(crate) fn check_tools(
    tools: Option<&Value>,
    tool_choice: Option<&Value>,
) -> Result<(Option<Value>, bool, Option<Forced>), ApiError> {
    const SHAPE: &str = r#"{"type": "function", "function": {"name": ...}}"#;
    let mut names = Vec::new();
    let tools = match tools {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            for (i, t) in list.iter().enumerate() {
                let at = |field: &str| format!("tools[{i}]{field}");
                let bad = |field: &str, m: String| Err(ApiError::invalid_param(&at(field), m));
                let Some(t) = t.as_object() else {
                    return bad("", format!("`{}` must be an object such as {SHAPE}", at("")));
                };
                match t.get("type") {
                    Some(Value::String(ty)) if ty == "function" => {}
                    Some(Value::String(ty)) => {
                        return bad(".type", format!("`{}` must be \"function\", got \"{ty}\"", at(".type")))
                    }
                    _ => {
                        return bad(
                            ".type",
                            format!("`{}` is required and must be \"function\"", at(".type")),
                        )
                    }
                }
                let Some(f) = t.get("function").and_then(Value::as_object) else {
                    return bad(
                        ".function",
                        format!("`{}` is required and must be an object with a `name`", at(".function")),
                    );
                };
                match f.get("name") {
                    Some(Value::String(n)) if !n.is_empty() => names.push(n.as_str()),
                    _ => {
                        return bad(
                            ".function.name",
                            format!("`{}` is required and must be a non-empty string", at(".function.name")),
                        )
                    }
                }
                if !matches!(f.get("description"), None | Some(Value::Null) | Some(Value::String(_))) {
                    return bad(
                        ".function.description",
                        format!("`{}` must be a string", at(".function.description")),
                    );
                }
                if !matches!(f.get("parameters"), None | Some(Value::Null) | Some(Value::Object(_))) {
                    return bad(
                        ".function.parameters",
                        format!("`{}` must be a JSON Schema object", at(".function.parameters")),
                    );
                }
            }
            (!list.is_empty()).then(|| Value::Array(list.clone()))
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "tools",
                format!("`tools` must be a list of tools such as {SHAPE}"),
            ))
        }
    };
    let bad_choice = |param: &str, m: String| Err(ApiError::invalid_param(param, m));
    let mut calls = tools.is_some();
    match tool_choice {
        None | Some(Value::Null) => {}
        Some(Value::String(c)) => match c.as_str() {
            "none" => calls = false,
            "auto" => {}
            "required" if tools.is_some() => return Ok((tools, true, Some(Forced::Any))),
            "required" => {
                return bad_choice(
                    "tool_choice",
                    "`tool_choice` \"required\" needs a non-empty `tools` list".into(),
                )
            }
            other => {
                return bad_choice(
                    "tool_choice",
                    format!("`tool_choice` must be \"none\", \"auto\", \"required\" or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}, got \"{other}\""),
                )
            }
        },
        Some(Value::Object(o)) => {
            if o.get("type").and_then(Value::as_str) != Some("function") {
                return bad_choice("tool_choice.type", "`tool_choice.type` must be \"function\"".into());
            }
            let Some(name) = o.get("function").and_then(|f| f.get("name")).and_then(Value::as_str) else {
                return bad_choice(
                    "tool_choice.function.name",
                    "`tool_choice.function.name` is required and must be a string".into(),
                );
            };
            if !names.contains(&name) {
                return bad_choice(
                    "tool_choice.function.name",
                    format!("`tool_choice.function.name` \"{name}\" is not one of the functions in `tools`"),
                );
            }
            return Ok((tools, true, Some(Forced::Named(name.to_string()))));
        }
        Some(_) => {
            return bad_choice(
                "tool_choice",
                "`tool_choice` must be \"none\", \"auto\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
            )
        }
    }
    Ok((tools, calls, None))
}

/// Prompt as token ids: a string (tokenized with the tokenizer's special tokens, e.g. BOS), a
/// list of ids, or a one-element list of either.
fn prompt_ids(s: &AppState, prompt: Option<&Value>) -> Result<Vec<u32>, ApiError> {
    let bad = |m: &str| ApiError::invalid_param("prompt", m.to_string());
    let prompt = match prompt {
        Some(Value::Array(a)) if a.len() == 1 && (a[0].is_string() || a[0].is_array()) => &a[0],
        Some(p) => p,
        None => return Err(bad("`prompt` is required")),
    };
    let ids: Vec<u32> = match prompt {
        Value::String(t) => {
            if t.is_empty() {
                return Err(bad("`prompt` is empty"));
            }
            s.tokenizer
                .encode(t, true)
                .map_err(|e| ApiError::invalid_param("prompt", format!("cannot tokenize the prompt: {e}")))?
        }
        Value::Array(a) => {
            if a.is_empty() {
                return Err(bad("`prompt` is empty"));
            }
            if a.iter().any(|x| x.is_string() || x.is_array()) {
                return Err(bad("only one prompt per request is supported"));
            }
            let mut ids = Vec::with_capacity(a.len());
            for x in a {
                let id = x
                    .as_i64()
                    .ok_or_else(|| bad("`prompt` must be a string or a list of integer token ids"))?;
                if id < 0 || id as usize >= s.vocab_size {
                    return Err(bad(&format!(
                        "token id {id} in `prompt` is out of range: the vocabulary has {} tokens (ids 0 to {})",
                        s.vocab_size,
                        s.vocab_size - 1
                    )));
                }
                ids.push(id as u32);
            }
            ids
        }
        _ => return Err(bad("`prompt` must be a string or a list of integer token ids")),
    };
    if ids.is_empty() {
        return Err(bad("`prompt` encodes to zero tokens"));
    }
    Ok(ids)
}

/// `POST /v1/completions`.
pub async fn completions(State(s): State<Shared>, body: Result<Bytes, BytesRejection>) -> Result<Response, ApiError> {
    let r: CompletionRequest = parse_body(body, Flavor::OpenAi)?;
    s.check_model(&r.model)?;
    check_n(r.n)?;
    check_best_of(r.best_of)?;
    let json_format = check_response_format(r.response_format.as_ref())?;
    if r.echo == Some(true) {
        return Err(ApiError::invalid_param("echo", "`echo` is not supported"));
    }
    if r.suffix.as_deref().is_some_and(|x| !x.is_empty()) {
        return Err(ApiError::invalid_param("suffix", "`suffix` is not supported"));
    }
    let logprobs = match r.logprobs {
        None => None,
        Some(n) if (0..=MAX_TOP_LOGPROBS).contains(&n) => Some(n as usize),
        Some(n) => {
            return Err(ApiError::invalid_param(
                "logprobs",
                format!("`logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
    };
    let sampling = sampling_of(&s, &r.sampling_fields(), r.temperature, r.top_p, r.top_k, r.seed)?;
    let stop = stop_strings(r.stop.as_ref(), "stop")?;
    if let Some(p) = &r.prompt {
        crate::limits::check_prompt_bytes(s.context_length, crate::limits::text_bytes(p), "prompt")?;
    }
    let ticket = s.admit().await?;
    let (ticket, prompt) = {
        let p = r.prompt.clone();
        s.prepare(ticket, move |st| prompt_ids(st, p.as_ref())).await?
    };
    let max_new_tokens = s.max_new_tokens(r.max_tokens, "max_tokens", "prompt", prompt.len())?;
    // A raw prompt: no chat markup, so no think block to close.
    let constraint = match json_format {
        Some(c) => Some(s.constrain(c, String::new(), "response_format").await?),
        None => None,
    };
    let req = GenerationRequest {
        prompt,
        max_new_tokens,
        sampling,
        stop,
        ignore_eos: r.ignore_eos.unwrap_or(false),
        logprobs,
        keep_special_tokens: false,
        constraint,
    };
    let include_usage = r.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let (rx, meta) = launch(&s, ticket, req, Kind::Completion, "cmpl-", include_usage).await?;
    if r.stream.unwrap_or(false) {
        return Ok(sse_with(rx, meta, None).into_response());
    }
    let c = collect(rx).await?;
    let lp = meta
        .logprobs
        .then(|| completion_logprobs(|id, t| token_bytes(&s.tokenizer, id, t), &c.logprobs));
    Ok(Json(json!({
        "id": meta.id,
        "object": "text_completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "text": c.output.text,
            "logprobs": lp,
            "finish_reason": finish_reason(&c.output.finish),
        }],
        "usage": usage(&c.output),
    }))
    .into_response())
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(
    State(s): State<Shared>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Response, ApiError> {
    let r: ChatRequest = parse_body(body, Flavor::OpenAi)?;
    s.check_model(&r.model)?;
    check_n(r.n)?;
    check_best_of(r.best_of)?;
    let json_format = check_response_format(r.response_format.as_ref())?;
    let want_logprobs = r.logprobs.unwrap_or(false);
    let logprobs = match (want_logprobs, r.top_logprobs) {
        (_, Some(n)) if !(0..=MAX_TOP_LOGPROBS).contains(&n) => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                format!("`top_logprobs` must be between 0 and {MAX_TOP_LOGPROBS}, got {n}"),
            ))
        }
        (false, Some(n)) if n > 0 => {
            return Err(ApiError::invalid_param(
                "top_logprobs",
                "`top_logprobs` needs `logprobs: true`",
            ))
        }
        (false, _) => None,
        (true, n) => Some(n.unwrap_or(0) as usize),
    };
    let sampling = sampling_of(&s, &r.sampling_fields(), r.temperature, r.top_p, r.top_k, r.seed)?;
    let stop = stop_strings(r.stop.as_ref(), "stop")?;
    let (tools, calls_enabled, forced) = check_tools(r.tools.as_ref(), r.tool_choice.as_ref())?;
    if forced.is_some() && json_format.is_some() {
        return Err(ApiError::invalid_param(
            "response_format",
            "`response_format` JSON and a forced `tool_choice` cannot both shape the reply: the reply is the tool call",
        ));
    }
    if !matches!(r.parallel_tool_calls, None | Some(Value::Null) | Some(Value::Bool(_))) {
        return Err(ApiError::invalid_param(
            "parallel_tool_calls",
            "`parallel_tool_calls` must be a boolean",
        ));
    }
    let parallel = r.parallel_tool_calls.as_ref().and_then(Value::as_bool).unwrap_or(true);
    let messages = chat_messages::openai_messages(r.messages.as_deref().unwrap_or(&[]))?;
    let extra = template_vars(
        s.family,
        r.chat_template_kwargs.as_ref(),
        "chat_template_kwargs",
        tools.clone(),
        None,
        r.reasoning_effort.as_ref(),
        "reasoning_effort",
    )?;
    let (ticket, rendered) = chat_prompt(&s, messages, extra).await?;
    let (constraint, family) = match (forced, json_format, &tools) {
        (Some(f), _, Some(t)) => {
            let c = Constraint::ToolCalls {
                tools: forced_tools(t, &f),
                parallel,
            };
            let g = s.constrain(c, rendered.tail.clone(), "tool_choice").await?;
            (Some(g), Some(call_family(s.family)))
        }
        (None, Some(c), _) => (
            Some(s.constrain(c, rendered.tail.clone(), "response_format").await?),
            s.family,
        ),
        _ => (None, s.family),
    };
    let parser = ReplyParser::new(family, calls_enabled, tools, rendered.tail);
    let prompt = rendered.ids;
    let (requested, param) = match (r.max_completion_tokens, r.max_tokens) {
        (Some(v), _) => (Some(v), "max_completion_tokens"),
        (None, v) => (v, "max_tokens"),
    };
    let max_new_tokens = s.max_new_tokens(requested, param, "messages", prompt.len())?;
    let req = GenerationRequest {
        prompt,
        max_new_tokens,
        sampling,
        stop,
        ignore_eos: r.ignore_eos.unwrap_or(false),
        logprobs,
        keep_special_tokens: parser.active() && s.keeps_special_tokens(family),
        constraint,
    };
    let include_usage = r.stream_options.and_then(|o| o.include_usage).unwrap_or(false);
    let (rx, meta) = launch(&s, ticket, req, Kind::Chat, "chatcmpl-", include_usage).await?;
    if r.stream.unwrap_or(false) {
        return Ok(sse_with(rx, meta, Some(parser)).into_response());
    }
    let c = collect(rx).await?;
    let lp = meta
        .logprobs
        .then(|| json!({"content": chat_logprobs(&s.tokenizer, &c.logprobs), "refusal": null}));
    let reply = Reply::parse(parser, &c.output.text);
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": chat_message(&reply),
            "logprobs": lp,
            "finish_reason": chat_finish_reason(&c.output.finish, !reply.calls.is_empty()),
        }],
        "usage": usage(&c.output),
    }))
    .into_response())
}

/// The assistant message of a chat completion: `content` (null when the reply is only tool
/// calls), `reasoning_content` when the model reasoned (the field vLLM and DeepSeek's API use),
/// `tool_calls` when it called tools.
fn chat_message(r: &Reply) -> Value {
    let content = if r.content.is_empty() && !r.calls.is_empty() {
        Value::Null
    } else {
        Value::String(r.content.clone())
    };
    let mut m = json!({"role": "assistant", "content": content, "refusal": null});
    if !r.reasoning.is_empty() {
        m["reasoning_content"] = json!(r.reasoning);
    }
    if !r.calls.is_empty() {
        m["tool_calls"] = r
            .calls
            .iter()
            .map(|c| json!({"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}))
            .collect();
    }
    m
}

/// `finish_reason` of a chat completion: `"tool_calls"` when the model called tools and
/// stopped by itself (a length cut stays `"length"`), as OpenAI.
fn chat_finish_reason(f: &FinishReason, called: bool) -> &'static str {
    match f {
        FinishReason::Eos | FinishReason::StopString(_) if called => "tool_calls",
        f => finish_reason(f),
    }
}

pub(crate) fn finish_reason(f: &FinishReason) -> &'static str {
    match f {
        FinishReason::Length => "length",
        FinishReason::Eos | FinishReason::StopString(_) | FinishReason::Cancelled => "stop",
    }
}

fn usage(o: &GenerationOutput) -> Value {
    let completion = o.generated_ids.len();
    json!({
        "prompt_tokens": o.prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": o.prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": o.reused_tokens},
    })
}

/// The chat `logprobs.content` entries. `token` is the token's text (a partial UTF-8 character
/// as U+FFFD, as OpenAI does); `bytes` its exact bytes ([`Tokenizer::token_bytes`]), so that
/// concatenating them rebuilds characters split across tokens.
fn chat_logprobs(tokenizer: &Tokenizer, lps: &[TokenLogprob]) -> Vec<Value> {
    let bytes = |id: u32, text: &str| token_bytes(tokenizer, id, text);
    lps.iter()
        .map(|t| {
            json!({
                "token": t.token,
                "logprob": t.logprob,
                "bytes": bytes(t.id, &t.token),
                "top_logprobs": t.top.iter().map(|(id, tok, lp)| json!({
                    "token": tok, "logprob": lp, "bytes": bytes(*id, tok),
                })).collect::<Vec<_>>(),
            })
        })
        .collect()
}

/// A token's exact bytes ([`Tokenizer::token_bytes`]; its text's UTF-8 should that fail).
fn token_bytes(tokenizer: &Tokenizer, id: u32, text: &str) -> Vec<u8> {
    tokenizer.token_bytes(id).unwrap_or_else(|_| text.as_bytes().to_vec())
}

/// A token as the legacy completions shape writes it: its text, or when its bytes are not
/// valid UTF-8 on their own (part of a multi-byte character) `bytes:` followed by each byte as
/// `\xNN` (e.g. `bytes:\xe2\x80`), as OpenAI does, so distinct partial tokens stay distinct.
fn completion_token(bytes: &[u8]) -> String {
    match std::str::from_utf8(bytes) {
        Ok(t) => t.to_string(),
        Err(_) => {
            let mut t = String::from("bytes:");
            for b in bytes {
                let _ = write!(t, "\\x{b:02x}");
            }
            t
        }
    }
}

/// The legacy completions shape: parallel lists plus one `{token: logprob}` map per position.
/// Tokens are written by [`completion_token`]. `text_offset` is the token's start in the
/// returned text, in characters (OpenAI's offsets are Python string indices): the characters
/// completed by the tokens before it, so the tokens of one split character share an offset.
/// `bytes_of(id, text)` gives a token's exact bytes.
fn completion_logprobs(bytes_of: impl Fn(u32, &str) -> Vec<u8>, lps: &[TokenLogprob]) -> Value {
    let mut chars = 0usize;
    let mut pending: Vec<u8> = Vec::new();
    let mut offsets = Vec::with_capacity(lps.len());
    let mut tokens = Vec::with_capacity(lps.len());
    for t in lps {
        offsets.push(chars);
        let bytes = bytes_of(t.id, &t.token);
        tokens.push(completion_token(&bytes));
        pending.extend_from_slice(&bytes);
        // Count the characters `pending` completes; an invalid sequence is one U+FFFD (as in a
        // lossy decode); an incomplete character at the end waits for the next token.
        loop {
            match std::str::from_utf8(&pending) {
                Ok(v) => {
                    chars += v.chars().count();
                    pending.clear();
                    break;
                }
                Err(e) => {
                    let valid = e.valid_up_to();
                    chars += std::str::from_utf8(&pending[..valid]).map_or(0, |v| v.chars().count());
                    match e.error_len() {
                        Some(n) => {
                            chars += 1;
                            pending.drain(..valid + n);
                        }
                        None => {
                            pending.drain(..valid);
                            break;
                        }
                    }
                }
            }
        }
    }
    json!({
        "tokens": tokens,
        "token_logprobs": lps.iter().map(|t| t.logprob).collect::<Vec<_>>(),
        "top_logprobs": lps.iter().map(|t| {
            let mut m = serde_json::Map::new();
            for (id, tok, lp) in &t.top {
                m.entry(completion_token(&bytes_of(*id, tok))).or_insert(json!(lp));
            }
            Value::Object(m)
        }).collect::<Vec<_>>(),
        "text_offset": offsets,
    })
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Kind {
    Completion,
    Chat,
}

/// Takes the generation slot, queues `req`, and returns its events with the response metadata.
async fn launch(
    s: &Shared,
    ticket: Ticket,
    req: GenerationRequest,
    kind: Kind,
    id_prefix: &str,
    include_usage: bool,
) -> Result<(UnboundedReceiver<JobEvent>, Meta), ApiError> {
    let logprobs = req.logprobs.is_some();
    let rx = s.start(ticket, req).await?;
    let meta = Meta {
        kind,
        id: new_id(id_prefix),
        created: unix_now(),
        model: s.config.model_id.clone(),
        include_usage,
        logprobs,
        tokenizer: Arc::clone(&s.tokenizer),
    };
    Ok((rx, meta))
}

struct Meta {
    kind: Kind,
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
    logprobs: bool,
    /// For the exact `bytes` of chat logprobs.
    tokenizer: Arc<Tokenizer>,
}

/// The SSE state machine: queued events out first; then the next job event.
struct StreamState {
    /// The job's events in, the reply's events out.
    out: Outbox,
    meta: Meta,
    /// The content chunk held back so that the last one can carry `finish_reason`.
    held_text: String,
    held_logprobs: Vec<TokenLogprob>,
    /// Chat with a family parser: its deltas replace the plain `content` deltas.
    parser: Option<ReplyParser>,
    /// The parsed delta held back so that the last one can carry `finish_reason`.
    held_delta: Option<Value>,
    /// Whether a tool call was streamed.
    called: bool,
}

impl StreamState {
    /// A chat chunk with a given `delta` object.
    fn chat_chunk(&self, delta: Value, logprobs: &[TokenLogprob], finish: Option<&str>) -> Value {
        let m = &self.meta;
        let lp = if m.logprobs && !logprobs.is_empty() {
            json!({"content": chat_logprobs(&m.tokenizer, logprobs), "refusal": null})
        } else {
            Value::Null
        };
        let mut c = json!({
            "id": m.id,
            "object": "chat.completion.chunk",
            "created": m.created,
            "model": m.model,
            "choices": [{"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}],
        });
        if m.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    /// Parsed events become chat deltas, as OpenAI streams them: `content`, `reasoning_content`,
    /// and for a call first its index, id, type and name (empty arguments), then its arguments
    /// in pieces under the same index.
    fn on_parsed(&mut self, events: Vec<ParsedEvent>) {
        for e in events {
            let delta = match e {
                ParsedEvent::Content(t) => json!({"content": t}),
                ParsedEvent::Reasoning(t) => json!({"reasoning_content": t}),
                ParsedEvent::ToolCallStart { index, id, name } => {
                    self.called = true;
                    json!({"tool_calls": [{"index": index, "id": id, "type": "function",
                                           "function": {"name": name, "arguments": ""}}]})
                }
                ParsedEvent::ToolCallArgs { index, args } => {
                    json!({"tool_calls": [{"index": index, "function": {"arguments": args}}]})
                }
                ParsedEvent::ToolCallEnd { .. } => continue,
            };
            if let Some(held) = self.held_delta.take() {
                let lps = std::mem::take(&mut self.held_logprobs);
                let c = self.chat_chunk(held, &lps, None);
                self.push_json(&c);
            }
            self.held_delta = Some(delta);
        }
    }

    /// Sends the held parsed delta (an empty one when only `finish` is left to say).
    fn flush_held_delta(&mut self, finish: Option<&str>) {
        let lps = std::mem::take(&mut self.held_logprobs);
        let delta = match self.held_delta.take() {
            Some(d) => d,
            None if finish.is_none() && lps.is_empty() => return,
            None => json!({}),
        };
        let c = self.chat_chunk(delta, &lps, finish);
        self.push_json(&c);
    }

    fn chunk(&self, text: &str, logprobs: &[TokenLogprob], finish: Option<&str>, role: bool) -> Value {
        let m = &self.meta;
        let lp = if m.logprobs && !logprobs.is_empty() {
            match m.kind {
                Kind::Chat => json!({"content": chat_logprobs(&m.tokenizer, logprobs), "refusal": null}),
                Kind::Completion => completion_logprobs(|id, t| token_bytes(&m.tokenizer, id, t), logprobs),
            }
        } else {
            Value::Null
        };
        let choice = match m.kind {
            Kind::Chat => {
                let delta = if role {
                    json!({"role": "assistant", "content": ""})
                } else if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                json!({"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Kind::Completion => json!({"index": 0, "text": text, "logprobs": lp, "finish_reason": finish}),
        };
        let mut c = json!({
            "id": m.id,
            "object": if m.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
            "created": m.created,
            "model": m.model,
            "choices": [choice],
        });
        if m.include_usage {
            c["usage"] = Value::Null;
        }
        c
    }

    fn push_json(&mut self, v: &Value) {
        self.out.queue.push_back(Event::default().data(v.to_string()));
    }

    fn flush_held(&mut self, finish: Option<&str>) {
        if self.parser.is_some() {
            return self.flush_held_delta(finish);
        }
        let text = std::mem::take(&mut self.held_text);
        let lps = std::mem::take(&mut self.held_logprobs);
        if finish.is_none() && text.is_empty() && lps.is_empty() {
            return;
        }
        let c = self.chunk(&text, &lps, finish, false);
        self.push_json(&c);
    }

    fn finish(&mut self) {
        self.out.queue.push_back(Event::default().data("[DONE]"));
        self.out.done = true;
    }
}

impl JobStream for StreamState {
    fn outbox(&mut self) -> &mut Outbox {
        &mut self.out
    }

    fn on_delta(&mut self, d: Delta) {
        if let Some(p) = self.parser.as_mut() {
            self.held_logprobs.extend(d.logprob);
            let events = p.push(&d.text);
            self.on_parsed(events);
        } else {
            if !d.text.is_empty() && !self.held_text.is_empty() {
                self.flush_held(None);
            }
            self.held_text.push_str(&d.text);
            self.held_logprobs.extend(d.logprob);
        }
    }

    fn on_done(&mut self, out: GenerationOutput) {
        let events = self.parser.as_mut().map(ReplyParser::finish).unwrap_or_default();
        self.on_parsed(events);
        let reason = match self.parser {
            Some(_) => chat_finish_reason(&out.finish, self.called),
            None => finish_reason(&out.finish),
        };
        self.flush_held(Some(reason));
        if self.meta.include_usage {
            let m = &self.meta;
            let u = json!({
                "id": m.id,
                "object": if m.kind == Kind::Chat { "chat.completion.chunk" } else { "text_completion" },
                "created": m.created,
                "model": m.model,
                "choices": [],
                "usage": usage(&out),
            });
            self.push_json(&u);
        }
        self.finish();
    }

    fn fail(&mut self, message: &str) {
        self.flush_held(None);
        let e = ApiError::internal(message).body();
        self.push_json(&e);
        self.finish();
    }
}

/// The SSE response of a generation; `parser` (chat only) turns the text into content,
/// reasoning and tool-call deltas.
fn sse_with(
    rx: UnboundedReceiver<JobEvent>,
    meta: Meta,
    parser: Option<ReplyParser>,
) -> Sse<impl Stream<Item = Result<Event, Infallible>>> {
    let mut st = StreamState {
        out: Outbox::new(rx),
        meta,
        held_text: String::new(),
        held_logprobs: Vec::new(),
        parser: parser.filter(ReplyParser::active),
        held_delta: None,
        called: false,
    };
    if st.meta.kind == Kind::Chat {
        let c = st.chunk("", &[], None, true);
        st.push_json(&c);
    }
    sse_reply(st)
}

#[cfg(test)]
pub(crate) mod stream_tests {
    //! The chat SSE machinery (the layer right below the HTTP handler) fed a fixed text stream
    //! in place of a model, with each family's real markup.
    use deltafin_engine::session::Delta;
    use tokio::sync::mpsc::unbounded_channel;

    use super::*;
    use crate::tools::Family;

    pub(crate) fn tokenizer() -> Arc<Tokenizer> {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3/dsv3_a");
        Arc::new(Tokenizer::from_dir(&dir).unwrap())
    }

    pub(crate) fn output(text: &str, finish: FinishReason) -> GenerationOutput {
        GenerationOutput {
            text: text.into(),
            generated_ids: vec![1; 4],
            finish,
            prompt_tokens: 3,
            reused_tokens: 0,
            stats: Default::default(),
        }
    }

    /// `text` sent to a receiver in pieces of `piece` chars, then the end.
    pub(crate) fn events(text: &str, piece: usize, finish: FinishReason) -> UnboundedReceiver<JobEvent> {
        let (tx, rx) = unbounded_channel();
        let chars: Vec<char> = text.chars().collect();
        for c in chars.chunks(piece) {
            let d = Delta {
                token: Some(1),
                text: c.iter().collect(),
                logprob: None,
            };
            tx.send(JobEvent::Delta(d)).unwrap();
        }
        tx.send(JobEvent::Done(Ok(output(text, finish)))).unwrap();
        rx
    }

    /// The SSE body of the response `make` builds, as (event name, data) pairs.
    pub(crate) fn sse_events(make: impl FnOnce() -> Response) -> Vec<(String, String)> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        // The keep-alive timer needs the runtime when the response is built.
        let response = {
            let _in_runtime = rt.enter();
            make()
        };
        let bytes = rt
            .block_on(axum::body::to_bytes(response.into_body(), usize::MAX))
            .unwrap();
        let text = String::from_utf8(bytes.to_vec()).unwrap();
        text.split("\n\n")
            .filter(|e| !e.trim().is_empty())
            .map(|e| {
                let mut name = String::new();
                let mut data = String::new();
                for line in e.lines() {
                    if let Some(n) = line.strip_prefix("event: ") {
                        name = n.to_string();
                    } else if let Some(d) = line.strip_prefix("data: ") {
                        data = d.to_string();
                    }
                }
                (name, data)
            })
            .collect()
    }

    fn stream_chat(family: Family, tail: &str, text: &str, piece: usize) -> Vec<Value> {
        let meta = Meta {
            kind: Kind::Chat,
            id: "chatcmpl-t".into(),
            created: 0,
            model: "m".into(),
            include_usage: false,
            logprobs: false,
            tokenizer: tokenizer(),
        };
        let parser = ReplyParser::new(Some(family), true, None, tail.into());
        let rx = events(text, piece, FinishReason::Eos);
        let data = sse_events(|| sse_with(rx, meta, Some(parser)).into_response());
        assert_eq!(data.last().map(|d| d.1.as_str()), Some("[DONE]"));
        data[..data.len() - 1]
            .iter()
            .map(|(_, d)| serde_json::from_str(d).unwrap())
            .collect()
    }

    const K2: &str = "<think>The user wants the weather.</think>Let me check.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Zürich\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";

    /// Streamed as OpenAI streams them: role first; `reasoning_content` and `content` deltas;
    /// each call's first delta carries index, id, type and name, the next its arguments; the
    /// last chunk `finish_reason: "tool_calls"`. Non-streaming gives the same reply.
    #[test]
    fn chat_stream_carries_reasoning_content_and_tool_calls() {
        for piece in [1, 3, 7, 1000] {
            let chunks = stream_chat(Family::KimiK2, "", K2, piece);
            assert_eq!(
                chunks[0]["choices"][0]["delta"],
                json!({"role": "assistant", "content": ""})
            );
            let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
            let join = |key: &str| -> String { deltas.iter().filter_map(|d| d[key].as_str()).collect() };
            assert_eq!(join("reasoning_content"), "The user wants the weather.");
            assert_eq!(join("content"), "Let me check.");
            let calls: Vec<&Value> = deltas
                .iter()
                .filter_map(|d| d["tool_calls"].as_array())
                .flatten()
                .collect();
            assert_eq!(calls[0]["index"], 0);
            assert_eq!(calls[0]["id"], "functions.get_weather:0");
            assert_eq!(calls[0]["type"], "function");
            assert_eq!(calls[0]["function"]["name"], "get_weather");
            let args = |i: i64| -> String {
                calls
                    .iter()
                    .filter(|c| c["index"] == i)
                    .filter_map(|c| c["function"]["arguments"].as_str())
                    .collect()
            };
            assert_eq!(args(0), "{\"city\": \"Zürich\"}");
            assert_eq!(
                calls.iter().filter(|c| c.get("id").is_some()).count(),
                2,
                "one header per call"
            );
            assert_eq!(args(1), "{}");
            let last = chunks.last().unwrap();
            assert_eq!(last["choices"][0]["finish_reason"], "tool_calls", "{piece}");
            assert!(chunks[..chunks.len() - 1]
                .iter()
                .all(|c| c["choices"][0]["finish_reason"].is_null()));
        }
        let reply = Reply::parse(ReplyParser::new(Some(Family::KimiK2), true, None, String::new()), K2);
        let m = chat_message(&reply);
        assert_eq!(m["content"], "Let me check.");
        assert_eq!(m["reasoning_content"], "The user wants the weather.");
        assert_eq!(
            m["tool_calls"][1],
            json!({"id": "functions.get_time:1", "type": "function",
            "function": {"name": "get_time", "arguments": "{}"}})
        );
        assert_eq!(chat_finish_reason(&FinishReason::Eos, true), "tool_calls");
        assert_eq!(chat_finish_reason(&FinishReason::Length, true), "length");
    }

    /// The generation prompt opened the think block (Qwen3 with thinking): the output starts
    /// inside it, and a call follows without `</think>`. A reply of only calls has null content.
    #[test]
    fn reasoning_from_the_prompt_and_call_without_think_end() {
        let text = "planning…\n<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"dir\": \"/\"}}\n</tool_call>";
        let tail = "<|im_start|>assistant\n<think>\n";
        let chunks = stream_chat(Family::Qwen, tail, text, 2);
        let deltas: Vec<&Value> = chunks.iter().map(|c| &c["choices"][0]["delta"]).collect();
        let reasoning: String = deltas.iter().filter_map(|d| d["reasoning_content"].as_str()).collect();
        assert_eq!(reasoning, "planning…\n");
        assert!(deltas.iter().all(|d| d["content"].as_str().unwrap_or("").is_empty()));
        let reply = Reply::parse(ReplyParser::new(Some(Family::Qwen), true, None, tail.into()), text);
        let m = chat_message(&reply);
        assert_eq!(m["content"], Value::Null);
        assert_eq!(m["tool_calls"][0]["function"]["arguments"], "{\"dir\":\"/\"}");
    }

    /// Malformed markup is text with the usual `finish_reason`.
    #[test]
    fn malformed_call_streams_as_content() {
        let text = "<tool_call>\n{\"name\": \"ls\", \"arguments\": {\"dir\": }\n</tool_call>";
        let chunks = stream_chat(Family::Qwen, "", text, 4);
        let content: String = chunks
            .iter()
            .filter_map(|c| c["choices"][0]["delta"]["content"].as_str())
            .collect();
        assert_eq!(content, text);
        assert_eq!(chunks.last().unwrap()["choices"][0]["finish_reason"], "stop");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `text_offset` counts characters of the returned text (OpenAI's offsets are Python string
    /// indices), so a token of one multi-byte character advances it by 1, not by its UTF-8
    /// length, and the tokens of a character split across tokens share one offset; such
    /// partial tokens are written `bytes:\xNN...`, so two of them never collide as keys.
    #[test]
    fn completion_tokens_offsets_and_partial_characters() {
        // id -> bytes: 1 and 2 are the halves of "é" (c3 a9), 3 is "é!", 4 "ab", 5 is the
        // first two bytes of "€" (e2 82 ac), 6 its last.
        let bytes_of = |id: u32, _: &str| match id {
            1 => vec![0xc3],
            2 => vec![0xa9],
            3 => "é!".as_bytes().to_vec(),
            4 => b"ab".to_vec(),
            5 => vec![0xe2, 0x82],
            6 => vec![0xac],
            _ => unreachable!(),
        };
        let lp = |id: u32, top: &[u32]| TokenLogprob {
            id,
            token: String::from_utf8_lossy(&bytes_of(id, "")).into_owned(),
            logprob: -1.0,
            top: top
                .iter()
                .map(|&t| {
                    (
                        t,
                        String::from_utf8_lossy(&bytes_of(t, "")).into_owned(),
                        -1.0 - t as f32,
                    )
                })
                .collect(),
        };
        let v = completion_logprobs(
            bytes_of,
            &[
                lp(1, &[1, 2, 5]),
                lp(2, &[2]),
                lp(3, &[3]),
                lp(5, &[5, 6]),
                lp(6, &[6]),
                lp(4, &[4]),
            ],
        );
        assert_eq!(
            v["tokens"],
            json!([
                "bytes:\\xc3",
                "bytes:\\xa9",
                "é!",
                "bytes:\\xe2\\x82",
                "bytes:\\xac",
                "ab"
            ])
        );
        // Returned text "éé!€ab": é at 0, é! at 1..3, € at 3, ab at 4.
        assert_eq!(v["text_offset"], json!([0, 0, 1, 3, 3, 4]));
        let top0 = v["top_logprobs"][0].as_object().unwrap();
        assert_eq!(top0.len(), 3, "{top0:?}");
        assert!(top0.contains_key("bytes:\\xe2\\x82"), "{top0:?}");
    }
}

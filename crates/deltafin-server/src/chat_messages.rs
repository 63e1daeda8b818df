//! API messages turned into chat-template messages, the way vLLM hands them to transformers'
//! `apply_chat_template`, so that multi-turn tool conversations render exactly as the model's
//! own template expects.
//!
//! OpenAI (`vllm/entrypoints/chat_utils.py`, `_parse_chat_message_content` and
//! `_postprocess_messages`): each message becomes `{"role", "content", ...}` with `content` a
//! string (text parts joined with `"\n"`, null as `""`); an assistant turn keeps `tool_calls`,
//! whose `function.arguments` JSON text is parsed into its value (empty or null: `{}`; an empty
//! `tool_calls` list is dropped), and its reasoning as both `reasoning` and
//! `reasoning_content`; a `tool` turn keeps `tool_call_id`; a string `name` is kept. Templates
//! iterate `arguments|items` or print `arguments|tojson`, both of which need the parsed value.
//!
//! Anthropic (`vllm/entrypoints/anthropic/serving.py`,
//! `_convert_anthropic_to_openai_request`): `system` (text blocks joined) leads; in an
//! assistant turn `thinking` blocks become the reasoning, `tool_use` blocks `tool_calls` (the
//! `input` as the arguments) and text blocks the content; in a user turn each `tool_result`
//! becomes a `tool` message (its text blocks joined with `"\n"`) placed before the turn's text,
//! and a turn of only tool results adds no user message. The result then takes the OpenAI path.

use serde_json::{json, Map, Value};

use crate::ApiError;

/// Template messages of an OpenAI `messages` list: roles `system`, `developer` (as `system`),
/// `user`, `assistant`, `tool`; `content` a string or a list of text parts, null or absent only
/// on an assistant turn.
///
/// Errors: 400 naming `messages[i]...` for an empty list, an unknown role, a non-text content
/// part, a malformed tool call or arguments that are not JSON.
pub(crate) fn openai_messages(msgs: &[Value]) -> Result<Vec<Value>, ApiError> {
    if msgs.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    msgs.iter()
        .enumerate()
        .map(|(i, m)| openai_message(m, &format!("messages[{i}]")))
        .collect()
}

fn openai_message(m: &Value, at: &str) -> Result<Value, ApiError> {
    let bad = |field: &str, msg: String| ApiError::invalid_param(&format!("{at}{field}"), msg);
    let Some(obj) = m.as_object() else {
        return Err(bad("", format!("{at} must be an object")));
    };
    let role = match obj.get("role").and_then(Value::as_str) {
        Some("developer") => "system",
        Some(r @ ("system" | "user" | "assistant" | "tool")) => r,
        Some(r) => {
            return Err(bad(
                ".role",
                format!("{at}.role `{r}` is not one of system, developer, user, assistant, tool"),
            ))
        }
        None => return Err(bad(".role", format!("{at}.role is required and must be a string"))),
    };
    let content = match obj.get("content") {
        Some(Value::String(s)) => s.clone(),
        Some(Value::Array(parts)) => text_parts(parts, &format!("{at}.content"))?,
        None | Some(Value::Null) if role == "assistant" => String::new(),
        None | Some(Value::Null) => {
            return Err(bad(
                ".content",
                format!("{at}.content is required (null only on an assistant message)"),
            ))
        }
        Some(_) => {
            return Err(bad(
                ".content",
                format!("{at}.content must be a string or a list of text parts"),
            ))
        }
    };
    let mut out = Map::new();
    out.insert("role".into(), Value::String(role.into()));
    out.insert("content".into(), Value::String(content));
    match role {
        "assistant" => {
            match obj.get("tool_calls") {
                None | Some(Value::Null) => {}
                Some(Value::Array(calls)) if calls.is_empty() => {}
                Some(Value::Array(calls)) => {
                    let calls = calls
                        .iter()
                        .enumerate()
                        .map(|(j, c)| tool_call(c, &format!("{at}.tool_calls[{j}]")))
                        .collect::<Result<Vec<_>, _>>()?;
                    out.insert("tool_calls".into(), Value::Array(calls));
                }
                Some(_) => {
                    return Err(bad(
                        ".tool_calls",
                        format!("{at}.tool_calls must be a list of tool calls"),
                    ))
                }
            }
            // Python `message.get("reasoning") or message.get("reasoning_content")`.
            let reasoning = match obj.get("reasoning") {
                Some(v) if !matches!(v, Value::Null) && v.as_str() != Some("") => Some(("reasoning", v)),
                _ => obj.get("reasoning_content").map(|v| ("reasoning_content", v)),
            };
            match reasoning {
                None | Some((_, Value::Null)) => {}
                Some((_, Value::String(r))) => {
                    out.insert("reasoning".into(), Value::String(r.clone()));
                    out.insert("reasoning_content".into(), Value::String(r.clone()));
                }
                Some((k, _)) => return Err(bad(&format!(".{k}"), format!("{at}.{k} must be a string"))),
            }
        }
        "tool" => {
            if let Some(id) = obj.get("tool_call_id") {
                out.insert("tool_call_id".into(), id.clone());
            }
        }
        _ => {}
    }
    if let Some(name @ Value::String(_)) = obj.get("name") {
        out.insert("name".into(), name.clone());
    }
    Ok(Value::Object(out))
}

/// One assistant tool call with its `function.arguments` parsed (vLLM `_postprocess_messages`).
fn tool_call(c: &Value, at: &str) -> Result<Value, ApiError> {
    let shape = r#"{"id": ..., "type": "function", "function": {"name": ..., "arguments": "{...}"}}"#;
    let Some(obj) = c.as_object() else {
        return Err(ApiError::invalid_param(
            at,
            format!("{at} must be an object such as {shape}"),
        ));
    };
    let Some(f) = obj.get("function").and_then(Value::as_object) else {
        return Err(ApiError::invalid_param(
            &format!("{at}.function"),
            format!("{at}.function is required, an object such as {shape}"),
        ));
    };
    if !matches!(f.get("name"), Some(Value::String(_))) {
        return Err(ApiError::invalid_param(
            &format!("{at}.function.name"),
            format!("{at}.function.name is required and must be a string"),
        ));
    }
    let at_args = format!("{at}.function.arguments");
    let arguments = match f.get("arguments") {
        None | Some(Value::Null) => json!({}),
        Some(Value::String(s)) if s.is_empty() => json!({}),
        Some(Value::String(s)) => serde_json::from_str(s)
            .map_err(|e| ApiError::invalid_param(&at_args, format!("{at_args} is not valid JSON: {e}")))?,
        Some(v @ (Value::Object(_) | Value::Array(_))) => v.clone(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                &at_args,
                format!("{at_args} must be a string of JSON"),
            ))
        }
    };
    let mut call = obj.clone();
    let mut function = f.clone();
    function.insert("arguments".into(), arguments);
    call.insert("function".into(), Value::Object(function));
    Ok(Value::Object(call))
}

/// Text parts (`{"type": "text", "text": ...}`) joined with `"\n"`.
fn text_parts(parts: &[Value], at: &str) -> Result<String, ApiError> {
    let mut texts = Vec::with_capacity(parts.len());
    for (j, p) in parts.iter().enumerate() {
        match (p.get("type").and_then(Value::as_str), p.get("text")) {
            (Some("text"), Some(Value::String(t))) => texts.push(t.as_str()),
            (Some("text"), _) => return Err(ApiError::invalid_param(at, format!("{at}[{j}].text must be a string"))),
            (t, _) => {
                return Err(ApiError::invalid_param(
                    at,
                    format!(
                        "{at}[{j}]: only text parts are supported, got type {}",
                        t.unwrap_or("(none)")
                    ),
                ))
            }
        }
    }
    Ok(texts.join("\n"))
}

/// Template messages of an Anthropic request's `messages` and `system` (see the module doc).
///
/// Errors: 400 naming the field for an empty list, a role other than user/assistant, a block
/// type other than text, thinking, redacted_thinking, tool_use (assistant) and tool_result
/// (user), or a malformed block.
pub(crate) fn anthropic_messages(messages: &[Value], system: Option<&Value>) -> Result<Vec<Value>, ApiError> {
    if messages.is_empty() {
        return Err(ApiError::invalid_param(
            "messages",
            "`messages` must contain at least one message",
        ));
    }
    let mut out = Vec::with_capacity(messages.len() + 1);
    match system {
        None | Some(Value::Null) => {}
        Some(Value::String(s)) if s.is_empty() => {}
        Some(Value::String(s)) => out.push(json!({"role": "system", "content": s})),
        Some(Value::Array(blocks)) => {
            let mut text = String::new();
            for (j, b) in blocks.iter().enumerate() {
                match (b.get("type").and_then(Value::as_str), b.get("text")) {
                    (Some("text"), Some(Value::String(t))) => {
                        // vLLM drops Claude Code's per-request billing header (it defeats
                        // prefix caching and carries nothing for the model).
                        if !t.starts_with("x-anthropic-billing-header") {
                            text.push_str(t);
                        }
                    }
                    _ => {
                        return Err(ApiError::invalid_param(
                            "system",
                            format!("system[{j}]: only text blocks are supported"),
                        ))
                    }
                }
            }
            if !text.is_empty() {
                out.push(json!({"role": "system", "content": text}));
            }
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                "system",
                "`system` must be a string or a list of text blocks",
            ))
        }
    }
    for (i, m) in messages.iter().enumerate() {
        let at = format!("messages[{i}]");
        let role = match m.get("role").and_then(Value::as_str) {
            Some(r @ ("user" | "assistant")) => r,
            Some(r) => {
                return Err(ApiError::invalid_param(
                    &at,
                    format!("{at}.role `{r}` must be `user` or `assistant`"),
                ))
            }
            None => return Err(ApiError::invalid_param(&at, format!("{at}.role is required"))),
        };
        let blocks = match m.get("content") {
            Some(Value::String(s)) => {
                out.push(json!({"role": role, "content": s}));
                continue;
            }
            Some(Value::Array(blocks)) => blocks,
            _ => {
                return Err(ApiError::invalid_param(
                    &format!("{at}.content"),
                    format!("{at}.content is required, a string or a list of content blocks"),
                ))
            }
        };
        let mut texts: Vec<Value> = Vec::new();
        let mut calls: Vec<Value> = Vec::new();
        let mut reasoning: Option<String> = None;
        for (j, b) in blocks.iter().enumerate() {
            let at_b = format!("{at}.content[{j}]");
            let bad = |m: String| Err(ApiError::invalid_param(&at_b, m));
            let str_field = |k: &str| b.get(k).and_then(Value::as_str);
            match (b.get("type").and_then(Value::as_str), role) {
                (Some("text"), _) => match str_field("text") {
                    Some("") => {}
                    Some(t) => texts.push(json!({"type": "text", "text": t})),
                    None => return bad(format!("{at_b}.text must be a string")),
                },
                (Some("thinking"), "assistant") => match b.get("thinking") {
                    Some(Value::String(t)) => reasoning.get_or_insert_with(String::new).push_str(t),
                    Some(Value::Null) | None => {}
                    Some(_) => return bad(format!("{at_b}.thinking must be a string")),
                },
                // Opaque (encrypted) reasoning: accepted so clients can echo a turn back.
                (Some("redacted_thinking"), "assistant") => {}
                (Some("tool_use"), "assistant") => {
                    let (Some(id), Some(name)) = (str_field("id"), str_field("name")) else {
                        return bad(format!("{at_b}: a tool_use block needs a string `id` and `name`"));
                    };
                    let input = match b.get("input") {
                        None | Some(Value::Null) => json!({}),
                        Some(v @ Value::Object(_)) => v.clone(),
                        Some(_) => return bad(format!("{at_b}.input must be an object")),
                    };
                    calls.push(json!({
                        "id": id,
                        "type": "function",
                        "function": {"name": name, "arguments": input},
                    }));
                }
                (Some("tool_result"), "user") => {
                    let Some(id) = str_field("tool_use_id") else {
                        return bad(format!("{at_b}.tool_use_id is required, a string"));
                    };
                    let content = match b.get("content") {
                        None | Some(Value::Null) => String::new(),
                        Some(Value::String(s)) => s.clone(),
                        Some(Value::Array(parts)) => text_parts(parts, &format!("{at_b}.content"))?,
                        Some(_) => {
                            return bad(format!("{at_b}.content must be a string or a list of text blocks"))
                        }
                    };
                    out.push(json!({"role": "tool", "tool_call_id": id, "content": content}));
                }
                (t, _) => {
                    return bad(format!(
                        "{at_b}: block type {} is not supported in a {role} turn (text, and thinking/tool_use from the assistant or tool_result from the user)",
                        t.unwrap_or("(none)")
                    ))
                }
            }
        }
        let mut msg = Map::new();
        msg.insert("role".into(), Value::String(role.into()));
        let has_content = !texts.is_empty();
        if let Some(r) = &reasoning {
            msg.insert("reasoning".into(), Value::String(r.clone()));
        }
        if !calls.is_empty() {
            msg.insert("tool_calls".into(), Value::Array(calls));
        }
        if texts.len() == 1 {
            msg.insert("content".into(), texts[0]["text"].clone());
        } else if has_content {
            msg.insert("content".into(), Value::Array(texts));
        }
        if role == "assistant" || has_content {
            out.push(Value::Object(msg));
        }
    }
    out.iter()
        .enumerate()
        .map(|(i, m)| openai_message(m, &format!("messages[{i}]")))
        .collect()
}

#[cfg(test)]
mod tests {
    //! Byte-identity with transformers: every conversation of
    //! `tests/fixtures/chat_templates/conversations.json` (API request bodies) goes through the
    //! server's conversion, tool checks and template variables, then minijinja, and must equal
    //! `apply_chat_template`'s render in `expected.json` (made by `make_chat_template_fixtures.py`
    //! from the real templates in `templates/`), or fail where transformers fails.

    use std::path::{Path, PathBuf};

    use deltafin_tokenizer::{ChatTemplate, TokenizerError};
    use serde_json::Value;

    use crate::agent::template_vars;
    use crate::{anthropic, openai};

    fn dir() -> PathBuf {
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/chat_templates")
    }

    fn read_json(name: &str) -> Value {
        let path = dir().join(name);
        let text = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        serde_json::from_str(&text).unwrap()
    }

    /// The template input of a request body, as the chat endpoints build it.
    fn template_input(api: &str, body: &Value) -> (Vec<Value>, Value) {
        let none = |k: &str| body.get(k).filter(|v| !v.is_null());
        match api {
            "openai" => {
                let (tools, _, _) = openai::check_tools(none("tools"), None).unwrap();
                let messages = super::openai_messages(body["messages"].as_array().unwrap()).unwrap();
                let extra = template_vars(
                    None,
                    none("chat_template_kwargs"),
                    "chat_template_kwargs",
                    tools,
                    None,
                    None,
                    "reasoning_effort",
                )
                .unwrap();
                (messages, extra)
            }
            "anthropic" => {
                let (tools, _, _) = anthropic::check_tools(none("tools"), None).unwrap();
                let messages = super::anthropic_messages(body["messages"].as_array().unwrap(), none("system")).unwrap();
                (messages, template_vars(None, None, "", tools, None, None, "").unwrap())
            }
            other => panic!("unknown api {other}"),
        }
    }

    /// Malformed turns are 400s naming the field; nothing malformed reaches the template.
    #[test]
    fn malformed_turns_name_the_field() {
        use serde_json::json;
        let param = |e: crate::ApiError| {
            assert_eq!(e.status, axum::http::StatusCode::BAD_REQUEST, "{}", e.message);
            e.param.unwrap_or_default()
        };
        let call = |args: Value| {
            json!([{"role": "user", "content": "hi"},
                   {"role": "assistant", "content": null,
                    "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": args}}]}])
        };
        for (msgs, field) in [
            (call(json!("{\"a\": ")), "messages[1].tool_calls[0].function.arguments"),
            (call(json!(5)), "messages[1].tool_calls[0].function.arguments"),
            (
                json!([{"role": "assistant", "tool_calls": [{"function": {}}]}]),
                "messages[0].tool_calls[0].function.name",
            ),
            (
                json!([{"role": "assistant", "tool_calls": "x"}]),
                "messages[0].tool_calls",
            ),
            (
                json!([{"role": "assistant", "content": "", "reasoning_content": 3}]),
                "messages[0].reasoning_content",
            ),
            (json!([{"role": "tool", "content": null}]), "messages[0].content"),
            (
                json!([{"role": "user", "content": [{"type": "image_url"}]}]),
                "messages[0].content",
            ),
            (json!([{"role": "critic", "content": "x"}]), "messages[0].role"),
        ] {
            let e = super::openai_messages(msgs.as_array().unwrap()).unwrap_err();
            assert_eq!(param(e), field, "{msgs}");
        }
        let ok = super::openai_messages(call(json!("")).as_array().unwrap()).unwrap();
        assert_eq!(ok[1]["tool_calls"][0]["function"]["arguments"], json!({}));
        assert_eq!(ok[1]["content"], "");

        for (msgs, field) in [
            (
                json!([{"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_use", "name": "f"}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "tool_result"}]}]),
                "messages[0].content[0]",
            ),
            (
                json!([{"role": "user", "content": [{"type": "image", "source": {}}]}]),
                "messages[0].content[0]",
            ),
            (json!([{"role": "user"}]), "messages[0].content"),
        ] {
            let e = super::anthropic_messages(msgs.as_array().unwrap(), None).unwrap_err();
            assert_eq!(param(e), field, "{msgs}");
        }
        // A user turn of only tool results adds no user message; results keep their order.
        let m = super::anthropic_messages(
            json!([{"role": "user", "content": [
                {"type": "tool_result", "tool_use_id": "a", "content": "1"},
                {"type": "tool_result", "tool_use_id": "b", "content": [{"type": "text", "text": "2"}, {"type": "text", "text": "3"}]}]}])
            .as_array()
            .unwrap(),
            Some(&json!("sys")),
        )
        .unwrap();
        assert_eq!(
            Value::Array(m),
            json!([{"role": "system", "content": "sys"},
                   {"role": "tool", "content": "1", "tool_call_id": "a"},
                   {"role": "tool", "content": "2\n3", "tool_call_id": "b"}])
        );
    }

    #[test]
    fn renders_match_transformers_byte_for_byte() {
        let conversations = read_json("conversations.json");
        let expected = read_json("expected.json");
        let today = ChatTemplate::new("{{ strftime_now('%Y-%m-%d') }}", None, None)
            .unwrap()
            .render(&[], false, &Value::Null)
            .unwrap();
        let fixture_date = expected["date"].as_str().unwrap();
        let renders = expected["renders"].as_object().unwrap();
        assert_eq!(renders.len(), 8, "one render set per template");
        let mut checked = 0;
        let mut failures = Vec::new();
        for (family, cases) in renders {
            let source = std::fs::read_to_string(dir().join(format!("templates/{family}.jinja"))).unwrap();
            let special = &expected["special_tokens"][family];
            let token = |k: &str| special[k].as_str().map(str::to_string);
            let template = ChatTemplate::new(&source, token("bos"), token("eos")).unwrap();
            for case in conversations.as_array().unwrap() {
                let name = case["name"].as_str().unwrap();
                let (messages, extra) = template_input(case["api"].as_str().unwrap(), &case["request"]);
                let got = template.render(&messages, true, &extra);
                let want = &cases[name];
                checked += 1;
                match (got, want.get("prompt").and_then(Value::as_str)) {
                    (Ok(got), Some(want)) => {
                        // gpt-oss prints the current date: compare against the generation date.
                        let got = got.replace(
                            &format!("Current date: {today}"),
                            &format!("Current date: {fixture_date}"),
                        );
                        if got != want {
                            let at = got.bytes().zip(want.bytes()).take_while(|(a, b)| a == b).count();
                            let around = |s: &str| {
                                let b = s.as_bytes();
                                String::from_utf8_lossy(&b[at.saturating_sub(80).min(b.len())..(at + 80).min(b.len())])
                                    .into_owned()
                            };
                            failures.push(format!(
                                "{family}/{name}: differs at byte {at}\n  got:  {:?}\n  want: {:?}",
                                around(&got),
                                around(want),
                            ));
                        }
                    }
                    (Err(e), None) => {
                        let message = want["error"].as_str().unwrap();
                        if want["raised"].as_bool() == Some(true) {
                            match e {
                                TokenizerError::TemplateException { message: m } if m == message => {}
                                other => failures.push(format!(
                                    "{family}/{name}: want raise_exception({message:?}), got {other}"
                                )),
                            }
                        }
                    }
                    (Ok(got), None) => failures.push(format!(
                        "{family}/{name}: transformers fails ({}), we rendered {} bytes",
                        want["error"],
                        got.len()
                    )),
                    (Err(e), Some(_)) => failures.push(format!("{family}/{name}: we fail: {e}")),
                }
            }
        }
        assert!(
            failures.is_empty(),
            "{} of {checked} renders differ:\n{}",
            failures.len(),
            failures.join("\n")
        );
        assert_eq!(checked, 8 * conversations.as_array().unwrap().len());
    }
}

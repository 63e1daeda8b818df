//! Qwen3 and Qwen3.5 / Qwen3-Next / Qwen3-Coder tool calls, reasoning in `<think>…</think>`.
//!
//! - Qwen3 (Hermes style): `<tool_call>\n{"name": NAME, "arguments": {…}}\n</tool_call>`.
//! - Qwen3.5 / Qwen3-Next / Qwen3-Coder (XML style):
//!   `<tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n…</function>\n</tool_call>`.
//!
//! Followed: vLLM's `hermes` parser for the JSON form, and its `qwen3_coder` / `qwen3_xml`
//! parsers for the XML form: a parameter's value loses one leading and one trailing newline;
//! it stays a string when the tool's JSON Schema types it `string` (or the type is unknown),
//! and is read as JSON otherwise (kept as a string when it does not parse). One parser reads
//! both forms, by whether the call's inside starts with `{` or `<function=`.

use serde_json::{Map, Value};

use super::tagged::{Spec, THINK_CLOSE, THINK_OPEN};
use super::{param_type, valid_name, Call, Options};

/// The call opener.
pub const CALL_BEGIN: &str = "<tool_call>";
const CALL_END: &str = "</tool_call>";

pub(crate) static SPEC: Spec = Spec {
    think: Some((THINK_OPEN, THINK_CLOSE)),
    section_begin: &[],
    section_end: &[],
    call_begin: &[CALL_BEGIN],
    call_end: CALL_END,
    drop: &[],
    parse_call,
};

fn parse_call(_: &str, inside: &str, options: &Options) -> Option<Call> {
    let inside = inside.trim();
    if inside.starts_with('{') {
        let Value::Object(o) = serde_json::from_str::<Value>(inside).ok()? else {
            return None;
        };
        let name = o.get("name")?.as_str()?;
        let args = match o.get("arguments").or_else(|| o.get("parameters")) {
            None => "{}".to_string(),
            Some(Value::String(s)) => s.clone(),
            Some(v @ Value::Object(_)) => v.to_string(),
            Some(_) => return None,
        };
        return Call::json(None, name, &args);
    }
    xml_call(inside, options)
}

/// `<function=NAME>` then `<parameter=P>value</parameter>`…, then `</function>`.
fn xml_call(inside: &str, options: &Options) -> Option<Call> {
    let rest = inside.strip_prefix("<function=")?;
    let (name, mut rest) = rest.split_once('>')?;
    if !valid_name(name) {
        return None;
    }
    let mut args = Map::new();
    loop {
        rest = rest.trim_start();
        if let Some(after) = rest.strip_prefix("</function>") {
            if !after.trim().is_empty() {
                return None;
            }
            break;
        }
        let p = rest.strip_prefix("<parameter=")?;
        let (key, p) = p.split_once('>')?;
        let (value, p) = p.split_once("</parameter>")?;
        let value = value.strip_prefix('\n').unwrap_or(value);
        let value = value.strip_suffix('\n').unwrap_or(value);
        let ty = param_type(options.tools.as_ref(), name, key);
        let v = if ty == "string" {
            Value::String(value.to_string())
        } else {
            serde_json::from_str(value.trim()).unwrap_or_else(|_| Value::String(value.to_string()))
        };
        args.insert(key.to_string(), v);
        rest = p;
    }
    Call::json(None, name, &Value::Object(args).to_string())
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::test_util::*;
    use super::super::*;

    #[test]
    fn json_calls_after_thinking_at_every_split() {
        let text = "<think>\nuser wants weather\n</think>\n\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Köln\"}}\n</tool_call>\n<tool_call>\n{\"name\": \"get_time\", \"arguments\": {}}\n</tool_call>";
        let want = with_calls(
            vec![reasoning("\nuser wants weather\n")],
            &[
                ("call_0", "get_weather", "{\"city\":\"Köln\"}"),
                ("call_1", "get_time", "{}"),
            ],
        );
        assert_eq!(parse_every_split(Family::Qwen, &opts(), text), want);
    }

    #[test]
    fn xml_calls_with_schema_types_at_every_split() {
        let o = Options {
            tools: Some(
                json!([{"type": "function", "function": {"name": "write", "parameters": {
                    "type": "object",
                    "properties": {"path": {"type": "string"}, "count": {"type": "integer"}, "tags": {"type": ["array", "null"]}}
                }}}]),
            ),
            prompt_tail: "<|im_start|>assistant\n<think>\n".into(),
            ..opts()
        };
        let text = "ok</think>\n\nWriting.\n<tool_call>\n<function=write>\n<parameter=path>\n/tmp/a b.txt\n</parameter>\n<parameter=count>\n3\n</parameter>\n<parameter=tags>\n[\"x\"]\n</parameter>\n<parameter=note>\n007\n</parameter>\n</function>\n</tool_call>";
        let args = json!({"path": "/tmp/a b.txt", "count": 3, "tags": ["x"], "note": "007"}).to_string();
        let want = with_calls(
            vec![reasoning("ok"), content("Writing.\n")],
            &[("call_0", "write", &args)],
        );
        assert_eq!(parse_every_split(Family::Qwen, &o, text), want);
    }

    #[test]
    fn malformed_calls_are_text() {
        let bad = [
            "<tool_call>\n{\"name\": \"f\", \"arguments\": {\"a\": }\n</tool_call>",
            "<tool_call>\n{\"arguments\": {}}\n</tool_call>",
            "<tool_call>\n<function=f>\n<parameter=a>\n1\n</function>\n</tool_call>",
            "<tool_call>\n<function=f>\n",
        ];
        assert_malformed_calls_are_text(Family::Qwen, &opts(), str::to_string, vec![], &bad);
    }
}

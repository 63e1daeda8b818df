//! Kimi K3 XTML. Only `<|open|>`, `<|sep|>`, `<|close|>` and `<|end_of_msg|>` are special
//! tokens; tag names and attributes are text. An element is `<|open|>TAG attr="v"…<|sep|>`
//! body `<|close|>TAG<|sep|>`. An assistant turn holds up to three sections in order:
//! `think` (reasoning), `response` (content) and `tools`, whose `call tool="NAME" index="N"`
//! elements hold either typed `argument key="K" type="T"` elements (a `string` value is the
//! raw text, any other type a JSON value) or one `json type="object"` element with the
//! arguments object. Attribute values escape `&` and `"` as `&amp;` and `&quot;`. The
//! generation prompt already opens `think` (or `response` with thinking off), so the output
//! starts inside it; the turn ends with `<|close|>message<|sep|>` then `<|end_of_msg|>`.
//!
//! Followed: the released chat template as vendored in llama.cpp
//! (`models/templates/Kimi-K3.jinja`: `open_tag`, `close_tag`, `render_assistant`,
//! `xtml_type`, `xtml_value`), and the grammar of vLLM's `kimi_k3` tool and reasoning parsers
//! (vLLM PR #50093) as described in /work/shared/REFERENCES.md §9. Call ids are generated
//! (the markup has none).

use serde_json::{Map, Value};

use super::tagged::Spec;
use super::{Call, Options};

const SEP: &str = "<|sep|>";

pub(crate) static SPEC: Spec = Spec {
    think: Some(("<|open|>think<|sep|>", "<|close|>think<|sep|>")),
    section_begin: &["<|open|>tools<|sep|>"],
    section_end: &["<|close|>tools<|sep|>"],
    call_begin: &["<|open|>call"],
    call_end: "<|close|>call<|sep|>",
    drop: &[
        "<|open|>response<|sep|>",
        "<|close|>response<|sep|>",
        "<|close|>message<|sep|>",
    ],
    parse_call,
};

/// ` key="v" key2="v2"` → pairs, unescaping `&quot;` and `&amp;`; None when malformed.
fn attrs(s: &str) -> Option<Attrs> {
    let mut out = Vec::new();
    let mut rest = s.trim_start();
    while !rest.is_empty() {
        let (key, r) = rest.split_once("=\"")?;
        let (value, r) = r.split_once('"')?;
        let key = key.trim();
        if key.is_empty() || key.contains(char::is_whitespace) {
            return None;
        }
        out.push((key.to_string(), value.replace("&quot;", "\"").replace("&amp;", "&")));
        rest = r.trim_start();
    }
    Some(out)
}

fn attr<'a>(attrs: &'a [(String, String)], key: &str) -> Option<&'a str> {
    attrs.iter().find(|(k, _)| k == key).map(|(_, v)| v.as_str())
}

/// An element's attributes, unescaped.
type Attrs = Vec<(String, String)>;

/// `<|open|>TAG attrs<|sep|>body<|close|>TAG<|sep|>` at the start of `s` (after whitespace):
/// (tag, attrs, body, rest).
fn element(s: &str) -> Option<(&str, Attrs, &str, &str)> {
    let s = s.trim_start().strip_prefix("<|open|>")?;
    let (head, s) = s.split_once(SEP)?;
    let (tag, a) = head.split_once(' ').unwrap_or((head, ""));
    let close = format!("<|close|>{tag}{SEP}");
    let (body, rest) = s.split_once(close.as_str())?;
    Some((tag, attrs(a)?, body, rest))
}

/// The inside of `<|open|>call…<|close|>call<|sep|>`: ` tool="NAME" index="N"<|sep|>` then the
/// arguments.
fn parse_call(_: &str, inside: &str, _: &Options) -> Option<Call> {
    let (head, mut body) = inside.split_once(SEP)?;
    if !head.is_empty() && !head.starts_with(' ') {
        return None;
    }
    let head = attrs(head)?;
    let name = attr(&head, "tool")?;
    let mut args = Map::new();
    let mut json_block = None;
    while !body.trim().is_empty() {
        let (tag, a, value, rest) = element(body)?;
        match tag {
            "argument" => {
                let key = attr(&a, "key")?;
                let v = match attr(&a, "type").unwrap_or("string") {
                    "string" => Value::String(value.to_string()),
                    _ => serde_json::from_str(value.trim()).ok()?,
                };
                args.insert(key.to_string(), v);
            }
            "json" if json_block.is_none() && args.is_empty() => json_block = Some(value),
            _ => return None,
        }
        body = rest;
    }
    match json_block {
        Some(j) => Call::json(None, name, j),
        None => Call::json(None, name, &Value::Object(args).to_string()),
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::super::test_util::*;
    use super::super::*;

    fn k3() -> Options {
        opts_after("<|open|>message role=\"assistant\"<|sep|><|open|>think<|sep|>")
    }

    #[test]
    fn think_response_and_typed_calls_at_every_split() {
        let text = "The user wants é.<|close|>think<|sep|><|open|>response<|sep|>Let me check.<|close|>response<|sep|><|open|>tools<|sep|><|open|>call tool=\"get_weather\" index=\"1\"<|sep|><|open|>argument key=\"city\" type=\"string\"<|sep|>São \"Paulo\"<|close|>argument<|sep|><|open|>argument key=\"days\" type=\"number\"<|sep|>3<|close|>argument<|sep|><|close|>call<|sep|><|open|>call tool=\"run\" index=\"2\"<|sep|><|open|>json type=\"object\"<|sep|>{\"cmd\": \"ls\"}<|close|>json<|sep|><|close|>call<|sep|><|close|>tools<|sep|><|close|>message<|sep|>";
        let weather = json!({"city": "São \"Paulo\"", "days": 3}).to_string();
        let want = with_calls(
            vec![reasoning("The user wants é."), content("Let me check.")],
            &[
                ("call_0", "get_weather", &weather),
                ("call_1", "run", "{\"cmd\": \"ls\"}"),
            ],
        );
        assert_eq!(parse_every_split(Family::KimiK3, &k3(), text), want);
    }

    #[test]
    fn thinking_off_starts_in_the_response() {
        let o = opts_after("<|open|>message role=\"assistant\"<|sep|><|open|>response<|sep|>");
        let ev = parse_every_split(Family::KimiK3, &o, "Hi!<|close|>response<|sep|><|close|>message<|sep|>");
        assert_eq!(ev, vec![content("Hi!")]);
    }

    #[test]
    fn call_straight_after_think_and_escaped_attributes() {
        let text = "x<|close|>think<|sep|><|open|>tools<|sep|><|open|>call tool=\"a&amp;b\" index=\"1\"<|sep|><|open|>argument key=\"q&quot;\" type=\"boolean\"<|sep|>true<|close|>argument<|sep|><|close|>call<|sep|><|close|>tools<|sep|>";
        let want = with_calls(vec![reasoning("x")], &[("call_0", "a&b", "{\"q\\\"\":true}")]);
        assert_eq!(parse_every_split(Family::KimiK3, &k3(), text), want);
    }

    #[test]
    fn malformed_calls_are_text() {
        let bad = [
            "<|open|>call index=\"1\"<|sep|><|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|><|open|>argument key=\"n\" type=\"number\"<|sep|>x1<|close|>argument<|sep|><|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|><|open|>argument key=\"n\"<|sep|>1<|close|>call<|sep|>",
            "<|open|>call tool=\"f\"<|sep|><|open|>argument key=\"n\"<|sep|>1",
        ];
        let wrap = |bad: &str| format!("r<|close|>think<|sep|><|open|>tools<|sep|>{bad}");
        assert_malformed_calls_are_text(Family::KimiK3, &k3(), wrap, vec![reasoning("r")], &bad);
    }
}

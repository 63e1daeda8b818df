//! DeepSeek-V3 and V3.1 tool calls, reasoning in `<think>…</think>` (R1 / V3.1 thinking).
//!
//! - V3: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{json}\n```<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`
//! - V3.1: `<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{json}<｜tool▁call▁end｜>…<｜tool▁calls▁end｜>`
//!
//! Followed: vLLM's `deepseek_v3` and `deepseek_v31` tool parsers (their call regexes: type and
//! name around the separator then a fenced JSON block for V3; name, separator, bare JSON for
//! V3.1). One parser reads both: a call whose part before the separator is `function` and
//! whose arguments are a ```` ```json ```` fence is V3, anything else V3.1.

use super::tagged::{Spec, THINK_CLOSE, THINK_OPEN};
use super::{Call, Options};

/// The section opener.
pub const CALLS_BEGIN: &str = "<｜tool▁calls▁begin｜>";
const CALLS_END: &str = "<｜tool▁calls▁end｜>";
const CALL_BEGIN: [&str; 1] = ["<｜tool▁call▁begin｜>"];
const CALL_END: &str = "<｜tool▁call▁end｜>";
const SEP: &str = "<｜tool▁sep｜>";

pub(crate) static SPEC: Spec = Spec {
    think: Some((THINK_OPEN, THINK_CLOSE)),
    section_begin: &[CALLS_BEGIN],
    section_end: &[CALLS_END],
    call_begin: &CALL_BEGIN,
    call_end: CALL_END,
    drop: &[],
    parse_call,
};

fn parse_call(_: &str, inside: &str, _: &Options) -> Option<Call> {
    let (before, after) = inside.split_once(SEP)?;
    if before.trim() == "function" {
        // V3: NAME, newline, a ```json fence.
        let (name, rest) = after.split_once('\n')?;
        let body = rest.trim().strip_prefix("```json")?.strip_suffix("```")?;
        return Call::json(None, name, body);
    }
    Call::json(None, before, after)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;

    #[test]
    fn v3_fenced_calls_at_every_split() {
        let text = "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{\"city\": \"Paris\"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let want = with_calls(
            vec![content("Let me look.")],
            &[
                ("call_0", "get_weather", "{\"city\": \"Paris\"}"),
                ("call_1", "get_time", "{}"),
            ],
        );
        assert_eq!(parse_every_split(Family::DeepSeek, &opts(), text), want);
    }

    #[test]
    fn v31_bare_calls_after_reasoning() {
        let o = opts_after("<｜Assistant｜><think>");
        let text = "plan</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>search<｜tool▁sep｜>{\"q\": \"日本\"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>";
        let want = with_calls(vec![reasoning("plan")], &[("call_0", "search", "{\"q\": \"日本\"}")]);
        assert_eq!(parse_every_split(Family::DeepSeek, &o, text), want);
    }

    #[test]
    fn malformed_calls_are_text() {
        let bad = [
            "<｜tool▁call▁begin｜>function<｜tool▁sep｜>f\n```json\n{\"a\": 1}<｜tool▁call▁end｜>",
            "<｜tool▁call▁begin｜>f {}<｜tool▁call▁end｜>",
            "<｜tool▁call▁begin｜>f<｜tool▁sep｜>[1, 2]<｜tool▁call▁end｜>",
        ];
        let wrap = |bad: &str| format!("<｜tool▁calls▁begin｜>{bad}<｜tool▁calls▁end｜>");
        assert_malformed_calls_are_text(Family::DeepSeek, &opts(), wrap, vec![], &bad);
    }
}

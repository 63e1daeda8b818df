//! Kimi K2: `<|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{json}<|tool_call_end|><|tool_calls_section_end|>`,
//! reasoning in `<think>…</think>`, which also ends where the tool section begins.
//!
//! Followed: the grammar as vLLM's `kimi_k2` tool parser and llama.cpp's Kimi K2 chat parser
//! read it (the singular `<|tool_call_section_begin|>` spelling accepted as well, llama.cpp
//! PR #17376; reasoning ending at the section marker, vLLM #32216). The call id is the model's
//! own `functions.NAME:IDX`; the name is what lies between `functions.` and `:IDX`.

use super::tagged::{Spec, THINK_CLOSE, THINK_OPEN};
use super::{Call, Options};

/// The section openers (plural and singular spellings).
pub const SECTION_BEGIN: [&str; 2] = ["<|tool_calls_section_begin|>", "<|tool_call_section_begin|>"];
const SECTION_END: [&str; 2] = ["<|tool_calls_section_end|>", "<|tool_call_section_end|>"];
const CALL_BEGIN: [&str; 1] = ["<|tool_call_begin|>"];
const CALL_END: &str = "<|tool_call_end|>";
const ARGS_BEGIN: &str = "<|tool_call_argument_begin|>";

pub(crate) static SPEC: Spec = Spec {
    think: Some((THINK_OPEN, THINK_CLOSE)),
    section_begin: &SECTION_BEGIN,
    section_end: &SECTION_END,
    call_begin: &CALL_BEGIN,
    call_end: CALL_END,
    drop: &[],
    parse_call,
};

/// `functions.NAME:IDX<|tool_call_argument_begin|>{json}`.
fn parse_call(_: &str, inside: &str, _: &Options) -> Option<Call> {
    let (header, args) = inside.split_once(ARGS_BEGIN)?;
    let id = header.trim();
    let name = id.strip_prefix("functions.").unwrap_or(id);
    let name = match name.rsplit_once(':') {
        Some((n, idx)) if !idx.is_empty() && idx.bytes().all(|b| b.is_ascii_digit()) => n,
        _ => name,
    };
    Call::json(Some(id.to_string()), name, args)
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;

    const TWO_CALLS: &str = "<think>need weather</think>Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>{\"city\": \"Zürich\"}<|tool_call_end|><|tool_call_begin|>functions.get_time:1<|tool_call_argument_begin|>{}<|tool_call_end|><|tool_calls_section_end|>";

    #[test]
    fn calls_with_reasoning_and_content_at_every_split() {
        let want = with_calls(
            vec![reasoning("need weather"), content("Checking.")],
            &[
                ("functions.get_weather:0", "get_weather", "{\"city\": \"Zürich\"}"),
                ("functions.get_time:1", "get_time", "{}"),
            ],
        );
        assert_eq!(parse_every_split(Family::KimiK2, &opts(), TWO_CALLS), want);
    }

    #[test]
    fn singular_section_spelling_and_call_right_after_reasoning() {
        let o = opts_after("<|im_assistant|>assistant<|im_middle|><think>");
        let text = "hmm<|tool_call_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\":1}<|tool_call_end|><|tool_call_section_end|>";
        let want = with_calls(vec![reasoning("hmm")], &[("functions.f:0", "f", "{\"a\":1}")]);
        assert_eq!(parse_every_split(Family::KimiK2, &o, text), want);
    }

    #[test]
    fn malformed_calls_are_text() {
        // Arguments that are not a JSON object; a call without the argument marker; a call
        // cut off by the end of the output.
        let bad = [
            "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\":<|tool_call_end|>",
            "<|tool_call_begin|>functions.f:0 {}<|tool_call_end|>",
            "<|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>{\"a\": 1}",
        ];
        let wrap = |bad: &str| format!("<|tool_calls_section_begin|>{bad}");
        assert_malformed_calls_are_text(Family::KimiK2, &opts(), wrap, vec![], &bad);
    }

    #[test]
    fn without_tools_the_markup_stays_text() {
        let o = Options {
            tools_enabled: false,
            ..opts()
        };
        let ev = parse_every_split(Family::KimiK2, &o, TWO_CALLS);
        assert_eq!(
            ev,
            vec![
                reasoning("need weather"),
                content(&TWO_CALLS["<think>need weather</think>".len()..])
            ]
        );
    }
}

//! Bounds on the work one request may ask for, checked before anything expensive.
//!
//! A prompt's text is bounded in bytes *before* it is tokenized: tokenizing costs memory and
//! time proportional to the text (a 15 MB prompt drove the process to 2.4 GB), and a text
//! longer than the context can hold is refused anyway once tokenized. The bound is the
//! context length times [`PROMPT_BYTES_PER_TOKEN`], a generous bytes-per-token factor: BPE
//! vocabularies of current models average about 4 bytes of English or code per token, so a
//! text above the bound cannot fit the context except in pathological cases (long runs of a
//! single character), which can be sent as token ids instead.

use serde_json::Value;

use crate::error::ApiError;

/// Largest `top_logprobs` (chat) / `logprobs` (completions), as OpenAI.
pub const MAX_TOP_LOGPROBS: i64 = 20;

/// Bytes of prompt text allowed per token of context (see the module documentation).
pub const PROMPT_BYTES_PER_TOKEN: usize = 16;

/// Largest prompt text, in bytes, for a model with `context_length` tokens of context:
/// `context_length × PROMPT_BYTES_PER_TOKEN`.
pub fn max_prompt_bytes(context_length: usize) -> usize {
    context_length.saturating_mul(PROMPT_BYTES_PER_TOKEN)
}

/// Bytes of text in `v`: the UTF-8 length of every string (object keys included) in it,
/// numbers and literals counted by their JSON length. Iterative (a deeply nested value cannot
/// overflow the stack).
pub fn text_bytes(v: &Value) -> usize {
    let mut total = 0usize;
    let mut stack = vec![v];
    while let Some(v) = stack.pop() {
        match v {
            Value::String(s) => total = total.saturating_add(s.len()),
            Value::Array(a) => stack.extend(a.iter()),
            Value::Object(o) => {
                for (k, x) in o {
                    total = total.saturating_add(k.len());
                    stack.push(x);
                }
            }
            Value::Number(n) => total = total.saturating_add(n.to_string().len()),
            Value::Bool(_) | Value::Null => total = total.saturating_add(4),
        }
    }
    total
}

/// 400 (`context_length_exceeded`, `param` named) when `bytes` of prompt text exceed
/// [`max_prompt_bytes`] for `context_length`.
pub fn check_prompt_bytes(context_length: usize, bytes: usize, param: &str) -> Result<(), ApiError> {
    let max = max_prompt_bytes(context_length);
    if bytes > max {
        return Err(ApiError::bad_request(format!(
            "`{param}` is {bytes} bytes of text, more than this model's context of {context_length} tokens can hold (at most {max} bytes are accepted, {PROMPT_BYTES_PER_TOKEN} per token of context). Please reduce `{param}`."
        ))
        .param(param)
        .code("context_length_exceeded"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn text_bytes_counts_every_string() {
        let v = json!([{"role": "user", "content": [{"type": "text", "text": "héllo"}]}]);
        // keys role, content, type, text; values user, text, héllo (6 bytes)
        assert_eq!(text_bytes(&v), 4 + 7 + 4 + 4 + 4 + 4 + 6);
        assert!(check_prompt_bytes(2, 32, "prompt").is_ok());
        let e = check_prompt_bytes(2, 33, "prompt").unwrap_err();
        assert_eq!(e.param.as_deref(), Some("prompt"));
    }
}

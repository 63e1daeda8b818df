//! Incremental detokenization: text out as ids arrive, never splitting a UTF-8 character.

use crate::{Backend, Tokenizer, TokenizerError};

/// Turns a stream of ids into text chunks.
///
/// Invariant: the concatenation of every [`push`](StreamDecoder::push) result and
/// [`finish`](StreamDecoder::finish) equals [`Tokenizer::decode`] of all ids, for byte-level
/// decoders (ByteLevel `tokenizer.json`, tiktoken). A character whose bytes are split across
/// tokens is held back until it completes; bytes that can never become valid come out as U+FFFD
/// exactly where `decode` puts them.
///
/// For tiktoken the decoder works on bytes directly (O(1) per id). For `tokenizer.json` it
/// decodes a short window of recent ids and emits the suffix beyond the previously emitted
/// prefix (the `prefix_offset`/`read_offset` scheme of HF text-generation-inference), so
/// context-dependent decoders (e.g. Metaspace's leading-space rule) also behave.
pub struct StreamDecoder<'a> {
    tokenizer: &'a Tokenizer,
    skip_special_tokens: bool,
    state: State,
}

enum State {
    /// tiktoken: bytes not yet emitted (an incomplete trailing UTF-8 sequence).
    Bytes { pending: Vec<u8> },
    /// tokenizer.json: ids since `prefix_offset`; `ids[..read_offset]` is already emitted.
    Window { ids: Vec<u32>, read_offset: usize },
}

impl<'a> StreamDecoder<'a> {
    pub(crate) fn new(tokenizer: &'a Tokenizer, skip_special_tokens: bool) -> Self {
        let state = match tokenizer.backend {
            Backend::Tiktoken(_) => State::Bytes { pending: Vec::new() },
            Backend::Hf(_) => State::Window {
                ids: Vec::new(),
                read_offset: 0,
            },
        };
        Self {
            tokenizer,
            skip_special_tokens,
            state,
        }
    }

    /// Feeds one id; returns the text that became final (possibly empty).
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`] for an id outside the vocabulary (the id is
    /// not consumed); backend decode failures.
    pub fn push(&mut self, id: u32) -> Result<String, TokenizerError> {
        let skip = self.skip_special_tokens;
        match (&mut self.state, &self.tokenizer.backend) {
            (State::Bytes { pending }, Backend::Tiktoken(tk)) => {
                if let Some(piece) = tk.piece(id, skip)? {
                    pending.extend_from_slice(piece);
                }
                Ok(drain_complete_utf8(pending))
            }
            (State::Window { ids, read_offset }, Backend::Hf(_)) => {
                self.tokenizer.check_id(id)?;
                ids.push(id);
                let prefix_text = self.tokenizer.decode(&ids[..*read_offset], skip)?;
                let new_text = self.tokenizer.decode(ids, skip)?;
                if new_text.len() > prefix_text.len() && !new_text.ends_with('\u{FFFD}') {
                    let common = common_prefix_len(&prefix_text, &new_text);
                    let out = new_text[common..].to_string();
                    // The emitted ids become the next window's prefix; older ids are dropped.
                    ids.drain(..*read_offset);
                    *read_offset = ids.len();
                    Ok(out)
                } else {
                    Ok(String::new())
                }
            }
            // `new` pairs each state with its backend.
            _ => Err(TokenizerError::Decode {
                message: "stream decoder state does not match the tokenizer backend".into(),
            }),
        }
    }

    /// Flushes what is held back (an incomplete character comes out as U+FFFD, as in `decode`).
    ///
    /// Errors: backend decode failures.
    pub fn finish(self) -> Result<String, TokenizerError> {
        match self.state {
            State::Bytes { pending } => Ok(String::from_utf8_lossy(&pending).into_owned()),
            State::Window { ids, read_offset } => {
                if read_offset == ids.len() {
                    return Ok(String::new());
                }
                let skip = self.skip_special_tokens;
                let prefix_text = self.tokenizer.decode(&ids[..read_offset], skip)?;
                let new_text = self.tokenizer.decode(&ids, skip)?;
                let common = common_prefix_len(&prefix_text, &new_text);
                Ok(new_text[common..].to_string())
            }
        }
    }
}

/// Length in bytes of the longest common prefix of `a` and `b` that ends on a char boundary
/// of `b` (normally all of `a`).
fn common_prefix_len(a: &str, b: &str) -> usize {
    if b.starts_with(a) {
        return a.len();
    }
    let mut n = 0;
    for ((i, ca), cb) in a.char_indices().zip(b.chars()) {
        if ca != cb {
            break;
        }
        n = i + ca.len_utf8();
    }
    n
}

/// Removes and returns the longest prefix of `pending` that `String::from_utf8_lossy` would
/// decode the same way whatever bytes follow: valid characters, and invalid sequences (as
/// U+FFFD). Only an incomplete sequence at the very end stays pending.
fn drain_complete_utf8(pending: &mut Vec<u8>) -> String {
    let mut out = String::new();
    let mut start = 0;
    loop {
        match std::str::from_utf8(&pending[start..]) {
            Ok(s) => {
                out.push_str(s);
                start = pending.len();
                break;
            }
            Err(e) => {
                let valid_end = start + e.valid_up_to();
                // The slice up to `valid_up_to` is valid UTF-8 by definition.
                out.push_str(&String::from_utf8_lossy(&pending[start..valid_end]));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        start = valid_end + n;
                    }
                    None => {
                        start = valid_end;
                        break;
                    }
                }
            }
        }
    }
    pending.drain(..start);
    out
}

#[cfg(test)]
mod tests {
    use super::drain_complete_utf8;

    #[test]
    fn drain_holds_incomplete_tail_and_replaces_invalid() {
        let mut p = vec![b'a', 0xF0, 0x9F];
        assert_eq!(drain_complete_utf8(&mut p), "a");
        assert_eq!(p, vec![0xF0, 0x9F]);
        p.extend_from_slice(&[0x99, 0x82, b'b']);
        assert_eq!(drain_complete_utf8(&mut p), "🙂b");
        assert!(p.is_empty());
        p.extend_from_slice(&[0x80, b'c', 0xF0, b'd']);
        assert_eq!(drain_complete_utf8(&mut p), "\u{FFFD}c\u{FFFD}d");
        assert!(p.is_empty());
    }
}

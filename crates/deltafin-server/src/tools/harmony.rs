//! gpt-oss Harmony. The output is a series of messages, each a header then
//! `<|message|>` and a body ended by `<|end|>`, `<|call|>` or `<|return|>` (the last two are
//! end-of-sequence tokens, so the body usually ends with the output). The header names the
//! channel (`<|channel|>analysis`, `final` or `commentary`) and, for a tool call, the
//! recipient (`to=functions.NAME`, in the role part or after the channel), with an optional
//! `<|constrain|>json`. `analysis` is reasoning, `final` and recipient-less `commentary`
//! (preambles) are content, a `commentary to=functions.NAME` body is the call's JSON arguments.
//! The generation prompt ends in `<|start|>assistant`, so the output starts with a header.
//!
//! Followed: OpenAI's Harmony response format guide (channels, recipients, `<|constrain|>`,
//! `<|call|>`), as vLLM's `openai` tool parser and `gpt_oss` reasoning parser apply it.
//! A body for another recipient (built-in `browser.*` / `python` tools) is kept as text, as
//! is a header without a channel.

use super::{find_first, held_suffix, Call, Event, Options};

/// The channel marker.
pub const CHANNEL: &str = "<|channel|>";
/// The marker between header and body.
pub const MESSAGE: &str = "<|message|>";
const START: &str = "<|start|>";
const END: &str = "<|end|>";
const CALL: &str = "<|call|>";
const RETURN: &str = "<|return|>";
const CONSTRAIN: &str = "<|constrain|>";

/// Every marker of the format.
pub(crate) const MARKERS: [&str; 7] = [START, CHANNEL, MESSAGE, END, CALL, RETURN, CONSTRAIN];
/// Markers that end a body.
const BODY_END: [&str; 5] = [END, CALL, RETURN, START, CHANNEL];

#[derive(Debug, Clone, PartialEq, Eq)]
enum Body {
    Reasoning,
    Content,
    Call(String),
    /// Malformed header or another recipient: header and body come back as text.
    Raw,
}

pub(crate) struct Harmony {
    options: Options,
    /// None while reading a header.
    body: Option<Body>,
    /// The current header's text so far (markers included), or the whole raw message.
    head: String,
    buf: String,
    calls: usize,
}

/// The word after `key` in `head` (up to whitespace or `<`).
fn word_after<'a>(head: &'a str, key: &str) -> Option<&'a str> {
    let at = head.find(key)? + key.len();
    let rest = &head[at..];
    let end = rest.find(|c: char| c.is_whitespace() || c == '<').unwrap_or(rest.len());
    Some(&rest[..end]).filter(|w| !w.is_empty())
}

impl Harmony {
    pub(crate) fn new(options: Options) -> Harmony {
        let mut h = Harmony {
            options,
            body: None,
            head: String::new(),
            buf: String::new(),
            calls: 0,
        };
        // A generation prompt that already wrote a header (e.g. `…<|channel|>final<|message|>`)
        // means the output starts in that message's body.
        let tail = h.options.prompt_tail.trim_end();
        if tail.ends_with(MESSAGE) {
            let from = tail.rfind(START).unwrap_or(0);
            h.head = tail[from..].to_string();
            h.body = Some(h.classify());
            if h.body == Some(Body::Raw) {
                h.body = None;
            }
            h.head.clear();
        }
        h
    }

    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<Event>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    pub(crate) fn finish(&mut self, out: &mut Vec<Event>) {
        self.run(true, out);
        match self.body.take() {
            None => {
                let raw = std::mem::take(&mut self.head);
                if !raw.trim().is_empty() {
                    out.push(Event::Content(raw));
                }
            }
            Some(body) => self.close(body, out),
        }
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Event>) {
        loop {
            match self.body.clone() {
                None => {
                    // The header stays whole until `<|message|>` (which may arrive in pieces).
                    let all = std::mem::take(&mut self.buf);
                    self.head.push_str(&all);
                    let Some(pos) = self.head.find(MESSAGE) else {
                        return;
                    };
                    self.buf = self.head.split_off(pos + MESSAGE.len());
                    self.body = Some(self.classify());
                }
                Some(body) => {
                    let found = find_first(&self.buf, &BODY_END);
                    let (upto, marker) = match found {
                        Some((pos, i)) => (pos, Some(BODY_END[i])),
                        None if at_end => (self.buf.len(), None),
                        None => (self.buf.len() - held_suffix(&self.buf, &BODY_END), None),
                    };
                    let text: String = self.buf.drain(..upto).collect();
                    match &body {
                        Body::Reasoning if !text.is_empty() => out.push(Event::Reasoning(text)),
                        Body::Content if !text.is_empty() => out.push(Event::Content(text)),
                        Body::Call(_) | Body::Raw => self.head.push_str(&text),
                        _ => {}
                    }
                    let Some(marker) = marker else {
                        return;
                    };
                    self.body = None;
                    self.close(body, out);
                    // `<|start|>` / `<|channel|>` begin the next header; the end markers go.
                    let m: String = self.buf.drain(..marker.len()).collect();
                    if marker == START || marker == CHANNEL {
                        self.head = m;
                    }
                }
            }
        }
    }

    /// What the header in `self.head` (ending in `<|message|>`) opens.
    fn classify(&self) -> Body {
        let head = &self.head[..self.head.len() - MESSAGE.len()];
        let Some(channel) = word_after(head, CHANNEL) else {
            return Body::Raw;
        };
        match word_after(head, "to=") {
            Some(r) => match r.strip_prefix("functions.") {
                Some(name) if super::valid_name(name) => Body::Call(name.to_string()),
                _ => Body::Raw,
            },
            None if channel == "analysis" => Body::Reasoning,
            None => Body::Content,
        }
    }

    /// Ends a message: a call's arguments are checked, raw text comes back as is.
    fn close(&mut self, body: Body, out: &mut Vec<Event>) {
        let raw = std::mem::take(&mut self.head);
        match body {
            Body::Reasoning | Body::Content => {}
            Body::Raw => out.push(Event::Content(raw)),
            Body::Call(name) => {
                let args = raw.rsplit_once(MESSAGE).map_or("", |(_, a)| a);
                match Call::json(None, &name, args) {
                    Some(call) => {
                        call.emit(self.calls, &self.options.id_prefix, out);
                        self.calls += 1;
                    }
                    None => out.push(Event::Content(raw)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;

    #[test]
    fn analysis_then_final_at_every_split() {
        let text =
            "<|channel|>analysis<|message|>User asks é.<|end|><|start|>assistant<|channel|>final<|message|>Hello!";
        let ev = parse_every_split(Family::Harmony, &opts(), text);
        assert_eq!(ev, vec![reasoning("User asks é."), content("Hello!")]);
    }

    #[test]
    fn commentary_calls_at_every_split() {
        // The recipient after the channel, then in the role part; the second call ends the
        // output (its `<|call|>` is the end-of-sequence token, not text).
        let text = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}";
        let want = with_calls(
            vec![reasoning("Need weather.")],
            &[
                ("call_0", "get_weather", "{\"city\":\"Oslo\"}"),
                ("call_1", "get_time", "{}"),
            ],
        );
        assert_eq!(parse_every_split(Family::Harmony, &opts(), text), want);
    }

    #[test]
    fn output_starts_in_the_body_the_prompt_opened() {
        let o = opts_after("<|start|>assistant<|channel|>final<|message|>");
        assert_eq!(parse_every_split(Family::Harmony, &o, "Hi é"), vec![content("Hi é")]);
        let o = opts_after("<|start|>assistant<|channel|>analysis<|message|>");
        let ev = parse_every_split(
            Family::Harmony,
            &o,
            "hmm<|end|><|start|>assistant<|channel|>final<|message|>ok",
        );
        assert_eq!(ev, vec![reasoning("hmm"), content("ok")]);
    }

    #[test]
    fn malformed_messages_are_text() {
        let bad_args = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{\"a\":";
        assert_eq!(
            parse_every_split(Family::Harmony, &opts(), bad_args),
            vec![content(bad_args)]
        );
        let other = "<|channel|>commentary to=browser.search<|message|>{\"q\":1}";
        assert_eq!(parse_every_split(Family::Harmony, &opts(), other), vec![content(other)]);
        assert_eq!(
            parse_every_split(Family::Harmony, &opts(), "plain words"),
            vec![content("plain words")]
        );
    }
}

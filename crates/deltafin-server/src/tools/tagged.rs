//! The state machine shared by the families whose markup is begin/end markers: a think block,
//! an optional section around the calls, and calls between a begin and an end marker. Each
//! family supplies its markers and how to read one call's inside ([`Spec`]).

use super::{find_first, held_suffix, Call, Event, Options};

pub(crate) const THINK_OPEN: &str = "<think>";
pub(crate) const THINK_CLOSE: &str = "</think>";

/// One family's markers.
pub(crate) struct Spec {
    /// Reasoning block open and close markers.
    pub think: Option<(&'static str, &'static str)>,
    /// Markers that open / close the section holding the calls (empty: calls stand alone).
    pub section_begin: &'static [&'static str],
    pub section_end: &'static [&'static str],
    /// Markers that open / close one call.
    pub call_begin: &'static [&'static str],
    pub call_end: &'static str,
    /// Markers dropped from content (structure with no meaning for the client).
    pub drop: &'static [&'static str],
    /// Reads a call's inside (between the begin and end markers); None when malformed.
    pub parse_call: fn(begin: &str, inside: &str, options: &Options) -> Option<Call>,
}

impl Spec {
    pub(crate) fn all_markers(&self) -> Vec<&'static str> {
        let mut m: Vec<&'static str> = Vec::new();
        if let Some((a, b)) = self.think {
            m.extend([a, b]);
        }
        m.extend(self.section_begin);
        m.extend(self.section_end);
        m.extend(self.call_begin);
        m.push(self.call_end);
        m.extend(self.drop);
        m.retain(|x| !x.is_empty());
        m
    }
}

fn no_calls(_: &str, _: &str, _: &Options) -> Option<Call> {
    None
}

/// Reasoning markers only (tokenizers with `<think>` and no known call markup).
pub(crate) static THINK_ONLY: Spec = Spec {
    think: Some((THINK_OPEN, THINK_CLOSE)),
    section_begin: &[],
    section_end: &[],
    call_begin: &[],
    call_end: "",
    drop: &[],
    parse_call: no_calls,
};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    Content,
    Reasoning,
    /// Inside a section, between calls.
    Section,
    /// Inside a call opened by `begin`; `in_section` tells where to return.
    Call {
        begin: &'static str,
        in_section: bool,
    },
}

pub(crate) struct Tagged {
    spec: &'static Spec,
    options: Options,
    mode: Mode,
    /// Text not yet turned into events.
    buf: String,
    /// Drop whitespace at the start of the content that follows the think block.
    strip_ws: bool,
    calls: usize,
}

impl Tagged {
    pub(crate) fn new(spec: &'static Spec, options: Options) -> Tagged {
        let tail = options.prompt_tail.trim_end();
        let mode = match spec.think {
            Some((open, _)) if tail.ends_with(open) => Mode::Reasoning,
            _ => Mode::Content,
        };
        Tagged {
            spec,
            options,
            mode,
            buf: String::new(),
            strip_ws: false,
            calls: 0,
        }
    }

    /// The markers that matter in the current mode.
    fn markers(&self) -> Vec<&'static str> {
        let s = self.spec;
        let tools = self.options.tools_enabled && !s.call_begin.is_empty();
        let call_openers: &[&'static str] = if !tools {
            &[]
        } else if s.section_begin.is_empty() {
            s.call_begin
        } else {
            s.section_begin
        };
        let mut m = Vec::new();
        match self.mode {
            Mode::Content => {
                m.extend(s.drop);
                if let Some((open, _)) = s.think {
                    m.push(open);
                }
                m.extend(call_openers);
            }
            Mode::Reasoning => {
                if let Some((_, close)) = s.think {
                    m.push(close);
                }
                // A call may follow the reasoning without the close marker.
                m.extend(call_openers);
            }
            Mode::Section => {
                m.extend(s.call_begin);
                m.extend(s.section_end);
            }
            Mode::Call { .. } => m.push(s.call_end),
        }
        m
    }

    pub(crate) fn push(&mut self, text: &str, out: &mut Vec<Event>) {
        self.buf.push_str(text);
        self.run(false, out);
    }

    pub(crate) fn finish(&mut self, out: &mut Vec<Event>) {
        self.run(true, out);
        let rest = std::mem::take(&mut self.buf);
        if let Mode::Call { begin, .. } = self.mode {
            // An unfinished call is returned as the text the model wrote.
            out.push(Event::Content(format!("{begin}{rest}")));
            self.mode = Mode::Content;
        }
    }

    fn run(&mut self, at_end: bool, out: &mut Vec<Event>) {
        loop {
            let markers = self.markers();
            match find_first(&self.buf, &markers) {
                Some((pos, i)) => {
                    let marker = markers[i];
                    let before: String = self.buf.drain(..pos + marker.len()).collect();
                    let before = &before[..pos];
                    if let Mode::Call { begin, in_section } = self.mode {
                        self.end_call(begin, before, in_section, out);
                        continue;
                    }
                    self.text(before, out);
                    self.on_marker(marker);
                }
                None => {
                    // A call waits for its end; text between calls is judged whole (only
                    // whitespace is dropped), so both wait for the next marker.
                    if matches!(self.mode, Mode::Call { .. }) || (self.mode == Mode::Section && !at_end) {
                        return;
                    }
                    let keep = if at_end { 0 } else { held_suffix(&self.buf, &markers) };
                    let ready: String = self.buf.drain(..self.buf.len() - keep).collect();
                    self.text(&ready, out);
                    return;
                }
            }
        }
    }

    fn text(&mut self, s: &str, out: &mut Vec<Event>) {
        match self.mode {
            Mode::Content => {
                let s = if self.strip_ws { s.trim_start() } else { s };
                if !s.is_empty() {
                    self.strip_ws = false;
                    out.push(Event::Content(s.to_string()));
                }
            }
            Mode::Reasoning => {
                if !s.is_empty() {
                    out.push(Event::Reasoning(s.to_string()));
                }
            }
            // Between calls only whitespace is expected; anything else is kept as text.
            Mode::Section => {
                if !s.trim().is_empty() {
                    out.push(Event::Content(s.to_string()));
                }
            }
            Mode::Call { .. } => {}
        }
    }

    fn on_marker(&mut self, marker: &'static str) {
        let s = self.spec;
        if s.think.is_some_and(|(open, _)| open == marker) && self.mode == Mode::Content {
            self.mode = Mode::Reasoning;
        } else if s.think.is_some_and(|(_, close)| close == marker) && self.mode == Mode::Reasoning {
            self.mode = Mode::Content;
            self.strip_ws = true;
        } else if s.section_begin.contains(&marker) {
            self.mode = Mode::Section;
        } else if s.section_end.contains(&marker) {
            self.mode = Mode::Content;
            self.strip_ws = true;
        } else if s.call_begin.contains(&marker) {
            self.mode = Mode::Call {
                begin: marker,
                in_section: self.mode == Mode::Section,
            };
        }
        // Anything else is a dropped marker.
    }

    fn end_call(&mut self, begin: &'static str, inside: &str, in_section: bool, out: &mut Vec<Event>) {
        self.mode = if in_section { Mode::Section } else { Mode::Content };
        match (self.spec.parse_call)(begin, inside, &self.options) {
            Some(call) => {
                call.emit(self.calls, &self.options.id_prefix, out);
                self.calls += 1;
                self.strip_ws = true;
            }
            None => out.push(Event::Content(format!("{begin}{inside}{}", self.spec.call_end))),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_util::*;
    use super::super::*;

    #[test]
    fn think_block_is_reasoning_with_every_split() {
        let ev = parse_every_split(Family::Think, &opts(), "<think>\nplan é</think>\n\nAnswer €.");
        assert_eq!(ev, vec![reasoning("\nplan é"), content("Answer €.")]);
    }

    #[test]
    fn output_starts_inside_think_when_the_prompt_opened_it() {
        let o = opts_after("<｜Assistant｜><think>\n");
        let ev = parse_every_split(Family::Think, &o, "still thinking</think>done");
        assert_eq!(ev, vec![reasoning("still thinking"), content("done")]);
        // A prompt that closed the block (thinking off) starts in content.
        let o = opts_after("<｜Assistant｜></think>");
        let ev = parse_every_split(Family::Think, &o, "plain</think> text");
        assert_eq!(ev, vec![content("plain</think> text")]);
    }

    #[test]
    fn unfinished_think_is_reasoning_and_partial_markers_are_text() {
        assert_eq!(
            merged(Parser::parse_all(Family::Think, opts(), "<think>abc")),
            vec![reasoning("abc")]
        );
        assert_eq!(
            merged(Parser::parse_all(Family::Think, opts(), "a <thin")),
            vec![content("a <thin")]
        );
    }
}

//! Model text on a terminal: a model can generate any character, and control characters
//! (`ESC`, `BEL`, carriage returns, C1 controls) or bidirectional overrides written to a
//! terminal move the cursor, recolour or rewrite what is on screen. `run`, `chat` and `demo`
//! therefore show such characters escaped (`\u{1b}`, `\r`) when stdout is a terminal, and write
//! exact bytes to a pipe or file, or with `--raw-output`.

use std::borrow::Cow;
use std::io::IsTerminal;

/// Whether a character changes the terminal rather than printing: control characters other
/// than newline and tab (C0, DEL, C1) and the bidirectional formatting characters (U+200E,
/// U+200F, U+202A–U+202E, U+2066–U+2069) that reorder what is displayed.
fn unsafe_on_terminal(c: char) -> bool {
    (c.is_control() && c != '\n' && c != '\t')
        || matches!(c, '\u{200e}' | '\u{200f}' | '\u{202a}'..='\u{202e}' | '\u{2066}'..='\u{2069}')
}

/// `text` with every character [`unsafe_on_terminal`] replaced by its Rust escape (`\u{1b}`,
/// `\r`); borrowed unchanged when there is none.
pub(crate) fn escape(text: &str) -> Cow<'_, str> {
    if !text.chars().any(unsafe_on_terminal) {
        return Cow::Borrowed(text);
    }
    let mut out = String::with_capacity(text.len() + 8);
    for c in text.chars() {
        if unsafe_on_terminal(c) {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    Cow::Owned(out)
}

/// How model text is written to stdout: escaped when stdout is a terminal, unless `raw`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct TextOut {
    escape: bool,
}

impl TextOut {
    /// Escaping on when stdout is a terminal and `raw` (`--raw-output`) is not set.
    pub(crate) fn for_stdout(raw: bool) -> Self {
        TextOut {
            escape: !raw && std::io::stdout().is_terminal(),
        }
    }

    /// `text` as it should be written.
    pub(crate) fn render<'a>(&self, text: &'a str) -> Cow<'a, str> {
        if self.escape {
            escape(text)
        } else {
            Cow::Borrowed(text)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_what_moves_the_terminal() {
        assert_eq!(escape("plain text\nnext\tline"), "plain text\nnext\tline");
        assert!(matches!(escape("héllo ✓"), Cow::Borrowed(_)));
        assert_eq!(escape("a\u{1b}[2Jb\u{7}c\rd"), "a\\u{1b}[2Jb\\u{7}c\\rd");
        assert_eq!(escape("\u{9b}x\u{7f}"), "\\u{9b}x\\u{7f}");
        assert_eq!(escape("abc\u{202e}def"), "abc\\u{202e}def");
    }
}

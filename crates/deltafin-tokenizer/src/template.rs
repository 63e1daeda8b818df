//! Chat templates rendered with minijinja, configured to match transformers'
//! `apply_chat_template` (jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])` plus its `tojson`/`raise_exception` globals).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::TokenizerError;

const TEMPLATE_NAME: &str = "chat_template";

/// The message keys transformers treats as the same reasoning text
/// (`chat_template_utils._REASONING_FIELDS`).
const REASONING_FIELDS: [&str; 3] = ["reasoning_content", "thinking", "reasoning"];

/// A compiled chat template plus the special-token strings it may reference.
///
/// Rendering is deterministic and `Send + Sync`; one instance serves all requests.
pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
    bos_token: Option<String>,
    eos_token: Option<String>,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source_len", &self.source.len())
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .finish()
    }
}

/// Marks an error raised by the template's own `raise_exception(...)`.
#[derive(Debug)]
struct RaisedByTemplate(String);

impl std::fmt::Display for RaisedByTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for RaisedByTemplate {}

impl ChatTemplate {
    /// Compiles a Jinja chat template (`source`) with the jinja2/transformers-compatible
    /// settings; `bos_token`/`eos_token` become the template variables of the same names (left
    /// undefined when `None`, as transformers does for unset special tokens).
    ///
    /// Errors: [`TokenizerError::TemplateSyntax`] when the template does not compile.
    /// Sources: transformers `utils/chat_template_utils.py` (`_cached_compile_jinja_template`).
    pub fn new(source: &str, bos_token: Option<String>, eos_token: Option<String>) -> Result<Self, TokenizerError> {
        Self::with_origin(source, bos_token, eos_token, "<string>")
    }

    pub(crate) fn with_origin(
        source: &str,
        bos_token: Option<String>,
        eos_token: Option<String>,
        origin: &str,
    ) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()
            .map_err(|e| TokenizerError::TemplateSyntax {
                name: origin.to_string(),
                message: e.to_string(),
            })?;
        env.set_syntax(syntax);
        // Python string/dict methods (`.strip()`, `.split()`, `.items()`, `.get()`, ...).
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        // transformers overrides jinja2's HTML-escaping `tojson` with plain `json.dumps`.
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        // Python prints floats with repr (1e+16, 1e-05); minijinja would print 10000000000000000.0.
        env.set_formatter(|out, state, value| {
            if value.is_number() && !value.is_integer() {
                if let Ok(f) = f64::try_from(value.clone()) {
                    return out.write_str(&python_float_repr(f)).map_err(minijinja::Error::from);
                }
            }
            minijinja::escape_formatter(out, state, value)
        });
        env.add_template_owned(TEMPLATE_NAME, source.to_string())
            .map_err(|e| TokenizerError::TemplateSyntax {
                name: origin.to_string(),
                message: e.to_string(),
            })?;
        Ok(Self {
            env,
            source: source.to_string(),
            bos_token,
            eos_token,
        })
    }

    /// The template source text.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation the way transformers' `apply_chat_template(..., tokenize=False)`
    /// does.
    ///
    /// `messages`: OpenAI-style objects (`role`, `content`, `tool_calls`, ...). A message carrying
    /// `reasoning_content`, `thinking` or `reasoning` gets all of `thinking` and
    /// `reasoning_content` set to it, as transformers 5 does. `extra`: an object of additional
    /// variables (e.g. `tools`, `documents`, `enable_thinking`), or `Null`. `tools` and
    /// `documents` are defined as `none` unless `extra` sets them, and `bos_token`/`eos_token`
    /// come from [`ChatTemplate::new`] unless `extra` overrides them.
    ///
    /// Errors: [`TokenizerError::TemplateInput`] if a message is not an object, `extra` is
    /// neither an object nor null, or `extra` tries to set `messages`/`add_generation_prompt`;
    /// [`TokenizerError::TemplateException`] when the template calls `raise_exception`;
    /// [`TokenizerError::TemplateRender`] for any other render failure.
    pub fn render(
        &self,
        messages: &[Json],
        add_generation_prompt: bool,
        extra: &Json,
    ) -> Result<String, TokenizerError> {
        let mut chat = Vec::with_capacity(messages.len());
        for (i, m) in messages.iter().enumerate() {
            let obj = m.as_object().ok_or_else(|| TokenizerError::TemplateInput {
                message: format!("messages[{i}] must be an object, got {m}"),
            })?;
            chat.push(Json::Object(alias_reasoning_fields(obj)));
        }

        let mut ctx = Map::new();
        if let Some(bos) = &self.bos_token {
            ctx.insert("bos_token".into(), Json::String(bos.clone()));
        }
        if let Some(eos) = &self.eos_token {
            ctx.insert("eos_token".into(), Json::String(eos.clone()));
        }
        ctx.insert("tools".into(), Json::Null);
        ctx.insert("documents".into(), Json::Null);
        match extra {
            Json::Null => {}
            Json::Object(vars) => {
                for (k, v) in vars {
                    if k == "messages" || k == "add_generation_prompt" {
                        return Err(TokenizerError::TemplateInput {
                            message: format!("extra may not set `{k}`; it is a render() argument"),
                        });
                    }
                    ctx.insert(k.clone(), v.clone());
                }
            }
            other => {
                return Err(TokenizerError::TemplateInput {
                    message: format!("extra must be an object or null, got {other}"),
                })
            }
        }
        ctx.insert("messages".into(), Json::Array(chat));
        ctx.insert("add_generation_prompt".into(), Json::Bool(add_generation_prompt));

        let template = self
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::TemplateRender { message: e.to_string() })?;
        template
            .render(Value::from(minijinja::value::Serde(&ctx)))
            .map_err(classify_render_error)
    }
}

/// Splits render failures into the template's own `raise_exception` and everything else.
fn classify_render_error(err: minijinja::Error) -> TokenizerError {
    let mut cur: Option<&(dyn std::error::Error + 'static)> = Some(&err);
    while let Some(e) = cur {
        if let Some(raised) = e.downcast_ref::<RaisedByTemplate>() {
            return TokenizerError::TemplateException {
                message: raised.0.clone(),
            };
        }
        cur = e.source();
    }
    TokenizerError::TemplateRender {
        message: format!("{err:#}"),
    }
}

/// `{"thinking": r, **message, "reasoning_content": r}` where `r` is the first non-null of
/// [`REASONING_FIELDS`] (transformers `_alias_reasoning_fields`); Python dict semantics: an
/// existing key keeps its position and the later assignment wins.
fn alias_reasoning_fields(message: &Map<String, Json>) -> Map<String, Json> {
    let reasoning = REASONING_FIELDS
        .iter()
        .find_map(|k| message.get(*k).filter(|v| !v.is_null()));
    let Some(r) = reasoning else {
        return message.clone();
    };
    let mut out = Map::with_capacity(message.len() + 2);
    out.insert("thinking".into(), r.clone());
    for (k, v) in message {
        out.insert(k.clone(), v.clone());
    }
    out.insert("reasoning_content".into(), r.clone());
    out
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, message.clone()).with_source(RaisedByTemplate(message)))
}

/// transformers' `tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`,
/// i.e. Python `json.dumps`: no HTML escaping, `", "`/`": "` separators, Python float repr.
fn tojson(value: &Value, kwargs: Kwargs) -> Result<Value, minijinja::Error> {
    let ensure_ascii: Option<bool> = kwargs.get("ensure_ascii")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let indent_v: Option<Value> = kwargs.get("indent")?;
    let separators: Option<Vec<String>> = kwargs.get("separators")?;
    kwargs.assert_all_used()?;

    let indent = match indent_v {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => {
            if let Some(s) = v.as_str() {
                Some(s.to_string())
            } else if let Some(n) = v.as_i64() {
                Some(" ".repeat(usize::try_from(n).unwrap_or(0)))
            } else {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be an integer or a string",
                ));
            }
        }
    };
    let (item_sep, key_sep) = match separators {
        Some(s) if s.len() == 2 => (s[0].clone(), s[1].clone()),
        Some(_) => {
            return Err(minijinja::Error::new(
                ErrorKind::InvalidOperation,
                "tojson: separators must be a pair of strings",
            ))
        }
        // json.dumps: (', ', ': ') without indent, (',', ': ') with it.
        None if indent.is_some() => (",".to_string(), ": ".to_string()),
        None => (", ".to_string(), ": ".to_string()),
    };
    let json = serde_json::to_value(value)
        .map_err(|e| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {e}")))?;
    let style = PyJson {
        ensure_ascii: ensure_ascii.unwrap_or(false),
        sort_keys: sort_keys.unwrap_or(false),
        indent,
        item_sep,
        key_sep,
    };
    let mut out = String::new();
    style.write(&mut out, &json, 0);
    Ok(Value::from_safe_string(out))
}

/// Python `json.dumps` formatting options.
struct PyJson {
    ensure_ascii: bool,
    sort_keys: bool,
    indent: Option<String>,
    item_sep: String,
    key_sep: String,
}

impl PyJson {
    fn newline(&self, out: &mut String, level: usize) {
        if let Some(ind) = &self.indent {
            out.push('\n');
            for _ in 0..level {
                out.push_str(ind);
            }
        }
    }

    fn write(&self, out: &mut String, v: &Json, level: usize) {
        match v {
            Json::Null => out.push_str("null"),
            Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
            Json::Number(n) => {
                if let Some(i) = n.as_i64() {
                    let _ = write!(out, "{i}");
                } else if let Some(u) = n.as_u64() {
                    let _ = write!(out, "{u}");
                } else if let Some(f) = n.as_f64() {
                    out.push_str(&python_float_repr(f));
                }
            }
            Json::String(s) => self.write_str(out, s),
            Json::Array(items) => {
                if items.is_empty() {
                    out.push_str("[]");
                    return;
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write(out, item, level + 1);
                }
                self.newline(out, level);
                out.push(']');
            }
            Json::Object(map) => {
                if map.is_empty() {
                    out.push_str("{}");
                    return;
                }
                let mut entries: Vec<(&String, &Json)> = map.iter().collect();
                if self.sort_keys {
                    entries.sort_by(|a, b| a.0.cmp(b.0));
                }
                out.push('{');
                for (i, (k, item)) in entries.into_iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item_sep);
                    }
                    self.newline(out, level + 1);
                    self.write_str(out, k);
                    out.push_str(&self.key_sep);
                    self.write(out, item, level + 1);
                }
                self.newline(out, level);
                out.push('}');
            }
        }
    }

    /// Python's `json` string escaping: `"` `\` and C0 controls (short forms for
    /// `\b\f\n\r\t`), plus every non-ASCII char as `\uXXXX` (UTF-16) when `ensure_ascii`.
    fn write_str(&self, out: &mut String, s: &str) {
        out.push('"');
        for c in s.chars() {
            match c {
                '"' => out.push_str("\\\""),
                '\\' => out.push_str("\\\\"),
                '\n' => out.push_str("\\n"),
                '\r' => out.push_str("\\r"),
                '\t' => out.push_str("\\t"),
                '\u{08}' => out.push_str("\\b"),
                '\u{0c}' => out.push_str("\\f"),
                c if (c as u32) < 0x20 => {
                    let _ = write!(out, "\\u{:04x}", c as u32);
                }
                c if self.ensure_ascii && !c.is_ascii() => {
                    let mut buf = [0u16; 2];
                    for unit in c.encode_utf16(&mut buf) {
                        let _ = write!(out, "\\u{unit:04x}");
                    }
                }
                c => out.push(c),
            }
        }
        out.push('"');
    }
}

/// Python `repr(float)` (`float_repr_style='short'`): shortest round-trip digits, scientific
/// notation when the decimal exponent is < -4 or >= 16, as `json.dumps` prints floats.
pub(crate) fn python_float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity".into() } else { "-Infinity".into() };
    }
    if f == 0.0 {
        return if f.is_sign_negative() {
            "-0.0".into()
        } else {
            "0.0".into()
        };
    }
    // Rust's `{:e}` gives the shortest round-trip digits: "1.2345e-5".
    let sci = format!("{f:e}");
    let (mantissa, exp) = match sci.split_once('e') {
        Some((m, e)) => (m, e.parse::<i32>().unwrap_or(0)),
        None => (sci.as_str(), 0),
    };
    let negative = mantissa.starts_with('-');
    let digits: String = mantissa.chars().filter(char::is_ascii_digit).collect();
    let sign = if negative { "-" } else { "" };
    if !(-4..16).contains(&exp) {
        let (head, tail) = digits.split_at(1);
        let frac = if tail.is_empty() {
            String::new()
        } else {
            format!(".{tail}")
        };
        let esign = if exp < 0 { '-' } else { '+' };
        return format!("{sign}{head}{frac}e{esign}{:02}", exp.abs());
    }
    let point = exp + 1; // digits before the decimal point
    if point <= 0 {
        let zeros = "0".repeat(point.unsigned_abs() as usize);
        format!("{sign}0.{zeros}{digits}")
    } else {
        let point = point as usize;
        if digits.len() <= point {
            let zeros = "0".repeat(point - digits.len());
            format!("{sign}{digits}{zeros}.0")
        } else {
            let (int, frac) = digits.split_at(point);
            format!("{sign}{int}.{frac}")
        }
    }
}

#[cfg(test)]
mod tests {
    use super::python_float_repr;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (1.5, "1.5"),
            (0.1, "0.1"),
            (1e16, "1e+16"),
            (1e15, "1000000000000000.0"),
            (1.5e16, "1.5e+16"),
            (0.0001, "0.0001"),
            (1e-5, "1e-05"),
            (1.25e-7, "1.25e-07"),
            (-2.5, "-2.5"),
            (123456.789, "123456.789"),
            (1e100, "1e+100"),
            (0.0, "0.0"),
        ];
        for (f, want) in cases {
            assert_eq!(python_float_repr(f), want, "{f}");
        }
    }
}

//! Chat templates rendered with minijinja, configured to match transformers'
//! `apply_chat_template` (jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])` plus its `tojson`/`raise_exception` globals).

use std::fmt::Write as _;

use minijinja::value::{Kwargs, Value, ValueKind};
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
        env.add_function("strftime_now", strftime_now);
        // jinja2 prints (and `|string` converts) values with Python's `str`: `True`, `None`,
        // `1e-05`, `['a', 1]`; minijinja would write `true`, `none`, `0.00001`, `["a", 1]`.
        env.add_filter("string", |v: &Value| Value::from(python_str(v)));
        // jinja2's `iterable`/`sequence` tests: `none`, booleans and numbers are neither (minijinja
        // iterates `none` as empty), undefined is both; a dict is a sequence (it has `len` and
        // `[]`). Templates guard `tools | length` with `tools is iterable`.
        env.add_test("iterable", |v: &Value| python_iterable(v));
        env.add_test("sequence", |v: &Value| {
            v.is_undefined() || matches!(v.kind(), ValueKind::String | ValueKind::Seq | ValueKind::Map)
        });
        env.set_formatter(|out, state, value| {
            if value.is_undefined() || value.kind() == ValueKind::String {
                return minijinja::escape_formatter(out, state, value);
            }
            out.write_str(&python_str(value)).map_err(minijinja::Error::from)
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

/// jinja2's `value is iterable` (`iter(value)` succeeds).
fn python_iterable(v: &Value) -> bool {
    match v.kind() {
        ValueKind::Undefined => true,
        ValueKind::None | ValueKind::Bool | ValueKind::Number => false,
        _ => v.try_iter().is_ok(),
    }
}

/// Python `str(value)` for the values a template can hold: strings as they are, `None`,
/// `True`/`False`, integers, floats as `repr`, lists and dicts as their `repr` (items with
/// `repr`, `', '` and `': '` separators). Other objects (macros, namespaces) keep minijinja's
/// text.
fn python_str(value: &Value) -> String {
    match value.kind() {
        ValueKind::String => value.as_str().unwrap_or_default().to_string(),
        _ => python_repr(value),
    }
}

/// Python `repr(value)`; see [`python_str`].
fn python_repr(value: &Value) -> String {
    match value.kind() {
        ValueKind::None | ValueKind::Undefined => "None".into(),
        ValueKind::Bool => if value.is_true() { "True" } else { "False" }.into(),
        ValueKind::Number if !value.is_integer() => match f64::try_from(value.clone()) {
            Ok(f) => python_float_repr(f),
            Err(_) => value.to_string(),
        },
        ValueKind::String => python_str_repr(value.as_str().unwrap_or_default()),
        ValueKind::Seq | ValueKind::Iterable => match value.try_iter() {
            Ok(items) => format!("[{}]", items.map(|v| python_repr(&v)).collect::<Vec<_>>().join(", ")),
            Err(_) => value.to_string(),
        },
        ValueKind::Map => match value.try_iter() {
            Ok(keys) => {
                let items: Vec<String> = keys
                    .map(|k| {
                        let v = value.get_item(&k).unwrap_or_default();
                        format!("{}: {}", python_repr(&k), python_repr(&v))
                    })
                    .collect();
                format!("{{{}}}", items.join(", "))
            }
            Err(_) => value.to_string(),
        },
        _ => value.to_string(),
    }
}

/// Python `repr(str)`: single quotes unless the text holds `'` and no `"`; backslash,
/// the chosen quote, `\n` `\r` `\t` and other non-printable characters escaped
/// (`\xNN`, `\uNNNN`, `\UNNNNNNNN`); printable non-ASCII kept.
fn python_str_repr(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') {
        '"'
    } else {
        '\''
    };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x20 || (0x7f..0xa0).contains(&(c as u32)) => {
                let _ = write!(out, "\\x{:02x}", c as u32);
            }
            c if c.is_control() || matches!(c as u32, 0xad | 0x2028 | 0x2029 | 0xfeff) => {
                let n = c as u32;
                let _ = if n <= 0xffff {
                    write!(out, "\\u{n:04x}")
                } else {
                    write!(out, "\\U{n:08x}")
                };
            }
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// transformers' `strftime_now(format)` (`datetime.now().strftime(format)`), in UTC: the
/// directives `%Y %y %m %d %e %H %I %M %S %p %j %A %a %B %b %%`.
///
/// Errors: `InvalidOperation` naming any other directive.
fn strftime_now(format: String) -> Result<Value, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    strftime_utc(&format, secs).map(Value::from)
}

/// `format` applied to the UTC time `secs` seconds after the Unix epoch (see
/// [`strftime_now`]). Civil date from days: H. Hinnant, "chrono-Compatible Low-Level Date
/// Algorithms" (`civil_from_days`).
fn strftime_utc(format: &str, secs: u64) -> Result<String, minijinja::Error> {
    const MONTHS: [&str; 12] = [
        "January",
        "February",
        "March",
        "April",
        "May",
        "June",
        "July",
        "August",
        "September",
        "October",
        "November",
        "December",
    ];
    const DAYS: [&str; 7] = [
        "Sunday",
        "Monday",
        "Tuesday",
        "Wednesday",
        "Thursday",
        "Friday",
        "Saturday",
    ];
    let days = (secs / 86_400) as i64;
    let tod = secs % 86_400;
    let (hour, minute, second) = (tod / 3600, tod % 3600 / 60, tod % 60);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    const CUM: [i64; 12] = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = CUM[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 4).rem_euclid(7) as usize; // 1970-01-01 was a Thursday
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let _ = match chars.next() {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('H') => write!(out, "{hour:02}"),
            Some('I') => write!(out, "{:02}", (hour + 11) % 12 + 1),
            Some('M') => write!(out, "{minute:02}"),
            Some('S') => write!(out, "{second:02}"),
            Some('p') => out.write_str(if hour < 12 { "AM" } else { "PM" }),
            Some('j') => write!(out, "{yday:03}"),
            Some('A') => out.write_str(DAYS[weekday]),
            Some('a') => out.write_str(&DAYS[weekday][..3]),
            Some('B') => out.write_str(month_name),
            Some('b') => out.write_str(&month_name[..3]),
            Some('%') => out.write_str("%"),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{} in {format:?}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
    }
    Ok(out)
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
    use serde_json::json;

    use super::{python_float_repr, python_str_repr, strftime_utc, ChatTemplate};

    #[test]
    fn strftime_matches_python() {
        // 2026-12-01 23:59:07 UTC, a Tuesday; 2024-02-29 12:00:00, a Thursday.
        let t = 1_796_169_547;
        assert_eq!(strftime_utc("%Y-%m-%d %H:%M:%S", t).unwrap(), "2026-12-01 23:59:07");
        assert_eq!(
            strftime_utc("%d %b %Y, %A %j %I%p %%", t).unwrap(),
            "01 Dec 2026, Tuesday 335 11PM %"
        );
        assert_eq!(
            strftime_utc("%e %B %y %a", 1_709_208_000).unwrap(),
            "29 February 24 Thu"
        );
        assert!(strftime_utc("%Q", t).is_err());
    }

    /// `{{ x }}`, `x|string`, `x is iterable`, `x is sequence` as jinja2 evaluates them.
    #[test]
    fn printing_and_type_tests_follow_jinja2() {
        let t = ChatTemplate::new(
            "{{ x }}|{{ x|string }}|{{ x is iterable }}|{{ x is sequence }}|{{ y is iterable }}{{ y is sequence }}",
            None,
            None,
        )
        .unwrap();
        let cases = [
            (json!(true), "True|True|False|False"),
            (json!(null), "None|None|False|False"),
            (json!(1.0), "1.0|1.0|False|False"),
            (json!(7), "7|7|False|False"),
            (json!("s"), "s|s|True|True"),
            (
                json!([1, "a'b", null]),
                "[1, \"a'b\", None]|[1, \"a'b\", None]|True|True",
            ),
            (json!({"k": false}), "{'k': False}|{'k': False}|True|True"),
        ];
        for (x, want) in cases {
            let got = t.render(&[], false, &json!({ "x": x })).unwrap();
            assert_eq!(got, format!("{want}|TrueTrue"), "{x}");
        }
    }

    #[test]
    fn str_repr_matches_python() {
        assert_eq!(python_str_repr("a"), "'a'");
        assert_eq!(python_str_repr("it's"), "\"it's\"");
        assert_eq!(python_str_repr("'\""), "'\\'\"'");
        assert_eq!(python_str_repr("a\\b\n\t\u{1}é"), "'a\\\\b\\n\\t\\x01é'");
    }

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

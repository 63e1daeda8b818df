//! `tokenizer_config.json` (and friends): the fields deltafin reads, with errors naming the field.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

use crate::TokenizerError;

/// Reads and parses a JSON file; `Ok(None)` when the file does not exist.
///
/// Errors: [`TokenizerError::Io`] for read failures other than "not found" (a FIFO, device or
/// directory in its place is one: it is refused at once, never read),
/// [`TokenizerError::Json`] for malformed JSON.
pub(crate) fn read_json_if_exists(path: &Path) -> Result<Option<Value>, TokenizerError> {
    match deltafin_fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes)
            .map(Some)
            .map_err(|source| TokenizerError::Json {
                path: path.to_path_buf(),
                source,
            }),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(TokenizerError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

/// Builds a [`TokenizerError::Field`].
pub(crate) fn field_error(path: &Path, field: &str, message: impl Into<String>) -> TokenizerError {
    TokenizerError::Field {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: message.into(),
    }
}

/// A chat template found in the model directory, with where it came from.
#[derive(Debug, Clone)]
pub(crate) struct TemplateSource {
    /// Human-readable origin, e.g. `tokenizer_config.json:chat_template[default]`.
    pub(crate) origin: String,
    pub(crate) source: String,
}

/// The digested `tokenizer_config.json`. Every field is optional because the file is.
#[derive(Debug, Default)]
pub(crate) struct TokenizerConfig {
    pub(crate) bos_token: Option<String>,
    pub(crate) eos_token: Option<String>,
    pub(crate) add_bos_token: Option<bool>,
    pub(crate) chat_template: Option<TemplateSource>,
    /// Split-pattern override for tiktoken vocabularies (non-standard key; Kimi hard-codes it).
    pub(crate) pat_str: Option<String>,
    /// `added_tokens_decoder`: id -> content.
    pub(crate) added_tokens: BTreeMap<u32, String>,
    pub(crate) path: PathBuf,
}

impl TokenizerConfig {
    /// Loads `dir/tokenizer_config.json` if present (an absent file gives the default config)
    /// and `dir/chat_template.jinja` if present, which takes precedence over the config's
    /// `chat_template` as in transformers >= 4.47.
    ///
    /// Errors: malformed JSON, or a known field of the wrong type ([`TokenizerError::Field`]).
    pub(crate) fn load(dir: &Path) -> Result<Self, TokenizerError> {
        let path = dir.join("tokenizer_config.json");
        let mut config = TokenizerConfig {
            path: path.clone(),
            ..Default::default()
        };
        if let Some(json) = read_json_if_exists(&path)? {
            let obj = json
                .as_object()
                .ok_or_else(|| field_error(&path, "<root>", "must be a JSON object"))?;
            config.bos_token = special_token_field(&path, "bos_token", obj.get("bos_token"))?;
            config.eos_token = special_token_field(&path, "eos_token", obj.get("eos_token"))?;
            config.add_bos_token = match obj.get("add_bos_token") {
                None | Some(Value::Null) => None,
                Some(Value::Bool(b)) => Some(*b),
                Some(_) => return Err(field_error(&path, "add_bos_token", "must be a boolean")),
            };
            config.pat_str = match obj.get("pat_str") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(s.clone()),
                Some(_) => return Err(field_error(&path, "pat_str", "must be a string")),
            };
            config.chat_template = chat_template_field(&path, obj.get("chat_template"))?;
            if let Some(decoder) = obj.get("added_tokens_decoder") {
                config.added_tokens = added_tokens_field(&path, decoder)?;
            }
        }
        let jinja = dir.join("chat_template.jinja");
        match deltafin_fs::read_to_string(&jinja) {
            Ok(source) => {
                config.chat_template = Some(TemplateSource {
                    origin: "chat_template.jinja".to_string(),
                    source,
                })
            }
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => return Err(TokenizerError::Io { path: jinja, source }),
        }
        Ok(config)
    }
}

/// `bos_token` / `eos_token`: a string, an `AddedToken` object `{"content": ...}`, or null.
fn special_token_field(path: &Path, field: &str, value: Option<&Value>) -> Result<Option<String>, TokenizerError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Object(obj)) => match obj.get("content") {
            Some(Value::String(s)) => Ok(Some(s.clone())),
            _ => Err(field_error(path, &format!("{field}.content"), "must be a string")),
        },
        Some(_) => Err(field_error(path, field, "must be a string or an object with `content`")),
    }
}

/// `chat_template`: a string, or a list of `{name, template}` where `default` is preferred
/// (transformers' rule) and the first entry is the fallback.
fn chat_template_field(path: &Path, value: Option<&Value>) -> Result<Option<TemplateSource>, TokenizerError> {
    match value {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(TemplateSource {
            origin: "tokenizer_config.json:chat_template".to_string(),
            source: s.clone(),
        })),
        Some(Value::Array(items)) => {
            let mut named = Vec::with_capacity(items.len());
            for (i, item) in items.iter().enumerate() {
                let name = item.get("name").and_then(Value::as_str);
                let template = item.get("template").and_then(Value::as_str);
                match (name, template) {
                    (Some(n), Some(t)) => named.push((n, t)),
                    _ => {
                        return Err(field_error(
                            path,
                            &format!("chat_template[{i}]"),
                            "must be an object with string `name` and `template`",
                        ))
                    }
                }
            }
            let chosen = named.iter().find(|(n, _)| *n == "default").or_else(|| named.first());
            Ok(chosen.map(|(n, t)| TemplateSource {
                origin: format!("tokenizer_config.json:chat_template[{n}]"),
                source: (*t).to_string(),
            }))
        }
        Some(_) => Err(field_error(
            path,
            "chat_template",
            "must be a string or a list of {name, template}",
        )),
    }
}

/// `added_tokens_decoder`: `{"<id>": {"content": "...", ...}, ...}`.
fn added_tokens_field(path: &Path, value: &Value) -> Result<BTreeMap<u32, String>, TokenizerError> {
    let obj = value
        .as_object()
        .ok_or_else(|| field_error(path, "added_tokens_decoder", "must be an object"))?;
    let mut out = BTreeMap::new();
    for (key, entry) in obj {
        let field = format!("added_tokens_decoder.{key}");
        let id: u32 = key
            .parse()
            .map_err(|_| field_error(path, &field, "key must be a non-negative integer id"))?;
        let content = entry
            .get("content")
            .and_then(Value::as_str)
            .ok_or_else(|| field_error(path, &format!("{field}.content"), "must be a string"))?;
        out.insert(id, content.to_string());
    }
    Ok(out)
}

//! What the chat endpoints share for tool calls and reasoning: the per-response parser (or
//! plain text when the model's family is unknown), the whole reply gathered from its events,
//! and the chat-template variables a request sets (`tools`, thinking on/off, reasoning
//! effort, `chat_template_kwargs`).

use serde_json::{Map, Value};

use crate::tools::{Event, Family, Options, Parser};
use crate::{new_id, ApiError};

/// The generated text turned into events: through the family's [`Parser`], or all content.
pub(crate) struct ReplyParser {
    parser: Option<Parser>,
}

impl ReplyParser {
    /// For the model's `family` (None: plain text). `tools_enabled`: the request offered tools
    /// and allowed calls; `tools` (OpenAI shape) gives parameter types; `prompt_tail` is the
    /// end of the rendered prompt.
    pub(crate) fn new(
        family: Option<Family>,
        tools_enabled: bool,
        tools: Option<Value>,
        prompt_tail: String,
    ) -> ReplyParser {
        let parser = family.map(|f| {
            Parser::new(
                f,
                Options {
                    tools_enabled,
                    tools,
                    id_prefix: format!("{}_", new_id("call_")),
                    prompt_tail,
                },
            )
        });
        ReplyParser { parser }
    }

    /// Events for the next decoded text.
    pub(crate) fn push(&mut self, text: &str) -> Vec<Event> {
        match &mut self.parser {
            Some(p) => p.push(text),
            None if text.is_empty() => Vec::new(),
            None => vec![Event::Content(text.to_string())],
        }
    }

    /// Events held back until the end.
    pub(crate) fn finish(&mut self) -> Vec<Event> {
        self.parser.as_mut().map(Parser::finish).unwrap_or_default()
    }

    /// Whether a family parser runs (otherwise the text passes through untouched).
    pub(crate) fn active(&self) -> bool {
        self.parser.is_some()
    }
}

/// One tool call of a reply.
pub(crate) struct ToolCall {
    pub id: String,
    pub name: String,
    /// A JSON object's text.
    pub arguments: String,
}

/// A whole reply: content, reasoning and tool calls.
#[derive(Default)]
pub(crate) struct Reply {
    pub content: String,
    pub reasoning: String,
    pub calls: Vec<ToolCall>,
}

impl Reply {
    /// Parses a finished generation's text.
    pub(crate) fn parse(mut parser: ReplyParser, text: &str) -> Reply {
        let mut events = parser.push(text);
        events.extend(parser.finish());
        let mut r = Reply::default();
        for e in events {
            match e {
                Event::Content(t) => r.content.push_str(&t),
                Event::Reasoning(t) => r.reasoning.push_str(&t),
                Event::ToolCallStart { id, name, .. } => r.calls.push(ToolCall {
                    id,
                    name,
                    arguments: String::new(),
                }),
                Event::ToolCallArgs { args, .. } => {
                    if let Some(c) = r.calls.last_mut() {
                        c.arguments.push_str(&args);
                    }
                }
                Event::ToolCallEnd { .. } => {}
            }
        }
        r
    }
}

/// The chat-template variables of a request: `chat_template_kwargs` (an object), then
/// `tools` (OpenAI shape), thinking on or off (the family's variable, see
/// [`Family::thinking_kwarg`]) and the reasoning effort (see [`Family::effort_kwarg`]); the
/// request's own fields win over the same names in `chat_template_kwargs`, for a model of
/// markup `family` (the server's [`AppState::family`](crate::AppState)).
///
/// Errors: 400 naming `kwargs_param` when it is not an object, or `effort_param` when the
/// effort is not a string.
pub(crate) fn template_vars(
    family: Option<Family>,
    kwargs: Option<&Value>,
    kwargs_param: &str,
    tools: Option<Value>,
    thinking: Option<bool>,
    effort: Option<&Value>,
    effort_param: &str,
) -> Result<Value, ApiError> {
    let mut extra = match kwargs {
        None | Some(Value::Null) => Map::new(),
        Some(Value::Object(o)) => o.clone(),
        Some(_) => {
            return Err(ApiError::invalid_param(
                kwargs_param,
                format!("`{kwargs_param}` must be an object of chat template variables"),
            ))
        }
    };
    let family = family.unwrap_or(Family::Think);
    if let Some(t) = tools {
        extra.insert("tools".into(), t);
    }
    if let Some(on) = thinking {
        extra.insert(family.thinking_kwarg().into(), Value::Bool(on));
    }
    match effort {
        None | Some(Value::Null) => {}
        Some(Value::String(e)) if !e.is_empty() => {
            extra.insert(family.effort_kwarg().into(), Value::String(e.clone()));
        }
        Some(_) => {
            return Err(ApiError::invalid_param(
                effort_param,
                format!("`{effort_param}` must be a non-empty string such as \"low\", \"medium\" or \"high\""),
            ))
        }
    }
    Ok(if extra.is_empty() {
        Value::Null
    } else {
        Value::Object(extra)
    })
}

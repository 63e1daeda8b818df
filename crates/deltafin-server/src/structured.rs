//! Structured output: `response_format` JSON (OpenAI `json_object` / `json_schema`) and forced
//! tool calls (OpenAI `tool_choice` `"required"` or a named function, Anthropic `any` / `tool`),
//! by constrained decoding with llguidance (the grammar engine llama.cpp and vLLM use).
//!
//! A request's constraint becomes a Lark grammar (llguidance's dialect: `%json {schema}` for a
//! JSON value, `<[ID]>` for one special token) compiled against the model's vocabulary into an
//! [`deltafin_engine::constraint::Grammar`]; the sampler then masks every token the grammar does
//! not allow, each step, and the generation ends where the grammar does.
//!
//! Forced tool calls are written in the model family's own markup (the markup its parser in
//! [`crate::tools`] reads back into `tool_calls` / `tool_use`), with the tool's parameter schema
//! as the arguments' grammar:
//! - Kimi K2: `<|tool_calls_section_begin|>` then per call `<|tool_call_begin|>functions.NAME:IDX`
//!   `<|tool_call_argument_begin|>{args}<|tool_call_end|>`, then `<|tool_calls_section_end|>`;
//! - Kimi K3: `<|open|>tools<|sep|>` then per call `<|open|>call tool="NAME" index="IDX"<|sep|>`
//!   `<|open|>json type="object"<|sep|>{args}<|close|>json<|sep|><|close|>call<|sep|>`, then
//!   `<|close|>tools<|sep|>`;
//! - DeepSeek: `<｜tool▁calls▁begin｜>` then per call `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{args}`
//!   `<｜tool▁call▁end｜>` (V3.1), or V3's `function<｜tool▁sep｜>NAME` and a fenced `json` block
//!   when the chat template writes calls that way, then `<｜tool▁calls▁end｜>`;
//! - Qwen, and every model without a tool-call markup of its own (the Hermes format, as text):
//!   per call `<tool_call>\n{"name": NAME, "arguments": {args}}\n</tool_call>`;
//! - gpt-oss Harmony: `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{args}`
//!   `<|call|>` (one call: a Harmony call ends the turn).
//!
//! Where the generation prompt opened a think block, the output first closes it (no reasoning
//! before a forced call or a JSON answer). Markers that are special tokens of the vocabulary are
//! matched as those tokens; the rest as text. JSON is written on one line with `", "` and
//! `": "` separators (`x-guidance` in a schema overrides that), so that even a random-weight
//! model reaches the end; strings and numbers are as long as the model makes them.
//!
//! Cost: nothing for a request without a constraint. The vocabulary's token trie and
//! llguidance's parser factory are built once, on the first constrained request.

use std::sync::{Arc, Mutex, OnceLock};

use deltafin_engine::constraint::{Grammar, GrammarState};
use deltafin_tokenizer::Tokenizer;
use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{InferenceCapabilities, SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use crate::tools::{deepseek, Family};

/// What a request's output must be.
#[derive(Debug, Clone, PartialEq)]
pub(crate) enum Constraint {
    /// One JSON value following this JSON Schema (`{"type": "object"}` for `json_object`).
    Json(Value),
    /// Tool calls in the family's markup: one, or with `parallel` one or more, each naming one of
    /// `tools` (name, parameters schema) with arguments following its schema.
    ToolCalls {
        /// `(name, parameters)`; a single entry for a named tool.
        tools: Vec<(String, Value)>,
        /// Whether several calls may follow each other.
        parallel: bool,
    },
}

/// How the request's `tool_choice` asks for calls (besides `auto` and `none`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Forced {
    /// At least one call, of any tool (OpenAI `"required"`, Anthropic `any`).
    Any,
    /// A call of this tool (OpenAI `{"type": "function", ...}`, Anthropic `tool`).
    Named(String),
}

/// The `(name, parameters)` of the tools `forced` allows, from OpenAI-shaped `tools`
/// (`{"type": "function", "function": {"name", "parameters"?}}`); an absent or null parameters
/// schema allows any object.
pub(crate) fn forced_tools(tools: &Value, forced: &Forced) -> Vec<(String, Value)> {
    let mut out = Vec::new();
    for t in tools.as_array().into_iter().flatten() {
        let f = t.get("function").unwrap_or(t);
        let Some(name) = f.get("name").and_then(Value::as_str) else {
            continue;
        };
        if let Forced::Named(n) = forced {
            if n != name {
                continue;
            }
        }
        let params = match f.get("parameters") {
            Some(p @ Value::Object(_)) => p.clone(),
            _ => json!({"type": "object"}),
        };
        out.push((name.to_string(), params));
    }
    out
}

/// The family whose markup and parser a forced call uses: the model's own, or Qwen's (Hermes
/// `<tool_call>` as text) for a model whose family has no tool-call markup.
pub(crate) fn call_family(family: Option<Family>) -> Family {
    match family {
        Some(f @ (Family::KimiK2 | Family::KimiK3 | Family::DeepSeek | Family::Qwen | Family::Harmony)) => f,
        Some(Family::Think) | None => Family::Qwen,
    }
}

/// The vocabulary as llguidance sees it: each id's bytes, special tokens marked.
struct Vocab {
    trie: TokTrie,
}

impl TokenizerEnv for Vocab {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    // Only used for forced-token fast-forwarding, which deltafin does not do: the trie's greedy
    // split is enough (and says so: not canonical).
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        self.trie.greedy_tokenize(s)
    }

    fn tokenize_is_canonical(&self) -> bool {
        false
    }
}

/// Compiles request constraints for one model. Cheap to create; the vocabulary work happens
/// on the first compile of a request's constraint.
pub struct Structured {
    tokenizer: Arc<Tokenizer>,
    /// The model's vocabulary size (logits length; may exceed the tokenizer's).
    vocab_size: usize,
    eos: Vec<u32>,
    factory: OnceLock<Result<Arc<ParserFactory>, String>>,
}

impl std::fmt::Debug for Structured {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Structured")
            .field("vocab_size", &self.vocab_size)
            .finish()
    }
}

impl Structured {
    /// For a model whose logits have `vocab_size` entries, tokenized by `tokenizer`, whose
    /// generations end at any of `eos` (non-empty for a useful end: a complete grammar then
    /// allows only these).
    pub fn new(tokenizer: Arc<Tokenizer>, vocab_size: usize, eos: Vec<u32>) -> Structured {
        Structured {
            tokenizer,
            vocab_size,
            eos,
            factory: OnceLock::new(),
        }
    }

    fn factory(&self) -> Result<&Arc<ParserFactory>, String> {
        self.factory
            .get_or_init(|| self.build_factory())
            .as_ref()
            .map_err(Clone::clone)
    }

    /// The token trie (ids past the tokenizer's vocabulary have no bytes, so are never allowed;
    /// a special token is `0xFF` then its name, as llguidance expects) and the parser factory.
    fn build_factory(&self) -> Result<Arc<ParserFactory>, String> {
        let tok = &self.tokenizer;
        let mut words = Vec::with_capacity(self.vocab_size);
        for id in 0..self.vocab_size as u32 {
            let plain = tok.decode(&[id], true).unwrap_or_default();
            let bytes = tok.token_bytes(id).unwrap_or_default();
            if plain.is_empty() && !bytes.is_empty() {
                let mut b = Vec::with_capacity(bytes.len() + 1);
                b.push(TokTrie::SPECIAL_TOKEN_MARKER);
                b.extend_from_slice(&bytes);
                words.push(b);
            } else {
                words.push(bytes);
            }
        }
        let eos = self.eos.first().copied().unwrap_or(0);
        let info = TokRxInfo::new(self.vocab_size as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocab { trie });
        // The JSON slices (token subsets precomputed for whitespace and string contents) are
        // what makes a mask inside a JSON string cheap.
        let slices = llguidance::earley::SlicedBiasComputer::general_slices();
        let mut factory = ParserFactory::new(&env, InferenceCapabilities::default(), &slices)
            .map_err(|e| format!("building the grammar engine over the vocabulary: {e}"))?;
        factory.quiet();
        Ok(Arc::new(factory))
    }

    /// The special-token id of `name` (e.g. `<|tool_call_begin|>`), if the vocabulary has it
    /// as a special token.
    fn special(&self, factory: &ParserFactory, name: &str) -> Option<u32> {
        factory.tok_env().tok_trie().get_special_token(name)
    }

    /// `text` as a Lark sequence: each special token of the vocabulary in it (a `<…>` span, e.g.
    /// `<|tool_call_begin|>`, `<｜tool▁sep｜>`, `<think>`) as `<[ID]>`, the text between as
    /// string literals.
    fn lark_text(&self, factory: &ParserFactory, text: &str) -> String {
        let mut parts: Vec<String> = Vec::new();
        let mut lit = String::new();
        let mut rest = text;
        while !rest.is_empty() {
            if rest.starts_with('<') {
                if let Some(end) = rest.find('>') {
                    let name = &rest[..=end];
                    if let Some(id) = self.special(factory, name) {
                        if !lit.is_empty() {
                            parts.push(lark_string(&std::mem::take(&mut lit)));
                        }
                        parts.push(format!("<[{id}]>"));
                        rest = &rest[name.len()..];
                        continue;
                    }
                }
            }
            let c = rest.chars().next().unwrap_or_default();
            lit.push(c);
            rest = &rest[c.len_utf8()..];
        }
        if !lit.is_empty() {
            parts.push(lark_string(&lit));
        }
        parts.join(" ")
    }

    /// The Lark grammar of `constraint` for a model of `family` whose rendered prompt ends in
    /// `prompt_tail` (see the module documentation for each family's markup).
    ///
    /// Errors: the vocabulary could not be prepared; a forced call with no tool to call.
    pub(crate) fn lark(
        &self,
        constraint: &Constraint,
        family: Option<Family>,
        prompt_tail: &str,
    ) -> Result<String, String> {
        let factory = self.factory()?;
        let t = |s: &str| self.lark_text(factory, s);
        let tail = prompt_tail.trim_end();
        // Close a think block the generation prompt opened.
        let close_think = match family {
            Some(Family::KimiK3) if tail.ends_with("<|open|>think<|sep|>") => t("<|close|>think<|sep|>"),
            Some(Family::KimiK2 | Family::DeepSeek | Family::Qwen | Family::Think) if tail.ends_with("<think>") => {
                t("</think>")
            }
            _ => String::new(),
        };
        let mut g = String::new();
        match constraint {
            Constraint::Json(schema) => {
                let open = match family {
                    Some(Family::Harmony) => t("<|channel|>final<|message|>"),
                    _ => close_think,
                };
                g.push_str(&format!("start: {open} %json {}\n", json_for_grammar(schema)));
            }
            Constraint::ToolCalls { tools, parallel } => {
                if tools.is_empty() {
                    return Err("no tool to call".into());
                }
                let family = call_family(family);
                let parallel = *parallel && family != Family::Harmony;
                let idx = if parallel { "/[0-9]{1,2}/".to_string() } else { t("0") };
                let (begin, end, sep) = match family {
                    Family::KimiK2 => (
                        t("<|tool_calls_section_begin|>"),
                        t("<|tool_calls_section_end|>"),
                        String::new(),
                    ),
                    Family::KimiK3 => (t("<|open|>tools<|sep|>"), t("<|close|>tools<|sep|>"), String::new()),
                    Family::DeepSeek => (t(deepseek::CALLS_BEGIN), t("<｜tool▁calls▁end｜>"), String::new()),
                    _ => (String::new(), String::new(), t("\n")),
                };
                let fenced = self
                    .tokenizer
                    .chat_template()
                    .is_some_and(|c| c.source().contains("```json"));
                let mut alts = Vec::new();
                for (i, (name, params)) in tools.iter().enumerate() {
                    let args = json_for_grammar(params);
                    let body = match family {
                        Family::KimiK2 => format!(
                            "{} {} {idx} {} %json {args} {}",
                            t("<|tool_call_begin|>"),
                            t(&format!("functions.{name}:")),
                            t("<|tool_call_argument_begin|>"),
                            t("<|tool_call_end|>")
                        ),
                        Family::KimiK3 => format!(
                            "{} {idx} {} %json {args} {}",
                            t(&format!("<|open|>call tool=\"{}\" index=\"", xml_attr(name))),
                            t("\"<|sep|><|open|>json type=\"object\"<|sep|>"),
                            t("<|close|>json<|sep|><|close|>call<|sep|>")
                        ),
                        Family::DeepSeek if fenced => format!(
                            "{} %json {args} {}",
                            t(&format!("<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n")),
                            t("\n```<｜tool▁call▁end｜>")
                        ),
                        Family::DeepSeek => format!(
                            "{} %json {args} {}",
                            t(&format!("<｜tool▁call▁begin｜>{name}<｜tool▁sep｜>")),
                            t("<｜tool▁call▁end｜>")
                        ),
                        Family::Harmony => format!(
                            "{} %json {args} {}",
                            t(&format!(
                                "<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
                            )),
                            t("<|call|>")
                        ),
                        _ => {
                            let call = json!({
                                "type": "object",
                                "properties": {"name": {"const": name}, "arguments": params},
                                "required": ["name", "arguments"],
                                "additionalProperties": false,
                            });
                            format!(
                                "{} %json {} {}",
                                t("<tool_call>\n"),
                                json_for_grammar(&call),
                                t("\n</tool_call>")
                            )
                        }
                    };
                    g.push_str(&format!("call_{i}: {body}\n"));
                    alts.push(format!("call_{i}"));
                }
                g.push_str(&format!("call: {}\n", alts.join(" | ")));
                let calls = if parallel {
                    if sep.is_empty() {
                        "call+".to_string()
                    } else {
                        format!("call ({sep} call)*")
                    }
                } else {
                    "call".to_string()
                };
                g.insert_str(0, &format!("start: {close_think} {begin} {calls} {end}\n"));
            }
        }
        Ok(g)
    }

    /// Compiles `constraint` (see [`Structured::lark`]) into a grammar for the sampler. CPU
    /// work (milliseconds for a schema, the vocabulary pass on first use): call it off the
    /// async runtime.
    ///
    /// Errors: a one-line message naming what llguidance rejected (an unsupported or
    /// unsatisfiable schema feature, e.g. a remote `$ref`).
    pub(crate) fn compile(
        &self,
        constraint: &Constraint,
        family: Option<Family>,
        prompt_tail: &str,
    ) -> Result<Arc<dyn Grammar>, String> {
        let lark = self.lark(constraint, family, prompt_tail)?;
        let factory = self.factory()?;
        let parser = factory
            .create_parser(TopLevelGrammar::from_lark(lark))
            .map_err(|e| one_line(&e.to_string()))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(one_line(&e));
        }
        let eos = {
            let mut v = factory.tok_env().tok_trie().alloc_token_set();
            for &id in &self.eos {
                if (id as usize) < self.vocab_size {
                    v.allow_token(id);
                }
            }
            v
        };
        Ok(Arc::new(Compiled {
            pristine: Mutex::new(matcher),
            eos,
        }))
    }
}

/// A compiled request grammar: each generation starts from a copy of the pristine matcher.
struct Compiled {
    pristine: Mutex<Matcher>,
    /// End-of-sequence tokens: all a finished grammar allows.
    eos: SimpleVob,
}

impl std::fmt::Debug for Compiled {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Compiled(llguidance grammar)")
    }
}

impl Grammar for Compiled {
    fn start(&self) -> Result<Box<dyn GrammarState>, String> {
        let m = self
            .pristine
            .lock()
            .map_err(|_| "the grammar's lock is poisoned".to_string())?;
        Ok(Box::new(State {
            matcher: m.deep_clone(),
            eos: self.eos.clone(),
        }))
    }
}

/// One generation's place in its grammar.
struct State {
    matcher: Matcher,
    eos: SimpleVob,
}

impl std::fmt::Debug for State {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("State")
            .field("stopped", &self.matcher.is_stopped())
            .finish()
    }
}

impl GrammarState for State {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let computed;
        let allowed = if self.matcher.is_stopped() {
            &self.eos
        } else {
            computed = self.matcher.compute_mask().map_err(|e| one_line(&e.to_string()))?;
            &computed
        };
        if allowed.is_zero() {
            return Err("the grammar allows no token here".into());
        }
        let n = allowed.len().min(logits.len());
        allowed.iter_unset_entries(|i| {
            if i < n {
                logits[i] = f32::NEG_INFINITY;
            }
        });
        for l in logits.iter_mut().skip(n) {
            *l = f32::NEG_INFINITY;
        }
        Ok(())
    }

    fn commit(&mut self, token: u32) -> Result<(), String> {
        if self.matcher.is_stopped() {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(|e| one_line(&e.to_string()))
    }

    fn is_finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}

/// `s` as a Lark string literal (JSON string syntax, which llguidance's Lark accepts).
fn lark_string(s: &str) -> String {
    Value::String(s.to_string()).to_string()
}

/// `&` and `"` escaped as Kimi K3's attribute values are (`&amp;`, `&quot;`).
fn xml_attr(s: &str) -> String {
    s.replace('&', "&amp;").replace('"', "&quot;")
}

/// A schema for `%json`, with deltafin's JSON layout (one line, `", "` and `": "`) unless the
/// schema sets its own `x-guidance` options.
fn json_for_grammar(schema: &Value) -> String {
    let mut s = schema.clone();
    if let Value::Object(o) = &mut s {
        if !o.contains_key("x-guidance") {
            o.insert(
                "x-guidance".into(),
                json!({"whitespace_flexible": false, "item_separator": ", ", "key_separator": ": "}),
            );
        }
    }
    s.to_string()
}

/// The first line of an error message (llguidance's can span several).
fn one_line(s: &str) -> String {
    s.lines().next().unwrap_or(s).trim().to_string()
}

#[cfg(test)]
mod tests {
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    use super::*;
    use crate::tools::{Event, Options, Parser};

    const BOS: &str = "<|bos|>";
    const EOS: &str = "<|eos|>";

    /// A byte-level tokenizer with `specials` as special tokens, and its eos id.
    fn tokenizer(specials: &[&str], template: &str) -> (tempfile::TempDir, Arc<Tokenizer>, u32) {
        let dir = tempfile::tempdir().unwrap();
        let corpus = "{\"city\": \"Paris\", \"days\": 3, \"unit\": \"c\"} functions.get_weather tool_call";
        deltafin_tokenizer::synth::write_byte_level_tokenizer(dir.path(), corpus, 40, specials, BOS, EOS, template)
            .unwrap();
        let tok = Arc::new(Tokenizer::from_dir(dir.path()).unwrap());
        let eos = tok.token_to_id(EOS).unwrap();
        (dir, tok, eos)
    }

    fn weather() -> Value {
        json!({
            "type": "object",
            "properties": {
                "city": {"type": "string", "minLength": 1, "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["c", "f"]},
            },
            "required": ["city", "days", "unit"],
            "additionalProperties": false,
        })
    }

    /// Checks `v` against [`weather`]'s schema (by hand: the schema is fixed).
    fn check_weather(v: &Value) {
        let o = v.as_object().unwrap_or_else(|| panic!("not an object: {v}"));
        assert_eq!(o.len(), 3, "{v}");
        let city = o["city"].as_str().unwrap_or_else(|| panic!("city: {v}"));
        assert!((1..=8).contains(&city.chars().count()), "{v}");
        let days = o["days"].as_i64().unwrap_or_else(|| panic!("days: {v}"));
        assert!((1..=14).contains(&days), "{v}");
        assert!(matches!(o["unit"].as_str(), Some("c" | "f")), "{v}");
    }

    /// Generates with random logits under `grammar` (every allowed token equally likely to be
    /// the argmax): the token ids, ending where the grammar or an end-of-sequence token does.
    fn random_walk(grammar: &Arc<dyn Grammar>, vocab: usize, eos: u32, seed: u64) -> Vec<u32> {
        let mut rng = StdRng::seed_from_u64(seed);
        let mut state = grammar.start().unwrap();
        let mut ids = Vec::new();
        for _ in 0..2000 {
            let mut logits: Vec<f32> = (0..vocab).map(|_| rng.random::<f32>()).collect();
            state.mask(&mut logits).unwrap();
            let id = deltafin_engine::sampler::greedy(&logits);
            assert!(logits[id as usize].is_finite(), "a masked token was chosen");
            if id == eos {
                return ids;
            }
            state.commit(id).unwrap();
            ids.push(id);
            if state.is_finished() {
                return ids;
            }
        }
        panic!("the grammar did not end in 2000 tokens");
    }

    fn calls(events: &[Event]) -> Vec<(String, Value)> {
        let mut out: Vec<(String, String)> = Vec::new();
        for e in events {
            match e {
                Event::ToolCallStart { name, .. } => out.push((name.clone(), String::new())),
                Event::ToolCallArgs { args, .. } => out.last_mut().unwrap().1.push_str(args),
                Event::Content(c) => assert!(c.trim().is_empty(), "content {c:?} beside the calls"),
                Event::Reasoning(r) => assert!(r.is_empty(), "reasoning {r:?} beside the calls"),
                Event::ToolCallEnd { .. } => {}
            }
        }
        out.into_iter()
            .map(|(n, a)| (n, serde_json::from_str(&a).unwrap()))
            .collect()
    }

    /// For each family's markup (special tokens as the real tokenizers have them), a forced
    /// call walked at random through the grammar is read back by the family's own parser as
    /// valid calls of the allowed tools with arguments that follow the schema.
    #[test]
    fn forced_calls_parse_and_validate_in_every_family() {
        let k2 = [
            "<|tool_calls_section_begin|>",
            "<|tool_calls_section_end|>",
            "<|tool_call_begin|>",
            "<|tool_call_end|>",
            "<|tool_call_argument_begin|>",
            "<think>",
            "</think>",
        ];
        let ds = [
            "<｜tool▁calls▁begin｜>",
            "<｜tool▁calls▁end｜>",
            "<｜tool▁call▁begin｜>",
            "<｜tool▁call▁end｜>",
            "<｜tool▁sep｜>",
            "<think>",
            "</think>",
        ];
        let k3 = ["<|open|>", "<|sep|>", "<|close|>", "<|end_of_msg|>"];
        let harmony = [
            "<|start|>",
            "<|channel|>",
            "<|message|>",
            "<|end|>",
            "<|call|>",
            "<|constrain|>",
            "<|return|>",
        ];
        let qwen = ["<tool_call>", "</tool_call>", "<think>", "</think>"];
        let think = ["<think>", "</think>"];
        let cases: Vec<(&str, &[&str], &str, &str)> = vec![
            ("kimi k2", &k2, "", "<|im_assistant|>assistant<|im_middle|>"),
            ("deepseek v3.1", &ds, "", "<｜Assistant｜></think>"),
            ("deepseek v3", &ds, "{{ '```json' }}", "<｜Assistant｜>"),
            ("deepseek, think opened", &ds, "", "<｜Assistant｜><think>"),
            ("kimi k3", &k3, "", "<|open|>assistant<|sep|><|open|>think<|sep|>"),
            ("harmony", &harmony, "", "<|start|>assistant"),
            ("qwen", &qwen, "", "<|im_start|>assistant\n"),
            (
                "think only (hermes fallback)",
                &think,
                "",
                "<|User|>hi<|Assistant|><think>\n",
            ),
            ("no markup (hermes fallback)", &[], "", "<|User|>hi<|Assistant|>"),
        ];
        let tools = json!([
            {"type": "function", "function": {"name": "get_weather", "parameters": weather()}},
            {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}, "additionalProperties": false}}},
        ]);
        for (what, specials, template, tail) in cases {
            let (_dir, tok, eos) = tokenizer(specials, template);
            let family = Family::detect(&tok);
            let vocab = tok.vocab_size() + 3; // padded rows: never allowed
            let s = Structured::new(Arc::clone(&tok), vocab, vec![eos]);
            for (forced, parallel) in [
                (Forced::Named("get_weather".into()), false),
                (Forced::Any, false),
                (Forced::Any, true),
            ] {
                let c = Constraint::ToolCalls {
                    tools: forced_tools(&tools, &forced),
                    parallel,
                };
                let g = s.compile(&c, family, tail).unwrap_or_else(|e| panic!("{what}: {e}"));
                for seed in 0..6 {
                    let ids = random_walk(&g, vocab, eos, seed);
                    let text = tok.decode(&ids, false).unwrap();
                    let opts = Options {
                        tools_enabled: true,
                        tools: Some(tools.clone()),
                        id_prefix: "call_".into(),
                        prompt_tail: tail.into(),
                    };
                    let got = calls(&Parser::parse_all(call_family(family), opts, &text));
                    assert!(!got.is_empty(), "{what} {forced:?}: no call in {text:?}");
                    if !parallel || call_family(family) == Family::Harmony {
                        assert_eq!(got.len(), 1, "{what}: {text:?}");
                    }
                    for (name, args) in &got {
                        match name.as_str() {
                            "get_weather" => check_weather(args),
                            "get_time" => {
                                assert_eq!(forced, Forced::Any, "{what}: {text:?}");
                                assert_eq!(args, &json!({}), "{what}: {text:?}");
                            }
                            other => panic!("{what}: unknown tool {other} in {text:?}"),
                        }
                    }
                }
            }
        }
    }

    /// JSON output (after closing a think block the prompt opened) is content that follows the
    /// schema.
    #[test]
    fn json_output_follows_the_schema() {
        for (specials, tail) in [
            (&["<think>", "</think>"][..], "<|Assistant|><think>\n"),
            (&[][..], "<|Assistant|>"),
        ] {
            let (_dir, tok, eos) = tokenizer(specials, "");
            let family = Family::detect(&tok);
            let s = Structured::new(Arc::clone(&tok), tok.vocab_size(), vec![eos]);
            let g = s.compile(&Constraint::Json(weather()), family, tail).unwrap();
            for seed in 0..6 {
                let ids = random_walk(&g, tok.vocab_size(), eos, seed);
                let text = tok.decode(&ids, false).unwrap();
                let mut content = String::new();
                let events = match family {
                    Some(f) => Parser::parse_all(
                        f,
                        Options {
                            prompt_tail: tail.into(),
                            ..Options::default()
                        },
                        &text,
                    ),
                    None => vec![Event::Content(text.clone())],
                };
                for e in events {
                    match e {
                        Event::Content(c) => content.push_str(&c),
                        Event::Reasoning(r) => assert!(r.trim().is_empty(), "{r:?}"),
                        other => panic!("{other:?}"),
                    }
                }
                check_weather(&serde_json::from_str(&content).unwrap_or_else(|e| panic!("{e}: {text:?}")));
            }
        }
    }

    /// The mask's cost per token at a real vocabulary size: `DELTAFIN_MASK_TOKENIZER` names a
    /// directory with a `tokenizer.json` (bench/NOTES.md says how the 128k one was made).
    /// Prints the one-time vocabulary preparation, the grammar compile, and per generated token
    /// the mask (llguidance's `compute_mask` plus setting the logits) and the commit.
    #[test]
    #[ignore = "a measurement: needs DELTAFIN_MASK_TOKENIZER"]
    fn mask_cost() {
        use std::time::{Duration, Instant};
        let Ok(dir) = std::env::var("DELTAFIN_MASK_TOKENIZER") else {
            panic!("set DELTAFIN_MASK_TOKENIZER to a tokenizer directory");
        };
        let tok = Arc::new(Tokenizer::from_dir(std::path::Path::new(&dir)).unwrap());
        let eos = tok.eos_token_ids().first().copied().unwrap_or(0);
        let vocab = tok.vocab_size();
        let s = Structured::new(Arc::clone(&tok), vocab, vec![eos]);
        let t = Instant::now();
        s.factory().unwrap();
        eprintln!(
            "vocabulary {vocab}: trie and parser factory built in {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let tools = json!([{"type": "function", "function": {"name": "get_weather", "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 200},
                "days": {"type": "integer", "minimum": 1, "maximum": 14},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 40}, "maxItems": 8},
            },
            "required": ["city", "days", "unit", "tags"],
            "additionalProperties": false,
        }}}]);
        let family = Family::detect(&tok);
        let plain = json!({
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "days": {"type": "integer"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["city", "days", "unit", "tags"],
        });
        let cases = [
            ("json_object", Constraint::Json(json!({"type": "object"}))),
            ("json_schema, unbounded strings", Constraint::Json(plain)),
            (
                "json_schema, maxLength strings",
                Constraint::Json(forced_tools(&tools, &Forced::Any)[0].1.clone()),
            ),
            (
                "tool call",
                Constraint::ToolCalls {
                    tools: forced_tools(&tools, &Forced::Any),
                    parallel: false,
                },
            ),
        ];
        for (what, c) in cases {
            let t = Instant::now();
            let g = s.compile(&c, family, "").unwrap();
            let compile = t.elapsed();
            let mut rng = StdRng::seed_from_u64(1);
            let (mut mask, mut commit, mut n, mut worst) = (Duration::ZERO, Duration::ZERO, 0u32, Duration::ZERO);
            let mut logits = vec![0f32; vocab];
            for _ in 0..20 {
                let mut state = g.start().unwrap();
                for _ in 0..400 {
                    logits.iter_mut().for_each(|l| *l = rng.random::<f32>());
                    let t = Instant::now();
                    state.mask(&mut logits).unwrap();
                    let m = t.elapsed();
                    let id = deltafin_engine::sampler::greedy(&logits);
                    if id == eos {
                        break;
                    }
                    let t = Instant::now();
                    state.commit(id).unwrap();
                    commit += t.elapsed();
                    mask += m;
                    worst = worst.max(m);
                    n += 1;
                    if state.is_finished() {
                        break;
                    }
                }
            }
            let us = |d: Duration| d.as_secs_f64() * 1e6 / n as f64;
            eprintln!(
                "{what}: compile {:.1} ms; {n} tokens: mask {:.0} µs/token (worst {:.0} µs), commit {:.0} µs/token",
                compile.as_secs_f64() * 1e3,
                us(mask),
                worst.as_secs_f64() * 1e6,
                us(commit)
            );
        }
    }

    /// Grammar text: special tokens by id, text as literals; a schema llguidance cannot enforce
    /// is an error naming the problem, not a panic.
    #[test]
    fn special_tokens_by_id_and_bad_schemas_are_errors() {
        let (_dir, tok, eos) = tokenizer(&["<|tool_call_begin|>", "<tool_call>"], "");
        let s = Structured::new(Arc::clone(&tok), tok.vocab_size(), vec![eos]);
        let f = s.factory().unwrap();
        let id = tok.token_to_id("<|tool_call_begin|>").unwrap();
        let tc = tok.token_to_id("<tool_call>").unwrap();
        assert_eq!(
            s.lark_text(f, "a<|tool_call_begin|>\"b<tool_call>\n"),
            format!("\"a\" <[{id}]> \"\\\"b\" <[{tc}]> \"\\n\"")
        );
        assert_eq!(s.lark_text(f, "<|not_special|><x"), "\"<|not_special|><x\"");
        let bad = Constraint::Json(json!({"$ref": "https://example.com/schema.json"}));
        let e = s.compile(&bad, None, "").unwrap_err();
        assert!(!e.is_empty() && !e.contains('\n'), "{e}");
        let none = Constraint::ToolCalls {
            tools: Vec::new(),
            parallel: false,
        };
        assert_eq!(s.compile(&none, None, "").unwrap_err(), "no tool to call");
    }
}

//! Tokenizers, chat templates and streaming detokenization for deltafin.
//!
//! Two vocabulary formats are supported, chosen by what the model directory holds:
//! - `tokenizer.json` (Hugging Face `tokenizers`; DeepSeek-V3 and most checkpoints), and
//! - `tiktoken.model` (Kimi K2: `base64(bytes) rank` per line, special tokens after the ranks).
//!
//! `tokenizer_config.json` supplies `bos_token`/`eos_token`, `add_bos_token` and the chat
//! template, which is rendered with minijinja configured to match transformers'
//! `apply_chat_template` (see [`ChatTemplate`]).
//!
//! Golden tests compare against the Python reference (tokenizers, tiktoken, transformers,
//! jinja2); fixtures and the script that makes them live in `tests/fixtures/tokenizer/`.

#![deny(missing_docs)]

mod config;
mod eos;
mod error;
mod stream;
pub mod synth;
mod template;
mod tiktoken;

use std::path::Path;

pub use eos::eos_token_ids_union;
pub use error::TokenizerError;
pub use stream::StreamDecoder;
pub use template::ChatTemplate;
pub use tiktoken::KIMI_K2_PAT_STR;

use config::{field_error, TokenizerConfig};
use tiktoken::TiktokenBackend;

/// The vocabulary implementation behind a [`Tokenizer`].
pub(crate) enum Backend {
    /// `tokenizer.json` through the `tokenizers` crate.
    Hf(Box<tokenizers::Tokenizer>),
    /// Kimi-style `tiktoken.model` through `tiktoken-rs`.
    Tiktoken(Box<TiktokenBackend>),
}

/// A loaded tokenizer: vocabulary, special tokens and (optionally) the chat template.
///
/// `Send + Sync`; share one instance across requests.
pub struct Tokenizer {
    pub(crate) backend: Backend,
    bos_token_id: Option<u32>,
    eos_token_id: Option<u32>,
    /// tiktoken only: prepend BOS in `encode(.., add_special_tokens=true)`.
    add_bos_token: bool,
    chat_template: Option<ChatTemplate>,
}

impl std::fmt::Debug for Tokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kind = match self.backend {
            Backend::Hf(_) => "tokenizer.json",
            Backend::Tiktoken(_) => "tiktoken.model",
        };
        f.debug_struct("Tokenizer")
            .field("backend", &kind)
            .field("vocab_size", &self.vocab_size())
            .field("bos_token_id", &self.bos_token_id)
            .field("eos_token_id", &self.eos_token_id)
            .field("has_chat_template", &self.chat_template.is_some())
            .finish()
    }
}

impl Tokenizer {
    /// Loads from a model directory: `tokenizer.json` (HF `tokenizers`) if present, otherwise
    /// `tiktoken.model` (Kimi format: one `base64(bytes) rank` per line) with special tokens
    /// from `tokenizer_config.json` `added_tokens_decoder` at the ids after the ranks (256
    /// reserved slots, unnamed ones `<|reserved_token_{id}|>`, as `tokenization_kimi.py`) and
    /// the split pattern [`KIMI_K2_PAT_STR`] unless tokenizer_config.json has a `pat_str` key.
    ///
    /// Also reads `tokenizer_config.json` when present: `bos_token`/`eos_token` (string or
    /// `{content: ..}`), `add_bos_token`, `chat_template` (string, or list of `{name, template}`:
    /// `default` else the first). A `chat_template.jinja` file, when present, wins over the
    /// config's template (transformers >= 4.47 saves templates there).
    ///
    /// Errors: [`TokenizerError::NoTokenizerFile`] when neither vocabulary file exists;
    /// [`TokenizerError::TokenizerJson`], [`TokenizerError::TiktokenLine`] or
    /// [`TokenizerError::TiktokenBuild`] for a bad vocabulary; [`TokenizerError::Json`] /
    /// [`TokenizerError::Field`] for a bad `tokenizer_config.json` (including a `bos_token` or
    /// `eos_token` that is not in the vocabulary); [`TokenizerError::TemplateSyntax`] for a chat
    /// template that does not compile.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let config = TokenizerConfig::load(dir)?;
        let json_path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        let backend = if json_path.is_file() {
            let tok = tokenizers::Tokenizer::from_file(&json_path).map_err(|e| TokenizerError::TokenizerJson {
                path: json_path.clone(),
                message: e.to_string(),
            })?;
            Backend::Hf(Box::new(tok))
        } else if tiktoken_path.is_file() {
            let pattern = config.pat_str.as_deref().unwrap_or(KIMI_K2_PAT_STR);
            let tk = TiktokenBackend::load(&tiktoken_path, &config.added_tokens, &config.path, pattern)?;
            Backend::Tiktoken(Box::new(tk))
        } else {
            return Err(TokenizerError::NoTokenizerFile { dir: dir.to_path_buf() });
        };

        let mut tokenizer = Tokenizer {
            backend,
            bos_token_id: None,
            eos_token_id: None,
            add_bos_token: false,
            chat_template: None,
        };
        let resolve = |tok: &Tokenizer, field: &str, token: &Option<String>| match token {
            None => Ok(None),
            Some(t) => tok
                .token_to_id(t)
                .map(Some)
                .ok_or_else(|| field_error(&config.path, field, format!("`{t}` is not in the vocabulary"))),
        };
        tokenizer.bos_token_id = resolve(&tokenizer, "bos_token", &config.bos_token)?;
        tokenizer.eos_token_id = resolve(&tokenizer, "eos_token", &config.eos_token)?;
        tokenizer.add_bos_token = config.add_bos_token.unwrap_or(false);
        if tokenizer.add_bos_token && tokenizer.bos_token_id.is_none() {
            return Err(field_error(
                &config.path,
                "add_bos_token",
                "is true but no bos_token is configured",
            ));
        }
        if let Some(t) = &config.chat_template {
            tokenizer.chat_template = Some(ChatTemplate::with_origin(
                &t.source,
                config.bos_token.clone(),
                config.eos_token.clone(),
                &t.origin,
            )?);
        }
        Ok(tokenizer)
    }

    /// Encodes `text` to ids. Special-token strings appearing in the text are encoded as their
    /// special ids (HF's default; tiktoken with `allowed_special="all"`).
    ///
    /// `add_special_tokens` follows HF: for `tokenizer.json` it applies the post-processor (e.g.
    /// prepends BOS); for tiktoken it prepends BOS when `add_bos_token` is true in
    /// tokenizer_config.json. Pass `false` for text rendered by a chat template that already
    /// contains the BOS string.
    ///
    /// Errors: [`TokenizerError::Encode`] when the backend fails (e.g. regex backtracking limit).
    pub fn encode(&self, text: &str, add_special_tokens: bool) -> Result<Vec<u32>, TokenizerError> {
        match &self.backend {
            Backend::Hf(tok) => tok
                .encode_fast(text, add_special_tokens)
                .map(|enc| enc.get_ids().to_vec())
                .map_err(|e| TokenizerError::Encode { message: e.to_string() }),
            Backend::Tiktoken(tk) => {
                let ids = tk.encode(text)?;
                match self.bos_token_id {
                    Some(bos) if add_special_tokens && self.add_bos_token => {
                        let mut out = Vec::with_capacity(ids.len() + 1);
                        out.push(bos);
                        out.extend(ids);
                        Ok(out)
                    }
                    _ => Ok(ids),
                }
            }
        }
    }

    /// Decodes ids to text; invalid UTF-8 (e.g. a character cut between tokens) becomes U+FFFD.
    /// `skip_special_tokens` drops special tokens (for tiktoken: every id above the ranks).
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`] for an id outside the vocabulary (the HF
    /// library would silently drop it); [`TokenizerError::Decode`] on backend failure.
    pub fn decode(&self, ids: &[u32], skip_special_tokens: bool) -> Result<String, TokenizerError> {
        match &self.backend {
            Backend::Hf(tok) => {
                for &id in ids {
                    self.check_id(id)?;
                }
                tok.decode(ids, skip_special_tokens)
                    .map_err(|e| TokenizerError::Decode { message: e.to_string() })
            }
            Backend::Tiktoken(tk) => tk.decode(ids, skip_special_tokens),
        }
    }

    /// Fails with [`TokenizerError::UnknownTokenId`] unless `id` names a token.
    pub(crate) fn check_id(&self, id: u32) -> Result<(), TokenizerError> {
        let known = match &self.backend {
            Backend::Hf(tok) => tok.id_to_token(id).is_some(),
            Backend::Tiktoken(tk) => (id as usize) < tk.vocab_size(),
        };
        if known {
            Ok(())
        } else {
            Err(TokenizerError::UnknownTokenId {
                id,
                vocab_size: self.vocab_size(),
            })
        }
    }

    /// Number of ids including added/special tokens (HF `len(tokenizer)`; for tiktoken the
    /// ranks plus the 256 reserved special ids).
    pub fn vocab_size(&self) -> usize {
        match &self.backend {
            Backend::Hf(tok) => tok.get_vocab_size(true),
            Backend::Tiktoken(tk) => tk.vocab_size(),
        }
    }

    /// The id of a token string: added/special tokens by content; ordinary tokens in the
    /// vocabulary's own spelling (byte-level `Ġ`-form for `tokenizer.json`, the raw UTF-8 bytes
    /// for tiktoken, found by a linear scan).
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.backend {
            Backend::Hf(tok) => tok.token_to_id(token),
            Backend::Tiktoken(tk) => tk.token_to_id(token),
        }
    }

    /// The id of tokenizer_config.json's `bos_token`, if configured.
    pub fn bos_token_id(&self) -> Option<u32> {
        self.bos_token_id
    }

    /// The eos id(s) named by tokenizer_config.json (`eos_token`) — may be empty. See
    /// [`eos_token_ids_union`] for the full stop set of a model directory.
    pub fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_id.into_iter().collect()
    }

    /// The chat template from tokenizer_config.json / chat_template.jinja, if any.
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// A streaming decoder that emits valid UTF-8 text as ids arrive, holding back a multi-byte
    /// character split across tokens; `decode(all ids)` equals the concatenation of all
    /// [`StreamDecoder::push`] results plus [`StreamDecoder::finish`].
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn public_types_are_send_sync() {
        fn assert_send_sync<T: Send + Sync>() {}
        assert_send_sync::<super::Tokenizer>();
        assert_send_sync::<super::ChatTemplate>();
        assert_send_sync::<super::TokenizerError>();
    }
}

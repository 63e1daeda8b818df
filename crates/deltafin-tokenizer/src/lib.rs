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

pub use eos::{eos_token_ids_of_configs, eos_token_ids_union};
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
    /// The chat template's compile error, kept so that plain-text use still works.
    chat_template_error: Option<TokenizerError>,
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
    /// `eos_token` that is not in the vocabulary). A chat template that does not compile is not
    /// an error here: [`Tokenizer::chat_template_error`] holds it.
    pub fn from_dir(dir: &Path) -> Result<Self, TokenizerError> {
        let config = TokenizerConfig::load(dir)?;
        let json_path = dir.join("tokenizer.json");
        let tiktoken_path = dir.join("tiktoken.model");
        // `exists` (not `is_file`): a FIFO or directory in place of a vocabulary file is an
        // error naming it (from `deltafin_fs`), not a missing tokenizer.
        let backend = if json_path.exists() {
            let bytes = deltafin_fs::read(&json_path).map_err(|source| TokenizerError::Io {
                path: json_path.clone(),
                source,
            })?;
            let tok = tokenizers::Tokenizer::from_bytes(&bytes).map_err(|e| TokenizerError::TokenizerJson {
                path: json_path.clone(),
                message: e.to_string(),
            })?;
            Backend::Hf(Box::new(tok))
        } else if tiktoken_path.exists() {
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
            chat_template_error: None,
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
            match ChatTemplate::with_origin(&t.source, config.bos_token.clone(), config.eos_token.clone(), &t.origin) {
                Ok(tpl) => tokenizer.chat_template = Some(tpl),
                Err(e) => tokenizer.chat_template_error = Some(e),
            }
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

    /// The exact bytes of one token id, without the lossy UTF-8 conversion of [`decode`]: a
    /// byte-level token holding part of a multi-byte character (e.g. the first byte of `é`,
    /// `[0xC3]`) gives that byte, not U+FFFD. Concatenating the bytes of consecutive tokens
    /// rebuilds characters split across them; OpenAI's logprobs `bytes` field is this.
    ///
    /// For `tiktoken.model` these are the token's bytes (a special token's: its UTF-8 name).
    /// For `tokenizer.json` it is `decode(&[id], false)` when that decodes losslessly (no
    /// U+FFFD); otherwise the token's spelling run through the decoder with the byte-producing
    /// steps kept as bytes: `ByteLevel` maps each character back through GPT-2's byte-to-unicode
    /// table (openai/gpt-2 `encoder.py` `bytes_to_unicode`, as `tokenizers`'
    /// `decoders::ByteLevel`), `ByteFallback` turns `<0xNN>` into byte `NN` (as `tokenizers`'
    /// `decoders::ByteFallback`); string-level steps (`Replace`, `Strip`, `Metaspace`, ...) apply
    /// to text pieces as in [`decode`] and leave raw bytes alone. Should that not explain the
    /// U+FFFD (a token literally spelled with U+FFFD), the lossy text's UTF-8 is returned.
    /// Either way `String::from_utf8_lossy(&token_bytes(id)) == decode(&[id], false)`.
    ///
    /// Errors: [`TokenizerError::UnknownTokenId`] for an id outside the vocabulary;
    /// [`TokenizerError::Decode`] on backend failure.
    ///
    /// [`decode`]: Tokenizer::decode
    pub fn token_bytes(&self, id: u32) -> Result<Vec<u8>, TokenizerError> {
        match &self.backend {
            Backend::Tiktoken(tk) => Ok(tk.piece(id, false)?.unwrap_or_default().to_vec()),
            Backend::Hf(tok) => {
                let text = self.decode(&[id], false)?;
                if !text.contains('\u{FFFD}') {
                    return Ok(text.into_bytes());
                }
                let (Some(spelling), Some(decoder)) = (tok.id_to_token(id), tok.get_decoder()) else {
                    return Ok(text.into_bytes());
                };
                let raw = raw_decode(decoder, spelling)?;
                if String::from_utf8_lossy(&raw) == text {
                    Ok(raw)
                } else {
                    Ok(text.into_bytes())
                }
            }
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

    /// The chat template from tokenizer_config.json / chat_template.jinja, if any (`None` also
    /// when it does not compile: see [`Tokenizer::chat_template_error`]).
    pub fn chat_template(&self) -> Option<&ChatTemplate> {
        self.chat_template.as_ref()
    }

    /// Why the model's chat template is unusable: [`TokenizerError::TemplateSyntax`] when it
    /// does not compile. Loading does not fail for it, so a model whose template is broken still
    /// tokenizes plain text; whatever needs the template reports this error.
    pub fn chat_template_error(&self) -> Option<&TokenizerError> {
        self.chat_template_error.as_ref()
    }

    /// A streaming decoder that emits valid UTF-8 text as ids arrive, holding back a multi-byte
    /// character split across tokens; `decode(all ids)` equals the concatenation of all
    /// [`StreamDecoder::push`] results plus [`StreamDecoder::finish`].
    pub fn stream_decoder(&self, skip_special_tokens: bool) -> StreamDecoder<'_> {
        StreamDecoder::new(self, skip_special_tokens)
    }
}

/// One token's piece while [`raw_decode`] runs the decoder chain: text, or bytes that are not
/// valid UTF-8 (left alone by later string-level steps).
enum Piece {
    Text(String),
    Bytes(Vec<u8>),
}

impl Piece {
    fn from_bytes(b: Vec<u8>) -> Piece {
        match String::from_utf8(b) {
            Ok(s) => Piece::Text(s),
            Err(e) => Piece::Bytes(e.into_bytes()),
        }
    }
}

/// Runs the single-token `spelling` through `decoder` keeping bytes exact (see
/// [`Tokenizer::token_bytes`]).
fn raw_decode(decoder: &tokenizers::DecoderWrapper, spelling: String) -> Result<Vec<u8>, TokenizerError> {
    use tokenizers::{Decoder, DecoderWrapper};
    fn step(d: &DecoderWrapper, piece: Piece) -> Result<Piece, TokenizerError> {
        let Piece::Text(t) = piece else {
            return Ok(piece);
        };
        Ok(match d {
            DecoderWrapper::Sequence(seq) => {
                let mut p = Piece::Text(t);
                for d in seq.get_decoders() {
                    p = step(d, p)?;
                }
                p
            }
            DecoderWrapper::ByteLevel(_) => {
                let table = synth::byte_to_char();
                let bytes: Option<Vec<u8>> = t
                    .chars()
                    .map(|c| table.iter().position(|&x| x == c).map(|b| b as u8))
                    .collect();
                // As tokenizers: a token with a character outside the table stays as spelled.
                Piece::from_bytes(bytes.unwrap_or_else(|| t.into_bytes()))
            }
            DecoderWrapper::ByteFallback(_) => {
                let byte = (t.len() == 6 && t.starts_with("<0x") && t.ends_with('>'))
                    .then(|| u8::from_str_radix(&t[3..5], 16).ok())
                    .flatten();
                match byte {
                    Some(b) => Piece::from_bytes(vec![b]),
                    None => Piece::Text(t),
                }
            }
            other => Piece::Text(
                other
                    .decode_chain(vec![t])
                    .map_err(|e| TokenizerError::Decode { message: e.to_string() })?
                    .concat(),
            ),
        })
    }
    Ok(match step(decoder, Piece::Text(spelling))? {
        Piece::Text(t) => t.into_bytes(),
        Piece::Bytes(b) => b,
    })
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

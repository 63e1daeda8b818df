//! The tokenizer domain's error type.

use std::path::PathBuf;

/// Everything that can go wrong loading a tokenizer, encoding, decoding or rendering a chat
/// template. Load-time variants name the file (and line or field) that is wrong.
#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    /// A file could not be read (or, for the synthetic tokenizer, written).
    #[error("{path}: {source}")]
    Io {
        /// The file that failed.
        path: PathBuf,
        /// The underlying I/O error.
        #[source]
        source: std::io::Error,
    },

    /// A JSON file is not valid JSON.
    #[error("malformed JSON in {path}: {source}")]
    Json {
        /// The file that failed to parse.
        path: PathBuf,
        /// The parser's error (with line and column).
        #[source]
        source: serde_json::Error,
    },

    /// A JSON field has the wrong type or an unusable value.
    #[error("{path}: field `{field}` {message}")]
    Field {
        /// The file holding the field.
        path: PathBuf,
        /// Dotted path of the field, e.g. `text_config.eos_token_id`.
        field: String,
        /// What is wrong with it.
        message: String,
    },

    /// The model directory has neither `tokenizer.json` nor `tiktoken.model`.
    #[error("no tokenizer in {dir}: expected tokenizer.json or tiktoken.model")]
    NoTokenizerFile {
        /// The directory searched.
        dir: PathBuf,
    },

    /// The `tokenizers` crate rejected `tokenizer.json`.
    #[error("cannot load {path}: {message}")]
    TokenizerJson {
        /// The `tokenizer.json` path.
        path: PathBuf,
        /// The `tokenizers` crate's message.
        message: String,
    },

    /// A line of a tiktoken vocabulary (`base64(bytes) rank`) is malformed.
    #[error("{path}:{line}: {message}")]
    TiktokenLine {
        /// The `tiktoken.model` path.
        path: PathBuf,
        /// 1-based line number.
        line: usize,
        /// What is wrong with the line.
        message: String,
    },

    /// The tiktoken split pattern or special-token set could not be compiled.
    #[error("cannot build tiktoken encoder from {path}: {message}")]
    TiktokenBuild {
        /// The `tiktoken.model` path.
        path: PathBuf,
        /// The cause (e.g. regex compile error).
        message: String,
    },

    /// Encoding text failed (e.g. a regex backtracking limit was hit).
    #[error("encode failed: {message}")]
    Encode {
        /// The backend's message.
        message: String,
    },

    /// Decoding failed inside the backend.
    #[error("decode failed: {message}")]
    Decode {
        /// The backend's message.
        message: String,
    },

    /// A token id is outside the vocabulary (including added/special tokens).
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    UnknownTokenId {
        /// The offending id.
        id: u32,
        /// The vocabulary size it was checked against.
        vocab_size: usize,
    },

    /// A chat template does not compile.
    #[error("chat template `{name}` does not compile: {message}")]
    TemplateSyntax {
        /// Where the template came from (file name or `<string>`).
        name: String,
        /// minijinja's message with location.
        message: String,
    },

    /// Rendering a chat template failed for a reason other than `raise_exception`.
    #[error("chat template render failed: {message}")]
    TemplateRender {
        /// minijinja's message with location.
        message: String,
    },

    /// The template itself rejected the request through `raise_exception(message)`, e.g. an
    /// unsupported role. The message is the template's, unchanged; treat it as a client error.
    #[error("chat template rejected the conversation: {message}")]
    TemplateException {
        /// The message passed to `raise_exception`.
        message: String,
    },

    /// The render request itself is malformed (e.g. `extra` is not an object).
    #[error("chat template input: {message}")]
    TemplateInput {
        /// What is wrong.
        message: String,
    },

    /// Writing a synthetic tokenizer failed.
    #[error("cannot write synthetic tokenizer {path}: {message}")]
    Synth {
        /// The file being written.
        path: PathBuf,
        /// The cause.
        message: String,
    },
}

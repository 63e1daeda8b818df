//! Load-path errors name the file (and line or field) that is wrong; nothing panics.

use std::path::{Path, PathBuf};

use deltafin_tokenizer::{eos_token_ids_union, Tokenizer, TokenizerError};

fn fixture_dir(dir: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer")
        .join(dir)
}

/// Copies a fixture directory into a temp dir so a test can break one file.
fn copy_fixture(dir: &str) -> tempfile::TempDir {
    let tmp = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture_dir(dir)).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), tmp.path().join(entry.file_name())).unwrap();
    }
    tmp
}

fn write(dir: &Path, name: &str, text: &str) {
    std::fs::write(dir.join(name), text).unwrap();
}

/// The load error of the `hf_bpe` fixture with its file `name` replaced by `text`.
fn hf_bpe_error_with(name: &str, text: &str) -> TokenizerError {
    let tmp = copy_fixture("hf_bpe");
    write(tmp.path(), name, text);
    Tokenizer::from_dir(tmp.path()).unwrap_err()
}

#[test]
fn empty_dir_has_no_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::NoTokenizerFile { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json or tiktoken.model"), "{err}");
}

#[test]
fn missing_dir_is_an_error_not_a_panic() {
    let err = Tokenizer::from_dir(Path::new("/nonexistent/deltafin/model")).unwrap_err();
    assert!(matches!(err, TokenizerError::NoTokenizerFile { .. }), "{err}");
}

#[test]
fn tokenizer_config_is_optional() {
    let tmp = copy_fixture("hf_bpe");
    std::fs::remove_file(tmp.path().join("tokenizer_config.json")).unwrap();
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.bos_token_id(), None);
    assert!(tok.eos_token_ids().is_empty());
    assert!(tok.chat_template().is_none());
    // The post-processor still adds BOS: HF semantics follow tokenizer.json.
    assert_eq!(tok.encode("hi", true).unwrap()[0], tok.token_to_id("<|bos|>").unwrap());
}

#[test]
fn malformed_tokenizer_json_names_the_file() {
    let err = hf_bpe_error_with("tokenizer.json", "{\"model\": ");
    assert!(matches!(err, TokenizerError::TokenizerJson { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer.json"), "{err}");
}

#[test]
fn malformed_tokenizer_config_names_the_file() {
    let err = hf_bpe_error_with("tokenizer_config.json", "{\"bos_token\": \"<|bos|>\",,}");
    assert!(matches!(err, TokenizerError::Json { .. }), "{err}");
    assert!(err.to_string().contains("tokenizer_config.json"), "{err}");
}

#[test]
fn wrong_field_types_name_the_field() {
    let cases = [
        (r#"{"bos_token": 5}"#, "bos_token"),
        (r#"{"eos_token": {"text": "x"}}"#, "eos_token.content"),
        (r#"{"add_bos_token": "yes"}"#, "add_bos_token"),
        (r#"{"chat_template": 3}"#, "chat_template"),
        (r#"{"chat_template": [{"name": "default"}]}"#, "chat_template[0]"),
        (r#"{"eos_token": "<|not-in-vocab|>"}"#, "eos_token"),
        (r#"{"add_bos_token": true}"#, "add_bos_token"),
    ];
    for (json, field) in cases {
        let err = hf_bpe_error_with("tokenizer_config.json", json);
        match &err {
            TokenizerError::Field { field: f, path, .. } => {
                assert_eq!(f, field, "{json}");
                assert!(path.ends_with("tokenizer_config.json"));
            }
            other => panic!("{json}: expected Field error, got {other}"),
        }
    }
}

#[test]
fn bad_chat_template_is_a_syntax_error_naming_the_source() {
    let tmp = copy_fixture("hf_bpe");
    write(tmp.path(), "tokenizer_config.json", r#"{"chat_template": "{% if %}"}"#);
    // Loading still works (plain text needs no template); the template's error is kept.
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert!(tok.chat_template().is_none());
    assert!(!tok.encode("hi", false).unwrap().is_empty());
    let err = tok.chat_template_error().expect("the syntax error");
    // One line, with the position, not a dump of the template.
    let text = err.to_string();
    assert_eq!(text.lines().count(), 1, "{text}");
    assert!(text.contains("chat_template:1"), "{text}");
    match err {
        TokenizerError::TemplateSyntax { name, .. } => {
            assert_eq!(name, "tokenizer_config.json:chat_template")
        }
        other => panic!("{other}"),
    }
}

#[test]
fn chat_template_list_prefers_default_and_jinja_file_wins() {
    let tmp = copy_fixture("hf_bpe");
    write(
        tmp.path(),
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]}"#,
    );
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    let render = |t: &Tokenizer| {
        t.chat_template()
            .unwrap()
            .render(&[], false, &serde_json::Value::Null)
            .unwrap()
    };
    assert_eq!(render(&tok), "D");
    write(
        tmp.path(),
        "tokenizer_config.json",
        r#"{"chat_template": [{"name": "a", "template": "A"}, {"name": "b", "template": "B"}]}"#,
    );
    assert_eq!(render(&Tokenizer::from_dir(tmp.path()).unwrap()), "A");
    write(tmp.path(), "chat_template.jinja", "J{{ bos_token }}");
    write(
        tmp.path(),
        "tokenizer_config.json",
        r#"{"bos_token": "<|bos|>", "chat_template": "C"}"#,
    );
    assert_eq!(render(&Tokenizer::from_dir(tmp.path()).unwrap()), "J<|bos|>");
}

#[test]
fn bad_base64_line_names_file_and_line() {
    let tmp = copy_fixture("kimi_tiktoken");
    let path = tmp.path().join("tiktoken.model");
    let text = std::fs::read_to_string(&path).unwrap();
    let mut lines: Vec<&str> = text.lines().collect();
    lines[41] = "!!!not*base64 41";
    write(tmp.path(), "tiktoken.model", &lines.join("\n"));
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    match &err {
        TokenizerError::TiktokenLine { path, line, message } => {
            assert!(path.ends_with("tiktoken.model"));
            assert_eq!(*line, 42);
            assert!(message.contains("base64"), "{message}");
        }
        other => panic!("expected TiktokenLine, got {other}"),
    }
    assert!(err.to_string().contains("tiktoken.model:42:"), "{err}");
}

#[test]
fn other_bad_tiktoken_lines() {
    let cases = [
        ("IQ== 0\nIg==\n", 2, "expected"),
        ("IQ== 0\nIg== x\n", 2, "invalid rank"),
        ("IQ== 0\nIg== 0\n", 2, "duplicate rank"),
        ("IQ== 0\nIQ== 1\n", 2, "duplicate token"),
        ("IQ== 0\nIg== 1 extra\n", 2, "exactly two"),
        ("IQ== 0\n\nIg== 5\n", 3, "not below"),
    ];
    for (content, line_no, needle) in cases {
        let tmp = tempfile::tempdir().unwrap();
        write(tmp.path(), "tiktoken.model", content);
        let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
        match &err {
            TokenizerError::TiktokenLine { line, message, .. } => {
                assert_eq!(*line, line_no, "{content:?}: {err}");
                assert!(message.contains(needle), "{content:?}: {message}");
            }
            other => panic!("{content:?}: expected TiktokenLine, got {other}"),
        }
    }
}

#[test]
fn tiktoken_added_token_inside_ranks_is_a_field_error() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "tiktoken.model", "IQ== 0\nIg== 1\n");
    write(
        tmp.path(),
        "tokenizer_config.json",
        r#"{"added_tokens_decoder": {"1": {"content": "[BOS]"}}}"#,
    );
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Field { field, .. } if field == "added_tokens_decoder.1"),
        "{err}"
    );
    write(
        tmp.path(),
        "tokenizer_config.json",
        r#"{"added_tokens_decoder": {"two": {"content": "[BOS]"}}}"#,
    );
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Field { field, .. } if field == "added_tokens_decoder.two"),
        "{err}"
    );
}

#[test]
fn bad_pat_str_is_a_build_error() {
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "tiktoken.model", "IQ== 0\n");
    write(tmp.path(), "tokenizer_config.json", r#"{"pat_str": "([a-z"}"#);
    let err = Tokenizer::from_dir(tmp.path()).unwrap_err();
    assert!(matches!(err, TokenizerError::TiktokenBuild { .. }), "{err}");
}

#[test]
fn tiny_tiktoken_with_pat_str_override() {
    // Ranks for "a", "b", "ab"; the override splits every character apart so "ab" never merges.
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "tiktoken.model", "YQ== 0\nYg== 1\nYWI= 2\n");
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.encode("ab", true).unwrap(), [2]);
    assert_eq!(tok.vocab_size(), 3 + 256);
    assert_eq!(tok.token_to_id("<|reserved_token_3|>"), Some(3));
    assert_eq!(tok.decode(&[3, 0], true).unwrap(), "a");
    write(tmp.path(), "tokenizer_config.json", r#"{"pat_str": "."}"#);
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.encode("ab", true).unwrap(), [0, 1]);
}

#[test]
fn decode_rejects_out_of_vocab_ids() {
    for dir in ["hf_bpe", "kimi_tiktoken"] {
        let tok = Tokenizer::from_dir(&fixture_dir(dir)).unwrap();
        let bad = tok.vocab_size() as u32;
        let err = tok.decode(&[0, bad], false).unwrap_err();
        assert!(
            matches!(err, TokenizerError::UnknownTokenId { id, .. } if id == bad),
            "{dir}: {err}"
        );
    }
}

#[test]
fn eos_union_errors_name_the_file_and_field() {
    let tok = Tokenizer::from_dir(&fixture_dir("hf_bpe")).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    write(tmp.path(), "generation_config.json", "{not json");
    let err = eos_token_ids_union(tmp.path(), &tok).unwrap_err();
    assert!(
        matches!(err, TokenizerError::Json { ref path, .. } if path.ends_with("generation_config.json")),
        "{err}"
    );
    write(tmp.path(), "generation_config.json", r#"{"eos_token_id": [1, "x"]}"#);
    let err = eos_token_ids_union(tmp.path(), &tok).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Field { field, .. } if field == "eos_token_id[1]"),
        "{err}"
    );
    write(tmp.path(), "generation_config.json", "{}");
    write(tmp.path(), "config.json", r#"{"text_config": {"eos_token_id": -1}}"#);
    let err = eos_token_ids_union(tmp.path(), &tok).unwrap_err();
    assert!(
        matches!(&err, TokenizerError::Field { field, path, .. } if field == "text_config.eos_token_id" && path.ends_with("config.json")),
        "{err}"
    );
}

//! `Tokenizer::token_bytes`: the exact bytes of one token, where `decode` is lossy.

use deltafin_tokenizer::Tokenizer;

mod common;
use common::{fixture, gpt2_char};

/// Single-byte tokens give their byte, also the 128 that are not valid UTF-8 alone (decode
/// gives U+FFFD for those); every token's bytes decode lossily to `decode([id])`; and the bytes
/// of an encoding's tokens concatenate to the text's UTF-8.
#[test]
fn byte_tokens_give_their_byte_and_tokens_concatenate_to_the_text() {
    for dir in ["hf_bpe", "kimi_tiktoken"] {
        let tok = fixture(dir);
        for b in 0..=255u8 {
            let id = match dir {
                "hf_bpe" => tok.token_to_id(&gpt2_char(b).to_string()).expect("byte token"),
                // The tiktoken fixture's ranks 0..256 are the bytes in order.
                _ => u32::from(b),
            };
            assert_eq!(tok.token_bytes(id).unwrap(), vec![b], "{dir}: byte {b:#04x}");
            if b >= 0x80 {
                assert_eq!(tok.decode(&[id], false).unwrap(), "\u{FFFD}", "{dir}: byte {b:#04x}");
            }
        }
        for id in 0..tok.vocab_size() as u32 {
            let bytes = tok.token_bytes(id).unwrap();
            assert_eq!(
                String::from_utf8_lossy(&bytes),
                tok.decode(&[id], false).unwrap(),
                "{dir}: id {id}"
            );
        }
        let text = "héllo ☃ 日本語 🎉 naïve";
        let ids = tok.encode(text, false).unwrap();
        let joined: Vec<u8> = ids.iter().flat_map(|&id| tok.token_bytes(id).unwrap()).collect();
        assert_eq!(joined, tok.decode(&ids, false).unwrap().into_bytes(), "{dir}");
        assert!(String::from_utf8(joined).unwrap().contains(text), "{dir}");
        assert!(tok.token_bytes(tok.vocab_size() as u32).is_err(), "{dir}");
    }
}

/// A sentencepiece-style `tokenizer.json` (`<0xNN>` byte-fallback tokens behind Replace,
/// ByteFallback, Fuse, Strip, as Llama/Mixtral ship): a byte token gives its byte.
#[test]
fn byte_fallback_tokens_give_their_byte() {
    let dir = tempfile::tempdir().unwrap();
    let json = r#"{
      "version": "1.0", "truncation": null, "padding": null, "added_tokens": [],
      "normalizer": null, "pre_tokenizer": null, "post_processor": null,
      "decoder": {"type": "Sequence", "decoders": [
        {"type": "Replace", "pattern": {"String": "▁"}, "content": " "},
        {"type": "ByteFallback"},
        {"type": "Fuse"},
        {"type": "Strip", "content": " ", "start": 1, "stop": 0}
      ]},
      "model": {"type": "BPE", "dropout": null, "unk_token": null,
        "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
        "byte_fallback": true,
        "vocab": {"<0xE2>": 0, "<0x82>": 1, "<0xAC>": 2, "▁a": 3, "b": 4},
        "merges": []}
    }"#;
    std::fs::write(dir.path().join("tokenizer.json"), json).unwrap();
    let tok = Tokenizer::from_dir(dir.path()).unwrap();
    assert_eq!(tok.decode(&[0], false).unwrap(), "\u{FFFD}");
    assert_eq!(tok.token_bytes(0).unwrap(), vec![0xE2]);
    assert_eq!(tok.token_bytes(1).unwrap(), vec![0x82]);
    assert_eq!(tok.token_bytes(2).unwrap(), vec![0xAC]);
    assert_eq!(tok.decode(&[0, 1, 2], false).unwrap(), "€");
    // Text tokens are what decode gives (here Strip removes the leading space of the first).
    assert_eq!(
        tok.token_bytes(3).unwrap(),
        tok.decode(&[3], false).unwrap().into_bytes()
    );
    assert_eq!(tok.token_bytes(4).unwrap(), b"b".to_vec());
}

//! Helpers shared by the tokenizer's integration tests.

// Each test file uses a subset of them.
#![allow(dead_code)]

use std::path::PathBuf;

use deltafin_tokenizer::Tokenizer;

/// The tokenizer fixture `dir` under tests/fixtures/tokenizer.
pub fn fixture(dir: &str) -> Tokenizer {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/tokenizer")
        .join(dir);
    Tokenizer::from_dir(&path).expect("load fixture")
}

/// GPT-2 byte-to-unicode table (how tokenizer.json spells byte tokens), written out here
/// independently of the crate's.
pub fn gpt2_char(b: u8) -> char {
    let mut next = 256u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        let code = if printable {
            u32::from(x)
        } else {
            next += 1;
            next - 1
        };
        if x == b {
            return char::from_u32(code).unwrap();
        }
    }
    unreachable!()
}

/// A list of token ids in an expected-output JSON file.
pub fn ids(v: &serde_json::Value) -> Vec<u32> {
    v.as_array()
        .unwrap_or_else(|| panic!("ids array: {v}"))
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

/// Asserts that `tok` gives every token of `expected` (an expected-output JSON object, token →
/// id) its id; `what` labels a failure.
pub fn assert_token_ids(tok: &Tokenizer, expected: &serde_json::Map<String, serde_json::Value>, what: &str) {
    for (token, id) in expected {
        assert_eq!(
            tok.token_to_id(token).map(u64::from),
            id.as_u64(),
            "{what} token_to_id({token:?})"
        );
    }
}

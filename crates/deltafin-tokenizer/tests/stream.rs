//! StreamDecoder property tests: concatenated pushes + finish == decode(all ids).

use deltafin_tokenizer::Tokenizer;
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

mod common;
use common::{fixture, gpt2_char};

/// The single-byte token id of every byte. The tiktoken fixture's ranks 0..256 are the bytes in
/// order (see make_tokenizer_fixtures.py `kimi_ranks_from`).
fn byte_ids(tok: &Tokenizer, dir: &str) -> Vec<u32> {
    (0..=255u8)
        .map(|b| match dir {
            "hf_bpe" => tok.token_to_id(&gpt2_char(b).to_string()).expect("byte token"),
            _ => u32::from(b),
        })
        .collect()
}

/// Streams `ids`, checks the invariant, returns the chunks (last one from finish()).
fn check_stream(tok: &Tokenizer, ids: &[u32], skip: bool) -> Vec<String> {
    let want = tok.decode(ids, skip).unwrap();
    let mut dec = tok.stream_decoder(skip);
    let mut chunks = Vec::with_capacity(ids.len() + 1);
    for &id in ids {
        chunks.push(dec.push(id).unwrap());
    }
    chunks.push(dec.finish().unwrap());
    assert_eq!(chunks.concat(), want, "ids {ids:?} skip={skip}");
    if !want.contains('\u{FFFD}') {
        assert!(
            chunks.iter().all(|c| !c.contains('\u{FFFD}')),
            "spurious U+FFFD in {chunks:?}"
        );
    }
    chunks
}

/// Random id sequences: uniform over the vocabulary (specials included), perturbed encodings of
/// multilingual text, and shuffled single-byte tokens of multi-byte characters.
fn random_sequences(dir: &str, seed: u64) {
    let tok = fixture(dir);
    let bytes = byte_ids(&tok, dir);
    let mut rng = StdRng::seed_from_u64(seed);
    let vocab = tok.vocab_size() as u32;
    let texts = [
        "héllo 世界 🙂",
        "我们今天讨论混合专家模型",
        "👩\u{200d}💻 naïve",
        "plain ascii text",
    ];
    let multibyte: Vec<u32> = "é世🙂💻".bytes().map(|b| bytes[b as usize]).collect();
    for round in 0..600 {
        let len = rng.random_range(0..40);
        let ids: Vec<u32> = match round % 3 {
            0 => (0..len).map(|_| rng.random_range(0..vocab)).collect(),
            1 => {
                let text = texts[rng.random_range(0..texts.len())];
                let mut ids = tok.encode(text, round % 2 == 0).unwrap();
                for _ in 0..rng.random_range(0..4) {
                    if !ids.is_empty() {
                        let i = rng.random_range(0..ids.len());
                        ids.remove(i);
                    }
                }
                ids
            }
            _ => (0..len)
                .map(|_| multibyte[rng.random_range(0..multibyte.len())])
                .collect(),
        };
        for skip in [false, true] {
            check_stream(&tok, &ids, skip);
        }
    }
}

#[test]
fn stream_matches_decode_hf() {
    random_sequences("hf_bpe", 7);
}

#[test]
fn stream_matches_decode_tiktoken() {
    random_sequences("kimi_tiktoken", 11);
}

#[test]
fn stream_holds_back_split_characters() {
    for dir in ["hf_bpe", "kimi_tiktoken"] {
        let tok = fixture(dir);
        let bytes = byte_ids(&tok, dir);
        let ids: Vec<u32> = "a🙂b".bytes().map(|b| bytes[b as usize]).collect();
        assert_eq!(tok.decode(&ids, false).unwrap(), "a🙂b", "{dir}");
        let chunks = check_stream(&tok, &ids, false);
        assert_eq!(chunks, ["a", "", "", "", "🙂", "b", ""], "{dir}");
        // Cut off mid-character: finish() flushes U+FFFD exactly like decode().
        let chunks = check_stream(&tok, &ids[..3], false);
        assert_eq!(chunks.concat(), "a\u{FFFD}", "{dir}");
        // A special token between the bytes of a character breaks it, as in decode().
        let bos = tok.bos_token_id().unwrap();
        let ids = [bytes[0xF0], bos, bytes[0x9F], bytes[b'x' as usize]];
        let chunks = check_stream(&tok, &ids, false);
        assert!(chunks.concat().starts_with('\u{FFFD}'), "{dir}: {chunks:?}");
        check_stream(&tok, &ids, true);
    }
}

#[test]
fn stream_rejects_unknown_ids_and_stays_usable() {
    for dir in ["hf_bpe", "kimi_tiktoken"] {
        let tok = fixture(dir);
        let mut dec = tok.stream_decoder(false);
        assert!(dec.push(tok.vocab_size() as u32 + 5).is_err(), "{dir}");
        let mut out = String::new();
        for id in tok.encode("ok 世界", false).unwrap() {
            out += &dec.push(id).unwrap();
        }
        out += &dec.finish().unwrap();
        assert_eq!(out, "ok 世界", "{dir}");
    }
}

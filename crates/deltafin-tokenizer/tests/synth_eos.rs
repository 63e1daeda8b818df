//! synth::write_byte_level_tokenizer and eos_token_ids_union.

use std::path::PathBuf;

use deltafin_tokenizer::{eos_token_ids_union, synth, Tokenizer};

/// Merges requested; the corpus has more distinct repeated pairs than this.
const M: u32 = 32;

const TEMPLATE: &str = "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{{ eos_token }}{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}";

fn corpus() -> String {
    "the expert router sends the token to the top experts; the experts answer. 专家模型 专家 🙂\n".repeat(20)
}

#[test]
fn synth_tokenizer_round_trips_and_merges() {
    let tmp = tempfile::tempdir().unwrap();
    let specials = ["<|bos|>", "<|eos|>", "<|user|>", "<|assistant|>"];
    let n = synth::write_byte_level_tokenizer(
        tmp.path(),
        &corpus(),
        M as usize,
        &specials,
        "<|bos|>",
        "<|eos|>",
        TEMPLATE,
    )
    .unwrap();
    assert_eq!(n, (256 + M) as usize + specials.len());
    let tok = Tokenizer::from_dir(tmp.path()).unwrap();
    assert_eq!(tok.vocab_size(), n);
    // Ids 0..256 are the bytes in order (GPT-2 spelling), specials follow the merges.
    assert_eq!(tok.token_to_id("!"), Some(u32::from(b'!')));
    assert_eq!(tok.token_to_id("Ġ"), Some(u32::from(b' ')));
    assert_eq!(tok.token_to_id("<|bos|>"), Some(256 + M));
    assert_eq!(tok.bos_token_id(), Some(256 + M));
    assert_eq!(tok.eos_token_ids(), vec![256 + M + 1]);

    // Merges learned from the corpus shorten it well below one id per byte.
    let text = "the experts answer";
    let ids = tok.encode(text, false).unwrap();
    assert!(ids.len() < text.len() / 2, "{ids:?}");
    assert_eq!(tok.decode(&ids, false).unwrap(), text);
    // Post-processor prepends BOS; decode skips it on request.
    let ids = tok.encode("héllo 世界 🙂 <|user|>x", true).unwrap();
    assert_eq!(ids[0], 256 + M);
    assert!(ids.contains(&(256 + M + 2)));
    assert_eq!(tok.decode(&ids, true).unwrap(), "héllo 世界 🙂 x");
    assert_eq!(tok.decode(&ids, false).unwrap(), "<|bos|>héllo 世界 🙂 <|user|>x");

    let tpl = tok.chat_template().unwrap();
    let msgs = [serde_json::json!({"role": "user", "content": "hi"})];
    assert_eq!(
        tpl.render(&msgs, true, &serde_json::Value::Null).unwrap(),
        "<|bos|><|user|>hi<|eos|><|assistant|>"
    );
}

#[test]
fn synth_is_deterministic_and_stops_when_pairs_run_out() {
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    for dir in [a.path(), b.path()] {
        synth::write_byte_level_tokenizer(dir, &corpus(), 100, &[], "<s>", "</s>", "").unwrap();
    }
    let read = |p: &std::path::Path| std::fs::read(p.join("tokenizer.json")).unwrap();
    assert_eq!(read(a.path()), read(b.path()));
    // A tiny corpus runs out of repeated pairs long before 1000 merges.
    let c = tempfile::tempdir().unwrap();
    let n = synth::write_byte_level_tokenizer(c.path(), "abab cd", 1000, &[], "<s>", "</s>", "").unwrap();
    assert!(n < 256 + 10, "{n}");
    // bos/eos are added even when not listed in specials; an empty bos is rejected.
    let tok = Tokenizer::from_dir(c.path()).unwrap();
    assert!(tok.token_to_id("<s>").is_some() && tok.token_to_id("</s>").is_some());
    assert!(synth::write_byte_level_tokenizer(c.path(), "", 0, &[], "", "</s>", "").is_err());
}

#[test]
fn eos_union_merges_all_sources_in_order() {
    let fixtures = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer");
    let tok = Tokenizer::from_dir(&fixtures.join("hf_bpe")).unwrap();
    let eos = tok.eos_token_ids()[0];
    let tmp = tempfile::tempdir().unwrap();
    // No files: just the tokenizer's eos.
    assert_eq!(eos_token_ids_union(tmp.path(), &tok).unwrap(), vec![eos]);
    std::fs::write(
        tmp.path().join("config.json"),
        r#"{"eos_token_id": 7, "text_config": {"eos_token_id": [8, 7]}}"#,
    )
    .unwrap();
    std::fs::write(
        tmp.path().join("generation_config.json"),
        format!(r#"{{"eos_token_id": [9, {eos}, 8]}}"#),
    )
    .unwrap();
    assert_eq!(eos_token_ids_union(tmp.path(), &tok).unwrap(), vec![7, 8, 9, eos]);
    std::fs::write(tmp.path().join("config.json"), r#"{"eos_token_id": null}"#).unwrap();
    std::fs::write(tmp.path().join("generation_config.json"), r#"{"eos_token_id": 3}"#).unwrap();
    assert_eq!(eos_token_ids_union(tmp.path(), &tok).unwrap(), vec![3, eos]);
}

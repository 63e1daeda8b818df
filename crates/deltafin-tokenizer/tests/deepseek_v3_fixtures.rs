//! Cross-checks against the model fixtures in tests/fixtures/deepseek_v3/ (made by that
//! directory's make_fixtures.py from transformers/tokenizers/tiktoken). Each directory with a
//! `tokenizer_expected.json` is checked: encode/decode of the recorded texts, special ids, the
//! chat template renders and the ids of those renders. Skipped (passes) if the fixtures are absent.

use std::path::{Path, PathBuf};

use deltafin_tokenizer::{eos_token_ids_union, Tokenizer};
use serde_json::Value;

mod common;
use common::{assert_token_ids, ids};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/deepseek_v3")
}

fn load_expected(dir: &Path) -> Option<Value> {
    let text = std::fs::read_to_string(dir.join("tokenizer_expected.json")).ok()?;
    Some(serde_json::from_str(&text).expect("tokenizer_expected.json parses"))
}

/// The fixture directories holding a tokenizer_expected.json, sorted.
fn fixture_dirs() -> Vec<PathBuf> {
    let Ok(entries) = std::fs::read_dir(root()) else {
        return Vec::new();
    };
    let mut dirs: Vec<PathBuf> = entries
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.join("tokenizer_expected.json").is_file())
        .collect();
    dirs.sort();
    dirs
}

fn check_renders(dir: &Path, tok: &Tokenizer, exp: &Value, ids_key: &str, add_special: bool) -> usize {
    let tpl = tok.chat_template().unwrap_or_else(|| panic!("{dir:?}: chat template"));
    let mut n = 0;
    for case in exp["chat_template_renders"].as_array().unwrap() {
        let name = case["name"].as_str().unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let got = tpl
            .render(case["messages"].as_array().unwrap(), agp, &Value::Null)
            .unwrap_or_else(|e| panic!("{dir:?} {name}: {e}"));
        assert_eq!(
            got,
            case["rendered"].as_str().unwrap(),
            "{dir:?} render {name} agp={agp}"
        );
        assert_eq!(
            tok.encode(&got, add_special).unwrap(),
            ids(&case[ids_key]),
            "{dir:?} ids of render {name}"
        );
        n += 1;
    }
    n
}

fn check_hf_dir(dir: &Path, exp: &Value) -> usize {
    let tok = Tokenizer::from_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
    assert_eq!(
        tok.vocab_size() as u64,
        exp["vocab_size"].as_u64().unwrap(),
        "{dir:?} vocab"
    );
    let specials = &exp["special_tokens"];
    for key in ["bos", "eos", "pad"] {
        if let Some(t) = specials.get(key) {
            let content = t["content"].as_str().unwrap();
            assert_eq!(
                tok.token_to_id(content).map(u64::from),
                t["id"].as_u64(),
                "{dir:?} {key}"
            );
        }
    }
    assert_eq!(tok.bos_token_id().map(u64::from), specials["bos"]["id"].as_u64());
    assert_eq!(
        tok.eos_token_ids(),
        vec![specials["eos"]["id"].as_u64().unwrap() as u32]
    );
    for group in ["added_special", "added_not_special"] {
        if let Some(added) = specials[group].as_object() {
            assert_token_ids(&tok, added, &format!("{dir:?}"));
        }
    }
    let mut n = 0;
    for case in exp["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let with = ids(&case["ids_add_special_tokens"]);
        let without = ids(&case["ids_no_special_tokens"]);
        assert_eq!(
            tok.encode(text, true).unwrap(),
            with,
            "{dir:?} encode {text:?} add=true"
        );
        assert_eq!(
            tok.encode(text, false).unwrap(),
            without,
            "{dir:?} encode {text:?} add=false"
        );
        assert_eq!(
            tok.decode(&with, false).unwrap(),
            case["decoded_ids_add_special_tokens"].as_str().unwrap(),
            "{dir:?} decode {text:?}"
        );
        assert_eq!(
            tok.decode(&with, true).unwrap(),
            case["decoded_ids_add_special_tokens_skip_special"].as_str().unwrap(),
            "{dir:?} decode skip {text:?}"
        );
        assert_eq!(
            tok.decode(&without, false).unwrap(),
            case["roundtrip_no_special_decoded"].as_str().unwrap()
        );
        let mut stream = tok.stream_decoder(false);
        let mut streamed = String::new();
        for &id in &with {
            streamed += &stream.push(id).unwrap();
        }
        streamed += &stream.finish().unwrap();
        assert_eq!(streamed, case["decoded_ids_add_special_tokens"].as_str().unwrap());
        n += 1;
    }
    n += check_renders(dir, &tok, exp, "ids_of_rendered_no_special_tokens", false);

    // config.json / generation_config.json may name more stop ids than the tokenizer.
    let union = eos_token_ids_union(dir, &tok).unwrap();
    assert!(union.contains(&tok.eos_token_ids()[0]));
    n
}

fn check_kimi_dir(dir: &Path, exp: &Value) -> usize {
    let tok = Tokenizer::from_dir(dir).unwrap_or_else(|e| panic!("{dir:?}: {e}"));
    assert_eq!(exp["pat_str"].as_str().unwrap(), deltafin_tokenizer::KIMI_K2_PAT_STR);
    assert_eq!(tok.vocab_size() as u64, exp["vocab_size"].as_u64().unwrap());
    assert_token_ids(&tok, exp["special_tokens"].as_object().unwrap(), "kimi");
    let mut n = 0;
    for case in exp["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let want = ids(&case["ids_allowed_special_all"]);
        // This fixture's tokenizer_config.json has no add_bos_token: no BOS either way.
        assert_eq!(tok.encode(text, false).unwrap(), want, "kimi encode {text:?}");
        assert_eq!(tok.encode(text, true).unwrap(), want, "kimi encode {text:?} add=true");
        assert_eq!(tok.decode(&want, false).unwrap(), case["decoded"].as_str().unwrap());
        n += 1;
    }
    n += check_renders(dir, &tok, exp, "ids_allowed_special_all", false);
    n
}

#[test]
fn deepseek_v3_and_kimi_fixtures_match_their_expected_outputs() {
    let dirs = fixture_dirs();
    if dirs.is_empty() {
        eprintln!("tests/fixtures/deepseek_v3 not present; skipping");
        return;
    }
    let mut checked = 0;
    for dir in &dirs {
        let Some(exp) = load_expected(dir) else {
            continue;
        };
        checked += if dir.join("tiktoken.model").is_file() && !dir.join("tokenizer.json").is_file() {
            check_kimi_dir(dir, &exp)
        } else {
            check_hf_dir(dir, &exp)
        };
    }
    assert!(checked > 0);
}

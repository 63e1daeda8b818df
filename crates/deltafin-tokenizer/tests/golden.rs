//! Golden tests against the Python reference (tokenizers, tiktoken, transformers, jinja2).
//! Fixtures: tests/fixtures/tokenizer/ (made by make_tokenizer_fixtures.py).

use std::path::PathBuf;

use deltafin_tokenizer::{ChatTemplate, Tokenizer, TokenizerError};
use serde_json::Value;

mod common;
use common::{assert_token_ids, ids};

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/tokenizer")
}

fn expected() -> Value {
    let path = fixtures().join("expected.json");
    let text = std::fs::read_to_string(&path).expect("read expected.json");
    serde_json::from_str(&text).expect("parse expected.json")
}

/// Checks vocab size, bos/eos, token_to_id, every recorded encode and decode.
fn check_tokenizer(dir: &str) {
    let exp = &expected()[dir];
    let tok = Tokenizer::from_dir(&fixtures().join(dir)).expect("load fixture tokenizer");
    assert_eq!(
        tok.vocab_size() as u64,
        exp["vocab_size"].as_u64().unwrap(),
        "{dir} vocab_size"
    );
    assert_eq!(
        tok.bos_token_id().map(u64::from),
        exp["bos_token_id"].as_u64(),
        "{dir} bos"
    );
    assert_eq!(tok.eos_token_ids(), ids(&exp["eos_token_ids"]), "{dir} eos");
    assert_token_ids(&tok, exp["token_to_id"].as_object().unwrap(), dir);
    let mut n = 0;
    for case in exp["encode"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        let add = case["add_special_tokens"].as_bool().unwrap();
        let got = tok.encode(text, add).expect("encode");
        assert_eq!(
            got,
            ids(&case["ids"]),
            "{dir} encode({text:?}, add_special_tokens={add})"
        );
        n += 1;
    }
    for case in exp["decode"].as_array().unwrap() {
        let want = case["text"].as_str().unwrap();
        let skip = case["skip_special_tokens"].as_bool().unwrap();
        let input = ids(&case["ids"]);
        let got = tok.decode(&input, skip).expect("decode");
        assert_eq!(got, want, "{dir} decode({input:?}, skip={skip})");
        n += 1;
    }
    assert!(n > 30, "{dir}: too few golden cases ({n})");
}

#[test]
fn hf_bpe_matches_tokenizers_and_transformers() {
    check_tokenizer("hf_bpe");
}

#[test]
fn kimi_tiktoken_matches_tiktoken() {
    check_tokenizer("kimi_tiktoken");
}

#[test]
fn pat_str_fixture_is_the_default() {
    assert_eq!(
        expected()["kimi_pat_str"].as_str().unwrap(),
        deltafin_tokenizer::KIMI_K2_PAT_STR
    );
}

#[test]
fn chat_templates_match_transformers_apply_chat_template() {
    let exp = expected();
    let cases = exp["templates"].as_array().unwrap();
    assert!(cases.len() >= 10);
    for case in cases {
        let name = case["name"].as_str().unwrap();
        let path = fixtures()
            .join("templates")
            .join(format!("{}.jinja", case["template"].as_str().unwrap()));
        let source = std::fs::read_to_string(&path).unwrap();
        let tpl = ChatTemplate::new(
            &source,
            case["bos_token"].as_str().map(String::from),
            case["eos_token"].as_str().map(String::from),
        )
        .unwrap_or_else(|e| panic!("{name}: {e}"));
        let messages = case["messages"].as_array().unwrap();
        let agp = case["add_generation_prompt"].as_bool().unwrap();
        let result = tpl.render(messages, agp, &case["extra"]);
        match (case.get("output"), result) {
            (Some(want), Ok(got)) => {
                assert_eq!(got, want.as_str().unwrap(), "template case {name}")
            }
            (None, Err(TokenizerError::TemplateException { message })) => {
                assert_eq!(message, case["error"].as_str().unwrap(), "template case {name}")
            }
            (want, got) => panic!("template case {name}: want {want:?}, got {got:?}"),
        }
    }
}

#[test]
fn from_dir_reads_the_config_chat_template() {
    // hf_bpe/tokenizer_config.json carries templates/deepseek_style.jinja with <|bos|>/<|eos|>.
    let exp = expected();
    let tok = Tokenizer::from_dir(&fixtures().join("hf_bpe")).unwrap();
    let tpl = tok.chat_template().expect("chat template");
    let case = exp["templates"]
        .as_array()
        .unwrap()
        .iter()
        .find(|c| c["name"] == "ds_tools")
        .unwrap();
    let got = tpl
        .render(case["messages"].as_array().unwrap(), true, &case["extra"])
        .unwrap();
    assert_eq!(got, case["output"].as_str().unwrap());
    // Rendered prompts already hold the BOS string: encode without the post-processor.
    let ids = tok.encode(&got, false).unwrap();
    assert_eq!(ids[0], tok.bos_token_id().unwrap());
    assert_eq!(ids.iter().filter(|&&i| i == ids[0]).count(), 1);
    assert_eq!(tok.decode(&ids, false).unwrap(), got);
}

#[test]
fn template_rejects_bad_inputs() {
    let tpl = ChatTemplate::new("{{ messages | length }}", None, None).unwrap();
    let msgs = [serde_json::json!({"role": "user", "content": "x"})];
    assert_eq!(tpl.render(&msgs, false, &Value::Null).unwrap(), "1");
    let err = tpl.render(&msgs, false, &serde_json::json!([1])).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateInput { .. }), "{err}");
    let err = tpl
        .render(&msgs, false, &serde_json::json!({"messages": []}))
        .unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateInput { .. }), "{err}");
    let err = tpl.render(&[serde_json::json!("hi")], false, &Value::Null).unwrap_err();
    assert!(err.to_string().contains("messages[0]"), "{err}");
    let err = ChatTemplate::new("{% for x in %}", None, None).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateSyntax { .. }), "{err}");
    // A runtime error that is not raise_exception stays a render error.
    let tpl = ChatTemplate::new("{{ messages[0].content + 1 }}", None, None).unwrap();
    let err = tpl.render(&msgs, false, &Value::Null).unwrap_err();
    assert!(matches!(err, TokenizerError::TemplateRender { .. }), "{err}");
}

#[test]
fn template_python_compat_details() {
    let msgs = [serde_json::json!({"role": "user", "content": "a"})];
    let render = |src: &str, extra: Value| {
        ChatTemplate::new(src, Some("<s>".into()), None)
            .unwrap()
            .render(&msgs, false, &extra)
            .unwrap()
    };
    // tools/documents are defined-but-none unless given; eos undefined when unset.
    assert_eq!(
        render(
            "{{ tools is defined }}{{ tools is none }}{{ eos_token is defined }}{{ bos_token }}",
            Value::Null
        ),
        "TrueTrueFalse<s>"
    );
    // tojson is json.dumps: no HTML escaping, non-ASCII kept, Python separators.
    assert_eq!(
        render(
            "{{ x | tojson }}",
            serde_json::json!({"x": {"a": "<é>&'", "b": [1, 2.0]}})
        ),
        r#"{"a": "<é>&'", "b": [1, 2.0]}"#
    );
    assert_eq!(
        render("{{ x | tojson(ensure_ascii=true) }}", serde_json::json!({"x": "é🙂"})),
        r#""\u00e9\ud83d\ude42""#
    );
    assert_eq!(
        render(
            "{{ x | tojson(separators=[',', ':']) }}",
            serde_json::json!({"x": {"a": [1, 2]}})
        ),
        r#"{"a":[1,2]}"#
    );
    // loop controls are enabled.
    assert_eq!(
        render(
            "{% for i in range(5) %}{% if i == 3 %}{% break %}{% endif %}{{ i }}{% endfor %}",
            Value::Null
        ),
        "012"
    );
    // extra overrides bos_token, like apply_chat_template kwargs.
    assert_eq!(render("{{ bos_token }}", serde_json::json!({"bos_token": "B"})), "B");
}

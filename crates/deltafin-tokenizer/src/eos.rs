//! End-of-sequence ids gathered from every file that names them.

use std::path::Path;

use serde_json::Value;

use crate::config::{field_error, read_json_if_exists};
use crate::{Tokenizer, TokenizerError};

/// Union of end-of-sequence ids, in first-seen order without duplicates: `config.json`
/// `eos_token_id` (int or list), then `config.json` `text_config.eos_token_id` (multimodal
/// wrappers), then `generation_config.json` `eos_token_id`, then the tokenizer's own eos
/// ([`Tokenizer::eos_token_ids`]).
///
/// Missing files and missing/null fields are fine. Errors: [`TokenizerError::Json`] naming the
/// file for malformed JSON, [`TokenizerError::Field`] for an `eos_token_id` that is not a
/// non-negative integer (or list of them).
/// Sources: transformers `GenerationConfig` (`eos_token_id: int | list[int]`); vLLM merges the
/// generation config's eos into its stop ids the same way.
pub fn eos_token_ids_union(model_dir: &Path, tokenizer: &Tokenizer) -> Result<Vec<u32>, TokenizerError> {
    let mut out = eos_token_ids_of_configs(model_dir)?;
    for id in tokenizer.eos_token_ids() {
        if !out.contains(&id) {
            out.push(id);
        }
    }
    Ok(out)
}

/// The part of [`eos_token_ids_union`] that needs no tokenizer: the ids `config.json` and
/// `generation_config.json` name, in that order without duplicates (for a model directory
/// that has no tokenizer and runs on token ids alone).
///
/// Errors: as [`eos_token_ids_union`].
pub fn eos_token_ids_of_configs(model_dir: &Path) -> Result<Vec<u32>, TokenizerError> {
    let mut out: Vec<u32> = Vec::new();
    let mut add = |ids: Vec<u32>| {
        for id in ids {
            if !out.contains(&id) {
                out.push(id);
            }
        }
    };

    let config_path = model_dir.join("config.json");
    if let Some(config) = read_json_if_exists(&config_path)? {
        add(eos_field(&config_path, "eos_token_id", config.get("eos_token_id"))?);
        if let Some(text) = config.get("text_config") {
            add(eos_field(
                &config_path,
                "text_config.eos_token_id",
                text.get("eos_token_id"),
            )?);
        }
    }
    let gen_path = model_dir.join("generation_config.json");
    if let Some(gen) = read_json_if_exists(&gen_path)? {
        add(eos_field(&gen_path, "eos_token_id", gen.get("eos_token_id"))?);
    }
    Ok(out)
}

/// An `eos_token_id` value: absent/null, an integer, or a list of integers.
fn eos_field(path: &Path, field: &str, value: Option<&Value>) -> Result<Vec<u32>, TokenizerError> {
    let as_id = |v: &Value| -> Option<u32> { v.as_u64().and_then(|n| u32::try_from(n).ok()) };
    match value {
        None | Some(Value::Null) => Ok(Vec::new()),
        Some(Value::Array(items)) => items
            .iter()
            .enumerate()
            .map(|(i, v)| {
                as_id(v)
                    .ok_or_else(|| field_error(path, &format!("{field}[{i}]"), format!("must be a token id, got {v}")))
            })
            .collect(),
        Some(v) => as_id(v)
            .map(|id| vec![id])
            .ok_or_else(|| field_error(path, field, format!("must be a token id or a list of them, got {v}"))),
    }
}

//! Reading `config.json` fields: typed getters that name the field in every error, the bounds
//! that keep anything sized from a config within memory and 64-bit arithmetic, transformers'
//! `attribute_map` aliases, and the text config of a multimodal wrapper. Shared by every family
//! file; knows no family.

use std::path::Path;

use serde_json::Value;

use crate::FormatError;

/// The value of `key` in `obj`, None when absent or null.
pub(crate) fn get<'a>(obj: &'a Value, key: &str) -> Option<&'a Value> {
    obj.get(key).filter(|v| !v.is_null())
}

pub(crate) fn field_err(path: &Path, field: &str, msg: impl Into<String>) -> FormatError {
    FormatError::Config {
        path: path.to_path_buf(),
        field: field.to_string(),
        message: msg.into(),
    }
}

/// Reads and parses the JSON file at `path` (a `config.json`).
///
/// Errors: unreadable file ([`FormatError::Io`]), malformed JSON ([`FormatError::Json`]).
pub(crate) fn read_json(path: &Path) -> Result<Value, FormatError> {
    let text = deltafin_fs::read_to_string(path).map_err(|e| FormatError::Io {
        path: path.to_path_buf(),
        error: e,
    })?;
    serde_json::from_str(&text).map_err(|e| FormatError::Json {
        path: path.to_path_buf(),
        message: e.to_string(),
    })
}

/// Checks that every named count in `fields` is above 0, in order.
///
/// Errors: the first that is 0, named, with "must be greater than 0".
pub(crate) fn require_nonzero(path: &Path, fields: &[(&str, usize)]) -> Result<(), FormatError> {
    match fields.iter().find(|(_, v)| *v == 0) {
        Some((k, _)) => Err(field_err(path, k, "must be greater than 0")),
        None => Ok(()),
    }
}

/// [`require_nonzero`] over fields of `$cfg` named as in the config, in the order given:
/// `require_nonzero_fields!(path, self; vocab_size, hidden_size)` checks `self.vocab_size`, then
/// `self.hidden_size`, naming the first that is 0.
macro_rules! require_nonzero_fields {
    ($path:expr, $cfg:expr; $($field:ident),+ $(,)?) => {
        $crate::json::require_nonzero($path, &[$((stringify!($field), $cfg.$field)),+])
    };
}
pub(crate) use require_nonzero_fields;

/// Most decoder layers a config may name (the largest released MoE models have under 100).
/// Tables of per-layer tensors are built from this count before any checkpoint is read, so it
/// is bounded here: `num_hidden_layers` 10^7 would otherwise build gigabytes of tensor names.
pub const MAX_LAYERS: u64 = 1 << 12;
/// Most routed experts per layer (and experts per token) a config may name (released models
/// have at most 512); record indices are `u32`.
pub const MAX_EXPERTS: u64 = 1 << 16;
/// Most tokens of context a config may name (`max_position_embeddings` and kin).
pub const MAX_POSITIONS: u64 = 1 << 32;
/// Bound of every other count or width in a config (vocabulary, hidden and intermediate sizes,
/// heads, head widths, ranks): 2^20, far above any released model, and small enough that
/// products of two or three of them cannot overflow 64-bit arithmetic.
pub const MAX_DIM: u64 = 1 << 20;

/// The bound [`usize_or`] applies to integer field `key` (see [`MAX_LAYERS`], [`MAX_EXPERTS`],
/// [`MAX_POSITIONS`], [`MAX_DIM`]).
pub(crate) fn int_bound(key: &str) -> u64 {
    match key {
        "num_hidden_layers" => MAX_LAYERS,
        "max_position_embeddings" | "model_max_length" | "sliding_window" => MAX_POSITIONS,
        k if k.contains("experts") => MAX_EXPERTS,
        _ => MAX_DIM,
    }
}

/// Integer field `key` of `obj` (absent or null: `default`), at most its bound ([`int_bound`]),
/// so that nothing sized from a config can exhaust memory or overflow.
///
/// Errors: not a non-negative integer, or above the bound (field named).
pub(crate) fn usize_or(obj: &Value, path: &Path, key: &str, default: usize) -> Result<usize, FormatError> {
    match get(obj, key) {
        None => Ok(default),
        Some(v) => {
            let x = v
                .as_u64()
                .ok_or_else(|| field_err(path, key, format!("expected a non-negative integer, got {v}")))?;
            let bound = int_bound(key);
            if x > bound {
                return Err(field_err(
                    path,
                    key,
                    format!("{x} is larger than this implementation supports (at most {bound})"),
                ));
            }
            Ok(x as usize)
        }
    }
}

/// Optional integer field `key` of `obj` (absent or null: None), bounded as [`usize_or`].
///
/// Errors: as [`usize_or`].
pub(crate) fn opt_usize(obj: &Value, path: &Path, key: &str) -> Result<Option<usize>, FormatError> {
    match get(obj, key) {
        None => Ok(None),
        Some(_) => usize_or(obj, path, key, 0).map(Some),
    }
}

/// Integer field `key` of `obj` where an explicit `null` means `if_null` and an absent key
/// `if_absent` (transformers' `num_key_value_heads: null`: as many as the query heads).
///
/// Errors: as [`usize_or`].
pub(crate) fn usize_null_or(
    obj: &Value,
    path: &Path,
    key: &str,
    if_null: usize,
    if_absent: usize,
) -> Result<usize, FormatError> {
    match obj.get(key) {
        Some(Value::Null) => Ok(if_null),
        _ => usize_or(obj, path, key, if_absent),
    }
}

/// List field `key` of `obj` of 0-based layer indices (absent or null: empty), e.g.
/// `mlp_only_layers`.
///
/// Errors: not a list, or an entry that is not a non-negative integer (field named).
pub(crate) fn layer_indices(obj: &Value, path: &Path, key: &str) -> Result<Vec<usize>, FormatError> {
    match get(obj, key) {
        None => Ok(Vec::new()),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .map(|x| x as usize)
                    .ok_or_else(|| field_err(path, key, format!("expected layer indices, got {v}")))
            })
            .collect(),
        Some(v) => Err(field_err(
            path,
            key,
            format!("expected a list of layer indices, got {v}"),
        )),
    }
}

/// Field `key` of `obj` as read by `read` (`Value::as_f64`, `Value::as_bool`); None when absent
/// or null.
///
/// Errors: a value `read` does not accept (field named: "expected `expected`, got" the value).
fn opt_typed<T>(
    obj: &Value,
    path: &Path,
    key: &str,
    read: fn(&Value) -> Option<T>,
    expected: &str,
) -> Result<Option<T>, FormatError> {
    match get(obj, key) {
        None => Ok(None),
        Some(v) => read(v)
            .map(Some)
            .ok_or_else(|| field_err(path, key, format!("expected {expected}, got {v}"))),
    }
}

/// Real-valued field `key` of `obj` (absent or null: `default`).
///
/// Errors: not a number (field named).
pub(crate) fn f64_or(obj: &Value, path: &Path, key: &str, default: f64) -> Result<f64, FormatError> {
    Ok(opt_f64(obj, path, key)?.unwrap_or(default))
}

/// Which values of a real-valued config field make sense.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Range {
    /// Any finite value.
    Finite,
    /// Finite and > 0 (RoPE `theta`, `factor`, scaling factors).
    Positive,
    /// Finite and >= 0 (`rms_norm_eps`).
    NonNegative,
}

/// Checks that `x` (field `key`) lies in `range` and stays finite as an `f32` (the engine
/// computes in f32: 1e39 would become infinity, and JSON `null` in the manifest).
///
/// Errors: outside the range (field named, with the value).
pub(crate) fn check_range(path: &Path, key: &str, x: f64, range: Range) -> Result<f64, FormatError> {
    let ok = x.is_finite()
        && (x as f32).is_finite()
        && match range {
            Range::Finite => true,
            Range::Positive => x > 0.0,
            Range::NonNegative => x >= 0.0,
        };
    if ok {
        return Ok(x);
    }
    let want = match range {
        Range::Finite => "a finite number",
        Range::Positive => "a finite number greater than 0",
        Range::NonNegative => "a finite number of at least 0",
    };
    Err(field_err(
        path,
        key,
        format!("{x} is out of range: expected {want} (within f32 range)"),
    ))
}

/// A real-valued field as `f32` (absent or null: `default`), checked against `range`.
///
/// Errors: not a number, or outside `range` ([`check_range`]); the field is named.
pub(crate) fn f32_in(obj: &Value, path: &Path, key: &str, default: f64, range: Range) -> Result<f32, FormatError> {
    let x = f64_or(obj, path, key, default)?;
    Ok(check_range(path, key, x, range)? as f32)
}

/// Optional real-valued field `key` of `obj` (absent or null: None).
///
/// Errors: not a number (field named).
pub(crate) fn opt_f64(obj: &Value, path: &Path, key: &str) -> Result<Option<f64>, FormatError> {
    opt_typed(obj, path, key, Value::as_f64, "a number")
}

/// Spellings transformers accepts for one field: `attribute_map` entries of a config class
/// (`alias` read as `canonical`). [TRANSFORMERS_ATTRIBUTE_MAP]
pub(crate) type Aliases = &'static [(&'static str, &'static str)];

/// Returns `raw` with the text config's aliased fields ([`Aliases`]) stored under the name this
/// crate reads, as transformers' `PreTrainedConfig` does when it reads an `attribute_map`
/// key; `raw` itself when no alias is present.
///
/// Errors: both spellings present with different values (both named).
pub(crate) fn resolve_aliases<'a>(
    raw: &'a Value,
    path: &Path,
    aliases: Aliases,
) -> Result<std::borrow::Cow<'a, Value>, FormatError> {
    let tc = text_config(raw);
    if !aliases.iter().any(|(a, _)| get(tc, a).is_some()) {
        return Ok(std::borrow::Cow::Borrowed(raw));
    }
    let nested = !std::ptr::eq(tc, raw);
    let mut out = raw.clone();
    let obj = if nested { &mut out["text_config"] } else { &mut out };
    for (alias, canonical) in aliases {
        let Some(v) = get(tc, alias) else { continue };
        match get(tc, canonical) {
            Some(c) if c != v => {
                return Err(field_err(
                    path,
                    alias,
                    format!("{v} disagrees with {canonical} {c} (transformers reads both as {canonical})"),
                ))
            }
            Some(_) => {}
            None => obj[*canonical] = v.clone(),
        }
    }
    Ok(std::borrow::Cow::Owned(out))
}

/// Boolean field `key` of `obj` (absent or null: `default`).
///
/// Errors: not `true` or `false` (field named).
pub(crate) fn bool_or(obj: &Value, path: &Path, key: &str, default: bool) -> Result<bool, FormatError> {
    Ok(opt_typed(obj, path, key, Value::as_bool, "true or false")?.unwrap_or(default))
}

/// Fails with `message` when boolean field `key` of `obj` is true (absent or null: false): a
/// setting this implementation does not run (`attention_bias`, `tie_word_embeddings`).
///
/// Errors: the field true (`message`), or not a boolean; the field is named.
pub(crate) fn reject_true(obj: &Value, path: &Path, key: &str, message: &str) -> Result<(), FormatError> {
    if bool_or(obj, path, key, false)? {
        return Err(field_err(path, key, message));
    }
    Ok(())
}

/// Rejects `tie_word_embeddings: true` in `tc`, saying that `checkpoints` (`Mixtral`,
/// `gpt-oss`) checkpoints have an untied `lm_head`.
///
/// Errors: the field true, or not a boolean (`tie_word_embeddings` named).
pub(crate) fn reject_tied_embeddings(tc: &Value, path: &Path, checkpoints: &str) -> Result<(), FormatError> {
    reject_true(
        tc,
        path,
        "tie_word_embeddings",
        &format!("tied embeddings are not supported ({checkpoints} checkpoints have an untied lm_head)"),
    )
}

/// Reads `eos_token_id`-style fields: an integer or a list of integers.
pub fn token_ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a.iter().filter_map(|x| x.as_u64()).map(|x| x as u32).collect(),
        _ => Vec::new(),
    }
}

/// Returns the text config object of a `config.json`: the top level, or its `text_config` when
/// the top level is a multimodal wrapper (e.g. `kimi_k25`).
pub fn text_config(raw: &Value) -> &Value {
    match get(raw, "text_config") {
        Some(tc) if tc.is_object() => tc,
        _ => raw,
    }
}

/// End-of-sequence ids of a text config `tc` (plus those of the wrapper `raw` when `tc` is
/// nested), and its begin-of-sequence id.
pub(crate) fn eos_bos(tc: &Value, raw: &Value) -> (Vec<u32>, Option<u32>) {
    let mut eos = token_ids(get(tc, "eos_token_id"));
    if !std::ptr::eq(tc, raw) {
        for id in token_ids(get(raw, "eos_token_id")) {
            if !eos.contains(&id) {
                eos.push(id);
            }
        }
    }
    let bos = get(tc, "bos_token_id")
        .or_else(|| get(raw, "bos_token_id"))
        .and_then(|v| v.as_u64())
        .map(|x| x as u32);
    (eos, bos)
}

/// Fails with the field named unless string field `key` of `obj` is absent, not a string, or
/// `only` (`scoring_func` `sigmoid`, `hidden_act` `silu`).
pub(crate) fn require_only(obj: &Value, path: &Path, key: &str, only: &str) -> Result<(), FormatError> {
    match get(obj, key).and_then(|v| v.as_str()) {
        Some(s) if s != only => Err(field_err(
            path,
            key,
            format!("{s:?} is not supported (only \"{only}\")"),
        )),
        _ => Ok(()),
    }
}

/// Fails with the field named unless `hidden_act` (of `tc`) is absent or `silu`.
pub(crate) fn require_silu(tc: &Value, path: &Path) -> Result<(), FormatError> {
    require_only(tc, path, "hidden_act", "silu")
}

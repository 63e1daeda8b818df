//! The RoPE frequency scheme of a config (plain or YaRN), resolved from either transformers
//! spelling. Shared by every family file.

use std::path::Path;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::json::{bool_or, check_range, f64_or, field_err, get, opt_f64, Range};
use crate::FormatError;

/// RoPE frequency scheme, resolved from either `rope_scaling` + `rope_theta` (transformers 4.x
/// spelling) or `rope_parameters` (transformers 5 spelling).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "snake_case")]
pub enum Rope {
    /// Plain RoPE: `inv_freq[i] = theta^(-2i/dim)`.
    Default { theta: f64 },
    /// YaRN (Peng et al. 2023, arXiv:2309.00071) as transformers' `_compute_yarn_parameters`.
    Yarn {
        theta: f64,
        /// Context extension factor.
        factor: f64,
        /// Pre-extension context length in tokens.
        original_max_position_embeddings: f64,
        beta_fast: f64,
        beta_slow: f64,
        /// `mscale` of the YaRN attention factor (None when the config omits it or sets 0).
        mscale: Option<f64>,
        /// `mscale_all_dim`: also scales the MLA softmax by `yarn_mscale(factor, mscale_all_dim)^2`.
        mscale_all_dim: Option<f64>,
        /// Explicit cos/sin multiplier, when the config sets `attention_factor`.
        attention_factor: Option<f64>,
        /// Whether the correction range is rounded to whole dimensions (`truncate`, default true).
        truncate: bool,
    },
}

/// Resolves the RoPE scheme of a text config: `rope_parameters` (transformers 5) or
/// `rope_scaling` + `rope_theta` (4.x); `default_theta` is the family's `default_theta` for a
/// config that names no theta.
///
/// Errors: a non-numeric field, a RoPE type other than `default`/`yarn` (field named).
pub(crate) fn resolve_rope(tc: &Value, path: &Path, max_pos: usize, default_theta: f64) -> Result<Rope, FormatError> {
    // transformers 5 writes `rope_parameters` (holding rope_theta); 4.x writes `rope_scaling`
    // plus a top-level `rope_theta`. Either may be absent.
    // Either key holding something other than an object (`"rope_scaling": "x"`) is an error,
    // not "no scaling": the model would silently run with another RoPE.
    for key in ["rope_parameters", "rope_scaling"] {
        if let Some(v) = get(tc, key).filter(|v| !v.is_object()) {
            return Err(field_err(path, key, format!("expected an object or null, got {v}")));
        }
    }
    let params = get(tc, "rope_parameters").or_else(|| get(tc, "rope_scaling"));
    let top_theta = check_range(
        path,
        "rope_theta",
        f64_or(tc, path, "rope_theta", default_theta)?,
        Range::Positive,
    )?;
    let Some(p) = params else {
        return Ok(Rope::Default { theta: top_theta });
    };
    let field = if get(tc, "rope_parameters").is_some() {
        "rope_parameters"
    } else {
        "rope_scaling"
    };
    // A sub-field's value checked against `range`, named `field.key` in errors.
    let sub = |key: &str, x: f64, range: Range| check_range(path, &format!("{field}.{key}"), x, range);
    let theta = sub("rope_theta", f64_or(p, path, "rope_theta", top_theta)?, Range::Positive)?;
    let kind = get(p, "rope_type")
        .or_else(|| get(p, "type"))
        .and_then(|v| v.as_str())
        .unwrap_or("default");
    match kind {
        "default" => Ok(Rope::Default { theta }),
        "yarn" => {
            let original = sub(
                "original_max_position_embeddings",
                f64_or(p, path, "original_max_position_embeddings", max_pos as f64)?,
                Range::Positive,
            )?;
            let factor = match opt_f64(p, path, "factor")? {
                Some(f) => f,
                None => max_pos as f64 / original,
            };
            let factor = sub("factor", factor, Range::Positive)?;
            let nonzero = |x: Option<f64>| x.filter(|v| *v != 0.0);
            let opt = |key: &str, range: Range| -> Result<Option<f64>, FormatError> {
                opt_f64(p, path, key)?.map(|x| sub(key, x, range)).transpose()
            };
            Ok(Rope::Yarn {
                theta,
                factor,
                original_max_position_embeddings: original,
                beta_fast: nonzero(opt("beta_fast", Range::Finite)?).unwrap_or(32.0),
                beta_slow: nonzero(opt("beta_slow", Range::Finite)?).unwrap_or(1.0),
                mscale: nonzero(opt("mscale", Range::Finite)?),
                mscale_all_dim: nonzero(opt("mscale_all_dim", Range::Finite)?),
                attention_factor: opt("attention_factor", Range::Positive)?,
                truncate: bool_or(p, path, "truncate", true)?,
            })
        }
        other => Err(field_err(
            path,
            &format!("{field}.rope_type"),
            format!("RoPE type {other:?} is not supported (supported: default, yarn)"),
        )),
    }
}

//! Value checks of an untrusted `manifest.json`: everything the loader and the engine later
//! size, index or divide by is checked here, at load, against what the manifest's own config
//! implies, so a damaged or hostile manifest is a one-line error naming the field, never a
//! panic, a division by zero or a huge allocation. (File paths and checksums are checked where
//! the files are opened, in [`crate::model_dir`].)
//!
//! The rules are those `convert` writes by ([`crate::convert`]): the resident tensors are
//! exactly [`ModelConfig::backbone_tensors`] with their shapes, matrices in the backbone dtype
//! and the rest f32; every expert record has the layout [`record_layout`] gives for the
//! config's expert matrices.

use std::path::Path;

use serde_json::Value;

use crate::aligned::{RECORD_ALIGN, TENSOR_ALIGN};
use crate::family::TensorRole;
use crate::json::{check_range, int_bound, Range};
use crate::manifest::{matrix_dims, record_layout, Manifest, StoredDtype};
use crate::FormatError;

/// Real-valued fields of a resolved config (as the manifest stores it) with their ranges; the
/// same ranges `config.json` is held to. Any other real number must be finite.
const RANGES: &[(&str, Range)] = &[
    ("rms_norm_eps", Range::NonNegative),
    ("theta", Range::Positive),
    ("factor", Range::Positive),
    ("original_max_position_embeddings", Range::Positive),
    ("attention_factor", Range::Positive),
    ("routed_scaling_factor", Range::Positive),
];

/// Integer fields that hold token ids (any `u32`), not counts.
const TOKEN_ID_FIELDS: &[&str] = &["eos_token_id", "bos_token_id"];

/// Checks the values of manifest `m` read from `mpath`: the resolved config (integers within
/// the bounds `config.json` is held to, real numbers finite and in range, then the family's own
/// validation and [`crate::ModelConfig::check_sizes`]), `family`, `experts.record_align` (a
/// power of two of at least [`RECORD_ALIGN`]), every resident tensor's presence, shape, dtype,
/// byte count and range, and the expert layout and record lengths and ranges.
///
/// Errors: the first value that is wrong, as `manifest.json: field ...: what`.
pub fn check_manifest_values(m: &Manifest, mpath: &Path) -> Result<(), FormatError> {
    let bad = |field: &str, message: String| FormatError::Config {
        path: mpath.to_path_buf(),
        field: field.to_string(),
        message,
    };
    let cfg_value = serde_json::to_value(&m.config).map_err(|e| bad("config", e.to_string()))?;
    check_config_numbers(&cfg_value, "config", mpath)?;
    m.config.validate(mpath)?;
    if m.family != m.config.family() {
        return Err(bad(
            "family",
            format!(
                "{:?} disagrees with the config, which is {:?}",
                m.family,
                m.config.family()
            ),
        ));
    }

    let align = m.experts.record_align;
    if !align.is_power_of_two() || align < RECORD_ALIGN {
        return Err(bad(
            "experts.record_align",
            format!("{align} is not a power of two of at least {RECORD_ALIGN}"),
        ));
    }

    // Resident tensors: exactly what convert writes for this config.
    let bb = &m.backbone;
    if !matches!(
        bb.matrix_dtype,
        StoredDtype::Int8 | StoredDtype::Bf16 | StoredDtype::F32
    ) {
        return Err(bad(
            "backbone.matrix_dtype",
            format!("{} is not a backbone dtype (int8, bf16, f32)", bb.matrix_dtype.name()),
        ));
    }
    for t in m.config.backbone_tensors() {
        let field = format!("backbone.tensors.{}", t.name);
        let r = bb
            .tensors
            .get(&t.name)
            .ok_or_else(|| bad(&field, "missing: the model needs this tensor".into()))?;
        if r.shape != t.shape {
            return Err(bad(
                &field,
                format!(
                    "shape {:?} disagrees with the config, which implies {:?}",
                    r.shape, t.shape
                ),
            ));
        }
        let want = match t.role {
            TensorRole::F32 => StoredDtype::F32,
            TensorRole::Matrix => bb.matrix_dtype,
        };
        if r.dtype != want {
            return Err(bad(
                &field,
                format!("dtype {} where {} is stored", r.dtype.name(), want.name()),
            ));
        }
        let (rows, cols) = matrix_dims(&t.shape);
        let (vb, sb) = (want.value_bytes(rows, cols) as u64, want.scale_bytes(rows, cols) as u64);
        let scales = match want {
            StoredDtype::Int8 | StoredDtype::Mxfp4 => r.offset.checked_add(vb),
            _ => None,
        };
        let in_range = r.offset.checked_add(r.bytes).is_some_and(|end| end <= bb.bytes);
        if r.bytes != vb + sb || r.scales_offset != scales || r.offset % TENSOR_ALIGN != 0 || !in_range {
            return Err(bad(
                &field,
                format!(
                    "offset {} / {} bytes / scales at {:?} do not fit a {} {:?} tensor in backbone.bytes {}",
                    r.offset,
                    r.bytes,
                    r.scales_offset,
                    want.name(),
                    t.shape,
                    bb.bytes
                ),
            ));
        }
    }

    // Expert records: the layout convert writes, each record within the pack.
    let ex = &m.experts;
    let (layout, rec_len) = record_layout(&m.config.expert_matrices(), ex.dtype);
    if ex.layout != layout {
        return Err(bad(
            "experts.layout",
            format!(
                "disagrees with the config's expert matrices in {} (re-run `deltafin convert`)",
                ex.dtype.name()
            ),
        ));
    }
    for r in &ex.records {
        let in_range = r.offset.checked_add(r.length).is_some_and(|end| end <= ex.bytes);
        if r.length != rec_len || !in_range {
            return Err(bad(
                "experts.records",
                format!(
                    "record (layer {}, expert {}) at offset {} of {} bytes: expected {rec_len} bytes within experts.bytes {}",
                    r.layer, r.expert, r.offset, r.length, ex.bytes
                ),
            ));
        }
    }
    Ok(())
}

/// Walks the resolved config `v` (field `key`, named `field` in errors): integers within
/// [`int_bound`] of their key (token ids excepted), real numbers in their [`RANGES`] or finite.
fn check_config_numbers(v: &Value, field: &str, mpath: &Path) -> Result<(), FormatError> {
    let key = field.rsplit('.').next().unwrap_or(field);
    match v {
        Value::Object(o) => {
            for (k, x) in o {
                check_config_numbers(x, &format!("{field}.{k}"), mpath)?;
            }
        }
        Value::Array(a) => {
            for x in a {
                check_config_numbers(x, field, mpath)?;
            }
        }
        Value::Number(n) => {
            if let Some((_, range)) = RANGES.iter().find(|(k, _)| *k == key) {
                check_range(mpath, field, n.as_f64().unwrap_or(f64::NAN), *range)?;
            } else if let Some(x) = n.as_u64() {
                let bound = int_bound(key);
                if x > bound && !TOKEN_ID_FIELDS.contains(&key) {
                    return Err(FormatError::Config {
                        path: mpath.to_path_buf(),
                        field: field.to_string(),
                        message: format!("{x} is larger than this implementation supports (at most {bound})"),
                    });
                }
            } else {
                check_range(mpath, field, n.as_f64().unwrap_or(f64::NAN), Range::Finite)?;
            }
        }
        _ => {}
    }
    Ok(())
}

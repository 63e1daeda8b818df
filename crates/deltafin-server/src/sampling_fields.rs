//! The OpenAI sampling fields that adjust logits or truncate the distribution beyond
//! `temperature`/`top_p`/`top_k`/`seed`: `logit_bias`, `presence_penalty`, `frequency_penalty`,
//! `repetition_penalty` (vLLM's extension) and `min_p` (vLLM's extension). Each is honoured
//! (semantics in [`deltafin_engine::sampler`]) or the request is 400 naming the field; none is
//! accepted and ignored.

use deltafin_engine::sampler::SamplingParams;
use serde_json::Value;

use crate::error::ApiError;

/// The fields as the request gave them (`None`: absent or null).
#[derive(Debug, Default)]
pub(crate) struct SamplingFields<'a> {
    /// OpenAI `logit_bias`: an object mapping token ids (as strings) to biases in [-100, 100].
    pub logit_bias: Option<&'a Value>,
    /// OpenAI `presence_penalty`, in [-2, 2].
    pub presence_penalty: Option<f64>,
    /// OpenAI `frequency_penalty`, in [-2, 2].
    pub frequency_penalty: Option<f64>,
    /// vLLM `repetition_penalty`, greater than 0 (1 = off).
    pub repetition_penalty: Option<f64>,
    /// vLLM `min_p`, in [0, 1].
    pub min_p: Option<f64>,
}

impl SamplingFields<'_> {
    /// Sets the fields on `p` after checking them; `vocab_size` bounds `logit_bias` ids.
    ///
    /// Errors: 400 with `param` the field at fault and a message stating the allowed range.
    pub(crate) fn apply(&self, p: &mut SamplingParams, vocab_size: usize) -> Result<(), ApiError> {
        for (name, v, slot) in [
            ("presence_penalty", self.presence_penalty, &mut p.presence_penalty),
            ("frequency_penalty", self.frequency_penalty, &mut p.frequency_penalty),
        ] {
            if let Some(v) = v {
                if !(-2.0..=2.0).contains(&v) {
                    return Err(ApiError::invalid_param(
                        name,
                        format!("`{name}` must be between -2 and 2, got {v}"),
                    ));
                }
                *slot = v as f32;
            }
        }
        if let Some(r) = self.repetition_penalty {
            if !(r > 0.0 && (r as f32).is_finite()) {
                return Err(ApiError::invalid_param(
                    "repetition_penalty",
                    format!("`repetition_penalty` must be greater than 0 (1 = off), got {r}"),
                ));
            }
            p.repetition_penalty = r as f32;
        }
        if let Some(m) = self.min_p {
            if !(0.0..=1.0).contains(&m) {
                return Err(ApiError::invalid_param(
                    "min_p",
                    format!("`min_p` must be between 0 and 1, got {m}"),
                ));
            }
            p.min_p = m as f32;
        }
        if let Some(b) = self.logit_bias {
            p.logit_bias = logit_bias(b, vocab_size)?;
        }
        Ok(())
    }
}

/// OpenAI `logit_bias`: `{"<token id>": bias, ...}` with each id below `vocab_size` and each
/// bias a number in [-100, 100]; null or `{}` = none.
fn logit_bias(v: &Value, vocab_size: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::invalid_param("logit_bias", m);
    let map =
        match v {
            Value::Null => return Ok(Vec::new()),
            Value::Object(m) => m,
            _ => return Err(bad(
                "`logit_bias` must be an object mapping token ids to biases from -100 to 100, such as {\"42\": -100}"
                    .into(),
            )),
        };
    let mut out = Vec::with_capacity(map.len());
    for (key, bias) in map {
        let id = key
            .trim()
            .parse::<i64>()
            .map_err(|_| bad(format!("`logit_bias` key {key:?} is not a token id (an integer)")))?;
        if id < 0 || id as u64 >= vocab_size as u64 {
            return Err(bad(format!(
                "`logit_bias` token id {id} is out of range: the vocabulary has {vocab_size} tokens (ids 0 to {})",
                vocab_size.saturating_sub(1)
            )));
        }
        let b = bias.as_f64().filter(|b| (-100.0..=100.0).contains(b)).ok_or_else(|| {
            bad(format!(
                "`logit_bias` bias of token {id} must be a number from -100 to 100, got {bias}"
            ))
        })?;
        out.push((id as u32, b as f32));
    }
    Ok(out)
}

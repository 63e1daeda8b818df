//! The JSON body parser of every endpoint: turns malformed input into 400 (or 413, 408) in the
//! API's error shape instead of axum's plain-text rejections, naming the offending field.

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::http::StatusCode;
use serde::de::DeserializeOwned;

use crate::error::{ApiError, Flavor};
use crate::limits::MAX_TOP_LOGPROBS;

/// Whether reading the body failed because it stalled past the body timeout
/// (`tower_http::timeout::RequestBodyTimeoutLayer`).
fn timed_out(r: &BytesRejection) -> bool {
    let mut e: Option<&(dyn std::error::Error + 'static)> = Some(r);
    while let Some(x) = e {
        if x.is::<tower_http::timeout::TimeoutError>() {
            return true;
        }
        e = x.source();
    }
    false
}

/// Parses a request body as JSON into `T`: a body over the limit is 413, anything else
/// unreadable (malformed JSON, wrong types, missing required fields) is 400 with serde's
/// explanation. Unknown fields are ignored.
pub fn parse_body<T: DeserializeOwned>(body: Result<Bytes, BytesRejection>, flavor: Flavor) -> Result<T, ApiError> {
    let with_flavor = |e: ApiError| match flavor {
        Flavor::OpenAi => e,
        Flavor::Anthropic => e.anthropic(),
    };
    let bytes = body.map_err(|r| {
        let status = r.status();
        if timed_out(&r) {
            with_flavor(
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "the request body stalled: no data arrived within the body timeout (--body-timeout); was it shorter than its Content-Length?",
                )
                .code("request_timeout"),
            )
        } else if status == StatusCode::PAYLOAD_TOO_LARGE {
            with_flavor(
                ApiError::new(
                    status,
                    "request body is larger than the server's limit (--max-request-bytes)",
                )
                .code("request_too_large"),
            )
        } else {
            with_flavor(ApiError::bad_request(format!(
                "cannot read the request body: {}",
                r.body_text()
            )))
        }
    })?;
    let value: serde_json::Value = serde_json::from_slice(&bytes).map_err(|e| {
        with_flavor(ApiError::bad_request(format!(
            "the request body is not valid JSON: {e}"
        )))
    })?;
    if !value.is_object() {
        return Err(with_flavor(ApiError::bad_request(
            "the request body must be a JSON object",
        )));
    }
    // The path of the offending field (e.g. `max_tokens`, `messages[0].content`) names the
    // request parameter in the message and in `param`.
    serde_path_to_error::deserialize(&value).map_err(|e| {
        let path = e.path().to_string();
        let field = value_at(&value, e.path());
        let inner = e.into_inner().to_string();
        if path.is_empty() || path == "." {
            with_flavor(ApiError::bad_request(format!("invalid request: {inner}")))
        } else if let Some(message) = field.and_then(|v| integer_mismatch(&path, v, &inner)) {
            with_flavor(ApiError::invalid_param(&path, message))
        } else {
            with_flavor(ApiError::invalid_param(
                &path,
                format!("invalid request: `{path}`: {inner}"),
            ))
        }
    })
}

/// The value at a deserialization error's path, if the path leads to one.
fn value_at<'a>(root: &'a serde_json::Value, path: &serde_path_to_error::Path) -> Option<&'a serde_json::Value> {
    use serde_path_to_error::Segment;
    path.iter().try_fold(root, |v, seg| match seg {
        Segment::Seq { index } => v.get(*index),
        Segment::Map { key } => v.get(key.as_str()),
        Segment::Enum { .. } | Segment::Unknown => None,
    })
}

/// A clear message when an integer field got a JSON number that is not an integer of its
/// type: a fraction (`1.5`), or an integer outside the type's range (`1e23`, which JSON parsing
/// turns into a float, or `18446744073709551615` for an `i64`); None for any other error.
/// `serde_message` is serde's (`invalid type: floating point `1e23`, expected i64`), whose
/// expected type gives the range.
fn integer_mismatch(param: &str, v: &serde_json::Value, serde_message: &str) -> Option<String> {
    let serde_json::Value::Number(n) = v else {
        return None;
    };
    let (min, max): (i128, i128) = match serde_message.rsplit_once("expected ")?.1 {
        "i8" => (i8::MIN.into(), i8::MAX.into()),
        "i16" => (i16::MIN.into(), i16::MAX.into()),
        "i32" => (i32::MIN.into(), i32::MAX.into()),
        "i64" | "isize" => (i64::MIN.into(), i64::MAX.into()),
        "u8" => (0, u8::MAX.into()),
        "u16" => (0, u16::MAX.into()),
        "u32" => (0, u32::MAX.into()),
        "u64" | "usize" => (0, u64::MAX.into()),
        _ => return None,
    };
    if n.as_f64().is_some_and(|f| f.fract() != 0.0) {
        return Some(format!("`{param}` must be an integer, got {n}"));
    }
    let leaf = param.rsplit('.').next().unwrap_or(param);
    let range = match leaf {
        "max_tokens" | "max_completion_tokens" => {
            "a positive integer (at most what the context length leaves after the prompt)".to_string()
        }
        "logprobs" | "top_logprobs" => format!("an integer from 0 to {}", MAX_TOP_LOGPROBS),
        "n" | "best_of" => "1 (one completion per request)".to_string(),
        "top_k" => format!("-1, 0 (no limit) or a positive integer up to {max}"),
        _ => format!("an integer from {min} to {max}"),
    };
    Some(format!("`{param}` must be {range}, got {n}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(body: &str) -> ApiError {
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct R {
            max_tokens: Option<i64>,
            seed: Option<i64>,
            nested: Option<Nested>,
        }
        #[derive(serde::Deserialize, Debug)]
        #[allow(dead_code)]
        struct Nested {
            count: Option<u32>,
        }
        parse_body::<R>(Ok(Bytes::from(body.to_string())), Flavor::OpenAi).unwrap_err()
    }

    /// Integers out of their type's range (a float once parsed, or a too-large integer) and
    /// fractions name the parameter and its range instead of serde's "invalid type: floating
    /// point"; other type errors keep serde's explanation.
    #[test]
    fn out_of_range_integers_name_the_parameter_and_range() {
        let e = parse_err(r#"{"max_tokens": 99999999999999999999999}"#);
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(
            e.message.starts_with("`max_tokens` must be a positive integer"),
            "{}",
            e.message
        );
        assert!(e.message.ends_with("got 1e+23"), "{}", e.message);
        assert!(!e.message.contains("floating point"), "{}", e.message);
        let e = parse_err(r#"{"seed": 18446744073709551615}"#);
        assert_eq!(e.param.as_deref(), Some("seed"));
        assert_eq!(
            e.message,
            "`seed` must be an integer from -9223372036854775808 to 9223372036854775807, got 18446744073709551615"
        );
        let e = parse_err(r#"{"nested": {"count": -1}}"#);
        assert_eq!(e.param.as_deref(), Some("nested.count"));
        assert_eq!(
            e.message,
            "`nested.count` must be an integer from 0 to 4294967295, got -1"
        );
        let e = parse_err(r#"{"max_tokens": 2.5}"#);
        assert_eq!(e.message, "`max_tokens` must be an integer, got 2.5");
        let e = parse_err(r#"{"max_tokens": "four"}"#);
        assert_eq!(e.param.as_deref(), Some("max_tokens"));
        assert!(e.message.contains("invalid type: string"), "{}", e.message);
    }
}

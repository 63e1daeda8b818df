//! API errors in the OpenAI shape (`{"error":{"message","type","param","code"}}`) or the
//! Anthropic shape (`{"type":"error","error":{"type","message"}}`). The JSON body parser that
//! produces most of them is [`crate::body`].

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;

/// Which API's error shape to answer with.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flavor {
    /// `{"error":{"message","type","param","code"}}`
    OpenAi,
    /// `{"type":"error","error":{"type","message"}}`
    Anthropic,
}

/// An error answered to the client.
#[derive(Debug, Clone, thiserror::Error)]
#[error("{status}: {message}")]
pub struct ApiError {
    /// HTTP status.
    pub status: StatusCode,
    /// Human-readable explanation.
    pub message: String,
    /// The request field at fault, if one is.
    pub param: Option<String>,
    /// A machine-readable code (`context_length_exceeded`, `model_not_found`, ...).
    pub code: Option<&'static str>,
    /// Response shape.
    pub flavor: Flavor,
    /// Seconds for `Retry-After` (429).
    pub retry_after: Option<u64>,
}

impl ApiError {
    /// An error with `status` and `message` (OpenAI shape; no param, no code).
    pub fn new(status: StatusCode, message: impl Into<String>) -> Self {
        ApiError {
            status,
            message: message.into(),
            param: None,
            code: None,
            flavor: Flavor::OpenAi,
            retry_after: None,
        }
    }

    /// 400 invalid request.
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self::new(StatusCode::BAD_REQUEST, message)
    }

    /// 400 about one field.
    pub fn invalid_param(param: &str, message: impl Into<String>) -> Self {
        Self::bad_request(message).param(param)
    }

    /// 401.
    pub fn unauthorized() -> Self {
        let mut e = Self::new(
            StatusCode::UNAUTHORIZED,
            "invalid or missing API key: send `Authorization: Bearer KEY` (or `x-api-key: KEY`)",
        );
        e.code = Some("invalid_api_key");
        e
    }

    /// 404 for a model other than the served one.
    pub fn model_not_found(requested: &str, served: &str) -> Self {
        let mut e = Self::new(
            StatusCode::NOT_FOUND,
            format!("The model `{requested}` does not exist; this server serves `{served}`"),
        );
        e.param = Some("model".into());
        e.code = Some("model_not_found");
        e
    }

    /// 404 for an unknown route.
    pub fn route_not_found(path: &str) -> Self {
        let mut e = Self::new(StatusCode::NOT_FOUND, format!("no such endpoint: {path}"));
        e.code = Some("not_found");
        e
    }

    /// 429 while a generation runs and `max_queue` requests already wait (`--max-queue`).
    pub fn busy(max_queue: usize) -> Self {
        let mut e = Self::new(
            StatusCode::TOO_MANY_REQUESTS,
            format!("the server is busy: one generation runs and {max_queue} more wait (--max-queue {max_queue}). Retry shortly."),
        );
        e.code = Some("server_busy");
        e.retry_after = Some(1);
        e
    }

    /// 500.
    pub fn internal(message: impl Into<String>) -> Self {
        Self::new(StatusCode::INTERNAL_SERVER_ERROR, message)
    }

    /// Sets the field at fault.
    pub fn param(mut self, param: &str) -> Self {
        self.param = Some(param.to_string());
        self
    }

    /// Sets the code.
    pub fn code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    /// Switches to the Anthropic shape.
    pub fn anthropic(mut self) -> Self {
        self.flavor = Flavor::Anthropic;
        self
    }

    /// The OpenAI `type` string.
    fn openai_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            404 if self.code == Some("model_not_found") => "invalid_request_error",
            404 => "not_found_error",
            429 => "rate_limit_error",
            s if s >= 500 => "server_error",
            _ => "invalid_request_error",
        }
    }

    /// The Anthropic `error.type` string.
    fn anthropic_type(&self) -> &'static str {
        match self.status.as_u16() {
            401 => "authentication_error",
            403 => "permission_error",
            404 => "not_found_error",
            413 => "request_too_large",
            429 => "rate_limit_error",
            s if s >= 500 => "api_error",
            _ => "invalid_request_error",
        }
    }

    /// The JSON body.
    pub fn body(&self) -> serde_json::Value {
        match self.flavor {
            Flavor::OpenAi => json!({"error": {
                "message": self.message,
                "type": self.openai_type(),
                "param": self.param,
                "code": self.code,
            }}),
            Flavor::Anthropic => json!({"type": "error", "error": {
                "type": self.anthropic_type(),
                "message": self.message,
            }}),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(s) = self.retry_after {
            resp.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(s));
        }
        resp
    }
}

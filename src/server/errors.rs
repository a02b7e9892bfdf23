//! OpenAI-style errors: `{"error": {"message", "type", "param", "code"}}` with an HTTP status,
//! and the JSON body extractor that turns unreadable requests into them.

use std::collections::BTreeSet;

use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use serde::Serialize;
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::engine::scheduler::SubmitError;

/// An error answered to the client.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
}

#[derive(Serialize)]
struct ErrorBody<'a> {
    error: ErrorFields<'a>,
}

#[derive(Serialize)]
struct ErrorFields<'a> {
    message: &'a str,
    #[serde(rename = "type")]
    kind: &'a str,
    param: Option<&'a str>,
    code: Option<&'a str>,
}

impl ApiError {
    /// 400: the request is invalid; `param` names the offending field.
    pub fn invalid(param: impl Into<Option<&'static str>>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            kind: "invalid_request_error",
            param: param.into().map(str::to_owned),
            code: None,
        }
    }

    pub fn with_code(mut self, code: &'static str) -> Self {
        self.code = Some(code);
        self
    }

    pub fn with_status(mut self, status: StatusCode) -> Self {
        self.status = status;
        self
    }

    pub fn model_not_found(model: &str) -> Self {
        Self::invalid("model", format!("The model `{model}` does not exist."))
            .with_status(StatusCode::NOT_FOUND)
            .with_code("model_not_found")
    }

    pub fn unauthorized(message: &str) -> Self {
        Self {
            status: StatusCode::UNAUTHORIZED,
            message: message.to_owned(),
            kind: "invalid_request_error",
            param: None,
            code: Some("invalid_api_key"),
        }
    }

    pub fn not_found(path: &str) -> Self {
        Self::invalid(None, format!("No route for {path}."))
            .with_status(StatusCode::NOT_FOUND)
            .with_code("not_found")
    }

    /// 405: the path exists but not for this method.
    pub fn method_not_allowed(method: &str, path: &str) -> Self {
        Self::invalid(None, format!("{path} does not take {method} requests."))
            .with_status(StatusCode::METHOD_NOT_ALLOWED)
            .with_code("method_not_allowed")
    }

    /// 500: the engine failed while generating.
    pub fn internal(message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: message.into(),
            kind: "server_error",
            param: None,
            code: None,
        }
    }

    /// The body of the error, as sent in a response or a stream event.
    pub fn body(&self) -> Value {
        serde_json::to_value(ErrorBody {
            error: ErrorFields {
                message: &self.message,
                kind: self.kind,
                param: self.param.as_deref(),
                code: self.code,
            },
        })
        .unwrap_or(Value::Null)
    }
}

impl From<SubmitError> for ApiError {
    fn from(e: SubmitError) -> Self {
        match e {
            SubmitError::QueueFull => Self {
                status: StatusCode::TOO_MANY_REQUESTS,
                message: format!("{e}; retry later"),
                kind: "rate_limit_error",
                param: None,
                code: Some("queue_full"),
            },
            SubmitError::ShuttingDown => Self {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: e.to_string(),
                kind: "server_error",
                param: None,
                code: Some("shutting_down"),
            },
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, axum::Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            response
                .headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        response
    }
}

/// A JSON request body: a JSON object, read within the body size limit. Its errors are
/// [`ApiError`]s (413 for an oversized body, 400 for anything unreadable).
pub struct JsonObject(pub Value);

impl<S: Send + Sync> FromRequest<S> for JsonObject {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        let bytes = Bytes::from_request(req, state).await.map_err(|rejection| {
            let status = rejection.status();
            let message = if status == StatusCode::PAYLOAD_TOO_LARGE {
                "The request body is too large.".to_owned()
            } else {
                format!("Cannot read the request body: {}", rejection.body_text())
            };
            ApiError::invalid(None, message)
                .with_status(status)
                .with_code(if status == StatusCode::PAYLOAD_TOO_LARGE {
                    "request_too_large"
                } else {
                    "invalid_body"
                })
        })?;
        let value: Value = serde_json::from_slice(&bytes).map_err(|e| {
            ApiError::invalid(None, format!("The request body is not valid JSON: {e}"))
                .with_code("invalid_json")
        })?;
        if !value.is_object() {
            return Err(ApiError::invalid(
                None,
                "The request body must be a JSON object.",
            ));
        }
        Ok(Self(value))
    }
}

/// Reads the fields `T` describes from a request body, naming the field at fault on error.
pub fn fields<T: DeserializeOwned>(body: &Value) -> Result<T, ApiError> {
    serde_path_to_error::deserialize(body).map_err(field_error)
}

/// [`fields`], and the body's top-level fields that `T` does not read (for [`warn_unread`]),
/// in the same pass.
pub fn fields_and_unread<T: DeserializeOwned>(
    body: &Value,
) -> Result<(T, BTreeSet<String>), ApiError> {
    let mut unread = BTreeSet::new();
    let mut note = |path: serde_ignored::Path| {
        if let serde_ignored::Path::Map { parent, key } = path
            && matches!(parent, serde_ignored::Path::Root)
        {
            unread.insert(key);
        }
    };
    let noting = serde_ignored::Deserializer::new(body, &mut note);
    let value = serde_path_to_error::deserialize(noting).map_err(field_error)?;
    Ok((value, unread))
}

fn field_error(e: serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    let path = e.path().to_string();
    let inner = e.into_inner();
    let message = inner.to_string();
    if path == "." {
        // serde names a missing field only in its message: "missing field `x`".
        let mut error = ApiError::invalid(None, message.clone());
        error.param = message
            .strip_prefix("missing field `")
            .and_then(|rest| rest.split('`').next())
            .map(str::to_owned);
        error
    } else {
        let mut error = ApiError::invalid(None, format!("`{path}`: {message}"));
        error.param = Some(path);
        error
    }
}

/// OpenAI request fields for OpenAI's own bookkeeping, which change nothing lily computes:
/// taken without a word.
const BOOKKEEPING_FIELDS: [&str; 5] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
];

/// The fields of a request that none of its readers read (each set from
/// [`fields_and_unread`]), bookkeeping aside.
pub fn unread_fields(readers: &[BTreeSet<String>]) -> Vec<String> {
    let Some((first, rest)) = readers.split_first() else {
        return Vec::new();
    };
    first
        .iter()
        .filter(|f| rest.iter().all(|r| r.contains(*f)))
        .filter(|f| !BOOKKEEPING_FIELDS.contains(&f.as_str()))
        .cloned()
        .collect()
}

/// Logs the fields of a request that lily ignored (OpenAI's API refuses unknown fields; lily
/// takes them, as vLLM does, since clients send other servers' extensions, and says so).
pub fn warn_unread(endpoint: &str, readers: &[BTreeSet<String>]) {
    let unread = unread_fields(readers);
    if !unread.is_empty() {
        tracing::warn!(endpoint, fields = ?unread, "request fields lily does not take were ignored");
    }
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;
    use serde_json::json;

    use super::*;

    #[derive(Deserialize)]
    struct Common {
        _model: Option<String>,
    }

    #[derive(Deserialize)]
    struct Chat {
        _messages: Vec<Value>,
        #[serde(rename = "max_completion_tokens")]
        _max: Option<i64>,
    }

    #[test]
    fn unread_fields_are_those_no_reader_takes_bookkeeping_aside() {
        let body = json!({"_model": "m", "_messages": [{"role": "user", "x": 1}],
                          "max_completion_tokens": 3, "frobnicate": true, "user": "u",
                          "stop_sequences": ["a"]});
        let readers = [
            fields_and_unread::<Common>(&body).unwrap().1,
            fields_and_unread::<Chat>(&body).unwrap().1,
        ];
        assert!(readers[0].contains("_messages") && readers[1].contains("_model"));
        assert_eq!(unread_fields(&readers), ["frobnicate", "stop_sequences"]);
        assert!(unread_fields(&[]).is_empty());
    }
}

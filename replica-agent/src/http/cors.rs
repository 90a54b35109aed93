//! CORS as vLLM's server has it by default (Starlette's `CORSMiddleware` with every origin,
//! method and header allowed, no credentials): a preflight (`OPTIONS` with `Origin` and
//! `Access-Control-Request-Method`) is answered 200 on any path with what it may send; any
//! other request with an `Origin` gets `access-control-allow-origin: *` on its answer.

use hyper::header::{self, HeaderMap, HeaderValue};
use hyper::{Method, Response, StatusCode};

use super::{Body, full};

/// The answer to `method` with `headers` if it is a preflight.
pub(super) fn preflight(method: &Method, headers: &HeaderMap) -> Option<Response<Body>> {
    if method != Method::OPTIONS
        || !headers.contains_key(header::ORIGIN)
        || !headers.contains_key(header::ACCESS_CONTROL_REQUEST_METHOD)
    {
        return None;
    }
    let mut response = Response::new(full(b"OK".to_vec()));
    *response.status_mut() = StatusCode::OK;
    let h = response.headers_mut();
    h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain; charset=utf-8"));
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
    h.insert(
        header::ACCESS_CONTROL_ALLOW_METHODS,
        HeaderValue::from_static("DELETE, GET, HEAD, OPTIONS, PATCH, POST, PUT"),
    );
    h.insert(header::ACCESS_CONTROL_MAX_AGE, HeaderValue::from_static("600"));
    // Every header allowed: the ones asked for, echoed.
    if let Some(asked) = headers.get(header::ACCESS_CONTROL_REQUEST_HEADERS) {
        h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
    }
    Some(response)
}

/// Lets a browser read `response` to a request from another origin.
pub(super) fn allow(response: &mut Response<Body>) {
    response.headers_mut().insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, HeaderValue::from_static("*"));
}

//! Response heads from a replica: parsed with `httparse`, and how their body is delimited.

use std::mem::MaybeUninit;

use bytes::Bytes;
use http::header::{self, HeaderMap, HeaderName, HeaderValue};
use http::{Method, Response, StatusCode, Version};

use super::WireError;

/// Largest response head (status line and headers) read from a replica.
pub const MAX_HEAD_BYTES: usize = 64 * 1024;
/// Most response headers read from a replica.
pub(super) const MAX_HEADERS: usize = 100;

/// How a response body is delimited (RFC 9112 §6.3).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Framing {
    Length(u64),
    Chunked,
    UntilClose,
}

/// A parsed response head.
#[derive(Debug)]
pub struct Head {
    pub parts: http::response::Parts,
    pub framing: Framing,
    /// The replica keeps the connection open after this response.
    pub keep_alive: bool,
}

/// Parses a response head at the start of `buf`: its length and the head, or `None` if it
/// is not complete yet. A `101 Switching Protocols` is malformed: the proxy's requests do not
/// ask for an upgrade (`Upgrade` is hop-by-hop), except [`parse_upgrade_head`]'s.
pub fn parse_head(buf: &[u8], method: &Method) -> Result<Option<(usize, Head)>, WireError> {
    parse(buf, method, false)
}

/// [`parse_head`] of the answer to a request that asked for an upgrade: a 101 is its answer.
pub fn parse_upgrade_head(buf: &[u8], method: &Method) -> Result<Option<(usize, Head)>, WireError> {
    parse(buf, method, true)
}

fn parse(buf: &[u8], method: &Method, upgrading: bool) -> Result<Option<(usize, Head)>, WireError> {
    // Left uninitialized: zeroing 100 fields for every response showed in profiles.
    let mut headers = [const { MaybeUninit::uninit() }; MAX_HEADERS];
    let mut parsed = httparse::Response::new(&mut []);
    let length = match httparse::ParserConfig::default().parse_response_with_uninit_headers(
        &mut parsed,
        buf,
        &mut headers,
    ) {
        Ok(httparse::Status::Complete(n)) => n,
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(e) => return Err(WireError::Malformed(e.to_string())),
    };
    let code = parsed.code.unwrap_or_default();
    let status = StatusCode::from_u16(code).map_err(|_| WireError::Malformed(format!("status {code}")))?;
    if status == StatusCode::SWITCHING_PROTOCOLS && !upgrading {
        return Err(WireError::Malformed("101 Switching Protocols, unasked".into()));
    }
    let version = if parsed.version == Some(1) { Version::HTTP_11 } else { Version::HTTP_10 };
    // The values share one copy of the head instead of taking a copy each.
    let copy = Bytes::copy_from_slice(&buf[..length]);
    let mut map = HeaderMap::with_capacity(parsed.headers.len());
    for h in parsed.headers.iter() {
        let name = HeaderName::from_bytes(h.name.as_bytes())
            .map_err(|_| WireError::Malformed(format!("header name {:?}", h.name)))?;
        // httparse's values lie within `buf`; anything else is copied on its own.
        let value = match (h.value.as_ptr() as usize).checked_sub(buf.as_ptr() as usize) {
            Some(at) if at + h.value.len() <= length => {
                HeaderValue::from_maybe_shared(copy.slice(at..at + h.value.len()))
            }
            _ => HeaderValue::from_bytes(h.value),
        }
        .map_err(|_| WireError::Malformed(format!("value of header {name}")))?;
        map.append(name, value);
    }
    // An HTTP/1.0 message's Transfer-Encoding is faulty framing (RFC 9112 §6.1).
    if version == Version::HTTP_10 && map.contains_key(header::TRANSFER_ENCODING) {
        return Err(WireError::Malformed("Transfer-Encoding in an HTTP/1.0 response".into()));
    }
    let framing = framing(&map, status, method)?;
    // Transfer-Encoding overrides Content-Length, which a proxy must not pass on; a reply
    // with both is suspect, so its connection is not reused (RFC 9112 §6.3).
    let both = map.contains_key(header::TRANSFER_ENCODING) && map.remove(header::CONTENT_LENGTH).is_some();
    let close = both || connection_options(&map).any(|option| option.eq_ignore_ascii_case(b"close"));
    let keep_alive = version == Version::HTTP_11 && !close && framing != Framing::UntilClose;
    let mut response = Response::new(());
    *response.status_mut() = status;
    *response.version_mut() = version;
    *response.headers_mut() = map;
    let (parts, ()) = response.into_parts();
    Ok(Some((length, Head { parts, framing, keep_alive })))
}

/// The options of every `Connection` field, trimmed, as bytes: a value that is not UTF-8
/// elsewhere must not hide its `close` (RFC 9110 §7.6.1).
pub fn connection_options(headers: &HeaderMap) -> impl Iterator<Item = &[u8]> {
    headers
        .get_all(header::CONNECTION)
        .iter()
        .flat_map(|v| v.as_bytes().split(|&b| b == b','))
        .map(<[u8]>::trim_ascii)
}

/// RFC 9112 §6.3, for a response to `method`.
fn framing(headers: &HeaderMap, status: StatusCode, method: &Method) -> Result<Framing, WireError> {
    if *method == Method::HEAD
        || status.is_informational()
        || status == StatusCode::NO_CONTENT
        || status == StatusCode::NOT_MODIFIED
    {
        return Ok(Framing::Length(0));
    }
    let mut codings = headers.get_all(header::TRANSFER_ENCODING).iter().peekable();
    if codings.peek().is_some() {
        // Only `chunked` is decoded: another coding (gzip) would reach the client encoded
        // once `Transfer-Encoding`, a hop-by-hop field, is dropped.
        let only_chunked = codings
            .flat_map(|v| v.to_str().unwrap_or("?").split(','))
            .map(str::trim)
            .filter(|coding| !coding.is_empty())
            .try_fold(false, |seen, coding| {
                (!seen && coding.eq_ignore_ascii_case("chunked")).then_some(true)
            });
        return match only_chunked {
            Some(true) => Ok(Framing::Chunked),
            _ => Err(WireError::Malformed("a transfer coding other than chunked".into())),
        };
    }
    let mut lengths = headers.get_all(header::CONTENT_LENGTH).iter();
    let Some(first) = lengths.next() else { return Ok(Framing::UntilClose) };
    let parse = |v: &HeaderValue| -> Option<u64> {
        let s = v.to_str().ok()?.trim();
        if s.is_empty() || !s.bytes().all(|b| b.is_ascii_digit()) {
            return None;
        }
        s.parse().ok()
    };
    let n = parse(first).ok_or_else(|| WireError::Malformed("bad Content-Length".into()))?;
    if lengths.any(|v| parse(v) != Some(n)) {
        return Err(WireError::Malformed("conflicting Content-Length headers".into()));
    }
    Ok(Framing::Length(n))
}

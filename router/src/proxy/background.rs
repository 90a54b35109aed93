//! Responses generated in the background (`"background": true` in a Responses request:
//! [`Keeps::Background`]). vLLM answers one at once, its response `queued` (or streams it, and
//! generates on if the stream's client leaves), and generates it for as long as it takes. The
//! request's places (under `--max-in-flight`, and its key's under `--max-in-flight-per-key`)
//! and its load on its replica would end with the answer, and a client could start any number
//! of generations: so the router holds them until the stored response is final.
//!
//! It asks the replica that stored it (`GET /v1/responses/{id}`, with the `Authorization` the
//! request was sent with: `--replica-api-key`'s, else the client's) [`FIRST_ASK`] after the
//! answer ended, then at intervals doubling up to [`MOST_BETWEEN`], and lets go when
//! - the response's `status` is neither `queued` nor `in_progress` (`completed`,
//!   `incomplete`, `failed`, `cancelled`; an answer longer than [`MOST_READ`] counts as final:
//!   a response not yet done has no output);
//! - the replica says it has no such response (404: it restarted);
//! - the replica is out of the fleet;
//! - [`UNANSWERED`] asks in a row got no answer it could read: none in time, or one of
//!   another status (its process is gone, and the generation with it, or it refuses the
//!   router);
//! - [`MOST_HELD`] went by, or the router shuts down.
//!
//! A stream read to its end ended with its response: nothing is held then.
//!
//! Such a request is decided and sent apart from its client (`proxy::apart`), and its answer's
//! beginning is read before it is handed on ([`with_id_read`]): a client that leaves at once
//! (its connection closed as soon as the request went, its HTTP/2 stream reset) does not
//! take the forward with it, and the places are held by the response's id all the same. (A
//! client that leaves while its request waits for room leaves the line, as any other.) An
//! answer that ended before it showed an id (cut off) holds nothing (`unlearned`). The access
//! log's line of such a request is written when the router has read its answer (a queued
//! response is read whole); a client gone by then has a line of its own too (499).
//!
//! Held, the places count as the request's did: the queue, per-key limits and the policy's in-flight load see
//! a request running on the replica (though not its prefill tokens, let go at the answer's
//! first data: the router cannot tell when the replica prefills it). The responses held are
//! `kvroute_router_background_responses`; each let go counts in
//! `kvroute_router_background_released_total{outcome}`, by the reasons above: `final`,
//! `missing`, `gone`, `unanswered`, `expired`, `shutdown`, and `unlearned`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http::StatusCode;
use http::header::{self, HeaderValue};
use percent_encoding::utf8_percent_encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use super::body::{BoxError, ProxyBody, full, read_at_most};
use super::control::Client;
use super::forward::Slot;
use super::responses::{ID_WITHIN, RESPONSES_PATH, SEGMENT, first_id};
use super::upstream::LoadGuard;
use crate::fleet::Fleet;
use crate::metrics::{OutcomeLabel, ProxyMetrics};

#[cfg(doc)]
use super::responses::Keeps;

/// The first ask, after the answer ended.
pub const FIRST_ASK: Duration = Duration::from_millis(250);
/// The longest wait between two asks.
pub const MOST_BETWEEN: Duration = Duration::from_secs(5);
/// Asks in a row without an answer before the places are let go.
pub const UNANSWERED: u32 = 5;
/// The longest a background response is held.
pub const MOST_HELD: Duration = Duration::from_secs(3600);
/// The most of an answer read for its status.
pub const MOST_READ: usize = 1 << 20;

/// Holds background responses' places, and asks their replicas how they stand.
pub struct Backgrounds {
    client: Client,
    fleet: Fleet,
    /// Each ask's (`--control-timeout-ms`).
    timeout: Duration,
    shutdown: CancellationToken,
    held: Gauge,
    released: Family<OutcomeLabel, Counter>,
}

impl std::fmt::Debug for Backgrounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backgrounds").field("held", &self.held.get()).finish_non_exhaustive()
    }
}

/// What a background response holds: its request's load on its replica, and its places.
pub struct Places {
    pub guard: LoadGuard,
    pub slot: Option<Slot>,
}

/// How a stored response stands, as its replica says.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Stands {
    Running,
    Final,
    Missing,
}

impl Backgrounds {
    /// Asking `fleet`'s replicas with `client`, each ask within `timeout`, until `shutdown`.
    pub fn new(
        (client, fleet): (Client, Fleet),
        timeout: Duration,
        shutdown: CancellationToken,
        metrics: &ProxyMetrics,
    ) -> Self {
        let (held, released) = (metrics.background_responses.clone(), metrics.background_released.clone());
        Backgrounds { client, fleet, timeout, shutdown, held, released }
    }

    /// Holds `places` until response `id`, stored by replica `replica` (asked with
    /// `authorization`), is final.
    pub fn hold(
        self: &Arc<Self>,
        id: Box<str>,
        replica: Arc<str>,
        authorization: Option<HeaderValue>,
        places: Places,
    ) {
        // (A body dropped with its runtime, at its end: nothing left to hold for.)
        let Ok(runtime) = tokio::runtime::Handle::try_current() else { return };
        let this = self.clone();
        runtime.spawn(async move {
            this.held.inc();
            let reason = this.watch(&id, &replica, authorization.as_ref()).await;
            drop(places);
            this.held.dec();
            this.released.get_or_create(&OutcomeLabel { outcome: reason }).inc();
        });
    }

    /// A background response's answer ended (cut off) before it showed the response's id:
    /// nothing to ask for, so its places go at once, counted as `unlearned`.
    pub fn unlearned(&self) {
        self.released.get_or_create(&OutcomeLabel { outcome: "unlearned" }).inc();
    }

    /// Waits until response `id` is final (or is let go for another reason: the module's
    /// list), and says why.
    async fn watch(&self, id: &str, replica: &str, authorization: Option<&HeaderValue>) -> &'static str {
        let since = tokio::time::Instant::now();
        let (mut wait, mut unanswered) = (FIRST_ASK, 0);
        loop {
            tokio::select! {
                () = self.shutdown.cancelled() => return "shutdown",
                () = tokio::time::sleep(wait) => {}
            }
            if since.elapsed() >= MOST_HELD {
                return "expired";
            }
            let Some(member) = self.fleet.member(replica) else { return "gone" };
            match self.ask(&member.replica.spec.http_url, id, authorization).await {
                Some(Stands::Final) => return "final",
                Some(Stands::Missing) => return "missing",
                Some(Stands::Running) => unanswered = 0,
                None => {
                    unanswered += 1;
                    if unanswered >= UNANSWERED {
                        return "unanswered";
                    }
                }
            }
            wait = (wait * 2).min(MOST_BETWEEN);
        }
    }

    /// How response `id` stands on the replica at `base`, if it answered readably in time.
    async fn ask(&self, base: &str, id: &str, authorization: Option<&HeaderValue>) -> Option<Stands> {
        let url = format!("{base}{RESPONSES_PATH}/{}", utf8_percent_encode(id, SEGMENT));
        let mut request = http::Request::get(url).body(full(Bytes::new())).ok()?;
        if let Some(authorization) = authorization {
            request.headers_mut().insert(header::AUTHORIZATION, authorization.clone());
        }
        let ask = async {
            let response = self.client.request(request).await.ok()?;
            match response.status() {
                StatusCode::OK => {}
                StatusCode::NOT_FOUND => return Some(Stands::Missing),
                _ => return None,
            }
            match read_at_most(response.into_body(), MOST_READ).await {
                Ok(body) => stands(&body),
                Err(e) if e.is::<http_body_util::LengthLimitError>() => Some(Stands::Final),
                Err(_) => None,
            }
        };
        tokio::time::timeout(self.timeout, ask).await.ok()?
    }
}

/// `response` with its body's beginning read, up to the response's id (the first `"id"` of a
/// JSON answer or of a stream's first event, within [`ID_WITHIN`] bytes), or its end, or a
/// failure: the answer's hooks have seen the id ([`super::responses::Learner`]) whether or
/// not its client takes the rest.
pub async fn with_id_read(response: http::Response<ProxyBody>) -> http::Response<ProxyBody> {
    use http_body_util::BodyExt;
    let (parts, mut body) = response.into_parts();
    let (mut read, mut seen) = (std::collections::VecDeque::new(), Vec::new());
    let ended = loop {
        let Some(frame) = body.frame().await else { break true };
        let failed = frame.is_err();
        if let Some(data) = frame.as_ref().ok().and_then(|f| f.data_ref()) {
            seen.extend_from_slice(&data[..data.len().min(ID_WITHIN.saturating_sub(seen.len()))]);
        }
        read.push_back(frame);
        if failed || first_id(&seen).is_some() || seen.len() >= ID_WITHIN {
            break failed;
        }
    };
    let rest = (!ended).then_some(body);
    http::Response::from_parts(parts, Prefixed { read, rest }.boxed_unsync())
}

/// A body's frames read already, then the rest of it.
struct Prefixed {
    read: std::collections::VecDeque<Result<http_body::Frame<Bytes>, BoxError>>,
    rest: Option<ProxyBody>,
}

impl http_body::Body for Prefixed {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, BoxError>>> {
        if let Some(frame) = self.read.pop_front() {
            return std::task::Poll::Ready(Some(frame));
        }
        match &mut self.rest {
            Some(rest) => std::pin::Pin::new(rest).poll_frame(cx),
            None => std::task::Poll::Ready(None),
        }
    }

    fn is_end_stream(&self) -> bool {
        self.read.is_empty() && self.rest.as_ref().is_none_or(http_body::Body::is_end_stream)
    }

    fn size_hint(&self) -> http_body::SizeHint {
        let read: u64 = (self.read.iter().flatten())
            .filter_map(|frame| frame.data_ref().map(|data| data.len() as u64))
            .sum();
        let rest =
            self.rest.as_ref().map_or_else(|| http_body::SizeHint::with_exact(0), http_body::Body::size_hint);
        // The upper bound first: `SizeHint` refuses a lower one past the one it has.
        let mut hint = http_body::SizeHint::new();
        if let Some(upper) = rest.upper() {
            hint.set_upper(upper.saturating_add(read));
        }
        hint.set_lower(rest.lower().saturating_add(read));
        hint
    }
}

/// How the stored response `json` stands, by its `status`.
fn stands(json: &[u8]) -> Option<Stands> {
    #[derive(serde::Deserialize)]
    struct Status<'a> {
        #[serde(borrow)]
        status: Cow<'a, str>,
    }
    let status = serde_json::from_slice::<Status>(json).ok()?.status;
    Some(match &*status {
        "queued" | "in_progress" => Stands::Running,
        _ => Stands::Final,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The body the client gets is what was read, then the rest, its size known: a whole
    /// JSON answer read already (a panic, its bounds set in the wrong order), and one part
    /// read.
    #[tokio::test]
    async fn an_answer_read_up_to_its_id_is_handed_on_whole() {
        use http_body_util::BodyExt;
        let json = br#"{"id":"resp_1","status":"queued"}"#;
        let whole = http::Response::new(full(Bytes::from_static(json)));
        let handed = with_id_read(whole).await.into_body();
        assert_eq!(http_body::Body::size_hint(&handed).exact(), Some(json.len() as u64));
        assert_eq!(&handed.collect().await.unwrap().to_bytes()[..], json);

        let first: &'static [u8] = b"event: response.created\ndata: {\"response\":{\"id\":\"resp_2\"}}\n\n";
        let frames = [first, b"rest"];
        let data = frames.map(|f| Ok::<_, BoxError>(http_body::Frame::data(Bytes::from_static(f))));
        let body = http_body_util::StreamBody::new(futures::stream::iter(data)).boxed_unsync();
        let handed = with_id_read(http::Response::new(body)).await.into_body();
        let hint = http_body::Body::size_hint(&handed);
        assert!(hint.lower() >= first.len() as u64 && hint.upper().is_none(), "{hint:?}");
        assert_eq!(handed.collect().await.unwrap().to_bytes(), [first, b"rest"].concat());
    }

    #[test]
    fn a_response_runs_while_queued_or_in_progress() {
        let of = |json: &str| stands(json.as_bytes());
        assert_eq!(
            of(r#"{"id":"resp_1","output":[],"status":"queued","usage":null}"#),
            Some(Stands::Running)
        );
        assert_eq!(of(r#"{"status":"in_progress"}"#), Some(Stands::Running));
        for done in ["completed", "incomplete", "failed", "cancelled"] {
            assert_eq!(of(&format!(r#"{{"status":"{done}"}}"#)), Some(Stands::Final), "{done}");
        }
        assert_eq!(of(r#"{"id":"resp_1"}"#), None, "no status: unreadable");
        assert_eq!(of("<html>"), None);
    }
}

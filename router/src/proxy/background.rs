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
//! A stream read to its end ended with its response: nothing is held then. Nor is anything
//! held when the answer ended before it showed the response's id (`unlearned`): its client
//! left before the router read it (the answer's body is read as the client takes it), or
//! before the answer came at all (not counted: the request is dropped with its client). The
//! replica generates on, holding nothing: closing one's connection at once is a way around
//! the hold, which reading such answers apart from their clients would close. Held, the places
//! count as the request's did: the queue, per-key limits and the policy's in-flight load see
//! a request running on the replica (though not its prefill tokens, let go at the answer's
//! first data: the router cannot tell when the replica prefills it). The responses held are
//! `kvroute_router_background_responses`; each let go counts in
//! `kvroute_router_background_released_total{outcome}`, by the reasons above: `final`,
//! `missing`, `gone`, `unanswered`, `expired`, `shutdown`, and `unlearned`.

use std::borrow::Cow;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::StatusCode;
use http::header::{self, HeaderValue};
use percent_encoding::utf8_percent_encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use tokio_util::sync::CancellationToken;

use super::body::{full, read_at_most};
use super::control::Client;
use super::forward::Slot;
use super::responses::{RESPONSES_PATH, SEGMENT};
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
        this.held.inc();
        runtime.spawn(async move {
            let reason = this.watch(&id, &replica, authorization.as_ref()).await;
            drop(places);
            this.held.dec();
            this.released.get_or_create(&OutcomeLabel { outcome: reason }).inc();
        });
    }

    /// A background response's answer ended (its client left, say) before it showed the
    /// response's id: nothing to ask for, so its places go at once, counted as `unlearned`.
    pub fn unlearned(&self) {
        self.released.get_or_create(&OutcomeLabel { outcome: "unlearned" }).inc();
    }

    /// Waits until response `id` is final (or is let go for another reason: the module's
    /// list), and says why.
    async fn watch(&self, id: &str, replica: &str, authorization: Option<&HeaderValue>) -> &'static str {
        let since = Instant::now();
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

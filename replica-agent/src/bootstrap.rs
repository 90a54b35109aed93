//! Disaggregated prefill as SGLang plays it (`--disaggregation-mode prefill|decode`), so a
//! router can split a request between a prefill replica (P) and a decode replica (D) in
//! front of agents as in front of SGLang.
//!
//! 1. The router sends the request to P and to D at once, each with the same
//!    `bootstrap_host` (P's host), `bootstrap_port` (P's bootstrap port, or null for D's own
//!    `--disaggregation-bootstrap-port`) and `bootstrap_room` (a random integer naming the
//!    hand-over).
//! 2. P computes the prompt and one token, as for any request (its prefix cache and events
//!    too), then waits for D to take the room's KV; only then does it answer, one token
//!    long (`finish_reason` `length`), as SGLang's P answers once its transfer succeeded.
//! 3. D asks P's bootstrap server for the room and waits for P's prefill; it then takes what
//!    its own prefix cache holds, pulls the rest of the prompt but its last token (each
//!    pulled token costs [`crate::engine::LOAD_SHARE`] of a prefill token), and decodes. It
//!    reports P's cached tokens as its own, as SGLang's D copies them from P; it caches and
//!    publishes the prompt's blocks.
//!
//! A batch of prompts has a room a prompt: a list of rooms (hosts, ports), one a prompt, as
//! SGLang's router sends them, or one room `r` for them all, which names `r`, `r + 1`, ...,
//! as SGLang's servers read it.
//!
//! Either side gives up after `--disaggregation-timeout-ms` (SGLang's bootstrap and waiting
//! timeouts, 300 s): P's answer, or D's, is then a 500. A completion or chat without
//! `bootstrap_room` is refused with a 400 by both, as SGLang refuses it; Messages and
//! Responses requests are served whole (not modelled).
//!
//! Not modelled: the bytes (P's bootstrap server here answers one route of its own,
//! `GET /kvroute/rooms/{room}`, not SGLang's registration protocol), several choices (`n`: a
//! request for them is refused; SGLang's servers give every choice of a prompt its first
//! room), P's stream (the router asks P for a whole answer), and a batch's prompts handed over
//! one by one (P hands them all over once the batch is done; SGLang's, each as its prefill
//! ends).

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// `--disaggregation-mode`: SGLang's names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Mode {
    /// Neither: bootstrap fields are ignored.
    #[default]
    Null,
    /// Computes prompts for decode replicas; serves the bootstrap port.
    Prefill,
    /// Decodes prompts pulled from prefill replicas.
    Decode,
}

/// SGLang's default `--disaggregation-bootstrap-port`.
pub const DEFAULT_PORT: u16 = 8998;

/// What a request's bootstrap fields name: where D finds P, and the hand-over of each of its
/// prompts ([`Bootstrap::rooms`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bootstrap {
    hosts: Each<Option<String>>,
    ports: Each<Option<u16>>,
    rooms: Each<u64>,
}

/// A field given once for every prompt, or once for each.
#[derive(Clone, Debug, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
enum Each<T> {
    One(T),
    Many(Vec<T>),
}

impl<T: Clone> Each<T> {
    /// Prompt `i`'s of `n`, `one` making a field given once into prompt `i`'s.
    fn of(&self, i: usize, n: usize, field: &str, one: impl Fn(&T, usize) -> T) -> Result<T, String> {
        match self {
            Each::One(value) => Ok(one(value, i)),
            Each::Many(values) if values.len() == n => Ok(values[i].clone()),
            Each::Many(values) => Err(format!("{field} has {} values for {n} prompts", values.len())),
        }
    }
}

/// One prompt's hand-over: where D finds P, and the room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Room {
    /// `None` for P (its own host).
    pub host: Option<String>,
    /// `None`: D's own `--disaggregation-bootstrap-port`.
    pub port: Option<u16>,
    pub room: u64,
}

impl Bootstrap {
    /// The hand-over of each of `prompts` prompts. A room given once, `r`, is prompt `i`'s
    /// `r + i` (as SGLang reads it); a list gives one a prompt.
    pub fn rooms(&self, prompts: usize) -> Result<Vec<Room>, String> {
        (0..prompts)
            .map(|i| {
                let room =
                    self.rooms.of(i, prompts, "bootstrap_room", |room, i| room.wrapping_add(i as u64))?;
                let host = self.hosts.of(i, prompts, "bootstrap_host", |host, _| host.clone())?;
                let port = self.ports.of(i, prompts, "bootstrap_port", |port, _| *port)?;
                Ok(Room { host, port, room })
            })
            .collect()
    }
}

/// A field, unless absent or null.
fn present(raw: Option<&RawValue>) -> Option<&RawValue> {
    raw.filter(|raw| raw.get() != "null")
}

/// Reads `bootstrap_host`, `bootstrap_port` and `bootstrap_room` (each a value, or a list of
/// one a prompt) in `mode`. `Ok(None)`: not disaggregated here. `Err`: refused (no room, a
/// field of the wrong type, a decode replica not told where its prefill replica is).
pub fn asked(mode: Mode, [host, port, room]: [Option<&RawValue>; 3]) -> Result<Option<Bootstrap>, String> {
    if mode == Mode::Null {
        return Ok(None);
    }
    let Some(room) = present(room) else {
        return Err("Disaggregated request received without bootstrap room id".into());
    };
    let rooms = serde_json::from_str(room.get())
        .map_err(|_| "bootstrap_room must be a non-negative integer, or a list of them")?;
    let ports = match present(port) {
        Some(port) => serde_json::from_str(port.get())
            .map_err(|_| "bootstrap_port must be a port number, or a list of them")?,
        None => Each::One(None),
    };
    let hosts = match present(host) {
        Some(host) => serde_json::from_str(host.get())
            .map_err(|_| "bootstrap_host must be a string, or a list of them")?,
        None => Each::One(None),
    };
    let no_host = match &hosts {
        Each::One(host) => host.is_none(),
        Each::Many(hosts) => hosts.iter().any(Option::is_none),
    };
    if mode == Mode::Decode && no_host {
        return Err("bootstrap_host is required by a decode replica".into());
    }
    Ok(Some(Bootstrap { hosts, ports, rooms }))
}

/// What P hands over for a room: what D reports of the prompt.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Transfer {
    pub prompt_tokens: usize,
    /// P's prefix-cache hit, which D reports as its own.
    pub cached_tokens: u32,
}

/// A room as both sides see it.
#[derive(Clone, Copy, Debug, Default)]
struct Handover {
    /// D asked for it.
    claimed: bool,
    /// P's prefill ended.
    transfer: Option<Transfer>,
}

/// P's rooms, and D's way to P's: one per agent.
pub struct Rooms {
    rooms: Mutex<HashMap<u64, watch::Sender<Handover>>>,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
    /// Cancelled when the engines stopped (at the shutdown once they run nothing, else when
    /// its grace is over): no wait for a room outlasts them, or a shutdown would wait out the
    /// timeout for a decode replica that can no longer come (the bootstrap server stops at the
    /// shutdown).
    closed: CancellationToken,
}

impl Rooms {
    pub fn new(timeout: Duration) -> Self {
        let client = Client::builder(TokioExecutor::new()).build_http();
        Rooms { rooms: Mutex::default(), timeout, client, closed: CancellationToken::new() }
    }

    /// Ends every wait for a room, and those to come: the engines stopped.
    pub fn close(&self) {
        self.closed.cancel();
    }

    fn room(&self, id: u64) -> watch::Sender<Handover> {
        let mut rooms = self.rooms.lock().unwrap_or_else(|e| e.into_inner());
        rooms.entry(id).or_insert_with(|| watch::channel(Handover::default()).0).clone()
    }

    /// Waits until `room` is as `ready` says (or the timeout); the room is forgotten after,
    /// and when the wait is dropped (its request gone).
    async fn until(
        &self,
        id: u64,
        room: watch::Sender<Handover>,
        ready: impl Fn(&Handover) -> bool,
    ) -> Option<Handover> {
        let _forget = Forget { rooms: self, id, room: room.clone() };
        let mut changes = room.subscribe();
        let seen =
            self.closed.run_until_cancelled(tokio::time::timeout(self.timeout, changes.wait_for(ready)));
        seen.await.and_then(Result::ok).and_then(Result::ok).map(|room| *room)
    }

    /// P: hands `transfer` over to the room's D, once D has come for it.
    pub async fn hand_over(&self, id: u64, transfer: Transfer) -> Result<(), String> {
        let room = self.room(id);
        room.send_modify(|room| room.transfer = Some(transfer));
        match self.until(id, room, |room| room.claimed).await {
            Some(_) => Ok(()),
            None if self.closed.is_cancelled() => {
                Err(format!("the replica stopped before a decode replica came for bootstrap room {id}"))
            }
            None => Err(format!("no decode replica came for bootstrap room {id} in {:?}", self.timeout)),
        }
    }

    /// P's bootstrap server: D comes for room `id`, and waits for its prefill.
    async fn claim(&self, id: u64) -> Option<Transfer> {
        let room = self.room(id);
        room.send_modify(|room| room.claimed = true);
        self.until(id, room, |room| room.transfer.is_some()).await?.transfer
    }

    /// D: the prefill of `room`, from P's bootstrap server (`own_port` when the request names
    /// none).
    pub async fn pull(&self, room: &Room, own_port: u16) -> Result<Transfer, String> {
        let port = room.port.unwrap_or(own_port);
        let Some(host) = &room.host else {
            return Err(format!("bootstrap room {} names no bootstrap_host", room.room));
        };
        let uri = format!("http://{host}:{port}/kvroute/rooms/{}", room.room);
        let failed = |e: &dyn std::fmt::Display| format!("bootstrap {uri}: {e}");
        let request = Request::get(&uri).body(Full::default()).map_err(|e| failed(&e))?;
        let answer = tokio::time::timeout(self.timeout, async {
            let response = self.client.request(request).await.map_err(|e| failed(&e))?;
            let status = response.status();
            let body = response.into_body().collect().await.map_err(|e| failed(&e))?.to_bytes();
            if !status.is_success() {
                return Err(failed(&format!("{status}: {}", String::from_utf8_lossy(&body))));
            }
            serde_json::from_slice(&body).map_err(|e| failed(&e))
        });
        match self.closed.run_until_cancelled(answer).await {
            Some(answer) => {
                answer.unwrap_or_else(|_| Err(failed(&format!("no prefill in {:?}", self.timeout))))
            }
            None => Err(failed(&"the replica stopped before its prefill came")),
        }
    }
}

/// Forgets a room when dropped, unless it is another by now (a room id come again).
struct Forget<'a> {
    rooms: &'a Rooms,
    id: u64,
    room: watch::Sender<Handover>,
}

impl Drop for Forget<'_> {
    fn drop(&mut self) {
        let mut rooms = self.rooms.rooms.lock().unwrap_or_else(|e| e.into_inner());
        if rooms.get(&self.id).is_some_and(|room| room.same_channel(&self.room)) {
            rooms.remove(&self.id);
        }
    }
}

/// Binds P's bootstrap server on `addr`'s host at `port`.
pub async fn bind(addr: SocketAddr, port: u16) -> std::io::Result<TcpListener> {
    TcpListener::bind(SocketAddr::new(addr.ip(), port)).await
}

/// Serves `rooms` on `listener` until `shutdown`.
pub async fn serve(listener: TcpListener, rooms: Arc<Rooms>, shutdown: CancellationToken) {
    let handler = move |request: Request<hyper::body::Incoming>| {
        let rooms = rooms.clone();
        async move {
            let room = request.uri().path().strip_prefix("/kvroute/rooms/").and_then(|id| id.parse().ok());
            let (status, body) = match room {
                None => (StatusCode::NOT_FOUND, "no such route: GET /kvroute/rooms/{room}".to_owned()),
                Some(id) => match rooms.claim(id).await {
                    Some(transfer) => (StatusCode::OK, serde_json::to_string(&transfer).unwrap_or_default()),
                    None => (StatusCode::GATEWAY_TIMEOUT, format!("no prefill for bootstrap room {id}")),
                },
            };
            let mut response = Response::new(Full::new(Bytes::from(body)));
            *response.status_mut() = status;
            response
        }
    };
    kvroute_proto::serve::serve(listener, handler, shutdown).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(json: &str) -> Option<Box<RawValue>> {
        Some(RawValue::from_string(json.into()).unwrap())
    }

    fn ask(mode: Mode, host: &str, port: &str, room: &str) -> Result<Option<Bootstrap>, String> {
        let [host, port, room] = [raw(host), raw(port), raw(room)];
        asked(mode, [host.as_deref(), port.as_deref(), room.as_deref()])
    }

    #[test]
    fn a_disaggregated_replica_needs_a_room_and_decode_needs_a_host() {
        assert_eq!(ask(Mode::Null, "1", "2", "3"), Ok(None), "fields ignored");
        let named = ask(Mode::Decode, r#""10.0.0.7""#, "null", "7").unwrap().unwrap();
        let room = |host: Option<&str>, port, room| Room { host: host.map(str::to_owned), port, room };
        assert_eq!(named.rooms(1), Ok(vec![room(Some("10.0.0.7"), None, 7)]));
        let prefill = ask(Mode::Prefill, "null", "8998", "9").unwrap().unwrap();
        assert_eq!(prefill.rooms(1), Ok(vec![room(None, Some(8998), 9)]));
        assert!(ask(Mode::Prefill, r#""h""#, "1", "null").unwrap_err().contains("without bootstrap room"));
        assert!(ask(Mode::Decode, "null", "1", "3").is_err(), "D must find P");
        assert!(ask(Mode::Decode, r#"["h",null]"#, "1", "3").is_err(), "for every prompt");
        assert!(ask(Mode::Decode, r#""h""#, "70000", "1").is_err());
        assert!(ask(Mode::Decode, r#""h""#, "1", "-1").is_err());
    }

    #[test]
    fn a_batch_has_a_room_a_prompt() {
        // One room for three prompts: r, r + 1, r + 2, as SGLang reads it.
        let one = ask(Mode::Decode, r#""h""#, "null", "7").unwrap().unwrap();
        let rooms: Vec<u64> = one.rooms(3).unwrap().iter().map(|r| r.room).collect();
        assert_eq!(rooms, [7, 8, 9]);
        // A list of each, as SGLang's router sends a batch.
        let each = ask(Mode::Decode, r#"["a","b"]"#, "[1,null]", "[5,3]").unwrap().unwrap();
        let rooms = each.rooms(2).unwrap();
        assert_eq!((rooms[1].host.as_deref(), rooms[1].port, rooms[1].room), (Some("b"), None, 3));
        assert!(each.rooms(3).unwrap_err().contains("2 values for 3 prompts"));
    }

    #[tokio::test]
    async fn a_room_is_handed_over_whichever_side_comes_first() {
        let rooms = Rooms::new(Duration::from_secs(30));
        let transfer = Transfer { prompt_tokens: 40, cached_tokens: 16 };
        let (handed, claimed) = tokio::join!(rooms.hand_over(1, transfer), rooms.claim(1));
        assert_eq!((handed, claimed), (Ok(()), Some(transfer)));
        let (claimed, handed) = tokio::join!(rooms.claim(2), rooms.hand_over(2, transfer));
        assert_eq!((handed, claimed), (Ok(()), Some(transfer)));
        assert!(rooms.rooms.lock().unwrap().is_empty(), "rooms are forgotten");
    }

    #[tokio::test]
    async fn a_side_alone_gives_up() {
        let rooms = Rooms::new(Duration::from_millis(20));
        let transfer = Transfer { prompt_tokens: 4, cached_tokens: 0 };
        assert!(rooms.hand_over(3, transfer).await.unwrap_err().contains("no decode replica"));
        assert_eq!(rooms.claim(4).await, None);
        assert!(rooms.rooms.lock().unwrap().is_empty());
        // A wait dropped (its request gone) forgets its room too.
        let rooms = Rooms::new(Duration::from_secs(30));
        let waiting = rooms.claim(5);
        let _ = futures::poll!(Box::pin(waiting));
        assert!(rooms.rooms.lock().unwrap().is_empty());
    }
}

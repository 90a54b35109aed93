//! `--max-in-flight-per-key`: how many requests each client key (`--api-key`,
//! `--api-key-file`) may have in flight through this router at once, so that one tenant
//! cannot take every place under `--max-in-flight` (and every replica's room) from the others.
//! A request past its key's share gets 429 at once (`rate_limit_exceeded`, `Retry-After: 1`),
//! counted in `kvroute_router_errors_total{kind="key_limit"}`; it does not wait in line, where
//! it would hold a place the key's own requests free. A request holds its key's place until its
//! response body ends or the router cuts it (a WebSocket session, until it closes; a LoRA
//! change, until it is done), with its place under `--max-in-flight`; the fleet's model list,
//! which the router answers itself, takes none, nor does a brief ask about a stored Responses
//! API response the router knows (`GET /v1/responses/{id}` without `stream`, its cancel). A
//! response generated in the background holds its request's place until the response is
//! final ([`super::background`]).
//! Keys are told apart by a hash of the key: none is stored twice, and a reload that keeps a
//! key keeps its count (one that turns the limit on counts the requests sent from then on).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

/// Requests in flight, by key.
#[derive(Debug, Default)]
pub struct PerKey {
    counts: Mutex<HashMap<KeyId, u32>>,
}

/// A client key, by its hash.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyId(pub u64);

impl KeyId {
    pub fn of(key: &str) -> Self {
        KeyId(xxhash_rust::xxh3::xxh3_64(key.as_bytes()))
    }
}

impl PerKey {
    /// A place for a request of `key`, if it has fewer than `limit` in flight.
    pub fn try_hold(self: &Arc<Self>, key: KeyId, limit: u32) -> Option<KeyHold> {
        let mut counts = self.counts.lock().unwrap_or_else(PoisonError::into_inner);
        let count = counts.entry(key).or_default();
        if *count >= limit {
            return None;
        }
        *count += 1;
        Some(KeyHold { per_key: Arc::clone(self), key })
    }

    /// Requests of `key` in flight.
    pub fn in_flight(&self, key: KeyId) -> u32 {
        self.counts.lock().unwrap_or_else(PoisonError::into_inner).get(&key).copied().unwrap_or(0)
    }
}

/// A request's key's place, shared by the request and its answer: its place under
/// `--max-in-flight` takes it once admitted ([`KeyPlace::take`]), to end with it (when its
/// response ends, or is cut); the answer holds it otherwise, until its body ends.
#[derive(Clone, Debug)]
pub struct KeyPlace(Arc<Mutex<Option<KeyHold>>>);

impl KeyPlace {
    pub fn new(hold: KeyHold) -> Self {
        KeyPlace(Arc::new(Mutex::new(Some(hold))))
    }

    /// The place, if no one took it yet.
    pub fn take(&self) -> Option<KeyHold> {
        self.0.lock().unwrap_or_else(PoisonError::into_inner).take()
    }
}

/// A request's place under its key's limit, given back when dropped.
#[derive(Debug)]
pub struct KeyHold {
    per_key: Arc<PerKey>,
    key: KeyId,
}

impl Drop for KeyHold {
    fn drop(&mut self) {
        let mut counts = self.per_key.counts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(count) = counts.get_mut(&self.key) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                counts.remove(&self.key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_key_holds_at_most_its_limit_and_gives_places_back() {
        let per_key = Arc::new(PerKey::default());
        let (a, b) = (KeyId::of("a"), KeyId::of("b"));
        let held: Vec<KeyHold> = (0..2).map(|_| per_key.try_hold(a, 2).expect("room")).collect();
        assert!(per_key.try_hold(a, 2).is_none(), "a's share is taken");
        let other = per_key.try_hold(b, 2).expect("b's is its own");
        assert_eq!((per_key.in_flight(a), per_key.in_flight(b)), (2, 1));
        drop(held);
        assert_eq!(per_key.in_flight(a), 0);
        assert!(per_key.try_hold(a, 2).is_some());
        drop(other);
        assert!(per_key.counts.lock().unwrap().is_empty(), "no key is remembered without requests");
    }
}

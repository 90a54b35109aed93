//! A cache of texts' beginnings and their token ids, so that a prompt that begins like an
//! earlier one (the next turn of a chat, another question about the same document) is
//! tokenized only from where it differs. The router keeps one; replicas do not need it.
//!
//! # How
//!
//! A text is read in chunks of [`PrefixCache::CHUNK`] bytes. Chunk `j`'s key is a 128-bit
//! XXH3 of the whole text up to the chunk's end (seeded with a per-process random seed and
//! whether special tokens are added), so a key stands for a whole beginning, not one chunk.
//! Its entry holds the last resume point at least a lookahead before the chunk's end (see
//! [`crate::openai::tokenizer::resume`]) and the ids between the previous chunk's point and
//! that one, with the previous point's offset to check that entries chain.
//!
//! Encoding walks the chunks from the start while their entries chain, appending their
//! ids; then the tokenizer encodes the rest from the last point reached and reports its
//! resume points, from which the chunks not found get entries. The result is exactly what
//! the tokenizer gives for the whole text (tested against it), except after a collision of
//! 128-bit hashes of different texts.
//!
//! How much of a text that begins like an earlier one is tokenized again depends on the
//! tokenizer's resume points: with the builtin tokenizer (a point at every piece end), the
//! new part and at most a chunk before it; with a `tokenizer.json` (points after added
//! tokens), everything after the last added token that lies a lookahead before the last
//! shared chunk boundary, so a long last message is tokenized whole.
//!
//! Entries are weighed by the bytes of their ids (4 a token) plus an overhead, and evicted
//! by `quick_cache` (S3-FIFO: a text seen once does not push out beginnings that recur).
//! A text tokenized on its own as a whole (a piece of a Harmony prompt, which vLLM encodes
//! piece by piece: [`PrefixCache::encode_whole`]) is kept whole, under a key of the whole
//! text in a domain of its own; the same weights and evictions apply.
//!
//! The parameters: chunks of 4 KiB (an 8 k token prompt is 8-16 chunks; 1 KiB chunks made
//! a miss ~10 µs dearer at 8 k tokens, for 60 entries instead of 15, and a hit ~3 µs
//! dearer, for 60 lookups), and the capacity in bytes, set by the caller.

use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use quick_cache::Weighter;
use xxhash_rust::xxh3::Xxh3;

use super::RequestError;
use super::tokenizer::{Point, Points, Resume};

/// Texts' beginnings and their ids (see the module docs).
pub struct PrefixCache {
    entries: quick_cache::sync::Cache<u128, Arc<Entry>, EntryWeight>,
    /// [`PrefixCache::CHUNK`], smaller in tests.
    chunk: usize,
    seed: u64,
    reused_bytes: AtomicU64,
    tokenized_bytes: AtomicU64,
}

/// [`Entry::from`] of a whole text's entry.
const WHOLE: usize = usize::MAX;

/// What one chunk's key stands for (or, `from` [`WHOLE`], one whole text's).
struct Entry {
    /// The previous chunk's point (where these ids begin), in bytes.
    from: usize,
    /// The last resume point at least a lookahead before the chunk's end.
    point: Point,
    /// The ids from `from` to `point`.
    ids: Box<[u32]>,
}

/// An entry's weight: its ids and a fixed overhead, in bytes.
#[derive(Clone)]
struct EntryWeight;

/// Bytes an entry costs besides its ids (key, `Arc`, allocation, the cache's slot).
const ENTRY_OVERHEAD: u64 = 96;

impl Weighter<u128, Arc<Entry>> for EntryWeight {
    fn weight(&self, _: &u128, entry: &Arc<Entry>) -> u64 {
        ENTRY_OVERHEAD + 4 * entry.ids.len() as u64
    }
}

/// Counters since the cache was made.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PrefixCacheStats {
    /// Text bytes whose ids came from the cache.
    pub reused_bytes: u64,
    /// Text bytes tokenized.
    pub tokenized_bytes: u64,
    /// Entries held now.
    pub entries: u64,
    /// Their weight now, bytes.
    pub weight_bytes: u64,
}

impl PrefixCache {
    /// Bytes of text a key covers more than the previous one.
    pub const CHUNK: usize = 4096;

    /// A cache holding about `capacity_bytes` of entries.
    pub fn new(capacity_bytes: u64) -> Self {
        Self::with_chunk(capacity_bytes, Self::CHUNK)
    }

    /// A cache keyed every `chunk` bytes instead of every [`PrefixCache::CHUNK`] (smaller
    /// chunks: more entries and lookups, less tokenized again; tests use them to make short
    /// texts span several).
    pub fn with_chunk(capacity_bytes: u64, chunk: usize) -> Self {
        let chunk = chunk.max(1);
        let per_entry = ENTRY_OVERHEAD + chunk as u64;
        let items = usize::try_from(capacity_bytes / per_entry).unwrap_or(usize::MAX).max(16);
        Self {
            entries: quick_cache::sync::Cache::with_weighter(items, capacity_bytes, EntryWeight),
            chunk,
            seed: RandomState::new().hash_one(0u64),
            reused_bytes: AtomicU64::new(0),
            tokenized_bytes: AtomicU64::new(0),
        }
    }

    /// The ids `tokenizer` gives `text`, from the cache as far as it knows the text's
    /// beginning; what is tokenized is added to it.
    pub fn encode(
        &self,
        tokenizer: &dyn Resume,
        text: &str,
        add_special_tokens: bool,
    ) -> Result<Vec<u32>, RequestError> {
        let chunks = text.len() / self.chunk;
        let mut hasher = Xxh3::with_seed(self.seed ^ u64::from(add_special_tokens));
        let mut keys = Vec::with_capacity(chunks);
        let mut ids = Vec::with_capacity(text.len() / 4 + 8);
        ids.extend_from_slice(tokenizer.leading_ids(add_special_tokens));
        let mut point = Point { byte: 0, ids: ids.len() };
        let mut hits = 0;
        for chunk in text.as_bytes().chunks_exact(self.chunk) {
            hasher.update(chunk);
            let key = hasher.digest128();
            keys.push(key);
            if hits + 1 == keys.len()
                && let Some(entry) = self.entries.get(&key)
                && entry.from == point.byte
                && entry.point.ids == point.ids + entry.ids.len()
                // Only a collision of keys could fail this; the tokenizer slices there.
                && text.is_char_boundary(entry.point.byte)
            {
                ids.extend_from_slice(&entry.ids);
                point = entry.point;
                hits += 1;
            }
        }
        self.reused_bytes.fetch_add(point.byte as u64, Relaxed);
        self.tokenized_bytes.fetch_add((text.len() - point.byte) as u64, Relaxed);

        let lookahead = tokenizer.lookahead();
        let limits = (hits..chunks).map(|j| ((j + 1) * self.chunk).saturating_sub(lookahead).max(point.byte));
        let mut points = Points::new(limits.collect());
        tokenizer.encode_from(text, point.byte, &mut ids, &mut points)?;
        let mut from = point;
        for (&key, &point) in keys[hits..].iter().zip(points.found()) {
            let entry = Entry { from: from.byte, point, ids: ids[from.ids..point.ids].into() };
            self.entries.insert(key, Arc::new(entry));
            from = point;
        }
        Ok(ids)
    }

    /// The ids `encode` gives `text`, a whole text tokenized on its own: from the cache when
    /// it was seen before, else encoded and kept.
    pub fn encode_whole(
        &self,
        text: &str,
        encode: impl FnOnce(&str) -> Result<Vec<u32>, RequestError>,
    ) -> Result<Vec<u32>, RequestError> {
        // Seeds 0 and 1 are the beginnings' (without and with special tokens).
        let key = xxhash_rust::xxh3::xxh3_128_with_seed(text.as_bytes(), self.seed ^ 2);
        if let Some(entry) = self.entries.get(&key)
            && entry.from == WHOLE
            && entry.point.byte == text.len()
        {
            self.reused_bytes.fetch_add(text.len() as u64, Relaxed);
            return Ok(entry.ids.to_vec());
        }
        let ids = encode(text)?;
        self.tokenized_bytes.fetch_add(text.len() as u64, Relaxed);
        let point = Point { byte: text.len(), ids: ids.len() };
        self.entries.insert(key, Arc::new(Entry { from: WHOLE, point, ids: ids.as_slice().into() }));
        Ok(ids)
    }

    /// Counters since the cache was made, and its size now.
    pub fn stats(&self) -> PrefixCacheStats {
        PrefixCacheStats {
            reused_bytes: self.reused_bytes.load(Relaxed),
            tokenized_bytes: self.tokenized_bytes.load(Relaxed),
            entries: self.entries.len() as u64,
            weight_bytes: self.entries.weight(),
        }
    }
}

impl std::fmt::Debug for PrefixCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PrefixCache").field("stats", &self.stats()).finish_non_exhaustive()
    }
}

#[cfg(test)]
mod tests;

//! Turns a message's payload into the engine-neutral [`Batch`] the stream applies, and
//! decides here which vLLM / SGLang events the router can index.
//!
//! Filters (vLLM / SGLang; each skipped event counts once under its [`SkipReason`]):
//! - `medium` other than absent, `GPU` (case-insensitive) or a host tier → `medium`: disk and
//!   remote stores load too slowly to count on, and the lowercase `cpu` of the LMCache and
//!   Mooncake connectors comes from stores that never announce a removal. The host tier is
//!   `CPU` (vLLM's offloading connector), `CPU_PINNED` (SGLang's HiCache) and `CPU_TIER1`
//!   (SGLang before 0.5.11), spelled exactly so, as Dynamo reads them; its events are indexed
//!   apart ([`Tier::Host`]);
//! - `locality == "REMOTE"` → `remote`;
//! - `kv_cache_spec_kind` other than `full_attention` / `mla_attention` → `attention_kind`;
//!   without a kind (vLLM < 0.23) a `group_idx > 0` is treated the same way;
//! - `block_size == 0` or `len(token_ids) != len(block_hashes) * block_size` →
//!   `tokens_mismatch` (sliding-window / Mamba masked blocks), except a host-tier store
//!   without tokens: vLLM's offloading connector names only the hashes of what it stored
//!   (unless `self_describing_kv_events` is on, vLLM 0.24 and later), and the stream finds
//!   them among the blocks the device tier announced;
//! - a block size other than the replica's configured one → `block_size`;
//! - `extra_keys` holding anything but the LoRA name or a salt string → `extra_keys`
//!   (multimodal / prompt-embedding hashes the router cannot reproduce);
//! - a `BlockStored` that does not decode (EAGLE's bigram `token_ids`, a field of a newer
//!   shape) → `malformed_event`: the rest of its batch is applied. Any other event that does
//!   not decode fails its batch ([`DecodeError::Event`]), as an undecodable payload does: it
//!   may have removed blocks, so the rank resyncs.
//!
//! The cache namespace of a stored event: the replica's model, `lora_name` as the LoRA, and
//! the salt from SGLang's `cache_salt` or, for vLLM, a string in the first block's
//! `extra_keys` that is not the LoRA name (vLLM puts the salt there, on block 0 only).
//! Only a chain's first event (no parent) uses the namespace: later blocks inherit it
//! through their parent's router hash.

use kvroute_proto::native;
use kvroute_proto::vllm::{self, ExtraKey, VllmEvent};
use kvroute_proto::{BlockHash, Epoch, Seq, pb};

use super::metrics::SkipReason;
use crate::replicas::EngineKind;

/// One batch, whatever the wire format.
#[derive(Debug)]
pub(crate) struct Batch {
    pub seq: Seq,
    /// kvroute batches only: the publisher's process lifetime.
    pub epoch: Option<Epoch>,
    /// The data-parallel rank the batch says it is from (vLLM's `data_parallel_rank`,
    /// SGLang's `attn_dp_rank`, the agent's `dp_rank`), if it says.
    pub dp_rank: Option<u32>,
    pub events: Vec<Event>,
}

#[derive(Debug)]
pub(crate) enum Event {
    Stored(Stored, Tier),
    Removed(Removed, Tier),
    Cleared,
    Skipped(SkipReason),
    /// A store in a KV-cache group of a kind the router does not index (sliding window,
    /// Mamba): skipped, and that group's removals are not unknown blocks.
    OtherKind {
        group: u32,
    },
}

/// Where an event's blocks are held.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Tier {
    /// The engine's KV cache (GPU memory): a hit skips the prefill.
    Device,
    /// Host memory the engine offloads to and loads back from, faster than a prefill.
    Host,
}

/// A stored run of blocks (for a host-tier run without tokens, `tokens` is empty and
/// `block_size` 0: only the hashes are known).
#[derive(Debug)]
pub(crate) struct Stored {
    /// The engine's hashes (for kvroute engines, the router's hashes themselves).
    pub engine: Vec<BlockHash>,
    pub parent: Option<BlockHash>,
    pub tokens: Vec<u32>,
    pub block_size: u32,
    pub lora: Option<String>,
    pub salt: Option<String>,
    /// KV-cache group; engine hashes are only meaningful within one group.
    pub group: u32,
    /// What the engine says of the blocks: `Some(true)` re-announced prefix-cache hits
    /// (vLLM's `origin: "REUSED"`), `Some(false)` newly cached (`"NEW"`), `None` unsaid.
    pub reused: Option<bool>,
}

/// Evicted blocks of one group.
#[derive(Debug)]
pub(crate) struct Removed {
    pub engine: Vec<BlockHash>,
    pub group: u32,
}

/// Why a payload is unusable.
#[derive(Debug, thiserror::Error)]
pub(crate) enum DecodeError {
    #[error(transparent)]
    Native(#[from] native::DecodeError),
    #[error(transparent)]
    Vllm(#[from] vllm::DecodeError),
    /// An event that may have removed blocks did not decode: the batch is as good as lost.
    #[error("an event that is not a BlockStored did not decode: {0}")]
    Event(String),
}

/// Decodes the payload that arrived with frame seq `seq`.
pub(crate) fn decode(
    engine: EngineKind,
    block_size: Option<u32>,
    seq: Seq,
    payload: &[u8],
) -> Result<Batch, DecodeError> {
    match engine {
        EngineKind::Kvroute => Ok(from_native(native::decode_payload(seq, payload)?)),
        EngineKind::Vllm | EngineKind::Sglang => {
            let batch = vllm::decode_payload(payload)?;
            if let Some(VllmEvent::Malformed(bad)) =
                batch.events.iter().find(|e| matches!(e, VllmEvent::Malformed(bad) if !bad.is_store()))
            {
                return Err(DecodeError::Event(bad.reason.clone()));
            }
            let legacy = |e: &VllmEvent| engine == EngineKind::Sglang && legacy_sglang(e);
            let events = batch
                .events
                .into_iter()
                .map(|e| {
                    if legacy(&e) {
                        Event::Skipped(SkipReason::LegacyHashes)
                    } else {
                        from_vllm(e, block_size)
                    }
                })
                .collect();
            Ok(Batch { seq, epoch: None, dp_rank: batch.dp_rank, events })
        }
    }
}

/// Whether a store is an older SGLang's, its first block named by Python's `hash` of its
/// page's token ids alone (`hash(tuple(page))`, where SGLang now chains SHA-256 over the
/// pages): a page's hash is the same wherever it stands, and a radix node's first page came
/// without its parent, so the chain cannot be rebuilt. A chained hash equals it by chance
/// once in 2^64.
fn legacy_sglang(event: &VllmEvent) -> bool {
    let VllmEvent::BlockStored(s) = event else { return false };
    let page = (s.block_size as usize).min(s.token_ids.len());
    s.block_hashes.first().is_some_and(|&first| page > 0 && first == python_tuple_hash(&s.token_ids[..page]))
}

/// Python's `hash` of a tuple of non-negative integers below 2^61 - 1 (each its own hash),
/// as CPython 3.8 and later compute it (`tuplehash`, 64-bit).
fn python_tuple_hash(items: &[u32]) -> BlockHash {
    const P1: u64 = 11_400_714_785_074_694_791;
    const P2: u64 = 14_029_467_366_897_019_727;
    const P5: u64 = 2_870_177_450_012_600_261;
    let mut acc = P5;
    for &item in items {
        acc = acc.wrapping_add(u64::from(item).wrapping_mul(P2)).rotate_left(31).wrapping_mul(P1);
    }
    acc = acc.wrapping_add(items.len() as u64 ^ (P5 ^ 3_527_539));
    // -1 is no hash in CPython.
    BlockHash(if acc == u64::MAX { 1_546_275_796 } else { acc })
}

fn from_native(batch: pb::EventBatch) -> Batch {
    use pb::event::Kind;
    let events = batch
        .events
        .into_iter()
        .map(|e| match e.kind {
            Some(Kind::Stored(s)) => match tier(s.medium.as_deref()) {
                None => Event::Skipped(SkipReason::Medium),
                Some(tier) => Event::Stored(
                    Stored {
                        engine: s.block_hashes.into_iter().map(BlockHash).collect(),
                        parent: s.parent_block_hash.map(BlockHash),
                        tokens: s.token_ids,
                        block_size: batch.block_size,
                        lora: None,
                        salt: None,
                        group: 0,
                        reused: Some(false),
                    },
                    tier,
                ),
            },
            Some(Kind::Removed(r)) => match tier(r.medium.as_deref()) {
                None => Event::Skipped(SkipReason::Medium),
                Some(tier) => Event::Removed(
                    Removed { engine: r.block_hashes.into_iter().map(BlockHash).collect(), group: 0 },
                    tier,
                ),
            },
            Some(Kind::Cleared(_)) => Event::Cleared,
            None => Event::Skipped(SkipReason::UnknownEvent),
        })
        .collect();
    Batch { seq: Seq(batch.seq), epoch: Some(Epoch(batch.epoch)), dp_rank: Some(batch.dp_rank), events }
}

fn from_vllm(event: VllmEvent, block_size: Option<u32>) -> Event {
    match event {
        VllmEvent::BlockStored(s) => match check_stored(&s, block_size) {
            Err(SkipReason::AttentionKind) => Event::OtherKind { group: s.group_idx.unwrap_or(0) },
            Err(reason) => Event::Skipped(reason),
            Ok((salt, tier)) => Event::Stored(
                Stored {
                    salt: s.cache_salt.or(salt),
                    engine: s.block_hashes,
                    parent: s.parent_block_hash,
                    block_size: if s.token_ids.is_empty() { 0 } else { s.block_size },
                    tokens: s.token_ids,
                    lora: s.lora_name,
                    group: s.group_idx.unwrap_or(0),
                    reused: match s.origin.as_deref() {
                        Some(o) if o.eq_ignore_ascii_case("reused") => Some(true),
                        Some(o) if o.eq_ignore_ascii_case("new") => Some(false),
                        _ => None,
                    },
                },
                tier,
            ),
        },
        VllmEvent::BlockRemoved(r) => match tier(r.medium.as_deref()) {
            None => Event::Skipped(SkipReason::Medium),
            Some(_) if remote(r.locality.as_deref()) => Event::Skipped(SkipReason::Remote),
            // No kind on removals: the engine map is keyed by (group, hash); a group whose
            // stores were of another kind is known by them (`attention_kind`), any other
            // hash not held is an `unknown_block`.
            Some(tier) => {
                Event::Removed(Removed { engine: r.block_hashes, group: r.group_idx.unwrap_or(0) }, tier)
            }
        },
        VllmEvent::AllBlocksCleared => Event::Cleared,
        VllmEvent::Unknown(_) => Event::Skipped(SkipReason::UnknownEvent),
        VllmEvent::Malformed(bad) => {
            tracing::debug!(reason = %bad.reason, "malformed stored event skipped");
            Event::Skipped(SkipReason::MalformedEvent)
        }
    }
}

/// Whether a stored event can be indexed; on success, the vLLM salt found in `extra_keys`,
/// and the tier.
fn check_stored(
    s: &vllm::BlockStored,
    block_size: Option<u32>,
) -> Result<(Option<String>, Tier), SkipReason> {
    let Some(tier) = tier(s.medium.as_deref()) else { return Err(SkipReason::Medium) };
    if remote(s.locality.as_deref()) {
        return Err(SkipReason::Remote);
    }
    match s.kv_cache_spec_kind.as_deref() {
        Some("full_attention" | "mla_attention") => {}
        Some(_) => return Err(SkipReason::AttentionKind),
        None if s.group_idx.is_some_and(|g| g > 0) => return Err(SkipReason::AttentionKind),
        None => {}
    }
    let blocks = s.block_hashes.len();
    if tier == Tier::Host && blocks > 0 && s.token_ids.is_empty() {
        // Known by its hashes alone: its namespace is the device tier's blocks'. A block of
        // another size (vLLM 0.11 says the offloaded block's) is several of the cache's, named
        // by the last: it could never continue a request's run.
        if s.block_size != 0 && block_size.is_some_and(|b| b != s.block_size) {
            return Err(SkipReason::BlockSize);
        }
        return Ok((None, tier));
    }
    if s.block_size == 0 || blocks == 0 || s.token_ids.len() != blocks.saturating_mul(s.block_size as usize) {
        return Err(SkipReason::TokensMismatch);
    }
    if block_size.is_some_and(|b| b != s.block_size) {
        return Err(SkipReason::BlockSize);
    }
    if s.lora_id.is_some() && s.lora_name.is_none() {
        // An adapter known only by its id (vLLM 0.9-0.14): its blocks' namespace cannot be
        // reproduced, and indexed under the base model they would be false hits.
        return Err(SkipReason::ExtraKeys);
    }
    Ok((extra_salt(s)?, tier))
}

/// The salt string of block 0's extra keys, if any; an error for keys the router cannot
/// reproduce.
///
/// vLLM before 0.20 publishes no extra keys: a block hashed with a `cache_salt` or with an
/// image's features cannot be told from one of plain tokens, and is indexed as one (under
/// the model's namespace). A request with the same tokens and no salt is then predicted to
/// hit it and does not (the replica's own hash differs); salted or multimodal requests are
/// never predicted to hit. Routing on `cache_salt` and images needs vLLM 0.20 or later.
fn extra_salt(s: &vllm::BlockStored) -> Result<Option<String>, SkipReason> {
    let Some(keys) = &s.extra_keys else { return Ok(None) };
    let mut salt = None;
    for (i, key) in keys.iter().enumerate() {
        let items: &[ExtraKey] = match key {
            ExtraKey::Nil => continue,
            ExtraKey::Tuple(items) => items,
            other => std::slice::from_ref(other),
        };
        // A block's keys are its adapter's name (once, first), then on a prompt's first block
        // the salt, which may be spelled like the adapter.
        let mut adapter = s.lora_name.as_ref();
        for item in items {
            match item {
                ExtraKey::Nil => {}
                ExtraKey::Str(name) if adapter == Some(name) => adapter = None,
                ExtraKey::Str(value) if i == 0 && s.parent_block_hash.is_none() && salt.is_none() => {
                    salt = Some(value.clone());
                }
                _ => return Err(SkipReason::ExtraKeys),
            }
        }
    }
    Ok(salt)
}

/// The tier a `medium` names, if the router indexes it (see the module docs).
pub(super) fn tier(medium: Option<&str>) -> Option<Tier> {
    match medium {
        None => Some(Tier::Device),
        Some(m) if m.eq_ignore_ascii_case("gpu") => Some(Tier::Device),
        Some("CPU" | "CPU_PINNED" | "CPU_TIER1") => Some(Tier::Host),
        Some(_) => None,
    }
}

fn remote(locality: Option<&str>) -> bool {
    locality.is_some_and(|l| l.eq_ignore_ascii_case("remote"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stored() -> vllm::BlockStored {
        vllm::BlockStored {
            block_hashes: vec![BlockHash(1), BlockHash(2)],
            token_ids: vec![1, 2, 3, 4],
            block_size: 2,
            medium: Some("GPU".into()),
            ..Default::default()
        }
    }

    /// Values of CPython 3.11's `hash(tuple)`.
    #[test]
    fn python_tuple_hashes_are_cpythons() {
        let as_python = |h: i64| BlockHash(h as u64);
        assert_eq!(python_tuple_hash(&[]), as_python(5_740_354_900_026_072_187));
        assert_eq!(python_tuple_hash(&[1, 2, 3]), as_python(529_344_067_295_497_451));
        assert_eq!(python_tuple_hash(&[0]), as_python(-8_753_497_827_991_233_192));
        assert_eq!(python_tuple_hash(&(0..16).collect::<Vec<_>>()), as_python(2_828_489_712_818_767_170));
        assert_eq!(python_tuple_hash(&[151_643, 872, 198]), as_python(-2_158_743_237_302_262_662));
    }

    /// Regression: an older SGLang's stores (a page's hash is Python's hash of its tokens, and
    /// a radix node's first page comes without its parent) were indexed, a page from the
    /// middle of a prompt as a prompt's start. They are skipped, and only for SGLang.
    #[test]
    fn an_older_sglangs_unchained_hashes_are_skipped() {
        let page = |tokens: Vec<u32>, hash: BlockHash| vllm::BlockStored {
            block_hashes: vec![hash],
            token_ids: tokens,
            block_size: 4,
            ..Default::default()
        };
        let batch = |stored: vllm::BlockStored| {
            let events = vec![VllmEvent::BlockStored(stored)];
            vllm::encode_payload(&vllm::VllmBatch { ts: 0.0, events, dp_rank: None })
        };
        let tokens = vec![7, 8, 9, 10];
        let legacy = batch(page(tokens.clone(), python_tuple_hash(&tokens)));
        let chained = batch(page(tokens, BlockHash(0x4fa9_d65e)));
        let skipped =
            |engine, payload: &[u8]| match &decode(engine, Some(4), Seq(0), payload).unwrap().events[..] {
                [Event::Skipped(reason)] => Some(*reason),
                [Event::Stored(..)] => None,
                other => panic!("{other:?}"),
            };
        assert_eq!(skipped(EngineKind::Sglang, &legacy), Some(SkipReason::LegacyHashes));
        assert_eq!(skipped(EngineKind::Sglang, &chained), None);
        assert_eq!(skipped(EngineKind::Vllm, &legacy), None, "vLLM's hashes are never Python's of a page");
    }

    fn reason(s: vllm::BlockStored, block_size: Option<u32>) -> Option<SkipReason> {
        match from_vllm(VllmEvent::BlockStored(s), block_size) {
            Event::Skipped(r) => Some(r),
            Event::OtherKind { .. } => Some(SkipReason::AttentionKind),
            _ => None,
        }
    }

    #[test]
    fn filters_what_the_router_cannot_index() {
        assert_eq!(reason(stored(), None), None);
        assert_eq!(reason(stored(), Some(2)), None);
        assert_eq!(reason(stored(), Some(16)), Some(SkipReason::BlockSize));
        assert_eq!(
            reason(vllm::BlockStored { medium: Some("cpu".into()), ..stored() }, None),
            Some(SkipReason::Medium)
        );
        assert_eq!(reason(vllm::BlockStored { medium: None, ..stored() }, None), None);
        assert_eq!(
            reason(vllm::BlockStored { locality: Some("REMOTE".into()), ..stored() }, None),
            Some(SkipReason::Remote)
        );
        let kind = |k: &str| vllm::BlockStored {
            kv_cache_spec_kind: Some(k.into()),
            group_idx: Some(1),
            ..stored()
        };
        assert_eq!(reason(kind("sliding_window"), None), Some(SkipReason::AttentionKind));
        assert_eq!(reason(kind("mamba"), None), Some(SkipReason::AttentionKind));
        assert_eq!(reason(kind("mla_attention"), None), None);
        assert_eq!(
            reason(vllm::BlockStored { group_idx: Some(1), ..stored() }, None),
            Some(SkipReason::AttentionKind)
        );
        let placeholder = vllm::BlockStored { token_ids: vec![], block_size: 0, ..stored() };
        assert_eq!(reason(placeholder, None), Some(SkipReason::TokensMismatch));
        let masked = vllm::BlockStored { token_ids: vec![1, 2, 3, 4, 5, 6], ..stored() };
        assert_eq!(reason(masked, None), Some(SkipReason::TokensMismatch));
        let mm = vllm::BlockStored {
            extra_keys: Some(vec![
                ExtraKey::Tuple(vec![ExtraKey::Tuple(vec![ExtraKey::Str("img".into()), ExtraKey::UInt(0)])]),
                ExtraKey::Nil,
            ]),
            ..stored()
        };
        assert_eq!(reason(mm, None), Some(SkipReason::ExtraKeys));
        let adapter_by_id = vllm::BlockStored { lora_id: Some(7), ..stored() };
        assert_eq!(reason(adapter_by_id, None), Some(SkipReason::ExtraKeys), "its namespace is unknown");
        let named = vllm::BlockStored { lora_id: Some(7), lora_name: Some("ad".into()), ..stored() };
        assert_eq!(reason(named, None), None);
    }

    #[test]
    fn host_tiers_are_indexed_apart_and_others_skipped() {
        let tier_of = |s: vllm::BlockStored| match from_vllm(VllmEvent::BlockStored(s), Some(2)) {
            Event::Stored(st, tier) => Ok((tier, st.tokens.len(), st.block_size)),
            Event::Skipped(reason) => Err(reason),
            other => panic!("{other:?}"),
        };
        let medium = |m: &str| vllm::BlockStored { medium: Some(m.into()), ..stored() };
        assert_eq!(tier_of(medium("gpu")), Ok((Tier::Device, 4, 2)));
        assert_eq!(tier_of(medium("CPU")), Ok((Tier::Host, 4, 2)), "vLLM, self-describing");
        assert_eq!(tier_of(medium("CPU_PINNED")), Ok((Tier::Host, 4, 2)), "SGLang's HiCache");
        assert_eq!(tier_of(medium("CPU_TIER1")), Ok((Tier::Host, 4, 2)));
        for skipped in ["cpu", "STORAGE", "DISK", "CPU_TIER2", "EXTERNAL", "FS"] {
            assert_eq!(tier_of(medium(skipped)), Err(SkipReason::Medium), "{skipped}");
        }
        // vLLM's offloading placeholders: hashes only (0.11 says the offloaded block's size,
        // 0.20 and later 0); an offloaded block of several of the cache's is skipped.
        for block_size in [0, 2] {
            let placeholder = vllm::BlockStored { token_ids: vec![], block_size, ..medium("CPU") };
            assert_eq!(tier_of(placeholder), Ok((Tier::Host, 0, 0)));
        }
        let larger = vllm::BlockStored { token_ids: vec![], block_size: 32, ..medium("CPU") };
        assert_eq!(tier_of(larger), Err(SkipReason::BlockSize));
        let empty = vllm::BlockStored { block_hashes: vec![], token_ids: vec![], ..medium("CPU") };
        assert_eq!(tier_of(empty), Err(SkipReason::TokensMismatch));
        let masked = vllm::BlockStored { token_ids: vec![1, 2, 3], ..medium("CPU") };
        assert_eq!(tier_of(masked), Err(SkipReason::TokensMismatch));
        let remote = vllm::BlockStored { locality: Some("REMOTE".into()), ..medium("CPU") };
        assert_eq!(tier_of(remote), Err(SkipReason::Remote));
        let removed = |m: &str| {
            let r = vllm::BlockRemoved {
                block_hashes: vec![BlockHash(1)],
                medium: Some(m.into()),
                ..Default::default()
            };
            match from_vllm(VllmEvent::BlockRemoved(r), None) {
                Event::Removed(_, tier) => Some(tier),
                _ => None,
            }
        };
        assert_eq!(removed("GPU"), Some(Tier::Device));
        assert_eq!(removed("CPU"), Some(Tier::Host));
        assert_eq!(removed("DISK"), None);
    }

    #[test]
    fn namespace_comes_from_lora_name_and_salt() {
        let s = vllm::BlockStored {
            lora_name: Some("ad".into()),
            extra_keys: Some(vec![
                ExtraKey::Tuple(vec![ExtraKey::Str("ad".into()), ExtraKey::Str("tenant".into())]),
                ExtraKey::Tuple(vec![ExtraKey::Str("ad".into())]),
            ]),
            ..stored()
        };
        let Event::Stored(st, _) = from_vllm(VllmEvent::BlockStored(s), None) else { panic!("skipped") };
        assert_eq!(st.lora.as_deref(), Some("ad"));
        assert_eq!(st.salt.as_deref(), Some("tenant"));
        let same = vllm::BlockStored {
            lora_name: Some("ad".into()),
            extra_keys: Some(vec![ExtraKey::Tuple(vec![
                ExtraKey::Str("ad".into()),
                ExtraKey::Str("ad".into()),
            ])]),
            ..stored()
        };
        let Event::Stored(st, _) = from_vllm(VllmEvent::BlockStored(same), None) else { panic!("skipped") };
        assert_eq!(
            (st.lora.as_deref(), st.salt.as_deref()),
            (Some("ad"), Some("ad")),
            "a salt spelled like the adapter"
        );
        let sglang = vllm::BlockStored { cache_salt: Some("t2".into()), ..stored() };
        let Event::Stored(st, _) = from_vllm(VllmEvent::BlockStored(sglang), None) else { panic!("skipped") };
        assert_eq!(st.salt.as_deref(), Some("t2"));
    }

    #[test]
    fn origin_says_whether_blocks_are_reused() {
        let reused = |origin: Option<&str>| {
            let s = vllm::BlockStored { origin: origin.map(Into::into), ..stored() };
            let Event::Stored(st, _) = from_vllm(VllmEvent::BlockStored(s), None) else { panic!("skipped") };
            st.reused
        };
        assert_eq!(reused(Some("REUSED")), Some(true));
        assert_eq!(reused(Some("reused")), Some(true));
        assert_eq!(reused(Some("NEW")), Some(false));
        assert_eq!(reused(Some("LATER")), None, "an origin this router does not know says nothing");
        assert_eq!(reused(None), None);
    }
}

//! Prometheus metrics of event ingestion (all prefixed `kvroute_ingest_` by
//! [`IngestMetrics::register`]): per-replica counters labelled `replica` (the name), skip
//! reasons and repair outcomes as fixed label values, per-replica block counts and stream
//! state as gauges, and the index's size read at scrape time.
//!
//! A removed replica's label sets are deleted (`IngestMetrics::forget`), so metrics do not
//! grow with replica churn.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::{ConstGauge, Gauge};
use prometheus_client::registry::Registry;

use crate::index::SharedIndex;
use crate::replicas::StreamState;

/// Why an event (or part of one) was not applied to the index.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SkipReason {
    /// `token_ids` do not cover the blocks (`len != n * block_size`): connector placeholders,
    /// sliding-window or Mamba groups with masked blocks.
    TokensMismatch,
    /// `kv_cache_spec_kind` is not full or MLA attention (or, before vLLM 0.23 which has
    /// no kind, `group_idx > 0`); also the removals of such a group's blocks.
    AttentionKind,
    /// `locality == "REMOTE"`: blocks held by another node.
    Remote,
    /// A tier the router does not index (disk, remote stores, the lowercase `cpu` of
    /// connectors that never announce a removal), or a data-parallel replica's host tier.
    Medium,
    /// The event's block size differs from the replica's configured one.
    BlockSize,
    /// Extra hash keys the router cannot reproduce (multimodal, prompt embeddings, a LoRA
    /// adapter known only by its id).
    ExtraKeys,
    /// `parent_block_hash` names a block this rank never stored (or lost in a resync); or an
    /// offloaded block neither of the rank's tiers knows and none could chain (blocks).
    UnknownParent,
    /// A removed engine hash that this rank does not hold (in a group it indexes).
    UnknownBlock,
    /// An event tag the decoder does not know.
    UnknownEvent,
    /// An event that did not decode (a field of the wrong type or shape, say EAGLE's bigram
    /// `token_ids`); the rest of its batch is applied.
    MalformedEvent,
    /// A store that would take the rank past the most blocks it may hold
    /// (`snapshot_max_blocks`).
    OverCapacity,
    /// An older SGLang's store, named by Python's `hash` of its page's tokens alone: one hash
    /// for a page wherever it stands, and every radix node's first page published without its
    /// parent. Indexed, a page in the middle of a prompt would be taken for a prompt's start.
    LegacyHashes,
}

impl SkipReason {
    pub const ALL: [SkipReason; 12] = [
        SkipReason::TokensMismatch,
        SkipReason::AttentionKind,
        SkipReason::Remote,
        SkipReason::Medium,
        SkipReason::BlockSize,
        SkipReason::ExtraKeys,
        SkipReason::UnknownParent,
        SkipReason::UnknownBlock,
        SkipReason::UnknownEvent,
        SkipReason::MalformedEvent,
        SkipReason::OverCapacity,
        SkipReason::LegacyHashes,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            SkipReason::TokensMismatch => "tokens_mismatch",
            SkipReason::AttentionKind => "attention_kind",
            SkipReason::Remote => "remote",
            SkipReason::Medium => "medium",
            SkipReason::BlockSize => "block_size",
            SkipReason::ExtraKeys => "extra_keys",
            SkipReason::UnknownParent => "unknown_parent",
            SkipReason::UnknownBlock => "unknown_block",
            SkipReason::UnknownEvent => "unknown_event",
            SkipReason::MalformedEvent => "malformed_event",
            SkipReason::OverCapacity => "over_capacity",
            SkipReason::LegacyHashes => "legacy_hashes",
        }
    }
}

/// How a repair attempt ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Outcome {
    Ok,
    /// The replay answered, but its first batch is past the one asked for, or it ended
    /// without its end marker.
    Incomplete,
    Failed,
}

impl Outcome {
    pub fn as_str(self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Incomplete => "incomplete",
            Outcome::Failed => "failed",
        }
    }
}

/// What was malformed.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Malformed {
    /// Wrong frame count or seq length: not even a seq could be read.
    Frame,
    /// The payload did not decode.
    Payload,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReplicaLabel {
    replica: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    replica: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    replica: String,
    outcome: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    replica: String,
    kind: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    replica: String,
    state: String,
}

/// Every ingestion metric family; clone-cheap (the families are shared handles).
#[derive(Clone, Debug, Default)]
pub struct IngestMetrics {
    events_applied: Family<ReplicaLabel, Counter>,
    blocks_stored: Family<ReplicaLabel, Counter>,
    blocks_removed: Family<ReplicaLabel, Counter>,
    malformed: Family<KindLabels, Counter>,
    skipped: Family<ReasonLabels, Counter>,
    overflow: Family<ReplicaLabel, Counter>,
    gaps: Family<ReplicaLabel, Counter>,
    rank_mismatches: Family<ReplicaLabel, Counter>,
    restarts: Family<ReplicaLabel, Counter>,
    clears: Family<ReplicaLabel, Counter>,
    replays: Family<OutcomeLabels, Counter>,
    snapshots: Family<OutcomeLabels, Counter>,
    blocks: Family<ReplicaLabel, Gauge>,
    offloaded_blocks: Family<ReplicaLabel, Gauge>,
    stream_state: Family<StateLabels, Gauge>,
}

impl IngestMetrics {
    /// Fresh metrics, registered into `registry` under the `kvroute_ingest` prefix, plus a
    /// collector reporting `index`'s size, the data-parallel ranks' `rank_index`'s and the
    /// offloaded blocks' `host_index`'s, at every scrape.
    pub fn register(
        registry: &mut Registry,
        index: SharedIndex,
        rank_index: SharedIndex,
        host_index: SharedIndex,
    ) -> Self {
        let m = Self::default();
        let r = registry.sub_registry_with_prefix("kvroute_ingest");
        r.register("events_applied", "Events applied to the index", m.events_applied.clone());
        r.register("blocks_stored", "Block stores applied to the index", m.blocks_stored.clone());
        r.register("blocks_removed", "Block removals applied to the index", m.blocks_removed.clone());
        r.register(
            "malformed",
            "Messages that did not decode (kind = frame|payload; a payload also resyncs its rank), skipped, and connections cut for a message over the ZMTP guard's limits (kind = oversized_message)",
            m.malformed.clone(),
        );
        r.register("skipped", "Events or blocks not applied, by reason", m.skipped.clone());
        r.register("overflow", "Live messages dropped because the ingest queue was full", m.overflow.clone());
        r.register("gaps", "Sequence gaps detected", m.gaps.clone());
        r.register(
            "rank_mismatches",
            "Batches on a data-parallel rank's stream that name another rank (a dp-size or port layout that is not the replica's)",
            m.rank_mismatches.clone(),
        );
        r.register(
            "restarts",
            "Publisher restarts detected (seq backwards or new epoch)",
            m.restarts.clone(),
        );
        r.register("clears", "Times a replica rank's entries were cleared", m.clears.clone());
        r.register("replays", "Replay requests, by outcome", m.replays.clone());
        r.register("snapshots", "gRPC snapshot resyncs, by outcome", m.snapshots.clone());
        r.register("replica_blocks", "Distinct blocks the index holds for a replica", m.blocks.clone());
        r.register(
            "replica_offloaded_blocks",
            "Distinct blocks the index holds for a replica in host memory (its offloaded tier)",
            m.offloaded_blocks.clone(),
        );
        r.register("stream_state", "1 for the replica's current stream state", m.stream_state.clone());
        r.register_collector(Box::new(IndexCollector { index, rank_index, host_index }));
        m
    }

    /// The handles one replica's tasks update.
    pub(crate) fn replica(&self, name: &str) -> ReplicaMetrics {
        let replica = ReplicaLabel { replica: name.to_owned() };
        let reason = |r: SkipReason| ReasonLabels { replica: name.to_owned(), reason: r.as_str().to_owned() };
        let outcome = |o: Outcome| OutcomeLabels { replica: name.to_owned(), outcome: o.as_str().to_owned() };
        let kind = |k: &str| KindLabels { replica: name.to_owned(), kind: k.to_owned() };
        ReplicaMetrics {
            name: name.to_owned(),
            families: self.clone(),
            events_applied: self.events_applied.get_or_create_owned(&replica),
            blocks_stored: self.blocks_stored.get_or_create_owned(&replica),
            blocks_removed: self.blocks_removed.get_or_create_owned(&replica),
            malformed_frame: self.malformed.get_or_create_owned(&kind("frame")),
            malformed_payload: self.malformed.get_or_create_owned(&kind("payload")),
            malformed_oversized: self.malformed.get_or_create_owned(&kind("oversized_message")),
            skipped: SkipReason::ALL.map(|r| self.skipped.get_or_create_owned(&reason(r))),
            overflow: self.overflow.get_or_create_owned(&replica),
            gaps: self.gaps.get_or_create_owned(&replica),
            rank_mismatches: self.rank_mismatches.get_or_create_owned(&replica),
            restarts: self.restarts.get_or_create_owned(&replica),
            clears: self.clears.get_or_create_owned(&replica),
            replays: [Outcome::Ok, Outcome::Incomplete, Outcome::Failed]
                .map(|o| self.replays.get_or_create_owned(&outcome(o))),
            snapshots: [Outcome::Ok, Outcome::Failed]
                .map(|o| self.snapshots.get_or_create_owned(&outcome(o))),
            blocks: self.blocks.get_or_create_owned(&replica),
            offloaded_blocks: self.offloaded_blocks.get_or_create_owned(&replica),
        }
    }

    /// Drops every label set of replica `name`.
    pub(crate) fn forget(&self, name: &str) {
        let replica = ReplicaLabel { replica: name.to_owned() };
        for family in [
            &self.events_applied,
            &self.blocks_stored,
            &self.blocks_removed,
            &self.overflow,
            &self.gaps,
            &self.rank_mismatches,
            &self.restarts,
            &self.clears,
        ] {
            family.remove(&replica);
        }
        self.blocks.remove(&replica);
        self.offloaded_blocks.remove(&replica);
        for k in ["frame", "payload", "oversized_message"] {
            self.malformed.remove(&KindLabels { replica: name.to_owned(), kind: k.to_owned() });
        }
        for r in SkipReason::ALL {
            self.skipped.remove(&ReasonLabels { replica: name.to_owned(), reason: r.as_str().to_owned() });
        }
        for o in [Outcome::Ok, Outcome::Incomplete, Outcome::Failed] {
            let labels = OutcomeLabels { replica: name.to_owned(), outcome: o.as_str().to_owned() };
            self.replays.remove(&labels);
            self.snapshots.remove(&labels);
        }
        for s in StreamState::ALL {
            self.stream_state.remove(&StateLabels { replica: name.to_owned(), state: s.as_str().to_owned() });
        }
    }
}

/// One replica's metric handles (shared by its ranks' tasks); reading them is how tests and
/// the admin API see counts without scraping.
#[derive(Clone, Debug)]
pub struct ReplicaMetrics {
    name: String,
    families: IngestMetrics,
    pub events_applied: Counter,
    pub blocks_stored: Counter,
    pub blocks_removed: Counter,
    pub malformed_frame: Counter,
    pub malformed_payload: Counter,
    /// Connections cut for a message over the ZMTP guard's limits.
    pub malformed_oversized: Counter,
    skipped: [Counter; SkipReason::ALL.len()],
    pub overflow: Counter,
    pub gaps: Counter,
    pub rank_mismatches: Counter,
    pub restarts: Counter,
    pub clears: Counter,
    replays: [Counter; 3],
    snapshots: [Counter; 2],
    pub blocks: Gauge,
    pub offloaded_blocks: Gauge,
}

impl ReplicaMetrics {
    /// Counts a connection the ZMTP guard cut for a message over its limits.
    pub fn on_oversized(&self) -> kvroute_proto::zmtp_guard::OnRefused {
        let counter = self.malformed_oversized.clone();
        std::sync::Arc::new(move || {
            counter.inc();
        })
    }

    pub fn skipped(&self, reason: SkipReason) -> &Counter {
        let i = SkipReason::ALL.iter().position(|r| *r == reason).expect("every reason is in ALL");
        &self.skipped[i]
    }

    pub fn malformed(&self, what: Malformed) -> &Counter {
        match what {
            Malformed::Frame => &self.malformed_frame,
            Malformed::Payload => &self.malformed_payload,
        }
    }

    pub fn replays(&self, outcome: Outcome) -> &Counter {
        &self.replays[outcome as usize]
    }

    /// `Outcome::Incomplete` does not apply to snapshots and reads as failed.
    pub fn snapshots(&self, outcome: Outcome) -> &Counter {
        &self.snapshots[usize::from(outcome != Outcome::Ok)]
    }

    /// Publishes the replica's aggregate stream state (1 for it, 0 for the others).
    pub(crate) fn set_state(&self, state: StreamState) {
        for s in StreamState::ALL {
            let labels = StateLabels { replica: self.name.clone(), state: s.as_str().to_owned() };
            self.families.stream_state.get_or_create(&labels).set(i64::from(s == state));
        }
    }
}

/// Reports the index's size at scrape time (computing it per update would cost a walk over
/// the table shards for every batch), and the data-parallel replicas' rank index's.
#[derive(Debug)]
struct IndexCollector {
    index: SharedIndex,
    rank_index: SharedIndex,
    host_index: SharedIndex,
}

impl Collector for IndexCollector {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let stats = self.index.stats();
        let ranks = self.rank_index.stats();
        let host = self.host_index.stats();
        let as_i64 = |v: usize| i64::try_from(v).unwrap_or(i64::MAX);
        for (name, help, value) in [
            ("index_memory_bytes", "Estimated heap bytes of the prefix index", stats.memory_bytes),
            ("index_entries", "(block, replica) pairs in the prefix index", stats.entries),
            ("index_replicas", "Replicas holding at least one block", stats.replicas),
            (
                "rank_index_memory_bytes",
                "Estimated heap bytes of the data-parallel replicas' rank index",
                ranks.memory_bytes,
            ),
            (
                "rank_index_entries",
                "(block, rank) pairs in the data-parallel replicas' rank index",
                ranks.entries,
            ),
            (
                "offloaded_index_memory_bytes",
                "Estimated heap bytes of the index of blocks offloaded to host memory",
                host.memory_bytes,
            ),
            (
                "offloaded_index_entries",
                "(block, replica) pairs in the index of blocks offloaded to host memory",
                host.entries,
            ),
        ] {
            let gauge = ConstGauge::new(as_i64(value));
            let metric = encoder.encode_descriptor(name, help, None, gauge.metric_type())?;
            gauge.encode(metric)?;
        }
        Ok(())
    }
}

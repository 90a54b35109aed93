//! Identity newtypes. Every identity has its own type so that a sequence number can never be
//! passed where a block hash is expected, and no state is keyed by strings.

use std::fmt;

/// A block's 64-bit chained hash (see [`crate::hash`]), or an engine's opaque block id.
#[derive(
    Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, serde::Serialize, serde::Deserialize,
)]
#[serde(transparent)]
pub struct BlockHash(pub u64);

/// Per-publisher batch sequence number (frame 1 of a live message).
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Debug)]
pub struct Seq(pub u64);

/// Identifies one process lifetime of a publisher; a new epoch means a restart.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Debug)]
pub struct Epoch(pub u64);

/// A compact handle for a replica inside one router process (interned from its name), so
/// index entries stay small.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Default, Debug)]
pub struct ReplicaId(pub u32);

impl fmt::Debug for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "BlockHash({:#018x})", self.0)
    }
}

impl fmt::Display for BlockHash {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl Seq {
    /// The sequence number after this one.
    pub fn next(self) -> Seq {
        Seq(self.0.wrapping_add(1))
    }
}

impl fmt::Display for Seq {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.fmt(f)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:016x}", self.0)
    }
}

impl fmt::Display for ReplicaId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "r{}", self.0)
    }
}

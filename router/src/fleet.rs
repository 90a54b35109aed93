//! The fleet: every replica the router routes to, joining the event side (the ingest
//! registry, which interns names to ids and tracks stream state) with the HTTP side (the
//! proxy's [`Upstream`] load and health). Adding a replica starts following its events and
//! makes it routable; removing it stops both and frees its index entries and credits.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use kvroute_proto::ReplicaId;

use crate::discovery::ReplicaSink;
use crate::index::Credits;
use crate::ingest::{Ingest, IngestError};
use crate::proxy::upstream::Upstream;
use crate::proxy::waiters::Waiters;
use crate::replicas::{Replica, ReplicaSpec, StreamState};

/// One routable replica: its registry entry and its proxy-side state.
#[derive(Clone, Debug)]
pub struct Member {
    pub replica: Arc<Replica>,
    pub upstream: Arc<Upstream>,
}

/// What an operator's removal ([`Fleet::remove_for_good`]) did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Removed {
    /// The index entries freed, or `None` if no replica of the name was registered.
    pub freed: Option<usize>,
    /// A drain the router kept for the name (out of the fleet, or in it) is gone.
    pub drain_lifted: bool,
}

/// The fleet handle; cheap to clone.
#[derive(Clone)]
pub struct Fleet {
    ingest: Ingest,
    upstreams: Arc<RwLock<HashMap<ReplicaId, Arc<Upstream>>>>,
    /// Names drained by an operator: the drain outlasts the replica's entry, so a replica
    /// that discovery replaces (a pod back under a new address) or removes and adds again
    /// stays drained until it is undrained or removed through the admin service; except a
    /// replica named by its address, whose drain ends when discovery removes it (the address
    /// may come back as another pod; a pod out of DNS answers for 30 s counts as removed).
    drained: Arc<RwLock<HashSet<String>>>,
    /// Names discovery says are not serving (endpoints that are not Ready): kept by name, so a
    /// replica added or replaced under it (discovery, or an admin `AddReplica`) is never
    /// routable, not even for a moment, until discovery says it serves.
    not_serving: Arc<RwLock<HashSet<String>>>,
    /// LoRA adapters loaded through the router, which every replica should have.
    adapters: Arc<crate::proxy::lora::Registry>,
    /// Bumped after every change of membership ([`Fleet::changes`]).
    changes: Arc<AtomicU64>,
    /// Requests waiting for a replica's room ([`Fleet::waiters`]).
    waiters: Arc<Waiters>,
}

impl Fleet {
    pub fn new(ingest: Ingest) -> Self {
        Self {
            ingest,
            upstreams: Arc::default(),
            drained: Arc::default(),
            not_serving: Arc::default(),
            adapters: Arc::default(),
            changes: Arc::default(),
            waiters: Arc::default(),
        }
    }

    /// Requests waiting for a replica's room ([`crate::proxy::queue`]): woken as requests
    /// to the replicas end, and as replicas join or come back.
    pub fn waiters(&self) -> &Waiters {
        &self.waiters
    }

    /// How many times replicas joined or left so far: a caller that read [`Fleet::members`]
    /// before waiting on something (a remote tokenization) reads them again if this moved.
    pub fn changes(&self) -> u64 {
        self.changes.load(Ordering::Acquire)
    }

    /// LoRA adapters loaded through the router ([`crate::proxy::lora`]).
    pub fn adapters(&self) -> &crate::proxy::lora::Registry {
        &self.adapters
    }

    pub fn ingest(&self) -> &Ingest {
        &self.ingest
    }

    /// Credits of pending routing decisions (kept by the index, settled by events).
    pub fn credits(&self) -> &Credits {
        self.ingest.index().credits()
    }

    /// Starts routing to `spec` (and following its events).
    pub fn add(&self, spec: ReplicaSpec) -> Result<Member, IngestError> {
        self.add_keeping(spec, None)
    }

    /// [`Fleet::add`], going on with `kept`, the upstream of the replica `spec` replaces at the
    /// same address (its load, requests in flight, health and ejection are the server's).
    fn add_keeping(&self, spec: ReplicaSpec, kept: Option<Arc<Upstream>>) -> Result<Member, IngestError> {
        // Held until the upstream is in place, so that a drain (or a change of serving) cannot
        // fall between the two.
        let drained = self.drained.read().unwrap_or_else(PoisonError::into_inner);
        let not_serving = self.not_serving.read().unwrap_or_else(PoisonError::into_inner);
        let replica = self.ingest.add_replica(spec)?;
        let upstream = kept
            .filter(|kept| kept.id() == replica.id)
            .unwrap_or_else(|| Arc::new(Upstream::waking(self.waiters.clone(), replica.id)));
        upstream.set_draining(drained.contains(&replica.spec.name));
        upstream.set_serving(!not_serving.contains(&replica.spec.name));
        self.upstreams.write().unwrap_or_else(PoisonError::into_inner).insert(replica.id, upstream.clone());
        self.changes.fetch_add(1, Ordering::Release);
        tracing::info!(replica = %replica.spec.name, id = %replica.id, http = %replica.spec.http_url, "replica added");
        self.waiters.wake_all();
        Ok(Member { replica, upstream })
    }

    /// Stops routing to the replica named `name`; returns the index blocks freed, or `None`
    /// if no such replica is registered. In-flight requests to it finish on their own.
    pub async fn remove(&self, name: &str) -> Option<usize> {
        self.remove_with(name, false).await.freed
    }

    /// [`Fleet::remove`] for good (an operator's removal): the name's drain goes too, so that
    /// an address discovery hands to a new pod later does not come up drained. The drain is
    /// forgotten and the upstream taken out at once, before the removal's wait: a drain can
    /// fall neither between the two nor after a caller stopped waiting.
    pub async fn remove_for_good(&self, name: &str) -> Removed {
        self.remove_with(name, true).await
    }

    async fn remove_with(&self, name: &str, forget_drain: bool) -> Removed {
        let (replica, drain_lifted) = {
            let mut drained = self.drained.write().unwrap_or_else(PoisonError::into_inner);
            let drain_lifted = forget_drain && drained.remove(name);
            let Some(replica) = self.ingest.replicas().by_name(name) else {
                return Removed { freed: None, drain_lifted };
            };
            self.upstreams.write().unwrap_or_else(PoisonError::into_inner).remove(&replica.id);
            self.changes.fetch_add(1, Ordering::Release);
            (replica, drain_lifted)
        };
        // Those waiting for room decide again: a request waiting for it alone is answered now,
        // and one the rest could not take (a LoRA adapter it alone listed) may go elsewhere.
        self.waiters.wake_all();
        let freed = self.ingest.remove_replica(replica.id).await;
        tracing::info!(replica = %name, freed = ?freed, "replica removed");
        Removed { freed, drain_lifted }
    }

    /// Every routable replica, ordered by id.
    pub fn members(&self) -> Vec<Member> {
        let upstreams = self.upstreams.read().unwrap_or_else(PoisonError::into_inner);
        self.ingest
            .replicas()
            .list()
            .into_iter()
            .filter_map(|replica| upstreams.get(&replica.id).map(|u| Member { replica, upstream: u.clone() }))
            .collect()
    }

    /// Drains the replica named `name` (no new requests; those in flight finish), or undrains
    /// it. A name that left the fleet (a pod being rescheduled, a replica being replaced)
    /// keeps the change, so that it comes back drained or not as asked: undrained, any name;
    /// drained, one that has been in the fleet (a typo is not kept). For a name out of the
    /// fleet, `Err` says whether a drain is kept for it now (draining) or was lifted
    /// (undraining).
    pub fn set_draining(&self, name: &str, drain: bool) -> Result<Member, bool> {
        let mut drained = self.drained.write().unwrap_or_else(PoisonError::into_inner);
        let kept = match drain {
            true if self.knows(name) => {
                drained.insert(name.to_owned());
                true
            }
            true => false,
            false => drained.remove(name),
        };
        let member = self.member(name).ok_or(kept)?;
        member.upstream.set_draining(drain);
        Ok(member)
    }

    /// Whether the replica named `name` serves (discovery's word), now and for a replica
    /// added under that name later.
    pub fn set_serving(&self, name: &str, serving: bool) {
        let mut not_serving = self.not_serving.write().unwrap_or_else(PoisonError::into_inner);
        if serving {
            not_serving.remove(name);
        } else {
            not_serving.insert(name.to_owned());
        }
        if let Some(member) = self.member(name) {
            member.upstream.set_serving(serving);
        }
    }

    /// Whether a replica called `name` has ever been in the fleet.
    pub fn knows(&self, name: &str) -> bool {
        self.ingest.replicas().knows(name)
    }

    /// Whether `member` is still the fleet's replica of its name (not removed, nor replaced
    /// by one at another address, whose id it shares).
    pub fn still_has(&self, member: &Member) -> bool {
        self.member(&member.replica.spec.name).is_some_and(|now| Arc::ptr_eq(&now.upstream, &member.upstream))
    }

    pub fn member(&self, name: &str) -> Option<Member> {
        let replica = self.ingest.replicas().by_name(name)?;
        let upstream =
            self.upstreams.read().unwrap_or_else(PoisonError::into_inner).get(&replica.id)?.clone();
        Some(Member { replica, upstream })
    }

    /// Adds `spec`, or replaces the registered replica of that name if its spec changed (at the
    /// same HTTP address, the server's load, requests in flight, health and ejection go on;
    /// its index starts again from its events).
    pub async fn upsert(&self, spec: ReplicaSpec) -> Result<(), IngestError> {
        let mut kept = None;
        if let Some(existing) = self.ingest.replicas().by_name(&spec.name) {
            if existing.spec == spec {
                return Ok(());
            }
            if existing.spec.http_url == spec.http_url {
                kept = self.member(&spec.name).map(|member| member.upstream);
            }
            self.remove(&spec.name).await;
        }
        self.add_keeping(spec, kept).map(drop)
    }

    /// True once there is a serving replica and every serving replica completed its first
    /// event sync or has no usable stream at all (`FALLBACK`: routed without its own cache,
    /// so nothing to wait for). Replicas discovery says are not serving (a pod still loading
    /// its model) are not waited for.
    pub fn ready(&self) -> bool {
        let members: Vec<Member> = self.members().into_iter().filter(|m| m.upstream.is_serving()).collect();
        !members.is_empty()
            && members
                .iter()
                .all(|m| m.replica.status.is_synced() || m.replica.status.state() == StreamState::Fallback)
    }
}

/// Discovered replicas join and leave the fleet (ingestion and the proxy's upstreams).
impl ReplicaSink for Fleet {
    type Error = IngestError;

    async fn upsert(&self, spec: ReplicaSpec) -> Result<(), IngestError> {
        Fleet::upsert(self, spec).await
    }

    async fn remove(&self, name: &str) {
        // A replica named by its address (DNS discovery, an endpoint with no pod) is gone for
        // good: the address may be handed to an unrelated pod later, which must not come up
        // drained. A pod's name keeps its drain across the pod's restarts.
        match name.parse::<std::net::IpAddr>() {
            Ok(_) => Fleet::remove_for_good(self, name).await.freed,
            Err(_) => Fleet::remove(self, name).await,
        };
        // Gone from the platform: a replica added under the name later serves.
        Fleet::set_serving(self, name, true);
    }

    fn set_serving(&self, name: &str, serving: bool) {
        Fleet::set_serving(self, name, serving);
    }

    fn holds(&self, name: &str, spec: &ReplicaSpec) -> bool {
        ReplicaSink::holds(&self.ingest, name, spec)
    }
}

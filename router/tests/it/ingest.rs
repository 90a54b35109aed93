//! Event ingestion end to end: publishers (the replica agent's, or hand-written ones that
//! misbehave) → ZeroMQ → the router's ingest tasks → the prefix index.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use kvroute_proto::pb::{self, EventBatch};
use kvroute_proto::{CacheNamespace, Seq, framing};
use kvroute_replica_agent::publisher::EventFormat;
use kvroute_router::ingest::{Outcome, SkipReason};
use kvroute_router::replicas::{EngineKind, Replica, ReplicaSpec, StreamState};
use tokio_util::sync::CancellationToken;

use crate::support::*;

/// Engine ids of the vLLM-format publishers: router hashes XOR this, so equal router hashes
/// can only come from recomputing them.
const ENGINE_SALT: u64 = 0x5eed_0000_dead_beef;

fn vllm(batch: EventBatch) -> Bytes {
    EventFormat::Vllm.encode_payload(&opaque(batch, ENGINE_SALT))
}

fn native(batch: EventBatch) -> Bytes {
    EventFormat::Kvroute.encode_payload(&batch)
}

fn payload(engine: EngineKind, batch: EventBatch) -> Bytes {
    match engine {
        EngineKind::Kvroute => native(batch),
        EngineKind::Vllm | EngineKind::Sglang => vllm(batch),
    }
}

/// Publishes empty batches from `seq` on until the router applied one (so the subscription
/// is in place); returns the next free seq.
async fn warm_up(fake: &mut FakePublisher, replica: &Replica, epoch: u64, mut seq: u64) -> u64 {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        fake.send(seq, payload(replica.spec.engine, batch(epoch, seq, vec![]))).await;
        seq += 1;
        for _ in 0..20 {
            if replica.status.last_seq() == Some(Seq(seq - 1)) {
                return seq;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        assert!(tokio::time::Instant::now() < deadline, "publisher never reached the router");
    }
}

/// Waits for the first replay and the catch-up replay after connecting, so that counters
/// compared later change only because of what the test does.
async fn settled(m: &kvroute_router::ingest::ReplicaMetrics) {
    wait_until("catch-up replay done", || m.replays(Outcome::Ok).get() >= 2).await;
}

/// A hand-written vLLM publisher without replay, its replica synced and its stream warmed
/// up; the seq to send next.
async fn vllm_without_replay(
    h: &Harness,
    name: &str,
) -> (FakePublisher, Arc<Replica>, kvroute_router::ingest::ReplicaMetrics, u64) {
    let mut fake = FakePublisher::start(None).await;
    let (r, m) = h.add(spec(name, EngineKind::Vllm, &fake.events, None));
    h.synced(&r).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    (fake, r, m, seq)
}

async fn applied(replica: &Replica, seq: u64) {
    wait_until(&format!("{} applied seq {seq}", replica.spec.name), || {
        replica.status.last_seq() == Some(Seq(seq))
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_stream_is_applied_to_the_index() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, m) = h.add(spec("native-0", EngineKind::Kvroute, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let mut rng = Rng::new(1);
    let a = rng.tokens(6);
    let mut b = a[..2 * BLOCK as usize].to_vec();
    b.extend(rng.tokens(3));
    let a_hashes = chain(&a);
    agent.publish(batch(7, 0, vec![store_chain(&a, 0)])).await;
    agent.publish(batch(7, 1, vec![store_chain(&b, 2)])).await;
    agent.publish(batch(7, 2, vec![removed_event(&a_hashes[4..6])])).await;
    applied(&r, 2).await;
    assert_eq!(h.overlap(&r, &a), 4);
    assert_eq!(h.overlap(&r, &b), 5);
    assert_eq!(h.index.blocks(r.id), 7);
    assert_eq!(r.status.state(), StreamState::Exact);
    assert_eq!(r.status.epoch().0, 7);
    assert_eq!(m.blocks_stored.get(), 9);
    assert_eq!(m.blocks_removed.get(), 2);
    assert_eq!(m.blocks.get(), 7);
    let text = h.scrape();
    assert!(text.contains(r#"kvroute_ingest_stream_state{replica="native-0",state="exact"} 1"#), "{text}");
    assert!(text.contains("kvroute_ingest_index_entries 7"), "{text}");
}

/// Blocks of another size than the replica's (a misconfigured agent) never reach the
/// index: their hashes would match no request. vLLM events were already checked when
/// decoded; native batches were not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn native_blocks_of_another_size_are_skipped() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, m) = h.add(spec("native-size", EngineKind::Kvroute, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let mut rng = Rng::new(5);
    let (a, b) = (rng.tokens(4), rng.tokens(3));
    let mut other_size = batch(7, 0, vec![store_chain(&a, 0)]);
    other_size.block_size = 2 * BLOCK;
    agent.publish(other_size).await;
    agent.publish(batch(7, 1, vec![store_chain(&b, 0)])).await;
    applied(&r, 1).await;
    assert_eq!((h.overlap(&r, &a), h.overlap(&r, &b)), (0, 3));
    assert_eq!(m.skipped(SkipReason::BlockSize).get(), 1);
}

/// The same seeded workload, once as kvroute batches and once as vLLM batches with opaque
/// engine hashes: the router must end with identical index contents for both.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn vllm_stream_gives_the_same_router_hashes_as_native() {
    let h = Harness::start();
    let native_pub = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let vllm_pub = AgentPublisher::start(EventFormat::Vllm, true).await;
    let (n, _) = h.add(spec("native", EngineKind::Kvroute, &native_pub.events, native_pub.replay.as_deref()));
    let (v, vm) = h.add(spec("vllm", EngineKind::Vllm, &vllm_pub.events, vllm_pub.replay.as_deref()));
    h.synced(&n).await;
    h.synced(&v).await;

    let mut rng = Rng::new(42);
    // Per prompt: its tokens and how many leading blocks are cached.
    let mut prompts: Vec<(Vec<u32>, usize)> = Vec::new();
    let steps = 120u64;
    for seq in 0..steps {
        let op = if prompts.is_empty() { 0 } else { rng.below(3) };
        let event = match op {
            0 => {
                let blocks = 1 + rng.below(6) as usize;
                let tokens = rng.tokens(blocks);
                let event = store_chain(&tokens, 0);
                prompts.push((tokens, blocks));
                event
            }
            1 => {
                let p = rng.below(prompts.len() as u64) as usize;
                let extra = 1 + rng.below(3) as usize;
                let new_tokens = rng.tokens(extra);
                let (tokens, len) = &mut prompts[p];
                tokens.truncate(*len * BLOCK as usize);
                tokens.extend(new_tokens);
                let event = store_chain(tokens, *len);
                *len += extra;
                event
            }
            _ => {
                let p = rng.below(prompts.len() as u64) as usize;
                let (tokens, len) = &mut prompts[p];
                if *len == 0 {
                    *len = 1;
                    store_chain(&tokens[..BLOCK as usize], 0)
                } else {
                    let hashes = chain(&tokens[..*len * BLOCK as usize]);
                    *len -= 1;
                    removed_event(&hashes[*len..])
                }
            }
        };
        let b = batch(1, seq, vec![event]);
        native_pub.publish(b.clone()).await;
        vllm_pub.publish(opaque(b, ENGINE_SALT)).await;
    }
    applied(&n, steps - 1).await;
    applied(&v, steps - 1).await;
    let mut held = 0;
    for (tokens, len) in &prompts {
        let hashes = chain(&tokens[..*len * BLOCK as usize]);
        assert_eq!(h.index.lookup(&hashes).get(n.id), *len);
        assert_eq!(h.index.lookup(&hashes).get(v.id), *len);
        held += len;
    }
    assert!(held > 20, "the workload should leave blocks cached");
    assert_eq!(h.index.blocks(n.id), h.index.blocks(v.id));
    assert_eq!(h.index.blocks(v.id), held);
    for reason in SkipReason::ALL {
        assert_eq!(vm.skipped(reason).get(), 0, "{reason:?}");
    }
}

/// The cause of `vllm_stream_gives_the_same_router_hashes_as_native`'s flakiness: the first
/// batches a publisher sends right after the router's initial (empty) replay can go out
/// before the SUB's subscription reaches the PUB. The first batch that does arrive was then
/// applied as a fresh start and the lost ones were never replayed (the catch-up replay starts
/// after it). An empty replay says the next batch is seq 0, so a later one is a gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_joiner_losing_the_first_batches_is_repaired() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (events, replay) = (fake.events.clone(), fake.replay.clone().expect("replay"));
    let (r, m) = h.add(spec("slow-joiner", EngineKind::Vllm, &events, Some(&replay)));
    h.synced(&r).await;
    // After the catch-up replay, or it could fetch batch 0 before any gap shows.
    settled(&m).await;
    let a = Rng::new(11).tokens(3);
    fake.keep(0, vllm(batch(0, 0, vec![store_chain(&a, 0)])));
    warm_up(&mut fake, &r, 0, 1).await;
    assert_eq!(h.overlap(&r, &a), 3, "batch 0 was replayed");
    assert!(m.gaps.get() >= 1);
}

async fn gap_is_repaired_by_replay(layout: ReplayLayout) {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(layout)).await;
    let (r, m) = h.add(spec("gappy", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let (gaps, replays) = (m.gaps.get(), m.replays(Outcome::Ok).get());
    let mut rng = Rng::new(3);
    let a = rng.tokens(3);
    let b = rng.tokens(2);
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&a, 0)]))).await;
    fake.keep(seq + 1, vllm(batch(0, seq + 1, vec![store_chain(&b, 0)])));
    fake.send(seq + 2, vllm(batch(0, seq + 2, vec![removed_event(&chain(&a)[2..])]))).await;
    applied(&r, seq + 2).await;
    assert_eq!(h.overlap(&r, &a), 2);
    assert_eq!(h.overlap(&r, &b), 2, "the dropped batch was replayed");
    assert_eq!(m.gaps.get(), gaps + 1);
    assert_eq!(m.replays(Outcome::Ok).get(), replays + 1);
    assert_eq!(r.status.state(), StreamState::Exact);
}

/// A replay that comes back with a batch missing (a publisher's send buffer overflowed, and
/// ZeroMQ drops silently) is applied only up to the hole: the missing batch's removal must
/// not be skipped over. The index never holds a block the replica dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_with_a_hole_is_applied_only_up_to_it() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("holey", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let mut rng = Rng::new(31);
    let (a, b, c) = (rng.tokens(3), rng.tokens(2), rng.tokens(2));
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&a, 0)]))).await;
    applied(&r, seq).await;
    assert_eq!(h.overlap(&r, &a), 3);
    // seq+1 (b stored) is lost live but replayable; seq+2 (a's last block removed) is lost
    // for good; seq+3 (c stored) is replayable; seq+4 arrives live and reveals the gap.
    fake.keep(seq + 1, vllm(batch(0, seq + 1, vec![store_chain(&b, 0)])));
    fake.keep(seq + 3, vllm(batch(0, seq + 3, vec![store_chain(&c, 0)])));
    fake.send(seq + 4, vllm(batch(0, seq + 4, vec![]))).await;
    applied(&r, seq + 4).await;
    assert!(h.overlap(&r, &a) < 3, "a's last block was removed in the missing batch");
    assert!(m.gaps.get() >= 2, "the gap, and the hole in its replay");
    assert_eq!(r.status.state(), StreamState::Exact);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dropped_batch_is_repaired_by_replay() {
    gap_is_repaired_by_replay(ReplayLayout::New).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn old_replay_layout_is_understood() {
    gap_is_repaired_by_replay(ReplayLayout::Old).await;
}

/// A batch published after the router's first replay but before its subscription reached
/// the publisher is lost, and no later batch reveals it: the catch-up replay finds it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batch_lost_to_the_slow_joiner_is_caught_up() {
    let h = Harness::with_config(kvroute_router::ingest::IngestConfig {
        catch_up_after: Duration::from_secs(1),
        ..test_config()
    });
    let fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("joiner", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    let a = Rng::new(14).tokens(2);
    fake.keep(0, vllm(batch(0, 0, vec![store_chain(&a, 0)])));
    applied(&r, 0).await;
    assert_eq!(h.overlap(&r, &a), 2);
    assert_eq!(m.replays(Outcome::Ok).get(), 2);
    assert_eq!(m.gaps.get(), 0);
}

/// Live messages arriving while the stream task is busy (here: waiting for a replay) fill
/// the bounded queue; the rest are dropped and counted, and the hole they leave is repaired
/// like any gap.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn queue_overflow_is_counted_and_repaired() {
    overflow_is_counted_and_repaired(kvroute_router::ingest::IngestConfig {
        channel_capacity: 2,
        ..test_config()
    })
    .await;
}

/// A publisher whose replay answers one batch at a time (and says that is all) is asked a
/// bounded number of times: the gap is not repaired a seq a replay. The rank starts over from
/// the live batch, and is in step again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_not_repaired_one_seq_a_replay() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("dripping", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let replays = m.replays(Outcome::Ok).get();
    fake.limit_replay(1);
    for missed in seq..seq + 40 {
        fake.keep(missed, vllm(batch(0, missed, vec![])));
    }
    let tokens = Rng::new(41).tokens(2);
    fake.send(seq + 40, vllm(batch(0, seq + 40, vec![store_chain(&tokens, 0)]))).await;
    applied(&r, seq + 40).await;
    assert_eq!(h.overlap(&r, &tokens), 2);
    assert_eq!(r.status.state(), StreamState::Exact);
    let asked = m.replays(Outcome::Ok).get() - replays;
    assert!(asked <= 10, "{asked} replays for one gap");
}

/// A long gap that replays bring back in large parts (a publisher whose answers stop early)
/// is repaired to its end, however many replays it takes: the budget is for replays that
/// crawl. (Spent, the rank would start over and lose what it had.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_gap_replayed_in_large_parts_is_repaired_whole() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("chunked", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let mut seq = warm_up(&mut fake, &r, 0, 0).await;
    let kept = Rng::new(43).tokens(2);
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&kept, 0)]))).await;
    applied(&r, seq).await;
    seq += 1;
    fake.limit_replay(100);
    for missed in seq..seq + 1500 {
        fake.keep(missed, vllm(batch(0, missed, vec![])));
    }
    let tokens = Rng::new(44).tokens(2);
    fake.send(seq + 1500, vllm(batch(0, seq + 1500, vec![store_chain(&tokens, 0)]))).await;
    applied(&r, seq + 1500).await;
    assert_eq!(h.overlap(&r, &tokens), 2);
    assert_eq!(h.overlap(&r, &kept), 2, "repaired, not started over");
    assert_eq!(r.status.state(), StreamState::Exact);
}

/// The same without end markers: each replay then ends at its reply timeout, and the tail
/// replays a repair asks for count in the gap's budget too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gap_is_not_repaired_one_seq_a_replay_without_end_markers() {
    let h = Harness::with_config(kvroute_router::ingest::IngestConfig {
        replay_timeout: Duration::from_millis(300),
        ..test_config()
    });
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("dripping", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let replays = || m.replays(Outcome::Ok).get() + m.replays(Outcome::Incomplete).get();
    let before = replays();
    fake.limit_replay(1);
    fake.drop_end_markers();
    for missed in seq..seq + 40 {
        fake.keep(missed, vllm(batch(0, missed, vec![])));
    }
    let tokens = Rng::new(42).tokens(2);
    fake.send(seq + 40, vllm(batch(0, seq + 40, vec![store_chain(&tokens, 0)]))).await;
    applied(&r, seq + 40).await;
    assert_eq!(h.overlap(&r, &tokens), 2);
    let asked = replays() - before;
    assert!(asked <= 10, "{asked} replays for one gap");
}

/// The same with a queue bounded by the bytes it holds (a few of these messages' worth), not
/// by their number.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_full_of_bytes_overflows_like_a_full_one() {
    overflow_is_counted_and_repaired(kvroute_router::ingest::IngestConfig {
        channel_capacity: 1024,
        channel_max_bytes: 512,
        ..test_config()
    })
    .await;
}

/// A queue bounded by bytes counts each frame's own cost too: messages of a thousand empty
/// frames each were counted as nothing, and queued without bound while the stream was busy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_queue_counts_the_frames_of_a_message() {
    let h = Harness::with_config(kvroute_router::ingest::IngestConfig {
        channel_capacity: 1024,
        channel_max_bytes: 64 << 10,
        ..test_config()
    });
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("frames", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let gaps = m.gaps.get();
    fake.pause_replay(true);
    fake.keep(seq, vllm(batch(0, seq, vec![]))); // lost: the next batch's replay stalls the stream
    fake.send(seq + 1, vllm(batch(0, seq + 1, vec![]))).await;
    wait_until("replay requested", || m.gaps.get() == gaps + 1).await;
    for _ in 0..100 {
        fake.send_frames(vec![Bytes::new(); 1024]).await;
    }
    // 32 KiB of frames each: two fit in 64 KiB.
    wait_until("queue overflowed", || m.overflow.get() >= 90).await;
    fake.pause_replay(false);
}

async fn overflow_is_counted_and_repaired(config: kvroute_router::ingest::IngestConfig) {
    let h = Harness::with_config(config);
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (r, m) = h.add(spec("flooded", EngineKind::Vllm, &fake.events, fake.replay.as_deref()));
    h.synced(&r).await;
    settled(&m).await;
    let seq = warm_up(&mut fake, &r, 0, 0).await;
    let gaps = m.gaps.get();
    let mut rng = Rng::new(4);
    let prompts: Vec<Vec<u32>> = (0..42).map(|_| rng.tokens(2)).collect();
    let store = |i: usize| vllm(batch(0, seq + i as u64, vec![store_chain(&prompts[i], 0)]));
    fake.pause_replay(true);
    fake.keep(seq, store(0)); // lost: the next batch triggers a replay, which stalls
    fake.send(seq + 1, store(1)).await;
    wait_until("replay requested", || m.gaps.get() == gaps + 1).await;
    for i in 2..41 {
        fake.send(seq + i as u64, store(i)).await;
    }
    // Most of the 39 are dropped (the queue holds a few) before the replay goes on.
    wait_until("queue overflowed", || m.overflow.get() >= 30).await;
    fake.pause_replay(false);
    fake.send(seq + 41, store(41)).await;
    applied(&r, seq + 41).await;
    for (i, p) in prompts.iter().enumerate() {
        assert_eq!(h.overlap(&r, p), 2, "prompt {i}");
    }
    assert!(m.gaps.get() >= gaps + 2, "the overflow hole is a second gap");
    // One report of the drops waits for the stream at a time: not a repair per dropped
    // message (a queue full of bytes has free slots for reports).
    assert!(m.gaps.get() <= gaps + 6, "{} gaps for one stall", m.gaps.get() - gaps);
    // (The drops behind the first report have one more, whose repair may still run.)
    wait_until("EXACT again", || r.status.state() == StreamState::Exact).await;
}

/// Replay unavailable (`with_replay` false) or incomplete (its buffer wrapped): the router
/// resyncs from the agent's snapshot, and the index equals the snapshot plus later batches.
async fn gap_resyncs_from_snapshot(with_replay: bool) {
    let h = Harness::start();
    let shutdown = CancellationToken::new();
    let agent = FakeAgent::default();
    let grpc = agent.serve(shutdown.clone()).await;
    let mut fake = FakePublisher::start(with_replay.then_some(ReplayLayout::New)).await;
    let spec = ReplicaSpec {
        grpc_endpoint: Some(grpc),
        ..spec("snap", EngineKind::Kvroute, &fake.events, fake.replay.as_deref())
    };
    let (r, m) = h.add(spec);
    h.synced(&r).await;
    if with_replay {
        settled(&m).await;
    }
    let seq = warm_up(&mut fake, &r, 9, 0).await;
    let (gaps, snapshots) = (m.gaps.get(), m.snapshots(Outcome::Ok).get());
    let mut rng = Rng::new(5);
    let (a, c, d) = (rng.tokens(3), rng.tokens(4), rng.tokens(2));
    fake.send(seq, native(batch(9, seq, vec![store_chain(&a, 0)]))).await;
    applied(&r, seq).await;
    // Batches seq+1 (store c) and seq+2 (evict a) are lost, and gone from the replay buffer.
    fake.keep(seq + 2, native(batch(9, seq + 2, vec![removed_event(&chain(&a))])));
    fake.forget_before(seq + 2);
    *agent.state.lock().unwrap() =
        SnapshotState { epoch: 9, seq: Some(seq + 2), blocks: snapshot_blocks(&c) };
    fake.send(seq + 3, native(batch(9, seq + 3, vec![store_chain(&d, 0)]))).await;
    applied(&r, seq + 3).await;
    // (What an incomplete replay brought is applied before the snapshot replaces it: its
    // last seq may be seen first.)
    wait_until("the snapshot and the batch after it", || h.overlap(&r, &c) == 4 && h.overlap(&r, &d) == 2)
        .await;
    assert_eq!(h.overlap(&r, &a), 0);
    assert_eq!(h.overlap(&r, &c), 4);
    assert_eq!(h.overlap(&r, &d), 2);
    assert_eq!(h.index.blocks(r.id), 6, "index = snapshot + batches after it");
    assert_eq!(m.gaps.get(), gaps + 1);
    assert_eq!(m.snapshots(Outcome::Ok).get(), snapshots + 1);
    if with_replay {
        assert_eq!(m.replays(Outcome::Incomplete).get(), 1);
    }
    assert_eq!(r.status.state(), StreamState::Exact);
    shutdown.cancel();
}

/// A snapshot's blocks in host memory (`medium` CPU, hashes alone) go to the host tier's
/// index; a tier the router does not index is skipped and counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_names_host_memory_apart() {
    let h = Harness::start();
    let shutdown = CancellationToken::new();
    let agent = FakeAgent::default();
    let grpc = agent.serve(shutdown.clone()).await;
    let fake = FakePublisher::start(None).await;
    let mut rng = Rng::new(6);
    let (cached, offloaded) = (rng.tokens(2), rng.tokens(3));
    let in_tier = |block: pb::SnapshotBlock, medium: &str| pb::SnapshotBlock {
        parent: None,
        token_ids: Vec::new(),
        medium: Some(medium.into()),
        ..block
    };
    let mut blocks = snapshot_blocks(&cached);
    let tiers = ["CPU", "CPU", "DISK"];
    blocks.extend(snapshot_blocks(&offloaded).into_iter().zip(tiers).map(|(b, tier)| in_tier(b, tier)));
    *agent.state.lock().unwrap() = SnapshotState { epoch: 3, seq: None, blocks };
    let spec =
        ReplicaSpec { grpc_endpoint: Some(grpc), ..spec("tiers", EngineKind::Kvroute, &fake.events, None) };
    let (r, m) = h.add(spec);
    h.synced(&r).await;
    let host = |tokens: &[u32]| h.ingest.host_index().lookup(&chain(tokens)).get(r.id);
    assert_eq!((h.overlap(&r, &cached), host(&cached)), (2, 0));
    assert_eq!((h.overlap(&r, &offloaded), host(&offloaded)), (0, 2));
    assert_eq!(m.skipped(SkipReason::Medium).get(), 1);
    assert_eq!(m.offloaded_blocks.get(), 2);
    shutdown.cancel();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gap_without_replay_resyncs_from_snapshot() {
    gap_resyncs_from_snapshot(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incomplete_replay_resyncs_from_snapshot() {
    gap_resyncs_from_snapshot(true).await;
}

/// A vLLM publisher restarts on the same ports with seq back at 0: the SUB reconnects by
/// itself and the replica's old blocks are dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn publisher_restart_on_the_same_port_clears_the_replica() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let (events, replay) = (fake.events.clone(), fake.replay.clone().expect("replay"));
    let (r, m) = h.add(spec("restarts", EngineKind::Vllm, &events, Some(&replay)));
    h.synced(&r).await;
    // The old process is far into its stream, so the new one's seqs are clearly backwards.
    let seq = warm_up(&mut fake, &r, 0, 1000).await;
    let mut rng = Rng::new(6);
    let (a, b) = (rng.tokens(3), rng.tokens(2));
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&a, 0)]))).await;
    applied(&r, seq).await;
    assert_eq!(h.overlap(&r, &a), 3);
    let clears = m.clears.get();
    fake.close().await;

    let mut fake = FakePublisher::bind(&events, Some((replay, ReplayLayout::New))).await;
    fake.send(0, vllm(batch(0, 0, vec![store_chain(&b, 0)]))).await;
    // Keep the new process busy until the router has caught up with it.
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut next = 1;
    while !(h.overlap(&r, &b) == 2 && h.overlap(&r, &a) == 0) {
        assert!(tokio::time::Instant::now() < deadline, "router never followed the restarted publisher");
        fake.send(next, vllm(batch(0, next, vec![]))).await;
        next += 1;
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // Cleared when the old connection closed (or, had it not been noticed, on the seq going
    // backwards).
    assert!(m.clears.get() > clears);
    wait_until("exact again", || r.status.state() == StreamState::Exact).await;
}

/// kvroute batches carry an epoch: a new one means a restarted agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn new_epoch_clears_the_replica() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, m) = h.add(spec("epochs", EngineKind::Kvroute, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let mut rng = Rng::new(7);
    let (a, b) = (rng.tokens(3), rng.tokens(2));
    agent.publish(batch(1, 0, vec![store_chain(&a, 0)])).await;
    agent.publish(batch(1, 1, vec![])).await;
    applied(&r, 1).await;
    let restarts = m.restarts.get();
    agent.publish(batch(2, 0, vec![store_chain(&b, 0)])).await;
    wait_until("new epoch applied", || r.status.epoch().0 == 2 && r.status.last_seq() == Some(Seq(0))).await;
    assert_eq!(h.overlap(&r, &a), 0);
    assert_eq!(h.overlap(&r, &b), 2);
    assert_eq!(m.restarts.get(), restarts + 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn all_blocks_cleared_clears_the_replica() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Vllm, true).await;
    let (r, _) = h.add(spec("cleared", EngineKind::Vllm, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let mut rng = Rng::new(8);
    let (a, b, c) = (rng.tokens(3), rng.tokens(2), rng.tokens(2));
    agent.publish(opaque(batch(0, 0, vec![store_chain(&a, 0)]), ENGINE_SALT)).await;
    agent
        .publish(opaque(
            batch(0, 1, vec![store_chain(&b, 0), cleared_event(), store_chain(&c, 0)]),
            ENGINE_SALT,
        ))
        .await;
    applied(&r, 1).await;
    assert_eq!(h.overlap(&r, &a), 0);
    assert_eq!(h.overlap(&r, &b), 0);
    assert_eq!(h.overlap(&r, &c), 2);
    assert_eq!(h.index.blocks(r.id), 2);
}

/// vLLM stores the same block twice and removes it twice: it stays cached until the second
/// removal, and a third removal is an unknown block, not an underflow.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn duplicate_stores_and_removes_are_refcounted() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Vllm, true).await;
    let (r, m) = h.add(spec("dups", EngineKind::Vllm, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let a = Rng::new(9).tokens(3);
    let last = &chain(&a)[2..];
    let send = |seq: u64, events| agent.publish(opaque(batch(0, seq, events), ENGINE_SALT));
    send(0, vec![store_chain(&a, 0)]).await;
    send(1, vec![store_chain(&a, 2)]).await; // the same last block again, via its parent
    send(2, vec![removed_event(last)]).await;
    applied(&r, 2).await;
    assert_eq!(h.overlap(&r, &a), 3, "one reference left");
    send(3, vec![removed_event(last)]).await;
    applied(&r, 3).await;
    assert_eq!(h.overlap(&r, &a), 2);
    send(4, vec![removed_event(last)]).await;
    applied(&r, 4).await;
    assert_eq!(h.overlap(&r, &a), 2);
    assert_eq!(m.skipped(SkipReason::UnknownBlock).get(), 1);
}

/// Under `kv_cache_report_mode="full"` vLLM announces a request's prefix-cache hits again,
/// from token 0, for blocks it holds once: one removal ends each of them (counted as second
/// copies, they stayed indexed after their eviction).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reannounced_prefixes_end_at_their_one_removal() {
    let h = Harness::start();
    let agent = AgentPublisher::start(EventFormat::Vllm, true).await;
    let (r, _) = h.add(spec("full-report", EngineKind::Vllm, &agent.events, agent.replay.as_deref()));
    h.synced(&r).await;
    let a = Rng::new(12).tokens(3);
    let send = |seq: u64, events| agent.publish(opaque(batch(0, seq, events), ENGINE_SALT));
    send(0, vec![store_chain(&a, 0)]).await;
    send(1, vec![store_chain(&a, 0), store_chain(&a[..2 * BLOCK as usize], 0)]).await;
    send(2, vec![removed_event(&chain(&a)[1..])]).await;
    applied(&r, 2).await;
    assert_eq!(h.overlap(&r, &a), 1);
    assert_eq!(h.index.blocks(r.id), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_messages_are_counted_and_a_bad_payload_resyncs() {
    let h = Harness::start();
    let (mut fake, r, m, seq) = vllm_without_replay(&h, "garbage").await;
    let gaps = m.gaps.get();
    let topic = Bytes::from_static(b"kv-events");
    let seq_frame = |s: u64| Bytes::copy_from_slice(&s.to_be_bytes());
    fake.send_frames(vec![topic.clone(), seq_frame(seq)]).await;
    fake.send_frames(vec![topic.clone(), Bytes::from_static(b"abc"), Bytes::from_static(b"x")]).await;
    fake.send_frames(framing::encode_live(topic.clone(), Seq(seq), Bytes::from_static(&[0xc1, 0xff, 0x00])))
        .await;
    let a = Rng::new(10).tokens(2);
    fake.send(seq + 1, vllm(batch(0, seq + 1, vec![store_chain(&a, 0)]))).await;
    applied(&r, seq + 1).await;
    assert_eq!(h.overlap(&r, &a), 2);
    assert_eq!(m.malformed_frame.get(), 2);
    assert_eq!(m.malformed_payload.get(), 1);
    assert_eq!(r.status.events_malformed(), 3);
    assert_eq!(m.gaps.get(), gaps, "an undecodable batch consumes its seq");
    assert_eq!(r.status.state(), StreamState::Exact);

    // A run of garbage makes the stream unusable until a good batch arrives.
    for i in 0..test_config().malformed_fallback as u64 {
        fake.send_frames(framing::encode_live(topic.clone(), Seq(seq + 2 + i), Bytes::from_static(b"\xc1")))
            .await;
    }
    wait_until("fallback after repeated garbage", || r.status.state() == StreamState::Fallback).await;
    let next = seq + 2 + u64::from(test_config().malformed_fallback);
    let b = Rng::new(11).tokens(1);
    fake.send(next, vllm(batch(0, next, vec![store_chain(&b, 0)]))).await;
    applied(&r, next).await;
    assert_eq!(r.status.state(), StreamState::Exact);
    assert_eq!(h.overlap(&r, &b), 1);
}

/// A batch that cannot be decoded may have removed blocks: the rank resyncs at once (here,
/// with no replay or snapshot, it clears and starts again from the next batch) rather than
/// keep blocks the replica may have dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_undecodable_batch_resyncs_its_rank() {
    let h = Harness::start();
    let (mut fake, r, m, seq) = vllm_without_replay(&h, "lossy").await;
    let mut rng = Rng::new(32);
    let (a, b) = (rng.tokens(3), rng.tokens(2));
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&a, 0)]))).await;
    applied(&r, seq).await;
    assert_eq!(h.overlap(&r, &a), 3);
    let topic = Bytes::from_static(b"kv-events");
    // A malformed frame first (it is no batch, so nothing is lost by it), then a lost batch.
    fake.send_frames(vec![topic.clone(), Bytes::from_static(b"abc"), Bytes::from_static(b"x")]).await;
    fake.send_frames(framing::encode_live(topic, Seq(seq + 1), Bytes::from_static(&[0xc1]))).await;
    wait_until("what the lost batch may have removed is gone", || h.overlap(&r, &a) == 0).await;
    fake.send(seq + 2, vllm(batch(0, seq + 2, vec![store_chain(&b, 0)]))).await;
    applied(&r, seq + 2).await;
    assert_eq!((m.malformed_frame.get(), m.malformed_payload.get()), (1, 1));
    assert_eq!(h.overlap(&r, &b), 2, "the batch after it is applied");
    assert_eq!(r.status.state(), StreamState::Exact);
}

/// `payload` (a vLLM batch) with the `i`th event's `key` set to `value`.
fn with_field(payload: &[u8], i: usize, key: &str, value: rmpv::Value) -> Bytes {
    let mut batch = rmpv::decode::read_value(&mut &payload[..]).expect("msgpack");
    let rmpv::Value::Array(parts) = &mut batch else { panic!("an array batch") };
    let rmpv::Value::Array(events) = &mut parts[1] else { panic!("an events array") };
    let rmpv::Value::Map(fields) = &mut events[i] else { panic!("a map event") };
    fields.iter_mut().find(|(k, _)| k.as_str() == Some(key)).expect("the field").1 = value;
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &batch).expect("encoded");
    Bytes::from(out)
}

/// A BlockStored the router cannot read (EAGLE's bigram token ids: pairs, not ids) used to
/// fail its whole batch, so the stores beside it were lost with it: it is skipped and
/// counted, and the rest of the batch applied. A removal it cannot read still fails the
/// batch (it may have dropped blocks), and the rank resyncs.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreadable_store_is_skipped_and_the_rest_of_its_batch_applied() {
    let h = Harness::start();
    let (mut fake, r, m, seq) = vllm_without_replay(&h, "bigram").await;
    let mut rng = Rng::new(33);
    let (a, b, c) = (rng.tokens(2), rng.tokens(3), rng.tokens(1));
    let stores = vllm(batch(0, seq, vec![store_chain(&a, 0), store_chain(&b, 0), store_chain(&c, 0)]));
    let pair = |t: u32| rmpv::Value::Array(vec![t.into(), (t + 1).into()]);
    let pairs = rmpv::Value::Array((0..3 * BLOCK).map(pair).collect());
    fake.send(seq, with_field(&stores, 1, "token_ids", pairs)).await;
    applied(&r, seq).await;
    assert_eq!((h.overlap(&r, &a), h.overlap(&r, &b), h.overlap(&r, &c)), (2, 0, 1));
    assert_eq!(m.skipped(SkipReason::MalformedEvent).get(), 1);
    assert_eq!(m.malformed_payload.get(), 0);
    assert_eq!(r.status.state(), StreamState::Exact);

    let removal = vllm(batch(0, seq + 1, vec![removed_event(&chain(&c))]));
    let unreadable = rmpv::Value::Array(vec![rmpv::Value::from("not a hash")]);
    fake.send(seq + 1, with_field(&removal, 0, "block_hashes", unreadable)).await;
    wait_until("what the unreadable removal may have removed is gone", || {
        h.overlap(&r, &a) == 0 && h.overlap(&r, &c) == 0
    })
    .await;
    assert_eq!(m.malformed_payload.get(), 1);
    assert_eq!(m.skipped(SkipReason::MalformedEvent).get(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn removing_a_replica_frees_everything_it_held() {
    let h = Harness::start();
    let p0 = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let p1 = AgentPublisher::start(EventFormat::Vllm, true).await;
    let (r0, _) = h.add(spec("keep", EngineKind::Kvroute, &p0.events, p0.replay.as_deref()));
    let (r1, _) = h.add(spec("doomed", EngineKind::Vllm, &p1.events, p1.replay.as_deref()));
    h.synced(&r0).await;
    h.synced(&r1).await;
    let mut rng = Rng::new(12);
    let shared = rng.tokens(4);
    let own = rng.tokens(50);
    p0.publish(batch(1, 0, vec![store_chain(&shared, 0)])).await;
    p1.publish(opaque(batch(1, 0, vec![store_chain(&shared, 0), store_chain(&own, 0)]), ENGINE_SALT)).await;
    applied(&r0, 0).await;
    applied(&r1, 0).await;
    assert_eq!(h.index.stats().entries, 4 + 54);
    let before = h.index.stats().memory_bytes;
    assert!(h.scrape().contains("doomed"));

    assert_eq!(h.ingest.remove_replica(r1.id).await, Some(54));
    assert_eq!(h.index.blocks(r1.id), 0);
    assert_eq!(h.index.stats().entries, 4);
    assert_eq!(h.index.stats().replicas, 1);
    assert!(h.index.stats().memory_bytes <= before);
    assert_eq!(h.overlap(&r0, &shared), 4);
    assert!(h.ingest.replicas().get(r1.id).is_none());
    assert!(!h.scrape().contains("doomed"), "metric label sets are dropped");
    assert_eq!(h.ingest.remove_replica(r1.id).await, None);
    // The name can come back (same id, nothing left over).
    let (again, _) = h.add(spec("doomed", EngineKind::Vllm, &p1.events, p1.replay.as_deref()));
    assert_eq!(again.id, r1.id);
}

/// A removal whose caller stops waiting (an admin call that timed out) still completes: the
/// replica is unregistered and its blocks freed, not left registered with no one following it.
/// (One thread: the replica's tasks cannot end while the removal is polled.)
#[tokio::test(flavor = "current_thread")]
async fn a_removal_abandoned_midway_still_completes() {
    let h = Harness::start();
    let p = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, _) = h.add(spec("abandoned", EngineKind::Kvroute, &p.events, p.replay.as_deref()));
    h.synced(&r).await;
    p.publish(batch(1, 0, vec![store_chain(&Rng::new(33).tokens(3), 0)])).await;
    applied(&r, 0).await;
    assert_eq!(h.index.blocks(r.id), 3);
    {
        let removal = h.ingest.remove_replica(r.id);
        tokio::pin!(removal);
        assert!(futures::poll!(removal.as_mut()).is_pending(), "waiting for the replica's tasks");
    }
    wait_until("the removal completes on its own", || h.ingest.replicas().get(r.id).is_none()).await;
    assert_eq!(h.index.blocks(r.id), 0);
}

/// A removal frees the name last: once a replica added again under it could take the id, the
/// old one's blocks are gone (the index is cleared shard by shard, which takes a while for a
/// large one), and its metric label sets are not dropped after the new one made its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_removed_name_is_free_only_once_everything_is_freed() {
    let h = Harness::start();
    let p = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, _) = h.add(spec("big", EngineKind::Kvroute, &p.events, p.replay.as_deref()));
    h.synced(&r).await;
    let mut rng = Rng::new(35);
    for _ in 0..2000 {
        h.index.store(r.id, &chain(&rng.tokens(128)));
    }
    assert_eq!(h.index.blocks(r.id), 256_000);
    let (ingest, id) = (h.ingest.clone(), r.id);
    let removal = tokio::spawn(async move { ingest.remove_replica(id).await });
    // Meanwhile the name cannot be taken again, and says why; once it can, all is freed.
    let mut refused = 0;
    let again = loop {
        match h.ingest.add_replica(spec("big", EngineKind::Kvroute, &p.events, p.replay.as_deref())) {
            Ok(again) => break again,
            Err(kvroute_router::ingest::IngestError::Removing(_)) => refused += 1,
            Err(kvroute_router::ingest::IngestError::Spec(_)) => {} // not begun yet: a duplicate
            Err(other) => panic!("{other:?}"),
        }
        tokio::task::yield_now().await;
    };
    assert_eq!(h.index.blocks(id), 0, "freed before the name");
    assert!(refused > 0, "the clear of 256 k blocks outlasts a few attempts");
    assert_eq!(removal.await.unwrap(), Some(256_000));
    h.synced(&again).await;
    assert!(h.scrape().contains("replica=\"big\""), "the new one's metrics are kept");
}

/// A replica added again under a name (same id) starts without credits: a decision made as
/// its predecessor was removed may have credited that id after its credits were forgotten.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replica_added_again_starts_without_credits() {
    let index = kvroute_router::index::SharedIndex::with_credit_ttl(Duration::from_secs(60));
    let h = Harness::with_index(test_config(), index);
    let p = AgentPublisher::start(EventFormat::Kvroute, true).await;
    let (r, _) = h.add(spec("again", EngineKind::Kvroute, &p.events, p.replay.as_deref()));
    h.synced(&r).await;
    h.ingest.remove_replica(r.id).await.unwrap();
    let late = chain(&Rng::new(34).tokens(2));
    h.index.credits().credit(r.id, &late); // a decision that raced the removal
    assert_eq!(h.index.credits().extend(r.id, &late, 0), 2);
    let (again, _) = h.add(spec("again", EngineKind::Kvroute, &p.events, p.replay.as_deref()));
    assert_eq!(again.id, r.id);
    assert_eq!(h.index.credits().extend(again.id, &late, 0), 0, "no credit from before");
}

/// A replica's cache reset (`AllBlocksCleared`) empties its view but keeps the credits of
/// decisions in flight: the requests sent to it still store their prompts, and a burst of
/// their followers must not scatter meanwhile. A publisher that stays away (stopped, killed)
/// took its requests with it, and their credits end once it is unreachable.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cleared_replica_keeps_its_credits() {
    let index = kvroute_router::index::SharedIndex::with_credit_ttl(Duration::from_secs(60));
    let h = Harness::with_index(test_config(), index);
    let (mut fake, r, _m, seq) = vllm_without_replay(&h, "reset").await;
    let stored = Rng::new(35).tokens(2);
    fake.send(seq, vllm(batch(0, seq, vec![store_chain(&stored, 0)]))).await;
    applied(&r, seq).await;
    let pending = chain(&Rng::new(36).tokens(2));
    h.index.credits().credit(r.id, &pending);
    fake.send(seq + 1, vllm(batch(0, seq + 1, vec![cleared_event()]))).await;
    applied(&r, seq + 1).await;
    assert_eq!(h.overlap(&r, &stored), 0, "the view is cleared");
    assert_eq!(h.index.credits().extend(r.id, &pending, 0), 2, "the credits stay");
    fake.close().await;
    wait_until("the credits end with the connection", || h.index.credits().extend(r.id, &pending, 0) == 0)
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn unreachable_publisher_is_fallback_until_it_appears() {
    let h = Harness::with_config(kvroute_router::ingest::IngestConfig {
        fallback_after: Duration::from_secs(2),
        ..test_config()
    });
    let port = kvroute_proto::loopback_port::unused().unwrap();
    let endpoint = format!("tcp://127.0.0.1:{port}");
    let added = std::time::Instant::now();
    let (r, _) = h.add(spec("late", EngineKind::Vllm, &endpoint, None));
    // Not before `fallback_after`: the ZMTP guard in front of the socket keeps trying the
    // publisher for as long as the socket waits, as the socket alone would. (A lower bound:
    // a loaded machine can only make it later.)
    wait_until("fallback", || r.status.state() == StreamState::Fallback).await;
    assert!(
        added.elapsed() >= Duration::from_secs(2),
        "fallback before fallback_after: {:?}",
        added.elapsed()
    );
    assert!(!r.status.is_synced());
    let mut fake = FakePublisher::bind(&endpoint, None).await;
    h.synced(&r).await;
    warm_up(&mut fake, &r, 0, 0).await;
    assert_eq!(r.status.state(), StreamState::Exact);
}

/// A publisher that announces a frame of 2^62 bytes. `zeromq` would reserve that much and
/// abort the process; the ZMTP guard cuts the connection first and counts it, and the
/// router goes on (here: it keeps reconnecting and cutting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publisher_announcing_a_huge_frame_is_cut_off_and_counted() {
    let h = Harness::start();
    let endpoint = kvroute_proto::zmtp_guard::huge_frame_peer().await.unwrap();
    let (r, m) = h.add(spec("evil", EngineKind::Vllm, &endpoint, None));
    wait_until("the oversized frame is counted", || m.malformed_oversized.get() >= 2).await;
    assert!(!r.status.is_synced());
    assert!(h.scrape().contains(r#"kind="oversized_message""#));
}

/// Every frame of a capture from a real vLLM server (block size 32), through sockets and the
/// whole ingestion path: duplicate stores and removes, parent-linked re-stores, evictions and
/// a final `AllBlocksCleared` + re-store leave exactly the last prompt's 10 blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn real_vllm_capture_is_ingested() {
    let h = Harness::start();
    let mut fake = FakePublisher::start(Some(ReplayLayout::New)).await;
    let spec = ReplicaSpec {
        replay_endpoint: fake.replay.clone(),
        block_size: Some(32),
        ..ReplicaSpec::new("captured", fake.events.clone(), EngineKind::Vllm, "m")
    };
    let (r, m) = h.add(spec);
    h.synced(&r).await;
    let capture = include_str!("../../../proto/tests/data/vllm-capture.jsonl");
    let mut last_tokens = Vec::new();
    let mut frames_sent = 0u64;
    for line in capture.lines() {
        let record: serde_json::Value = serde_json::from_str(line).unwrap();
        let frames: Vec<Bytes> = record["frames_hex"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| Bytes::from(hex::decode(f.as_str().unwrap()).unwrap()))
            .collect();
        let msg = framing::decode_live(&frames).unwrap();
        fake.keep(msg.seq.0, msg.payload.clone());
        fake.send_frames(frames).await;
        for event in record["decoded"][1].as_array().unwrap() {
            if event["type"] == "BlockStored" && event["parent_block_hash"].is_null() {
                last_tokens = event["token_ids"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(|t| t.as_u64().unwrap() as u32)
                    .collect();
            }
        }
        frames_sent += 1;
    }
    assert_eq!(frames_sent, 11);
    // One more (empty) batch, so a loss of the last capture frame shows up as a gap.
    let empty = kvroute_proto::vllm::encode_payload(&kvroute_proto::vllm::VllmBatch::default());
    fake.send(11, empty).await;
    applied(&r, 11).await;
    let expected = CacheNamespace::new("m").chain(&last_tokens, 32);
    assert_eq!(expected.len(), 10);
    assert_eq!(h.index.lookup(&expected).get(r.id), 10);
    assert_eq!(h.index.blocks(r.id), 10);
    assert_eq!(m.malformed_frame.get() + m.malformed_payload.get(), 0);
    for reason in SkipReason::ALL {
        assert_eq!(m.skipped(reason).get(), 0, "{reason:?}");
    }
    assert_eq!(m.events_applied.get(), 31);
    assert_eq!(r.status.state(), StreamState::Exact);
}

/// Each data-parallel rank has its own stream (port + rank); clearing one rank keeps the
/// other's blocks.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dp_ranks_are_followed_and_cleared_separately() {
    let h = Harness::start();
    let (mut rank0, mut rank1) = crate::support::rank_publishers().await;
    let spec = ReplicaSpec { dp_size: 2, ..spec("dp", EngineKind::Vllm, &rank0.events, None) };
    let (r, _) = h.add(spec);
    h.synced(&r).await;
    let mut rng = Rng::new(13);
    let (a, b) = (rng.tokens(2), rng.tokens(3));
    rank0.send(0, vllm(batch(0, 0, vec![store_chain(&a, 0)]))).await;
    rank1.send(0, vllm(batch(0, 0, vec![store_chain(&b, 0)]))).await;
    let deadline = tokio::time::Instant::now() + WAIT;
    let mut seq = 1;
    // Publishing again covers a batch lost to the subscription race (no replay here).
    while !(h.overlap(&r, &a) == 2 && h.overlap(&r, &b) == 3) {
        assert!(tokio::time::Instant::now() < deadline, "both ranks applied");
        tokio::time::sleep(Duration::from_millis(50)).await;
        rank0.send(seq, vllm(batch(0, seq, vec![store_chain(&a, 0)]))).await;
        rank1.send(seq, vllm(batch(0, seq, vec![store_chain(&b, 0)]))).await;
        seq += 1;
    }
    rank1.send(seq, vllm(batch(0, seq, vec![cleared_event()]))).await;
    wait_until("rank 1 cleared", || h.overlap(&r, &b) == 0).await;
    assert_eq!(h.overlap(&r, &a), 2, "rank 0 keeps its blocks");
}

/// A snapshot block with more tokens than a block (whose count would then bound nothing the
/// router keeps) fails the snapshot, and the rank rebuilds from the live stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_block_of_the_wrong_size_is_refused() {
    let mut blocks = snapshot_blocks(&Rng::new(22).tokens(2));
    blocks[1].token_ids = vec![7; 4096];
    let why = "a 4096-token block of a 4-token block size";
    snapshot_is_refused(test_config(), EngineKind::Vllm, blocks, |spec| spec, why).await;
}

/// An agent's snapshot stream decides how many chunks it sends: without a cap on the blocks
/// kept, one that never ends (or is simply huge) grew the router's memory until the
/// snapshot timeout. Beyond `snapshot_max_blocks` it counts as failed, and the rank falls
/// back to clear-and-rebuild from the live stream.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn oversized_snapshot_is_refused() {
    let config = kvroute_router::ingest::IngestConfig { snapshot_max_blocks: 3, ..test_config() };
    let blocks = snapshot_blocks(&Rng::new(21).tokens(4));
    let why = "a 4-block snapshot is over the cap of 3";
    let (_h, r, _publisher) =
        snapshot_is_refused(config, EngineKind::Kvroute, blocks, |spec| spec, why).await;
    assert_eq!(r.status.state(), StreamState::Exact, "rebuilt from the live stream instead");
}

/// The count of blocks bounded nothing of a block's strings: an agent naming a long salt on
/// every block grew the router's memory without limit while the count stayed under the cap.
/// Their tokens and names may take 256 bytes a block on average.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_long_names_is_refused() {
    let config = kvroute_router::ingest::IngestConfig { snapshot_max_blocks: 8, ..test_config() };
    let mut blocks = snapshot_blocks(&Rng::new(23).tokens(4));
    for block in &mut blocks {
        block.cache_salt = Some("s".repeat(4096));
    }
    let why = "16 KiB of salts in 4 blocks, under a cap of 8 blocks";
    snapshot_is_refused(config, EngineKind::Kvroute, blocks, |spec| spec, why).await;
}

/// A snapshot of another block size than the replica's is refused whole, and the rank rebuilds
/// from its live stream; it was taken, its blocks each skipped, and the rank counted in sync.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_snapshot_of_another_block_size_is_refused() {
    let blocks = snapshot_blocks(&Rng::new(24).tokens(2));
    let wide = |spec| ReplicaSpec { block_size: Some(BLOCK * 2), ..spec };
    let why = format!("blocks of {BLOCK} tokens for a replica of {}", BLOCK * 2);
    snapshot_is_refused(test_config(), EngineKind::Kvroute, blocks, wide, &why).await;
}

/// Adds an `engine` replica (its spec as `adjust` makes it) whose agent's snapshot is `blocks`,
/// under `config`, and checks that the snapshot was refused (`why`) and nothing of it stored;
/// the harness goes on, for further checks, and so does the replica's publisher (dropped, it
/// would disconnect the replica, and make it DEGRADED).
async fn snapshot_is_refused(
    config: kvroute_router::ingest::IngestConfig,
    engine: EngineKind,
    blocks: Vec<kvroute_proto::pb::SnapshotBlock>,
    adjust: impl FnOnce(ReplicaSpec) -> ReplicaSpec,
    why: &str,
) -> (Harness, Arc<Replica>, FakePublisher) {
    let h = Harness::with_config(config);
    let shutdown = CancellationToken::new();
    let agent = FakeAgent::default();
    *agent.state.lock().unwrap() = SnapshotState { epoch: 4, seq: Some(0), blocks };
    let grpc = agent.serve(shutdown.clone()).await;
    let fake = FakePublisher::start(None).await;
    let (r, m) = h.add(adjust(ReplicaSpec {
        grpc_endpoint: Some(grpc),
        ..spec("refused", engine, &fake.events, None)
    }));
    h.synced(&r).await;
    assert!(m.snapshots(Outcome::Failed).get() >= 1, "{why}");
    assert_eq!(m.snapshots(Outcome::Ok).get(), 0, "{why}");
    assert_eq!(h.index.blocks(r.id), 0, "nothing of it was stored");
    shutdown.cancel();
    (h, r, fake)
}

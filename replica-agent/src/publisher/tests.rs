//! The publisher over real ZeroMQ sockets on loopback: live frames reach a SUB, and a DEALER
//! replay returns what was missed, in the vLLM >= 0.26 layout.

use super::*;
use kvroute_proto::framing::ReplayReply;
use kvroute_proto::pb::{BlockStored, Event, event};
use kvroute_proto::{native, vllm};
use std::time::Duration;
use zeromq::{DealerSocket, SubSocket};

fn batch(seq: u64) -> EventBatch {
    EventBatch {
        replica: "r0".into(),
        epoch: 7,
        seq,
        ts_unix_nanos: 1_700_000_000_000_000_000 + seq,
        block_size: 2,
        dp_rank: 0,
        events: vec![Event {
            kind: Some(event::Kind::Stored(BlockStored {
                block_hashes: vec![seq * 10 + 1],
                parent_block_hash: None,
                token_ids: vec![1, 2],
                ..Default::default()
            })),
        }],
    }
}

async fn start(format: EventFormat) -> (Publisher, PublisherEndpoints) {
    let tracker = TaskTracker::new();
    let config = PublisherConfig { format, ..Default::default() };
    let (publisher, endpoints) =
        Publisher::bind(config, "tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), &tracker).await.unwrap();
    (publisher, endpoints)
}

/// How long a test waits for what must come.
const WAIT: Duration = Duration::from_secs(20);

/// `what`, or a failure if it has not finished within [`WAIT`].
async fn within<T>(what: &str, future: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(WAIT, future).await.unwrap_or_else(|_| panic!("{what}: nothing within {WAIT:?}"))
}

/// Publishes batches from `seq` on until `sub` receives one (the subscription has reached
/// the publisher: a slow joiner misses what came before), and returns that frame and the
/// next seq to publish.
async fn joined(publisher: &Publisher, sub: &mut SubSocket, mut seq: u64) -> (ZmqMessage, u64) {
    within("a subscription reaching the publisher", async {
        loop {
            assert!(publisher.publish(batch(seq)).await);
            seq += 1;
            if let Ok(Ok(msg)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                return (msg, seq);
            }
        }
    })
    .await
}

async fn subscribe(endpoint: &str) -> SubSocket {
    let mut sub = SubSocket::new();
    sub.connect(endpoint).await.unwrap();
    sub.subscribe("").await.unwrap();
    sub
}

async fn replay(endpoint: &str, start: u64) -> Vec<ReplayReply> {
    let mut dealer = DealerSocket::new();
    dealer.connect(endpoint).await.unwrap();
    let req = ZmqMessage::try_from(framing::encode_replay_request(Seq(start))).unwrap();
    dealer.send(req).await.unwrap();
    let mut out = Vec::new();
    loop {
        let msg = tokio::time::timeout(Duration::from_secs(10), dealer.recv()).await.unwrap().unwrap();
        let reply = framing::decode_replay_reply(&msg.into_vec()).unwrap();
        let end = reply == ReplayReply::End;
        out.push(reply);
        if end {
            return out;
        }
    }
}

#[tokio::test]
async fn live_batches_reach_a_subscriber_and_replay_returns_the_rest() {
    let (publisher, endpoints) = start(EventFormat::Kvroute).await;
    let mut sub = subscribe(&endpoints.events).await;
    let (first, seq) = joined(&publisher, &mut sub, 0).await;
    let (topic, got) = native::decode(&first.into_vec()).unwrap();
    assert_eq!(&topic[..], b"kv-events");
    assert_eq!(got, batch(got.seq));
    for s in seq..seq + 3 {
        publisher.publish(batch(s)).await;
    }
    let mut last = got.seq;
    while last + 1 < seq + 3 {
        let (_, b) = native::decode(&within("a live batch", sub.recv()).await.unwrap().into_vec()).unwrap();
        assert_eq!(b.seq, last + 1, "live stream is contiguous");
        last = b.seq;
    }

    // Everything from seq 0 is still buffered, including what the SUB missed while joining.
    let replies = replay(endpoints.replay.as_deref().unwrap(), 0).await;
    assert_eq!(replies.len() as u64, seq + 3 + 1);
    for (i, r) in replies[..replies.len() - 1].iter().enumerate() {
        let ReplayReply::Batch(m) = r else { panic!("batch expected") };
        assert_eq!(m.seq, Seq(i as u64));
        assert_eq!(&m.topic[..], b"kv-events");
        assert_eq!(native::decode_payload(m.seq, &m.payload).unwrap(), batch(i as u64));
    }
    // A start beyond the newest seq gets only the end marker.
    assert_eq!(replay(endpoints.replay.as_deref().unwrap(), 1_000).await, vec![ReplayReply::End]);
}

/// Batches handed to the publisher before it is dropped (the engine's scheduler ending) are
/// still sent (and kept for replay): they are seq'd, and a snapshot may cover them. Here the
/// drop comes first.
#[tokio::test]
async fn batches_handed_over_before_the_publisher_is_dropped_are_sent() {
    let mut socket = PubSocket::new();
    let endpoint = socket.bind("tcp://127.0.0.1:0").await.unwrap().to_string();
    let mut sub = subscribe(&endpoint).await;
    // Probes on the socket itself until one arrives: the subscription has reached it.
    within("a subscription reaching the socket", async {
        loop {
            socket.send(ZmqMessage::from("probe")).await.unwrap();
            if let Ok(Ok(_)) = tokio::time::timeout(Duration::from_millis(50), sub.recv()).await {
                return;
            }
        }
    })
    .await;
    let config = PublisherConfig::default();
    let (tx, rx) = mpsc::channel(config.queue);
    for seq in 0..200 {
        tx.send(batch(seq)).await.unwrap();
    }
    let buffer: RingBuffer = Arc::default();
    drop(tx);
    publish_loop(socket, rx, config, Bytes::from_static(b"kv-events"), buffer.clone()).await;
    let kept: Vec<u64> = buffer.lock().unwrap().iter().map(|(seq, _)| seq.0).collect();
    assert_eq!(kept, (0..200).collect::<Vec<u64>>());
    let mut sent = Vec::new();
    while sent.len() < 200 {
        let msg = within("the batches on the socket", sub.recv()).await.unwrap();
        if msg.get(0).is_some_and(|frame| &frame[..] == b"probe") {
            continue;
        }
        let (_, batch) = native::decode(&msg.into_vec()).unwrap();
        sent.push(batch.seq);
    }
    assert_eq!(sent, (0..200).collect::<Vec<u64>>());
}

/// A replay client may ask again and again on one connection, as vLLM's own clients do:
/// the guard charged its requests to the 64 KiB a subscriber may send, and cut it after
/// about 900 of them.
#[tokio::test]
async fn one_replay_connection_serves_request_after_request() {
    let (_publisher, endpoints) = start(EventFormat::Kvroute).await;
    let mut dealer = DealerSocket::new();
    dealer.connect(&endpoints.replay.unwrap()).await.unwrap();
    for i in 0..1_500 {
        let req = ZmqMessage::try_from(framing::encode_replay_request(Seq(u64::MAX))).unwrap();
        dealer.send(req).await.unwrap();
        let msg = within(&format!("the end marker of request {i}"), dealer.recv()).await.unwrap();
        assert_eq!(framing::decode_replay_reply(&msg.into_vec()).unwrap(), ReplayReply::End);
    }
}

/// A replay client that asks and does not read (its queue in the socket full, 100 000
/// messages) does not hold up the answers to others: the rest of its answers are dropped,
/// as libzmq's ROUTER drops past its high-water mark. The replay task waited on it until the
/// guard cut it, 30 s later (past [`WAIT`]).
#[tokio::test]
async fn a_replay_client_that_does_not_read_holds_up_no_one() {
    let (publisher, endpoints) = start(EventFormat::Kvroute).await;
    let ep = endpoints.replay.unwrap();
    let steps = PublisherConfig::default().buffer_steps as u64;
    for s in 0..steps {
        publisher.publish(batch(s)).await;
    }
    within("the last batch in the buffer", async {
        while replay(&ep, steps - 1).await.len() != 2 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    // A hundred whole buffers asked for: a million messages, more than its queue and the
    // buffers hold.
    let mut stuck = DealerSocket::new();
    stuck.connect(&ep).await.unwrap();
    for _ in 0..100 {
        stuck.send(ZmqMessage::try_from(framing::encode_replay_request(Seq(0))).unwrap()).await.unwrap();
    }
    // The socket takes its peers' requests in turn: by the time these are answered, the
    // stuck client's have been answered too, as far as its queue takes them.
    let mut other = DealerSocket::new();
    other.connect(&ep).await.unwrap();
    for i in 0..100 {
        other
            .send(ZmqMessage::try_from(framing::encode_replay_request(Seq(steps - 2))).unwrap())
            .await
            .unwrap();
        for reply in 0..3 {
            let msg = within(&format!("reply {reply} of request {i}"), other.recv()).await.unwrap();
            let ended = framing::decode_replay_reply(&msg.into_vec()).unwrap() == ReplayReply::End;
            assert_eq!(ended, reply == 2);
        }
    }
    drop(stuck);
}

#[tokio::test]
async fn replay_buffer_is_bounded() {
    let tracker = TaskTracker::new();
    let config = PublisherConfig { buffer_steps: 3, ..Default::default() };
    let (publisher, endpoints) =
        Publisher::bind(config, "tcp://127.0.0.1:0", Some("tcp://127.0.0.1:0"), &tracker).await.unwrap();
    for s in 0..10 {
        publisher.publish(batch(s)).await;
    }
    // Wait until the last batch is buffered: replay from 9 returns it.
    let ep = endpoints.replay.clone().unwrap();
    within("the last batch in the buffer", async {
        while replay(&ep, 9).await.len() != 2 {
            tokio::task::yield_now().await;
        }
    })
    .await;
    let seqs: Vec<u64> = replay(&ep, 0)
        .await
        .into_iter()
        .filter_map(|r| match r {
            ReplayReply::Batch(m) => Some(m.seq.0),
            ReplayReply::End => None,
        })
        .collect();
    assert_eq!(seqs, vec![7, 8, 9]);
}

#[tokio::test]
async fn vllm_format_decodes_with_the_vllm_decoder() {
    let (publisher, endpoints) = start(EventFormat::Vllm).await;
    publisher.publish(batch(0)).await;
    let ep = endpoints.replay.clone().unwrap();
    let replies = within("the batch in the buffer", async {
        loop {
            let r = replay(&ep, 0).await;
            if r.len() == 2 {
                return r;
            }
            tokio::task::yield_now().await;
        }
    })
    .await;
    let ReplayReply::Batch(m) = &replies[0] else { panic!("batch expected") };
    let decoded = vllm::decode_payload(&m.payload).unwrap();
    let vllm::VllmEvent::BlockStored(stored) = &decoded.events[0] else { panic!("BlockStored expected") };
    assert_eq!(stored.block_hashes, vec![kvroute_proto::BlockHash(1)]);
    assert_eq!(stored.token_ids, vec![1, 2]);
    assert_eq!(stored.block_size, 2);
}

/// vLLM's namespace fields: `lora_name` on every run of an adapter's request, and per block
/// the untagged extra keys of its hash: the adapter's name, then the salt on the prompt's
/// first block only; `nil` for a block with neither.
#[test]
fn vllm_format_names_the_adapter_and_the_salt_per_block() {
    let stored = |hashes: Vec<u64>, parent: Option<u64>, lora: Option<&str>, salt: Option<&str>| Event {
        kind: Some(event::Kind::Stored(BlockStored {
            token_ids: vec![7; hashes.len() * 2],
            block_hashes: hashes,
            parent_block_hash: parent,
            lora_name: lora.map(Into::into),
            cache_salt: salt.map(Into::into),
            medium: None,
        })),
    };
    let mut native = batch(0);
    native.events = vec![
        stored(vec![1, 2], None, Some("tuned"), Some("s")),
        stored(vec![3], Some(2), Some("tuned"), Some("s")),
        stored(vec![4], None, None, Some("s")),
        stored(vec![5, 6], None, None, None),
    ];
    let decoded = vllm::decode_payload(&EventFormat::Vllm.encode_payload(&native)).unwrap();
    let runs: Vec<_> = decoded
        .events
        .iter()
        .map(|e| match e {
            vllm::VllmEvent::BlockStored(s) => (s.lora_name.clone(), s.extra_keys.clone().unwrap()),
            other => panic!("BlockStored expected, got {other:?}"),
        })
        .collect();
    let key =
        |k: &[&str]| vllm::ExtraKey::Tuple(k.iter().map(|s| vllm::ExtraKey::Str(s.to_string())).collect());
    let tuned = Some("tuned".to_string());
    assert_eq!(
        runs,
        vec![
            (tuned.clone(), vec![key(&["tuned", "s"]), key(&["tuned"])]),
            (tuned, vec![key(&["tuned"])]),
            (None, vec![key(&["s"])]),
            (None, vec![vllm::ExtraKey::Nil, vllm::ExtraKey::Nil]),
        ]
    );
}

/// A peer that sends a greeting and then announces a 2^62-byte frame, on both sockets:
/// `zeromq` alone would reserve that much and abort the agent; the ZMTP guard cuts that
/// peer, and the others go on being served.
#[tokio::test]
async fn a_peer_announcing_a_huge_frame_is_cut_off_and_the_others_served() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (publisher, endpoints) = start(EventFormat::Kvroute).await;
    let huge = kvroute_proto::zmtp_guard::huge_frame();
    for endpoint in [&endpoints.events, endpoints.replay.as_ref().unwrap()] {
        let mut peer =
            tokio::net::TcpStream::connect(endpoint.strip_prefix("tcp://").unwrap()).await.unwrap();
        peer.write_all(&huge).await.unwrap();
        // The guard closes the connection (after the agent's greeting, if it came first).
        let mut sink = vec![0u8; 1024];
        let closed = tokio::time::timeout(Duration::from_secs(10), async {
            while peer.read(&mut sink).await.is_ok_and(|n| n > 0) {}
        });
        closed.await.expect("the peer is cut off");
    }
    assert_eq!(publisher.refused().load(std::sync::atomic::Ordering::Relaxed), 2);
    let mut sub = subscribe(&endpoints.events).await;
    joined(&publisher, &mut sub, 0).await;
    assert!(matches!(replay(endpoints.replay.as_ref().unwrap(), 0).await.last(), Some(ReplayReply::End)));
}

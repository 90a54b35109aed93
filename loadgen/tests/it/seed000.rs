//! N = 1 replays against expected numbers: two small traces checked by hand (and by the
//! independent Python reference `tests/data/seed000_reference.py`), and the shared Mooncake
//! trace against that reference.

use kvroute_loadgen::SimReport;
use kvroute_replica_agent::cache::PolicyKind as Eviction;

use crate::support::{data, read, read_shared_trace, replay};

struct Expected {
    eviction: Eviction,
    capacity: usize,
    hit_tokens: u64,
    prompt_tokens: u64,
    final_blocks: usize,
    per_request: &'static [u64],
}

fn check(report: &SimReport, want: &Expected) {
    let what = format!("{:?} at capacity {}", want.eviction, want.capacity);
    assert_eq!(report.total_hit_tokens, want.hit_tokens, "{what}");
    assert_eq!(report.total_prompt_tokens, want.prompt_tokens, "{what}");
    assert_eq!(report.final_cache_blocks, want.final_blocks, "{what}");
    assert_eq!(report.overall_hit_rate, want.hit_tokens as f64 / want.prompt_tokens as f64, "{what}");
    if !want.per_request.is_empty() {
        let got: Vec<u64> = report.per_request.iter().map(|r| r.hit_tokens).collect();
        assert_eq!(got, want.per_request, "{what}");
    }
    // Seed 000's sanity checks.
    assert_eq!(report.per_request.iter().map(|r| r.hit_tokens).sum::<u64>(), report.total_hit_tokens);
    assert_eq!(report.per_request.iter().map(|r| r.prompt_tokens).sum::<u64>(), report.total_prompt_tokens);
    assert!(report.final_cache_blocks <= want.capacity);
}

/// `small_a.jsonl`, capacity 6 (S3FIFO: small 1, main 5, ghost 5). Traced by hand:
/// - LRU: hits on r2 (blocks 1,2), r4 (1,2,3 = 1536), r6 (1,7 capped at 600), r12 (1,2);
///   everything else is evicted before it comes back.
/// - LFU: as LRU until r7, where 1 (freq 4), 2, 3, 7 (freq 2+) survive the one-access
///   blocks, so r9 hits 1,2 and r12 hits all of 1,2,3 (capped at 1300).
/// - S3FIFO: r2 misses (1 and 2 went to ghost when the one-block small queue drained); they
///   come back into main and stay there by second chance; 3 and 7 come back from ghost too
///   late for r4/r6's full prefix; r11 hits 5,6 (in main since r7).
#[test]
fn small_trace_a_matches_hand_checked_numbers() {
    let trace = read(&data("small_a.jsonl"));
    let cases = [
        Expected {
            eviction: Eviction::Lru,
            capacity: 6,
            hit_tokens: 4184,
            prompt_tokens: 12484,
            final_blocks: 6,
            per_request: &[0, 1024, 0, 1536, 0, 600, 0, 0, 0, 0, 0, 1024],
        },
        Expected {
            eviction: Eviction::Lfu,
            capacity: 6,
            hit_tokens: 5484,
            prompt_tokens: 12484,
            final_blocks: 6,
            per_request: &[0, 1024, 0, 1536, 0, 600, 0, 0, 1024, 0, 0, 1300],
        },
        Expected {
            eviction: Eviction::S3fifo,
            capacity: 6,
            hit_tokens: 4608,
            prompt_tokens: 12484,
            final_blocks: 6,
            per_request: &[0, 0, 0, 1024, 0, 512, 0, 0, 1024, 0, 1024, 1024],
        },
    ];
    for want in &cases {
        check(&replay(&trace, want.eviction, want.capacity), want);
    }
}

/// `small_b.jsonl`: 20 requests on a prefix tree with partial last blocks and a few
/// out-of-order timestamps (replayed in the file's order, each result in its line's place),
/// capacity 10 (S3FIFO: small 1, main 9); numbers from the Python reference. S3FIFO ends
/// below capacity, as seed 000 warns it may.
#[test]
fn small_trace_b_matches_the_reference() {
    let trace = read(&data("small_b.jsonl"));
    let cases = [
        Expected {
            eviction: Eviction::Lru,
            capacity: 10,
            hit_tokens: 9384,
            prompt_tokens: 19066,
            final_blocks: 10,
            per_request: &[
                0, 60, 429, 0, 64, 512, 512, 512, 950, 1024, 0, 429, 553, 1024, 486, 1024, 364, 61, 920, 460,
            ],
        },
        Expected {
            eviction: Eviction::Lfu,
            capacity: 10,
            hit_tokens: 9896,
            prompt_tokens: 19066,
            final_blocks: 10,
            per_request: &[
                0, 60, 429, 0, 64, 512, 512, 512, 950, 1024, 512, 429, 553, 1024, 486, 1024, 364, 61, 920,
                460,
            ],
        },
        Expected {
            eviction: Eviction::S3fifo,
            capacity: 10,
            hit_tokens: 8374,
            prompt_tokens: 19066,
            final_blocks: 7,
            per_request: &[
                0, 0, 429, 0, 64, 512, 0, 512, 512, 512, 512, 429, 553, 1024, 486, 1024, 364, 61, 920, 460,
            ],
        },
    ];
    for want in &cases {
        check(&replay(&trace, want.eviction, want.capacity), want);
    }
}

/// Seed 000 replays a trace in its file's order, whatever the timestamps say: here the
/// third line's block would hit had the replay gone by time (after the first), but the
/// second line's block evicted it first (one block of LRU).
#[test]
fn a_trace_is_replayed_in_its_files_order() {
    let lines = [(0, 1), (20, 2), (10, 1)].map(|(t, id)| {
        format!(r#"{{"timestamp":{t},"input_length":512,"output_length":1,"hash_ids":[{id}]}}"#)
    });
    let trace = kvroute_loadgen::workload::mooncake::read(lines.join("\n").as_bytes()).unwrap();
    let report = replay(&trace, Eviction::Lru, 1);
    let want = Expected {
        eviction: Eviction::Lru,
        capacity: 1,
        hit_tokens: 0,
        prompt_tokens: 1536,
        final_blocks: 1,
        per_request: &[0, 0, 0],
    };
    check(&report, &want);
}

/// The shared trace (3,993 requests, 121,877 block accesses) against the Python reference:
/// `python3 tests/data/seed000_reference.py TRACE --policy P --capacity C`.
#[test]
fn shared_trace_matches_the_reference() {
    let trace = read_shared_trace();
    assert_eq!(trace.len(), 3993);
    const PROMPT: u64 = 61_194_628;
    let cases = [
        (Eviction::Lru, 2048, 9_106_996, 2048),
        (Eviction::Lfu, 2048, 6_145_455, 2048),
        (Eviction::S3fifo, 2048, 8_396_586, 2048),
        (Eviction::Lru, 16384, 33_092_507, 16384),
        (Eviction::Lfu, 16384, 34_184_697, 16384),
        (Eviction::S3fifo, 16384, 30_687_354, 16384),
    ];
    for (eviction, capacity, hit_tokens, final_blocks) in cases {
        let want = Expected {
            eviction,
            capacity,
            hit_tokens,
            prompt_tokens: PROMPT,
            final_blocks,
            per_request: &[],
        };
        let report = replay(&trace, eviction, capacity);
        check(&report, &want);
        // First request of the trace and every request opening on an unseen block miss.
        let mut seen = std::collections::HashSet::new();
        for (r, got) in trace.requests.iter().zip(&report.per_request) {
            if !seen.contains(&r.hash_ids[0]) {
                assert_eq!(got.hit_tokens, 0);
            }
            seen.extend(r.hash_ids.iter().copied());
        }
    }
}

/// The replica agent's engine path (`start_request`, which pins a request's blocks, then
/// `finish_request`), one request at a time, gives seed 000's S3FIFO hits on the shared trace:
/// pins change nothing while no block a request uses is ever a victim. That holds while the
/// small queue is longer than any request (374 blocks here) and no admission's drain goes all
/// the way round main while a request holds a block there (one can, with every block of main
/// at freq 1: the request's own hit block then comes back to main's head with freq 0, and is
/// parked where seed 000 evicts it; this trace never does); at capacity 2048 (small 205)
/// a long request's own first blocks would leave the small queue while it runs, which an
/// engine cannot do. (LRU is vLLM's there: blocks are used again when a request finishes,
/// its tail first, and differs by design.)
#[test]
fn s3fifo_with_pins_one_request_at_a_time_is_seed_000() {
    use kvroute_proto::BlockHash;
    use kvroute_replica_agent::cache::{BlockCache, CacheConfig};

    let trace = read_shared_trace();
    assert_eq!(trace.requests.iter().map(|r| r.hash_ids.len()).max(), Some(374));
    for capacity in [4096, 16384] {
        let report = replay(&trace, Eviction::S3fifo, capacity);
        let config = CacheConfig {
            capacity_blocks: capacity,
            block_size: 512,
            policy: Eviction::S3fifo,
            s3fifo: Default::default(),
        };
        let mut cache = BlockCache::new(&config).unwrap();
        let mut events = vec![];
        for (i, (r, want)) in trace.requests.iter().zip(&report.per_request).enumerate() {
            let blocks: Vec<BlockHash> = r.hash_ids.iter().map(|&h| BlockHash(h)).collect();
            let got = cache.start_request(&blocks, r.input_len, &mut events).unwrap();
            assert_eq!(got.hit_tokens as u64, want.hit_tokens, "capacity {capacity}, request {i}");
            cache.finish_request(&blocks).unwrap();
        }
        assert_eq!(cache.len(), report.final_cache_blocks, "capacity {capacity}");
    }
}

#!/usr/bin/env python3
"""Independent reference for seed 000's prefix-cache replay, used to produce the expected
numbers in loadgen's tests (`tests/it/seed000.rs`). Written from seed 000's text, separately
from the Rust block cache: plain dicts and deques, no shared code.

    python3 seed000_reference.py TRACE.jsonl --policy lru|lfu|s3fifo --capacity C \
        [--block-size 512] [--per-request]

For each request, k = the longest prefix of hash_ids resident when it arrives; hit tokens =
min(k * block_size, input_length); then every hash id is accessed in order.
- LRU: evict the least recently accessed block.
- LFU: evict the block with the fewest accesses since admission (admission counts as one),
  ties by least recent access.
- S3FIFO (small_ratio 0.1, max_freq 3): small = round-half-even(C * 0.1), main = C - small,
  ghost = main; as seed 000 spells it out.
"""
import argparse
import heapq
import json
from collections import OrderedDict, deque


class Lru:
    def __init__(self, cap):
        self.cap, self.d = cap, OrderedDict()

    def resident(self, h):
        return h in self.d

    def access(self, h):
        if h in self.d:
            self.d.move_to_end(h)
            return
        if len(self.d) >= self.cap:
            self.d.popitem(last=False)
        self.d[h] = True

    def size(self):
        return len(self.d)


class Lfu:
    def __init__(self, cap):
        self.cap, self.meta, self.heap, self.tick = cap, {}, [], 0

    def resident(self, h):
        return h in self.meta

    def access(self, h):
        self.tick += 1
        if h in self.meta:
            freq, _ = self.meta[h]
            self.meta[h] = (freq + 1, self.tick)
        else:
            while len(self.meta) >= self.cap:
                freq, tick, victim = heapq.heappop(self.heap)
                if self.meta.get(victim) == (freq, tick):
                    del self.meta[victim]
            self.meta[h] = (1, self.tick)
        heapq.heappush(self.heap, (*self.meta[h], h))

    def size(self):
        return len(self.meta)


class S3Fifo:
    def __init__(self, cap, small_ratio=0.1, max_freq=3):
        self.small_cap = round(cap * small_ratio)  # Python's round is half-to-even
        self.main_cap = cap - self.small_cap
        self.ghost_cap = self.main_cap
        self.max_freq = max_freq
        self.S, self.M, self.G = deque(), deque(), deque()
        self.freq = {}  # resident block -> freq
        self.where = {}  # resident block -> 'S' | 'M'
        self.ghost = set()

    def resident(self, h):
        return h in self.where

    def insert_ghost(self, h):
        if h in self.ghost:
            self.G.remove(h)
        elif len(self.G) >= self.ghost_cap:
            self.ghost.discard(self.G.popleft())
        self.G.append(h)
        self.ghost.add(h)

    def admit_main(self, h, f):
        while len(self.M) >= self.main_cap:
            victim = self.M[0]
            vf = self.freq[victim]
            self.M.popleft()
            if vf >= 1:
                self.freq[victim] = vf - 1
                self.M.append(victim)
                continue
            del self.freq[victim], self.where[victim]
            self.insert_ghost(victim)
            break
        self.M.append(h)
        self.freq[h], self.where[h] = f, 'M'

    def admit_small(self, h):
        while len(self.S) >= self.small_cap:
            victim = self.S.popleft()
            vf = self.freq.pop(victim)
            del self.where[victim]
            if vf >= 1:
                self.admit_main(victim, vf)
            else:
                self.insert_ghost(victim)
        self.S.append(h)
        self.freq[h], self.where[h] = 0, 'S'

    def access(self, h):
        if h in self.where:
            self.freq[h] = min(self.freq[h] + 1, self.max_freq)
        elif h in self.ghost:
            self.G.remove(h)
            self.ghost.discard(h)
            self.admit_main(h, 0)
        else:
            self.admit_small(h)

    def size(self):
        return len(self.S) + len(self.M)


def replay(requests, policy, capacity, block_size):
    cache = {'lru': Lru, 'lfu': Lfu, 's3fifo': S3Fifo}[policy](capacity)
    per_request = []
    for r in requests:
        k = 0
        for h in r['hash_ids']:
            if not cache.resident(h):
                break
            k += 1
        hit = min(k * block_size, r['input_length'])
        for h in r['hash_ids']:
            cache.access(h)
        per_request.append({'hit_tokens': hit, 'prompt_tokens': r['input_length']})
    hits = sum(p['hit_tokens'] for p in per_request)
    total = sum(p['prompt_tokens'] for p in per_request)
    return {
        'total_hit_tokens': hits,
        'total_prompt_tokens': total,
        'overall_hit_rate': hits / total if total else 0.0,
        'final_cache_blocks': cache.size(),
        'per_request': per_request,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('trace')
    ap.add_argument('--policy', required=True, choices=['lru', 'lfu', 's3fifo'])
    ap.add_argument('--capacity', type=int, required=True)
    ap.add_argument('--block-size', type=int, default=512)
    ap.add_argument('--per-request', action='store_true')
    args = ap.parse_args()
    with open(args.trace) as f:
        requests = [json.loads(line) for line in f if line.strip()]
    # Replayed in the file's order: seed 000 gives the timestamp no part in a replay.
    out = replay(requests, args.policy, args.capacity, args.block_size)
    if not args.per_request:
        del out['per_request']
    print(json.dumps(out))


if __name__ == '__main__':
    main()

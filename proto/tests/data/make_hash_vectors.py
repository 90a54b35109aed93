#!/usr/bin/env python3
"""Regenerates hash-vectors.json: kvroute's block-hash chain computed independently of the Rust
code, from the algorithm stated in proto/src/hash.rs, with the PyPI `xxhash` package.

    python3 -m venv /tmp/v && /tmp/v/bin/pip install xxhash && /tmp/v/bin/python make_hash_vectors.py
"""
import json
import struct

import xxhash


def field(tag: bytes, value: str) -> bytes:
    data = value.encode()
    return tag + struct.pack("<I", len(data)) + data


def root(model, lora=None, salt=None) -> int:
    buf = b"kvroute/v1" + field(b"m", model)
    if lora is not None:
        buf += field(b"l", lora)
    if salt is not None:
        buf += field(b"s", salt)
    return xxhash.xxh3_64_intdigest(buf)


def chain(parent: int, tokens, block_size):
    out = []
    for i in range(len(tokens) // block_size):
        block = tokens[i * block_size:(i + 1) * block_size]
        parent = xxhash.xxh3_64_intdigest(struct.pack(f"<{len(block)}I", *block), seed=parent)
        out.append(parent)
    return out


CASES = [
    dict(name="empty prompt", model="Qwen/Qwen3-0.6B", tokens=[], block_size=4),
    dict(name="partial block only", model="Qwen/Qwen3-0.6B", tokens=[1, 2, 3], block_size=4),
    dict(name="two blocks and a tail", model="Qwen/Qwen3-0.6B", tokens=list(range(1, 11)), block_size=4),
    dict(name="lora", model="Qwen/Qwen3-0.6B", lora="sql-adapter", tokens=list(range(1, 9)), block_size=4),
    dict(name="salt", model="Qwen/Qwen3-0.6B", salt="tenant-a", tokens=list(range(1, 9)), block_size=4),
    dict(name="lora and salt", model="m", lora="a", salt="b", tokens=list(range(1, 9)), block_size=4),
    dict(name="16-token blocks, large ids", model="meta-llama/Llama-3.1-8B",
         tokens=[(i * 2654435761) % 4294967296 for i in range(40)], block_size=16),
    dict(name="512-token blocks (long input path)", model="kvroute-sim",
         tokens=[(i * 7919) % 128000 for i in range(1100)], block_size=512),
    dict(name="unicode model name", model="модель-θ", tokens=[0, 0, 0, 0], block_size=2),
]


def main():
    out = []
    for case in CASES:
        r = root(case["model"], case.get("lora"), case.get("salt"))
        out.append({**case, "root": str(r), "hashes": [str(h) for h in chain(r, case["tokens"], case["block_size"])]})
    with open("hash-vectors.json", "w") as f:
        f.write("[\n" + ",\n".join(json.dumps(c, ensure_ascii=False) for c in out) + "\n]\n")


if __name__ == "__main__":
    main()

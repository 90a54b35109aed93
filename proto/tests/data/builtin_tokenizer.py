#!/usr/bin/env python3
"""Reference implementation of kvroute's builtin tokenizer (version 1), for third parties and
for cross-checking the vectors in proto/src/openai/tokenizer.rs. The algorithm is specified
in that module's docs.

Usage:  pip install xxhash && python3 builtin_tokenizer.py "some text" ...
"""
import sys

import xxhash

VOCAB_SIZE = 32768
RESERVED = 16
MAX_WORD_CHARS = 16
SPECIAL_TOKENS = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}


def _special_at(text: str, i: int):
    for token, tid in SPECIAL_TOKENS.items():
        if text.startswith(token, i):
            return tid, len(token)
    return None


def _is_alnum(c: str) -> bool:
    # Rust's char::is_alphanumeric: Unicode Alphabetic or Numeric (N*). Python's str.isalnum
    # agrees for the scripts we test (it also counts some marks as letters in edge cases).
    return c.isalnum()


def _starts_unit(text: str, i: int) -> bool:
    return i < len(text) and not _is_space(text[i]) and _special_at(text, i) is None


def _unit_end(text: str, i: int) -> int:
    if _is_alnum(text[i]):
        j = i + 1
        while j < len(text) and j - i < MAX_WORD_CHARS and _is_alnum(text[j]):
            j += 1
        return j
    return i + 1


def piece_id(piece: str) -> int:
    return RESERVED + xxhash.xxh3_64_intdigest(piece.encode("utf-8")) % (VOCAB_SIZE - RESERVED)


def _is_space(c: str) -> bool:
    # Rust's char::is_whitespace is the Unicode White_Space property; Python's isspace also
    # counts U+001C..U+001F, so exclude those.
    return c.isspace() and not "\x1c" <= c <= "\x1f"


def encode(text: str) -> list[int]:
    ids, i = [], 0
    while i < len(text):
        special = _special_at(text, i)
        if special:
            ids.append(special[0])
            i += special[1]
            continue
        start, c = i, text[i]
        if c == " " and _starts_unit(text, i + 1):
            i = _unit_end(text, i + 1)
        elif not _is_space(c):
            i = _unit_end(text, i)
        else:
            i += 1
            while i < len(text) and _is_space(text[i]) and not (text[i] == " " and _starts_unit(text, i + 1)):
                i += 1
        ids.append(piece_id(text[start:i]))
    return ids


if __name__ == "__main__":
    for arg in sys.argv[1:] or ["Hello, world!", "<|im_start|>user\nThe quick brown fox.<|im_end|>"]:
        print(repr(arg), encode(arg))

"""The prefix cache: full pages of global KV keyed by a chained hash of their tokens."""

from __future__ import annotations

import collections
import hashlib

import numpy as np


class PrefixCache:
    """Full pages of global KV keyed by a chained hash of their tokens; reference counted, LRU-evicted."""

    def __init__(self, page_tokens: int):
        self.page_tokens = page_tokens
        self.by_key: dict[bytes, int] = {}
        self.key_of: dict[int, bytes] = {}
        self.refs: collections.Counter = collections.Counter()
        self.evictable: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.hit_tokens = 0
        self.query_tokens = 0

    def keys(self, tokens: list[int], prev: bytes = b"", salts=()) -> list[bytes]:
        """Chained hashes of the full pages of `tokens`, continuing the chain from `prev` (the key of the page
        before them, b"" at the start of a sequence). salts: per page, bytes hashed with it (what its tokens do
        not say: the images whose spans it holds, `images.page_salts`)."""
        out, h = [], prev
        n = len(tokens) // self.page_tokens * self.page_tokens
        buf = np.asarray(tokens[:n], np.int32).tobytes()
        step = self.page_tokens * 4
        for j, i in enumerate(range(0, len(buf), step)):
            h = hashlib.blake2b(h + buf[i:i + step] + (salts[j] if j < len(salts) else b""), digest_size=16).digest()
            out.append(h)
        return out

    def match(self, keys: list[bytes]) -> list[int]:
        """The cached pages of the longest cached run of `keys` from the start."""
        pages = []
        for k in keys:
            p = self.by_key.get(k)
            if p is None:
                break
            pages.append(p)
        return pages

    def acquire(self, page: int) -> None:
        self.refs[page] += 1
        self.evictable.pop(page, None)

    def release(self, page: int) -> bool:
        """-> True when the page is cached (kept, evictable) rather than free."""
        self.refs[page] -= 1
        if self.refs[page] <= 0:
            del self.refs[page]
            if page in self.key_of:
                self.evictable[page] = None
                return True
            return False
        return True

    def insert(self, key: bytes, page: int) -> None:
        if key in self.by_key or page in self.key_of:
            return
        self.by_key[key] = page
        self.key_of[page] = key

    def evict(self) -> int | None:
        if not self.evictable:
            return None
        page, _ = self.evictable.popitem(last=False)
        del self.by_key[self.key_of.pop(page)]
        return page

"""A set of model keys that a store of millions fits in memory: their 64-bit hashes in one
sorted array (KeySet), gathered in sorted, de-duplicated chunks (Hashes), or growing as a
stream is read (SeenKeys).

Used by the resume plan (controller.run.plan), the sharded backend's count of what is done
and summary.csv's first row of each key; knows nothing of stores or lists, only of hashable
keys.
"""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Iterable

import numpy as np


class KeySet:
    """A set of model keys held as their 64-bit hashes in one sorted array: a store's 2M
    marker keys in 16 MB (a Python set of them: ~250 MB of strings, ~130 MB of hashes).
    Python's string hash (salted per process, so only within one) makes a false "present"
    about 2M² / 2^64 ≈ 2e-7 likely in a whole 2M-model run. Built once, then only read."""

    CHUNK = 1 << 16  # hashes gathered per chunk before they are sorted into the whole

    def __init__(self, keys: Iterable[object] = ()) -> None:
        builder = Hashes()
        for key in keys:
            builder.add(hash(key))
        self._hashes = builder.sorted()

    @classmethod
    def of_hashes(cls, hashes: array[int]) -> KeySet:
        self = cls()
        self._hashes = hashes
        return self

    def __contains__(self, key: object) -> bool:
        h = hash(key)
        i = bisect_left(self._hashes, h)
        return i < len(self._hashes) and self._hashes[i] == h

    def __len__(self) -> int:
        return len(self._hashes)


class Hashes:
    """Hashes gathered in chunks, each made unique as it fills, then one sorted array."""

    def __init__(self) -> None:
        self._chunks: list[np.ndarray] = []
        self._chunk = array("q")

    def add(self, h: int) -> None:
        self._chunk.append(h)
        if len(self._chunk) >= KeySet.CHUNK:
            self._chunks.append(np.unique(np.frombuffer(self._chunk, dtype=np.int64)))
            self._chunk = array("q")

    def unique(self) -> np.ndarray:
        chunks = [*self._chunks, np.unique(np.frombuffer(self._chunk, dtype=np.int64))]
        return np.unique(np.concatenate(chunks)) if len(chunks) > 1 else chunks[0]

    def sorted(self) -> array[int]:
        # bisect on an array.array reads C longs straight; on a numpy array each probe
        # would build a numpy scalar (~10 times slower per lookup).
        return array("q", self.unique().tobytes())


class SeenKeys:
    """Keys met so far, to keep the first of each in a stream of millions: 8 bytes a key
    (one sorted array of hashes, as KeySet, and a set of the last RECENT added, merged into
    it as it fills), not a set of strings. A false "seen" (two keys with one hash) is as
    unlikely as KeySet's false "present"."""

    RECENT = 1 << 14  # hashes held in a set (~1 MB) before they go into the sorted array

    def __init__(self) -> None:
        self._sorted = array("q")
        self._recent: set[int] = set()

    def add(self, key: object) -> bool:
        """Note `key`; False when it was met before."""
        h = hash(key)
        if h in self._recent:
            return False
        i = bisect_left(self._sorted, h)
        if i < len(self._sorted) and self._sorted[i] == h:
            return False
        self._recent.add(h)
        if len(self._recent) >= self.RECENT:
            recent = np.sort(np.fromiter(self._recent, dtype=np.int64, count=len(self._recent)))
            # One pass over the sorted array (np.insert), not a sort of all of it.
            held = np.frombuffer(self._sorted, dtype=np.int64)
            merged = np.insert(held, np.searchsorted(held, recent), recent)
            self._sorted = array("q", merged.tobytes())
            self._recent = set()
        return True

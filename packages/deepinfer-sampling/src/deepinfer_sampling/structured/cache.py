"""Compiled-grammar cache bounded by bytes.

Owns the map from a grammar key (schema type and schema text) to its ``xgrammar.CompiledGrammar``. Entries are
charged ``CompiledGrammar.memory_size_bytes``; when an insert pushes the total over the byte limit, the least
recently used entries are evicted until it fits again. A grammar larger than the whole limit is not cached at all.
The cache is shared by the compile worker threads, so every operation holds one lock.
"""

from __future__ import annotations

import threading
from collections import OrderedDict

import xgrammar as xgr

GrammarKey = tuple[str, str]


class CompiledGrammarCache:
    """Least-recently-used cache of compiled grammars with a byte limit.

    Args:
        limit_bytes: most bytes kept; ``None`` means unbounded and ``0`` disables caching.

    Raises:
        ValueError: when ``limit_bytes`` is negative.
    """

    def __init__(self, limit_bytes: int | None) -> None:
        if limit_bytes is not None and limit_bytes < 0:
            raise ValueError(f"limit_bytes={limit_bytes} must be >= 0 (0 disables the cache) or None (unbounded)")
        self._limit_bytes = limit_bytes
        self._entries: OrderedDict[GrammarKey, tuple[xgr.CompiledGrammar, int]] = OrderedDict()
        self._num_bytes = 0
        self._lock = threading.Lock()

    @property
    def num_bytes(self) -> int:
        """Bytes currently charged to cached grammars."""
        with self._lock:
            return self._num_bytes

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def __contains__(self, key: GrammarKey) -> bool:
        with self._lock:
            return key in self._entries

    def get(self, key: GrammarKey) -> xgr.CompiledGrammar | None:
        """Return the cached grammar for ``key`` (marking it most recently used), or ``None``."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                return None
            self._entries.move_to_end(key)
            return entry[0]

    def put(self, key: GrammarKey, grammar: xgr.CompiledGrammar) -> None:
        """Insert ``grammar`` under ``key`` and evict least recently used entries beyond the byte limit."""
        size = int(grammar.memory_size_bytes)
        with self._lock:
            if self._limit_bytes is not None and size > self._limit_bytes:
                return
            old = self._entries.pop(key, None)
            if old is not None:
                self._num_bytes -= old[1]
            self._entries[key] = (grammar, size)
            self._num_bytes += size
            if self._limit_bytes is None:
                return
            while self._num_bytes > self._limit_bytes:
                _, (_, evicted_size) = self._entries.popitem(last=False)
                self._num_bytes -= evicted_size

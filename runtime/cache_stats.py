"""A host-tier cell's cache counters (torch-free: the runtime's cache counts them, and
`embarkc simulate`'s replay of it, `embarkc.cache_replay`, counts the same)."""

from __future__ import annotations

from dataclasses import dataclass, fields

STAT_NAMES = ("lookups", "hits", "misses", "fetches", "evictions", "writebacks", "host_reads")


@dataclass
class CacheStats:
    """Counters of one cache (or a sum of caches), in rows."""

    lookups: int = 0
    """distinct rows requested, summed over steps"""
    hits: int = 0
    """of those, rows already in the cache"""
    misses: int = 0
    """lookups - hits"""
    fetches: int = 0
    """misses copied from host into a slot"""
    evictions: int = 0
    """rows dropped from a slot to make room"""
    writebacks: int = 0
    """evicted or flushed rows copied back to host (they were updated while cached)"""
    host_reads: int = 0
    """misses served from host for the step, without a slot (the cache was full of the
    step's own rows)"""

    def add(self, other: CacheStats) -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_list(self) -> list[int]:
        return [getattr(self, n) for n in STAT_NAMES]

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.lookups if self.lookups else None

    def as_dict(self) -> dict[str, int]:
        return dict(zip(STAT_NAMES, self.as_list(), strict=True))

"""Replica choice inside a tier: an order in which to try the tier's available backends.

- least_load: ascending `Backend.load_score()` (the router's in-flight count moves at once, so
  a burst spreads before the next metrics poll); ties go round robin.
- prefix_affinity: the replica that owns the request's prefix key on a consistent-hash ring
  (`virtual_nodes` points per backend, so a backend leaving moves only its own keys), unless it
  is `max_load_imbalance` busier than the least-loaded one; the rest by least load.
- round_robin: a rotating start.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools

from pagedllm.router.backends import Backend
from pagedllm.router.config import PrefixAffinityConfig


def _point(label: str) -> int:
    return int.from_bytes(hashlib.blake2b(label.encode(), digest_size=8).digest(), "big")


class HashRing:
    """A consistent-hash ring over backend URLs; rebuilt only when the set of URLs changes."""

    def __init__(self, virtual_nodes: int) -> None:
        self.virtual_nodes = virtual_nodes
        self._urls: tuple[str, ...] = ()
        self._points: list[int] = []
        self._owners: list[str] = []

    def _build(self, urls: tuple[str, ...]) -> None:
        ring = sorted((_point(f"{url}#{i}"), url) for url in urls for i in range(self.virtual_nodes))
        self._points = [p for p, _ in ring]
        self._owners = [u for _, u in ring]
        self._urls = urls

    def owner(self, key: int, urls: tuple[str, ...]) -> str:
        if urls != self._urls:
            self._build(urls)
        i = bisect.bisect_left(self._points, key)
        return self._owners[i % len(self._owners)]


class Balancer:
    """Per (route, tier) replica ordering; holds only the round-robin counter and the ring."""

    def __init__(self, policy: str, affinity: PrefixAffinityConfig) -> None:
        self.policy = policy
        self.affinity = affinity
        self._counter = itertools.count()
        self._ring = HashRing(affinity.virtual_nodes)

    def order(self, backends: list[Backend], prefix_key: int | None) -> list[Backend]:
        if len(backends) <= 1:
            return list(backends)
        start = next(self._counter) % len(backends)
        rotated = backends[start:] + backends[:start]
        if self.policy == "round_robin":
            return rotated
        by_load = sorted(rotated, key=Backend.load_score)  # stable: ties keep the rotation
        if self.policy == "least_load" or prefix_key is None:
            return by_load
        urls = tuple(sorted(b.url for b in backends))
        owner_url = self._ring.owner(prefix_key, urls)
        owner = next(b for b in backends if b.url == owner_url)
        if owner.load_score() - by_load[0].load_score() > self.affinity.max_load_imbalance:
            return by_load
        return [owner] + [b for b in by_load if b is not owner]

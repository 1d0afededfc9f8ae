"""A consistent-hash ring: which worker a key (an item's content hash) goes to.

Each endpoint owns `vnodes` points on a 64-bit circle; a key goes to the owner of
the first point at or after its own hash. Adding or removing an endpoint moves
only the keys between its points and their neighbours: about 1/n of them.
"""
from __future__ import annotations

import bisect

import xxhash


def _point(data: bytes) -> int:
    return xxhash.xxh3_64_intdigest(data)


class HashRing:
    def __init__(self, endpoints=(), vnodes: int = 256):
        if vnodes < 1:
            raise ValueError(f"vnodes must be >= 1, got {vnodes}")
        self.vnodes = vnodes
        self._points: list[tuple[int, str]] = []  # sorted (point, endpoint)
        self._endpoints: set[str] = set()
        for ep in endpoints:
            self.add(ep)

    @property
    def endpoints(self) -> list[str]:
        return sorted(self._endpoints)

    def __len__(self) -> int:
        return len(self._endpoints)

    def __contains__(self, endpoint: str) -> bool:
        return endpoint in self._endpoints

    def add(self, endpoint: str) -> None:
        if endpoint in self._endpoints:
            raise ValueError(f"endpoint {endpoint!r} is already on the ring")
        self._endpoints.add(endpoint)
        for i in range(self.vnodes):
            bisect.insort(self._points, (_point(f"{endpoint}#{i}".encode()), endpoint))

    def remove(self, endpoint: str) -> None:
        if endpoint not in self._endpoints:
            raise ValueError(f"endpoint {endpoint!r} is not on the ring")
        self._endpoints.discard(endpoint)
        self._points = [p for p in self._points if p[1] != endpoint]

    def route(self, key: int) -> str:
        """The endpoint for `key`, an unsigned 64-bit int (hashed again, so keys that
        are not uniform themselves, such as counters, spread as well)."""
        if not self._points:
            raise LookupError("the ring has no endpoints")
        h = _point(key.to_bytes(8, "little"))
        i = bisect.bisect_left(self._points, (h, ""))
        return self._points[i % len(self._points)][1]

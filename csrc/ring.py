"""RequestRing's uncompiled twin: same API and semantics as csrc/ring.pyx, in plain Python.

A preallocated list of slots with free-running head/tail counters. Its
cross-thread safety comes from the GIL (each push/pop publishes with a single
attribute store after the slot is written), not from atomics: use the
compiled ouro_fast.core.ring in the server.
"""

import operator

MAX_CAPACITY = 1 << 30
_INT32 = (-(1 << 31), (1 << 31) - 1)
_INT64 = (-(1 << 63), (1 << 63) - 1)


def round_capacity(capacity) -> int:
    """The power of two >= capacity that a ring asked for capacity holds; ValueError outside 1..2**30."""
    n = operator.index(capacity)
    if n <= 0 or n > MAX_CAPACITY:
        raise ValueError(f"ring capacity must be in 1..{MAX_CAPACITY}, got {n}")
    return 1 << (n - 1).bit_length()


def _check(value, bounds: tuple, what: str) -> int:
    """value as an int within bounds, raising what the compiled ring's C conversion raises."""
    n = operator.index(value)
    if not bounds[0] <= n <= bounds[1]:
        raise OverflowError(f"{what} {n} out of range")
    return n


class RequestRing:
    """A bounded single-producer/single-consumer ring of (op, key) records.

    push never blocks: it returns False when the ring is full. pop/pop_many
    return records in push order, each exactly once.
    """

    __slots__ = ("_slots", "_mask", "_head", "_tail")

    def __init__(self, capacity) -> None:
        n = round_capacity(capacity)
        self._slots: list = [None] * n
        self._mask = n - 1
        self._head = 0
        self._tail = 0

    @property
    def capacity(self) -> int:
        """Records the ring holds when full (a power of two)."""
        return self._mask + 1

    def push(self, op, key) -> bool:
        """Producer only: append (op, key); False, and nothing changed, when the ring is full."""
        record = (_check(op, _INT32, "op"), _check(key, _INT64, "key"))
        tail = self._tail
        if tail - self._head > self._mask:
            return False
        self._slots[tail & self._mask] = record
        # The slot is written before tail moves: the consumer never sees a stale slot.
        self._tail = tail + 1
        return True

    def pop(self):
        """Consumer only: the oldest record as (op, key), or None when the ring is empty."""
        head = self._head
        if head == self._tail:
            return None
        record = self._slots[head & self._mask]
        self._head = head + 1
        return record

    def pop_many(self, max_items: int) -> list:
        """Consumer only: up to max_items oldest records, in order; [] when empty or max_items <= 0."""
        head = self._head
        n = min(self._tail - head, operator.index(max_items))
        if n <= 0:
            return []
        mask = self._mask
        out = [self._slots[(head + i) & mask] for i in range(n)]
        self._head = head + n
        return out

    def __len__(self) -> int:
        """Records in the ring now: exact when idle, a snapshot while the other thread runs."""
        return self._tail - self._head

    def __repr__(self) -> str:
        return f"RequestRing(capacity={self.capacity}, len={len(self)})"

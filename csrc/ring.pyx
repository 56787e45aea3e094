"""RequestRing: the lock-free SPSC queue from the HTTP event loop to the engine-owner thread.

Records are (op, key) pairs: op an int32 code, key an int64 request id. The
producer (event loop) fills the request's payload dict before it pushes; the
ring's release/acquire ordering (ring.h) makes that payload visible to the
consumer (engine owner) that pops the record. Exactly one thread may push and
exactly one other thread may pop; the GIL is not needed for correctness.
"""

from cpython.number cimport PyNumber_Index
from libc.stdint cimport int32_t, int64_t

MAX_CAPACITY = 1 << 30


cdef extern from "ring.h" nogil:
    ctypedef struct ouro_ring:
        pass

    ctypedef struct ouro_ring_record:
        int32_t op
        int64_t key

    ouro_ring *ouro_ring_create(size_t capacity)
    void ouro_ring_destroy(ouro_ring *r)
    size_t ouro_ring_capacity(const ouro_ring *r)
    bint ouro_ring_push(ouro_ring *r, int32_t op, int64_t key)
    size_t ouro_ring_readable(ouro_ring *r, size_t want)
    ouro_ring_record ouro_ring_peek(const ouro_ring *r, size_t i)
    void ouro_ring_consume(ouro_ring *r, size_t n)
    size_t ouro_ring_size(const ouro_ring *r)


def round_capacity(capacity) -> int:
    """The power of two >= capacity that a ring asked for capacity holds; ValueError outside 1..2**30."""
    n = PyNumber_Index(capacity)
    if n <= 0 or n > MAX_CAPACITY:
        raise ValueError(f"ring capacity must be in 1..{MAX_CAPACITY}, got {n}")
    return 1 << (n - 1).bit_length()


cdef class RequestRing:
    """A bounded single-producer/single-consumer ring of (op, key) records.

    push never blocks and never allocates: it returns False when the ring is
    full. pop/pop_many return records in push order, each exactly once.
    """

    cdef ouro_ring *_ring

    def __cinit__(self, capacity):
        self._ring = NULL
        cdef size_t n = round_capacity(capacity)
        self._ring = ouro_ring_create(n)
        if self._ring == NULL:
            raise MemoryError(f"cannot allocate a ring of {n} records")

    def __dealloc__(self):
        ouro_ring_destroy(self._ring)

    @property
    def capacity(self) -> int:
        """Records the ring holds when full (a power of two)."""
        return ouro_ring_capacity(self._ring)

    def push(self, op, key) -> bool:
        """Producer only: append (op, key); False, and nothing changed, when the ring is full.

        op must fit in int32 and key in int64 (OverflowError); floats are refused (TypeError).
        """
        # PyNumber_Index refuses floats, which a plain C-integer conversion would truncate.
        cdef int32_t c_op = PyNumber_Index(op)
        cdef int64_t c_key = PyNumber_Index(key)
        return ouro_ring_push(self._ring, c_op, c_key)

    def pop(self):
        """Consumer only: the oldest record as (op, key), or None when the ring is empty."""
        if ouro_ring_readable(self._ring, 1) == 0:
            return None
        cdef ouro_ring_record rec = ouro_ring_peek(self._ring, 0)
        ouro_ring_consume(self._ring, 1)
        return (rec.op, rec.key)

    def pop_many(self, Py_ssize_t max_items) -> list:
        """Consumer only: up to max_items oldest records, in order; [] when empty or max_items <= 0."""
        if max_items <= 0:
            return []
        cdef size_t n = ouro_ring_readable(self._ring, <size_t>max_items)
        if n > <size_t>max_items:
            n = <size_t>max_items
        cdef list out = []
        cdef size_t i
        cdef ouro_ring_record rec
        for i in range(n):
            rec = ouro_ring_peek(self._ring, i)
            out.append((rec.op, rec.key))
        # Slots are handed back only after every record in them was copied out.
        ouro_ring_consume(self._ring, n)
        return out

    def __len__(self) -> int:
        """Records in the ring now: exact when idle, a snapshot while the other thread runs."""
        return ouro_ring_size(self._ring)

    def __repr__(self) -> str:
        return f"RequestRing(capacity={self.capacity}, len={len(self)})"

"""Per-request, per-loop block tables over one shared pool of KV blocks.

A physical block holds `block_size` consecutive positions of ONE loop plane for
ALL layers; the runner's cache is indexed by physical slot
`block_id * block_size + offset`. Request slot `s` has one table per loop depth:
`tables[s, t, i]` is the block of positions `[i*bs, (i+1)*bs)` at loop `t`.
Every loop needs KV at every position (computed or propagated), so blocks for
all loops of a position range are allocated together: a slot holding `n`
blocks per loop owns `n * num_loops` physical blocks.

Unused table entries are always -1 (`UNUSED_BLOCK`): a stray read of an
unowned entry fails loudly instead of aliasing block 0.

A block may have several holders: tables (a request's) and holds (hold() hands
a slot's leading blocks to a holder outside the tables, adopt() passes such a
hold to an empty slot's table). `refs[b]` counts them; the block returns to the
pool when its last holder lets it go. Holders of a shared block only read it:
the scheduler shares only blocks whose every position is computed.

Prefix cache (caching=True): cache() registers a slot's full, computed blocks as
entries keyed by a chain hash (hash_blocks: each block's hash covers its
parent's hash and its tokens); an entry is a position block at EVERY loop.
lookup() gives an empty slot the longest chain of entries that matches its
hashes, checking each entry's tokens and parent so a hash collision is a miss.
An entry whose last holder lets go stays cached and counts as free; the pool
evicts the least recently released entry only when it needs a block.

Compiled as ouro_fast.core.block_table; importable uncompiled as
ouro_fast.core_py.block_table (the twin, same behaviour).
"""

import cython
import numpy as np

# Compiled, this is the C constant of block_table.pxd's `cpdef enum` (same value).
if not cython.compiled:
    UNUSED_BLOCK = -1


class BlockTable:
    """Owns the free-block pool and every slot's per-loop block tables.

    Only the engine-owner thread may call it. The hot methods allocate nothing
    and touch only the blocks and positions they are asked about. Compiled, it
    cannot be subclassed; its C attributes and C methods are declared in
    block_table.pxd.
    """

    def __init__(
        self,
        num_blocks: cython.Py_ssize_t,
        block_size: cython.Py_ssize_t,
        num_loops: cython.Py_ssize_t,
        max_seqs: cython.Py_ssize_t,
        max_blocks_per_seq: cython.Py_ssize_t,
        caching: bool = False,
    ):
        if num_blocks < 0 or block_size < 1 or num_loops < 1 or max_seqs < 1 or max_blocks_per_seq < 1:
            raise ValueError(
                f"bad BlockTable geometry: num_blocks={num_blocks}, block_size={block_size}, "
                f"num_loops={num_loops}, max_seqs={max_seqs}, max_blocks_per_seq={max_blocks_per_seq}"
            )
        if num_blocks > 2**31 - 1:
            raise ValueError(f"num_blocks={num_blocks} does not fit the int32 tables")
        self._num_blocks = num_blocks
        self._block_size = block_size
        self._num_loops = num_loops
        self._max_seqs = max_seqs
        self._max_blocks_per_seq = max_blocks_per_seq
        self._tables_arr = np.full((max_seqs, num_loops, max_blocks_per_seq), UNUSED_BLOCK, dtype=np.int32)
        self._counts_arr = np.zeros(max_seqs, dtype=np.int32)
        self._tables = self._tables_arr
        self._counts = self._counts_arr
        # Stack with block 0 on top, so a fresh pool hands out 0, 1, 2, ...
        self._free = np.arange(num_blocks - 1, -1, -1, dtype=np.int32)
        self._num_free = num_blocks
        self._refs_arr = np.zeros(num_blocks, dtype=np.int32)
        self._refs = self._refs_arr
        self._caching = caching
        self._num_cached_free = 0
        self._num_cached = 0
        self._entry_arr = np.full(num_blocks, -1, dtype=np.int32)
        self._entry = self._entry_arr
        entries = num_blocks if caching else 0  # entry tables only where the cache is on
        self._eblk = np.zeros((entries, num_loops), dtype=np.int32)
        self._etok = np.zeros((entries, block_size), dtype=np.int32)
        self._eparent, self._epgen = np.zeros(entries, np.int32), np.zeros(entries, np.int32)
        self._egen, self._ekey = np.zeros(entries, np.int32), np.zeros(entries, np.int64)
        self._lru_prev, self._lru_next = np.full(entries, -1, np.int32), np.full(entries, -1, np.int32)
        self._lru_head = self._lru_tail = -1
        self._index = {}

    @property
    def tables(self):
        """int32 [max_seqs, num_loops, max_blocks_per_seq], the live array (mutated in place)."""
        return self._tables_arr

    @property
    def num_blocks_of(self):
        """int32 [max_seqs], the live array: blocks per loop held by each slot."""
        return self._counts_arr

    @property
    def refs(self):
        """int32 [num_blocks], the live array: holders of each block (tables and holds; 0 while free)."""
        return self._refs_arr

    @property
    def num_free_blocks(self) -> int:
        """Blocks no holder has: the free ones and the unheld cached ones (evicted on demand)."""
        return self._num_free + self._num_cached_free

    @property
    def caching(self) -> bool:
        return self._caching

    @property
    def num_cached_blocks(self) -> int:
        """Blocks of cache entries, held or not."""
        return self._num_cached

    @property
    def cached(self):
        """int32 [num_blocks], the live array: each block's entry (its loop-0 block), -1 if uncached."""
        return self._entry_arr

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_size(self) -> int:
        return self._block_size

    @property
    def num_loops(self) -> int:
        return self._num_loops

    @property
    def max_seqs(self) -> int:
        return self._max_seqs

    @property
    def max_blocks_per_seq(self) -> int:
        return self._max_blocks_per_seq

    def _check_slot(self, slot: cython.Py_ssize_t) -> cython.int:
        if slot < 0 or slot >= self._max_seqs:
            raise ValueError(f"slot {slot} out of range [0, {self._max_seqs})")
        return 0

    def _blocks_for(self, num_tokens: cython.Py_ssize_t) -> cython.Py_ssize_t:
        if num_tokens < 0:
            raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
        return (num_tokens + self._block_size - 1) // self._block_size

    def blocks_needed(self, slot: cython.Py_ssize_t, num_tokens: cython.Py_ssize_t) -> int:
        """Extra physical blocks (all loops together) that allocate(slot, num_tokens) would take."""
        need: cython.Py_ssize_t
        have: cython.Py_ssize_t
        self._check_slot(slot)
        need = self._blocks_for(num_tokens)
        have = cython.cast(cython.Py_ssize_t, self._counts[slot])
        if need <= have:
            return 0
        return (need - have) * self._num_loops

    @cython.initializedcheck(False)
    def allocate(self, slot: cython.Py_ssize_t, num_tokens: cython.Py_ssize_t) -> bool:
        """Grow `slot` to cover positions [0, num_tokens) at every loop.

        Returns False, changing nothing, when the pool lacks blocks. Raises
        ValueError when num_tokens needs more than max_blocks_per_seq blocks.
        Never shrinks: a smaller num_tokens than already covered is a no-op.
        """
        need: cython.Py_ssize_t
        have: cython.Py_ssize_t
        self._check_slot(slot)
        need = self._blocks_for(num_tokens)
        if need > self._max_blocks_per_seq:
            raise ValueError(
                f"{num_tokens} tokens need {need} blocks per loop, more than "
                f"max_blocks_per_seq={self._max_blocks_per_seq}"
            )
        have = cython.cast(cython.Py_ssize_t, self._counts[slot])
        if need <= have:
            return True
        if (need - have) * self._num_loops > self._num_free + self._num_cached_free:
            return False
        self._take_blocks(slot, have, need)
        return True

    def free(self, slot: cython.Py_ssize_t) -> None:
        """Let go of every block of `slot` (each returns to the pool once no other holder has it) and
        clear its tables; idempotent."""
        self._check_slot(slot)
        self._return_blocks(slot)

    @cython.initializedcheck(False)
    def _take_blocks(self, slot: cython.Py_ssize_t, have: cython.Py_ssize_t, need: cython.Py_ssize_t) -> None:
        """Grow a checked slot from `have` to `need` blocks per loop; the pool holds enough."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        for i in range(have, need):
            for t in range(self._num_loops):
                if self._num_free == 0:
                    self._evict()
                self._num_free -= 1
                self._tables[slot, t, i] = self._free[self._num_free]
                self._refs[self._free[self._num_free]] = 1
        self._counts[slot] = cython.cast(cython.int, need)

    @cython.initializedcheck(False)
    def _return_blocks(self, slot: cython.Py_ssize_t) -> None:
        """Let go of a checked slot's blocks (pooled once unheld) and clear its tables."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        # Push in reverse allocation order so a re-allocation gets the same blocks back.
        i = self._counts[slot] - 1
        while i >= 0:
            t = self._num_loops - 1
            while t >= 0:
                self._drop(self._tables[slot, t, i])
                self._tables[slot, t, i] = UNUSED_BLOCK
                t -= 1
            i -= 1
        self._counts[slot] = 0

    @cython.initializedcheck(False)
    def _drop(self, block: cython.int) -> None:
        """One holder of a block lets go; the last one returns it to the pool (to the LRU list if cached)."""
        e: cython.int = self._entry[block]
        self._refs[block] -= 1
        if self._refs[block] != 0:
            return
        if e < 0:
            self._free[self._num_free] = block
            self._num_free += 1
            return
        self._num_cached_free += 1
        if e == block:  # the entry's loop-0 block names it in the LRU list, newest at the tail
            self._lru_prev[e] = self._lru_tail
            self._lru_next[e] = -1
            if self._lru_tail >= 0:
                self._lru_next[self._lru_tail] = e
            else:
                self._lru_head = e
            self._lru_tail = e

    @cython.initializedcheck(False)
    def _lru_unlink(self, e: cython.int) -> None:
        if self._lru_prev[e] >= 0:
            self._lru_next[self._lru_prev[e]] = self._lru_next[e]
        else:
            self._lru_head = self._lru_next[e]
        if self._lru_next[e] >= 0:
            self._lru_prev[self._lru_next[e]] = self._lru_prev[e]
        else:
            self._lru_tail = self._lru_prev[e]
        self._lru_prev[e] = self._lru_next[e] = -1

    @cython.initializedcheck(False)
    def _evict(self) -> None:
        """Return the least recently released unheld entry's blocks to the pool (its index key goes stale:
        lookups check _entry, and the next entry of its block replaces the key)."""
        t: cython.Py_ssize_t
        b: cython.int
        e: cython.int = self._lru_head
        self._lru_unlink(e)
        for t in range(self._num_loops):
            b = self._eblk[e, t]
            self._entry[b] = -1
            self._free[self._num_free] = b
            self._num_free += 1
        self._num_cached_free -= self._num_loops
        self._num_cached -= self._num_loops

    def hash_blocks(self, tokens, num_tokens: cython.Py_ssize_t):
        """int64 chain hashes of the full blocks of tokens[:num_tokens]: block i's covers block i-1's hash
        and its own tokens, so equal hashes mean equal prefixes (up to collisions, which lookup checks)."""
        i: cython.Py_ssize_t
        n: cython.Py_ssize_t = num_tokens // self._block_size
        step: cython.Py_ssize_t = self._block_size * 4
        out = np.empty(n, dtype=np.int64)
        raw = np.ascontiguousarray(tokens[: n * self._block_size], dtype=np.int32).tobytes()
        h = 0
        for i in range(n):
            h = hash((h, raw[i * step : (i + 1) * step]))
            out[i] = h
        return out

    @cython.initializedcheck(False)
    def _entry_at(
        self, key, i: cython.Py_ssize_t, prev: cython.int, tokens: cython.const[cython.int][:]
    ) -> cython.int:
        """The live entry of `key` for position block i after entry `prev` (-1 before the first), holding
        exactly tokens[i*bs:(i+1)*bs]; -1 if none (a miss, a stale key or a collision)."""
        k: cython.Py_ssize_t
        bs: cython.Py_ssize_t = self._block_size
        found = self._index.get(key)
        if found is None:
            return -1
        e: cython.int = found
        if self._entry[e] != e or self._ekey[e] != key or self._eparent[e] != prev:
            return -1
        if prev >= 0 and self._epgen[e] != self._egen[prev]:
            return -1
        for k in range(bs):
            if self._etok[e, k] != tokens[i * bs + k]:
                return -1
        return e

    @cython.initializedcheck(False)
    def lookup(
        self,
        slot: cython.Py_ssize_t,
        hashes: cython.const[cython.longlong][:],
        tokens: cython.const[cython.int][:],
        max_blocks: cython.Py_ssize_t,
    ) -> int:
        """An empty slot takes the longest run (at most max_blocks) of cache entries matching hashes
        (hash_blocks of `tokens`) as its first blocks of every loop; returns how many it took."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        b: cython.int
        e: cython.int
        prev: cython.int = -1
        n: cython.Py_ssize_t = max_blocks
        self._check_slot(slot)
        if self._counts[slot] != 0:
            raise ValueError(f"slot {slot} already holds blocks")
        if n > hashes.shape[0]:
            n = hashes.shape[0]
        if n > self._max_blocks_per_seq:
            n = self._max_blocks_per_seq
        if n * self._block_size > tokens.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens do not fill {n} blocks")
        if not self._caching:
            return 0
        for i in range(n):
            e = self._entry_at(hashes[i], i, prev, tokens)
            if e < 0:
                self._counts[slot] = cython.cast(cython.int, i)
                return i
            if self._refs[e] == 0:
                self._lru_unlink(e)
                self._num_cached_free -= self._num_loops
            for t in range(self._num_loops):
                b = self._eblk[e, t]
                self._refs[b] += 1
                self._tables[slot, t, i] = b
            prev = e
        self._counts[slot] = cython.cast(cython.int, n)
        return n

    @cython.initializedcheck(False)
    def probe(
        self,
        hashes: cython.const[cython.longlong][:],
        tokens: cython.const[cython.int][:],
        max_blocks: cython.Py_ssize_t,
    ) -> int:
        """How many blocks lookup() would take now for these hashes (at most max_blocks); changes nothing."""
        i: cython.Py_ssize_t
        e: cython.int
        prev: cython.int = -1
        n: cython.Py_ssize_t = max_blocks
        if not self._caching:
            return 0
        if n > hashes.shape[0]:
            n = hashes.shape[0]
        if n > self._max_blocks_per_seq:
            n = self._max_blocks_per_seq
        if n * self._block_size > tokens.shape[0]:
            n = tokens.shape[0] // self._block_size
        for i in range(n):
            e = self._entry_at(hashes[i], i, prev, tokens)
            if e < 0:
                return i
            prev = e
        return n

    @cython.initializedcheck(False)
    def cache(
        self,
        slot: cython.Py_ssize_t,
        hashes: cython.const[cython.longlong][:],
        tokens: cython.const[cython.int][:],
        first: cython.Py_ssize_t,
        num_blocks: cython.Py_ssize_t,
    ) -> int:
        """Register the slot's blocks first..num_blocks-1, full and computed at every loop, as entries of
        hashes (hash_blocks of `tokens`); blocks before `first` must be entries already. Stops at a block
        whose content another entry caches. Returns the count of leading blocks that are entries now."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        k: cython.Py_ssize_t
        b: cython.int
        e: cython.int
        prev: cython.int = -1
        bs: cython.Py_ssize_t = self._block_size
        self._check_slot(slot)
        if not self._caching:
            return 0
        if first < 0 or num_blocks > self._counts[slot] or num_blocks > hashes.shape[0]:
            raise ValueError(f"slot {slot} holds {self._counts[slot]} blocks per loop, not {num_blocks}")
        if num_blocks * bs > tokens.shape[0]:
            raise ValueError(f"{tokens.shape[0]} tokens do not fill {num_blocks} blocks")
        if first > 0:
            prev = self._tables[slot, 0, first - 1]
            if self._entry[prev] != prev:
                raise ValueError(f"block {first - 1} of slot {slot} is not cached")
        for i in range(first, num_blocks):
            e = self._tables[slot, 0, i]
            if self._entry[e] == e:
                prev = e  # adopted or looked up: an entry of the same tokens already
                continue
            key = hashes[i]
            old = self._index.get(key)
            if old is not None and self._entry_at(key, i, prev, tokens) >= 0:
                return i  # another entry caches this content: the chain stays with it
            if self._index.get(self._ekey[e]) == e:
                del self._index[self._ekey[e]]  # the stale key of this block's evicted entry
            for t in range(self._num_loops):
                b = self._tables[slot, t, i]
                self._entry[b] = e
                self._eblk[e, t] = b
            for k in range(bs):
                self._etok[e, k] = tokens[i * bs + k]
            self._eparent[e] = prev
            self._epgen[e] = self._egen[prev] if prev >= 0 else 0
            self._egen[e] += 1
            self._ekey[e] = key
            self._index[key] = e
            self._num_cached += self._num_loops
            prev = e
        return num_blocks

    @cython.initializedcheck(False)
    def hold(self, slot: cython.Py_ssize_t, num_blocks: cython.Py_ssize_t):
        """The slot's first `num_blocks` blocks of every loop, int32 [num_loops, num_blocks], each gaining
        a holder: they stay out of the pool until release() drops the hold or adopt() hands it to a table."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        self._check_slot(slot)
        if num_blocks < 0 or num_blocks > self._counts[slot]:
            raise ValueError(f"slot {slot} holds {self._counts[slot]} blocks per loop, not {num_blocks}")
        held = np.array(self._tables_arr[slot, :, :num_blocks])
        for t in range(self._num_loops):
            for i in range(num_blocks):
                self._refs[self._tables[slot, t, i]] += 1
        return held

    def _check_held(self, held: cython.int[:, :]) -> cython.Py_ssize_t:
        """Raises ValueError unless `held` is [num_loops, k] of held blocks; returns k."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        b: cython.int
        if held.shape[0] != self._num_loops or held.shape[1] > self._max_blocks_per_seq:
            raise ValueError(f"held blocks must be [{self._num_loops}, <= {self._max_blocks_per_seq}]")
        for t in range(self._num_loops):
            for i in range(held.shape[1]):
                b = held[t, i]
                if b < 0 or b >= self._num_blocks or self._refs[b] < 1:
                    raise ValueError(f"block {b} is not held")
        return held.shape[1]

    @cython.initializedcheck(False)
    def adopt(self, slot: cython.Py_ssize_t, held: cython.int[:, :]) -> None:
        """An empty slot takes held blocks (hold()'s array) as its first blocks of every loop: the hold
        becomes its table's, dropped with the slot's other blocks by free()."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        k: cython.Py_ssize_t
        self._check_slot(slot)
        if self._counts[slot] != 0:
            raise ValueError(f"slot {slot} already holds blocks")
        k = self._check_held(held)
        for t in range(self._num_loops):
            for i in range(k):
                self._tables[slot, t, i] = held[t, i]
        self._counts[slot] = cython.cast(cython.int, k)

    @cython.initializedcheck(False)
    def release(self, held: cython.int[:, :]) -> None:
        """Drop one hold on each block of `held` (hold()'s array); unheld blocks return to the pool."""
        i: cython.Py_ssize_t
        t: cython.Py_ssize_t
        k: cython.Py_ssize_t = self._check_held(held)
        for t in range(self._num_loops):
            for i in range(k):
                self._drop(held[t, i])

    @cython.initializedcheck(False)
    def fill_slot_mapping(
        self,
        slot: cython.Py_ssize_t,
        loop: cython.Py_ssize_t,
        start: cython.Py_ssize_t,
        length: cython.Py_ssize_t,
        out: cython.longlong[:],
        out_offset: cython.Py_ssize_t,
    ) -> None:
        """Write into out[out_offset : out_offset+length] the physical slots of positions
        start .. start+length-1 in loop `loop`'s plane. The positions must be allocated."""
        k: cython.Py_ssize_t
        pos: cython.Py_ssize_t
        bs: cython.Py_ssize_t = self._block_size
        self._check_slot(slot)
        if loop < 0 or loop >= self._num_loops:
            raise ValueError(f"loop {loop} out of range [0, {self._num_loops})")
        if start < 0 or length < 0 or start + length > self._counts[slot] * bs:
            raise ValueError(
                f"positions [{start}, {start + length}) not allocated for slot {slot} "
                f"(covers {self._counts[slot] * bs})"
            )
        if out_offset < 0 or out_offset + length > out.shape[0]:
            raise ValueError(f"out (length {out.shape[0]}) too short for {length} entries at {out_offset}")
        for k in range(length):
            pos = start + k
            out[out_offset + k] = cython.cast(cython.longlong, self._tables[slot, loop, pos // bs]) * bs + (
                pos % bs
            )

    @cython.initializedcheck(False)
    def fill_propagation(
        self,
        slots: cython.const[cython.int][:],
        positions: cython.const[cython.int][:],
        exit_loops: cython.const[cython.int][:],
        count: cython.Py_ssize_t,
        src_out: cython.longlong[:],
        dst_out: cython.longlong[:],
    ) -> int:
        """For each i < count, token positions[i] of slots[i] exited at loop exit_loops[i]:
        write one (src, dst) pair of physical slots per deeper loop j in exit+1 .. num_loops-1,
        src in the exit loop's plane, dst in loop j's, in order of i then j.
        Returns the number of pairs written. Raises ValueError on bad input or short outputs."""
        i: cython.Py_ssize_t
        j: cython.Py_ssize_t
        n: cython.Py_ssize_t = 0
        s: cython.Py_ssize_t
        pos: cython.Py_ssize_t
        e: cython.Py_ssize_t
        blk: cython.Py_ssize_t
        off: cython.Py_ssize_t
        src: cython.longlong
        bs: cython.Py_ssize_t = self._block_size
        if count < 0 or count > slots.shape[0] or count > positions.shape[0] or count > exit_loops.shape[0]:
            raise ValueError(f"count {count} exceeds the input arrays")
        for i in range(count):
            s = slots[i]
            pos = positions[i]
            e = exit_loops[i]
            self._check_slot(s)
            if e < 0 or e >= self._num_loops:
                raise ValueError(f"exit loop {e} out of range [0, {self._num_loops})")
            if pos < 0 or pos >= self._counts[s] * bs:
                raise ValueError(f"position {pos} not allocated for slot {s}")
            if (
                n + (self._num_loops - 1 - e) > src_out.shape[0]
                or n + (self._num_loops - 1 - e) > dst_out.shape[0]
            ):
                raise ValueError("src_out/dst_out too short for the propagation pairs")
            blk = pos // bs
            off = pos % bs
            src = cython.cast(cython.longlong, self._tables[s, e, blk]) * bs + off
            for j in range(e + 1, self._num_loops):
                src_out[n] = src
                dst_out[n] = cython.cast(cython.longlong, self._tables[s, j, blk]) * bs + off
                n += 1
        return n

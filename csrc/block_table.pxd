# C interface of ouro_fast.core.block_table (implemented in block_table.py).
#
# Compiled callers (loop_scheduler) cimport BlockTable from here: they call allocate and
# free as C functions and read the tables, the counts and the block size as typed fields,
# which they never write. Python code sees only what block_table.py defines.

cimport cython

# The entry of a table position that holds no block: a module attribute too.
cpdef enum:
    UNUSED_BLOCK = -1


@cython.final
cdef class BlockTable:
    # Geometry, fixed at construction.
    cdef Py_ssize_t _num_blocks
    cdef Py_ssize_t _block_size
    cdef Py_ssize_t _num_loops
    cdef Py_ssize_t _max_seqs
    cdef Py_ssize_t _max_blocks_per_seq
    # The pool: _free[:_num_free] is a stack of free block ids; _refs[b]: holders of block b
    # (tables and holds), 0 while free.
    cdef Py_ssize_t _num_free
    cdef int[::1] _free
    cdef int[::1] _refs
    cdef object _refs_arr
    # _tables[slot, loop, i]: the block of positions [i*bs, (i+1)*bs) at that loop, -1 if unowned;
    # _counts[slot]: blocks per loop the slot holds. Views of _tables_arr and _counts_arr.
    cdef int[:, :, ::1] _tables
    cdef int[::1] _counts
    cdef object _tables_arr
    cdef object _counts_arr
    # The prefix cache. An entry is one position block of a prompt at every loop, named by its loop-0
    # block e: _eblk[e] its planes, _etok[e] its tokens, _eparent[e] and _epgen[e] the entry (and that
    # entry's generation) of the block before it, _ekey[e] its chain hash, _egen[e] bumped per entry.
    # _entry[b]: the entry block b belongs to, -1 if uncached. Unheld entries wait in an LRU list
    # (_lru_prev/_lru_next, oldest at _lru_head) and count as free: _num_cached_free of their blocks.
    cdef bint _caching
    cdef Py_ssize_t _num_cached_free
    cdef Py_ssize_t _num_cached
    cdef int[::1] _entry
    cdef object _entry_arr
    cdef int[:, ::1] _eblk
    cdef int[:, ::1] _etok
    cdef int[::1] _eparent
    cdef int[::1] _epgen
    cdef int[::1] _egen
    cdef long long[::1] _ekey
    cdef int[::1] _lru_prev
    cdef int[::1] _lru_next
    cdef int _lru_head
    cdef int _lru_tail
    cdef dict _index

    # Validation raises ValueError: -1 signals it to C callers.
    cdef inline int _check_slot(self, Py_ssize_t slot) except -1
    cdef inline Py_ssize_t _blocks_for(self, Py_ssize_t num_tokens) except -1
    cpdef bint allocate(self, Py_ssize_t slot, Py_ssize_t num_tokens) except -1
    # void, so Python still gets None; except *: C callers check PyErr_Occurred (frees are rare).
    cpdef void free(self, Py_ssize_t slot) except *
    # The block loops, on a checked slot: C fields only, nothing to fail.
    cdef void _take_blocks(self, Py_ssize_t slot, Py_ssize_t have, Py_ssize_t need) noexcept nogil
    cdef void _return_blocks(self, Py_ssize_t slot) noexcept nogil
    cdef void _drop(self, int block) noexcept nogil
    cdef void _evict(self) noexcept nogil
    cdef void _lru_unlink(self, int e) noexcept nogil
    cdef int _entry_at(self, object key, Py_ssize_t i, int prev, const int[:] tokens) except -2

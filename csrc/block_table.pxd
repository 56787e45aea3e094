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

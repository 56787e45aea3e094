# C interface of ouro_fast.core.loop_scheduler (implemented in loop_scheduler.py).
#
# Helpers marked `noexcept nogil` touch only C fields and cannot fail; those that call
# Python (numpy, the block table's allocate/free) return -1 on an exception. Nothing releases
# the GIL around them: each call is too short for another thread to use it, every release costs
# a few tens of ns, and a busy thread that takes the GIL can keep it for a switch interval (5 ms).

cimport cython

from ouro_fast.core.block_table cimport BlockTable

# Request states, and the exit bound of a row that does not sample: module attributes too.
cpdef enum:
    FREE = 0
    WAITING = 1
    RUNNING = 2
    PARKED = 3
    NO_EXIT = 127


@cython.final
cdef class LoopScheduler:
    cdef BlockTable bt
    cdef int num_loops
    cdef int max_requests
    cdef int max_rows
    cdef int max_tokens
    cdef bint refill
    cdef long long arrivals

    # Per request (indexed by rid).
    cdef int[::1] _status
    cdef int[::1] _kv_slot
    cdef int[::1] _num_prompt
    cdef int[::1] _num_tokens
    cdef int[::1] _num_done
    cdef int[::1] _cap
    cdef long long[::1] _arrival
    cdef int[::1] _row_loop
    cdef int[::1] _row_start
    cdef int[::1] _row_len
    cdef int[::1] _row_depth  # max depth among the row's non-live tokens
    cdef int[::1] _row_live  # 1 while the row's last token still has to sample
    cdef int[::1] _row_prev_off  # this row's first token index in the last step's batch
    cdef int[::1] _min_loops
    cdef int[::1] _max_loops
    cdef float[::1] _log1mq
    cdef int[::1] _epoch  # bumped when a request loses its KV, so stale propagation is dropped
    cdef int[::1] _held  # 1: neither admitted nor started by schedule() (run-ahead seats it itself)
    # Shared prompts: a prefix request computes blocks that its PARKED requests then share.
    cdef int[::1] _is_prefix  # 1: an add_prefix() request (computed at every loop, never sampled)
    cdef int[::1] _num_children  # a prefix's PARKED requests
    cdef int[::1] _prefix_of  # a PARKED request's prefix rid, else -1
    cdef list _shared  # per rid: the computed prefix's blocks it holds until admitted, else None
    # The prefix cache (the block table's): chain hashes of each request's full prompt blocks.
    cdef list _hashes  # per rid: int64 hashes while the block table caches, else None
    cdef int[::1] _may_hit  # 1: admission may take cache hits (0 for requests that want prompt logprobs)
    cdef int[::1] _num_reg  # leading blocks of the request's table that are cache entries
    cdef int[::1] _cached  # prompt tokens its first admission took from the cache, -1 before it
    cdef readonly long long cache_queries  # known tokens of admissions that looked the cache up
    cdef readonly long long cache_hits  # tokens those admissions took from the cache
    cdef list _tokens  # per rid: a parked array, or (while it holds a KV slot) a view of its slot's row
    cdef list _depths
    # Tokens and depths of the requests holding KV, one row per slot: the hot paths index these
    # instead of acquiring a memoryview of a per-request array for every row.
    cdef object _slot_tok_arr
    cdef object _slot_dep_arr
    cdef int[:, ::1] _stok
    cdef signed char[:, ::1] _sdep

    # Queues.
    cdef int[::1] _free_rids
    cdef int _num_free_rids
    cdef int[::1] _free_slots
    cdef int _num_free_slots
    cdef int[::1] _running  # rids holding a KV slot, oldest arrival first
    cdef int _num_running
    cdef int[::1] _waiting  # ring of rids, head = next to admit
    cdef int _wait_head
    cdef int _wait_count
    cdef int _num_waiting
    # Pending propagation (rid, position, exit loop), emitted at the next schedule().
    cdef int[::1] _pend_rid
    cdef int[::1] _pend_pos
    cdef int[::1] _pend_loop
    cdef int[::1] _pend_epoch
    cdef int _num_pend
    cdef int _off  # tokens placed so far in the step being scheduled

    # Step outputs (read-only for the caller, valid until the next call).
    cdef readonly int num_rows
    cdef readonly int num_step_tokens
    cdef readonly int num_cont_tokens
    cdef readonly int num_prop
    cdef readonly int num_events
    cdef readonly int num_preempted
    cdef readonly int num_refills
    cdef readonly int num_prefill_tokens  # tokens of the step's new non-decode rows (prompts, recomputations)
    cdef readonly object row_rid
    cdef readonly object row_kv_slot
    cdef readonly object row_loop
    cdef readonly object row_start
    cdef readonly object row_len
    cdef readonly object row_tok_off
    cdef readonly object row_exit_lo
    cdef readonly object row_exit_hi
    cdef readonly object row_log1mq
    cdef readonly object row_new
    cdef readonly object row_decode
    cdef readonly object token_ids
    cdef readonly object positions
    cdef readonly object slot_mapping
    cdef readonly object hidden_src
    cdef readonly object prop_src
    cdef readonly object prop_dst
    cdef readonly object ev_rid
    cdef readonly object ev_token
    cdef readonly object ev_loop
    cdef readonly object ev_finished
    # Typed views of the output arrays above.
    cdef int[::1] _o_rid
    cdef int[::1] _o_slot
    cdef int[::1] _o_loop
    cdef int[::1] _o_start
    cdef int[::1] _o_len
    cdef int[::1] _o_off
    cdef int[::1] _o_lo
    cdef int[::1] _o_hi
    cdef float[::1] _o_q
    cdef int[::1] _o_new
    cdef int[::1] _o_dec
    cdef long long[::1] _o_ids
    cdef long long[::1] _o_pos
    cdef long long[::1] _o_map
    cdef long long[::1] _o_hsrc
    cdef long long[::1] _o_psrc
    cdef long long[::1] _o_pdst
    cdef int[::1] _e_rid
    cdef int[::1] _e_tok
    cdef int[::1] _e_loop
    cdef int[::1] _e_fin

    cdef int _alloc_outputs(self) except -1
    cdef int _finish(self, int rid) except -1
    cdef void _wait_push(self, int rid, bint front) noexcept nogil
    cdef void _wait_remove(self, int rid) noexcept nogil
    cdef void _wait_pop(self) noexcept nogil
    cdef void _wait_insert(self, int rid) noexcept nogil
    cdef int _new_request(self, object prompt, int cap_tokens) except -1
    cdef int _release_children(self, int prefix, int num_blocks) except -1
    cdef int _most_hits(self, int rid) noexcept nogil
    cdef bint _take_kv(self, int rid, int budget) except -1
    cdef int _register(self, int rid) except -1
    cdef int _release_slot(self, int rid, bint keep) except -1
    cdef int _preempt(self, int rid) except -1
    cdef int _chunk_len(self, int rid, int budget) noexcept nogil
    cdef void _start_row(self, int rid, int length) noexcept nogil
    cdef int _emit_row(self, int r, int rid, int off, bint prev) noexcept nogil
    cdef void _admit(self, int rid) noexcept nogil
    cdef int _load_slot(self, int rid) except -1
    cdef int _start_running_rows(self, int r, bint prefill) except -1
    cdef bint _reserve(self, int rid, int end, int index) except -1
    cdef int _admit_waiting(self, int r) except -1
    cdef void _emit_propagation(self) noexcept nogil
    cdef int _take_sample(self, int rid, int token) except -1
    cdef void _advance_row(self, int rid) noexcept nogil

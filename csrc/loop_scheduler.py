# cython: initializedcheck=False
# Every memoryview is assigned in __init__. Methods that index one by a caller's rid keep the
# check (for an instance whose __init__ never ran); on such an instance the others run no loop.
"""The loop-boundary scheduler: which rows run in the next step, and what their exits change.

A request is identified by a small integer `rid`. It owns at most ONE row in
flight: a chunk [start, start+len) of its not-yet-computed tokens at some loop t.
Every step runs one loop for every scheduled row; rows at different loops share
the batch. After the step, `update()` applies the runner's exit flags: the
request's live token (its last known token) may exit and sample the next token;
a row ends once every token in it has reached its depth. Rows freed by exits are
refilled at the next `schedule()` by new loop-0 rows of other requests (decode
tokens first, then prefill chunks, then admissions), within the row and token
budgets.

Per-token depth (loops whose K/V is computed, the rest being propagated copies):
prompt tokens always run all T loops; a generated token runs until it exits.
Depths are remembered so that a preempted request can be recomputed exactly
(tokens past their depth do not write K/V; their deeper planes get the
propagated copy, as in the original run).

Shared prompts: a prefix request (add_prefix) is a whole number of blocks of a
prompt, computed at every loop and never sampled. Requests added with it as their
`prefix` wait PARKED, outside the queue, until it is computed; then each holds its
blocks (BlockTable.hold), rejoins the queue in arrival order, and on admission
adopts them and computes only its own tail (at least its last prompt token, so it
samples as a request of its own would). A shared block is full and never written
again: every write lands past it, in blocks of the request's own. A prefix ends
once computed, or when its last parked request ends; ending it early lets its
requests compute the whole prompt themselves.

Prefix cache (when the block table caches): a request's full prompt blocks are
hashed once when it is added. Admission takes the longest cached chain of them,
short of the last prompt token, in every loop plane at once, and starts computing
after it. A prompt block is registered once its row has run every loop; blocks
holding generated tokens never are (an early exit leaves propagated copies in the
deeper planes, which a cold prefill would compute). Run-ahead's admit_now takes no
hits: a rider computes its whole prompt.

Memory policy: blocks are allocated when a row starts at loop 0 (all loops of
its positions at once). When the pool runs dry, a request preempts the youngest
(by arrival) running requests with no row in flight (their blocks freed, recomputed
later); it never preempts itself or an older request, and waits instead, so the
oldest always progresses.

Compiled as ouro_fast.core.loop_scheduler; importable uncompiled as
ouro_fast.core_py.loop_scheduler (the twin).
"""

import cython
import numpy as np

# Compiled, these are the C constants of loop_scheduler.pxd's `cpdef enum` (same values).
if not cython.compiled:
    FREE = 0
    WAITING = 1
    RUNNING = 2
    PARKED = 3  # waits for its prefix request to be computed (outside the queue)
    NO_EXIT = 127  # exit_lo/exit_hi of a row whose last token does not sample at this step


class LoopScheduler:
    """Decides each step's rows. Only the engine-owner thread may call it.

    Compiled, it takes the compiled BlockTable only (the twin takes the twin's) and
    cannot be subclassed; its C attributes and C methods are declared in loop_scheduler.pxd.
    """

    def __init__(self, block_table, max_requests: int, max_rows: int, max_tokens: int, refill: bool = True):
        if max_rows < 1 or max_tokens < 1 or max_requests < 1:
            raise ValueError("max_requests, max_rows and max_tokens must be positive")
        if max_rows > block_table.max_seqs:
            raise ValueError(f"max_rows {max_rows} exceeds the block table's {block_table.max_seqs} slots")
        self.bt = block_table
        self.num_loops = block_table.num_loops
        self.max_requests = max_requests
        self.max_rows = max_rows
        self.max_tokens = max_tokens
        self.refill = refill
        self.arrivals = 0
        i32 = lambda n: np.zeros(n, dtype=np.int32)  # noqa: E731
        self._status, self._kv_slot = i32(max_requests), i32(max_requests)
        self._num_prompt, self._num_tokens, self._num_done = (
            i32(max_requests),
            i32(max_requests),
            i32(max_requests),
        )
        self._cap = i32(max_requests)
        self._arrival = np.zeros(max_requests, dtype=np.int64)
        self._row_loop = np.full(max_requests, -1, dtype=np.int32)
        self._row_start, self._row_len = i32(max_requests), i32(max_requests)
        self._row_depth, self._row_live, self._row_prev_off = (
            i32(max_requests),
            i32(max_requests),
            i32(max_requests),
        )
        self._min_loops, self._max_loops = i32(max_requests), i32(max_requests)
        self._log1mq = np.zeros(max_requests, dtype=np.float32)
        self._tokens = [None] * max_requests
        self._depths = [None] * max_requests
        max_len = block_table.max_blocks_per_seq * block_table.block_size
        self._slot_tok_arr = np.zeros((max_rows, max_len), dtype=np.int32)
        self._slot_dep_arr = np.zeros((max_rows, max_len), dtype=np.int8)
        self._stok, self._sdep = self._slot_tok_arr, self._slot_dep_arr
        self._free_rids = np.arange(max_requests - 1, -1, -1, dtype=np.int32)
        self._num_free_rids = max_requests
        self._free_slots = np.arange(max_rows - 1, -1, -1, dtype=np.int32)
        self._num_free_slots = max_rows
        self._running = i32(max_rows)
        self._num_running = 0
        self._waiting = i32(max_requests)
        self._wait_head = 0
        self._wait_count = 0
        self._num_waiting = 0
        pend = max_tokens + max_rows
        self._pend_rid, self._pend_epoch = i32(pend), i32(pend)
        self._pend_pos, self._pend_loop = i32(pend), i32(pend)
        self._epoch = i32(max_requests)
        self._held = i32(max_requests)
        self._is_prefix, self._num_children = i32(max_requests), i32(max_requests)
        self._prefix_of = np.full(max_requests, -1, dtype=np.int32)
        self._shared = [None] * max_requests
        self._hashes = [None] * max_requests
        self._may_hit, self._num_reg = i32(max_requests), i32(max_requests)
        self._cached = np.full(max_requests, -1, dtype=np.int32)
        self.cache_queries = self.cache_hits = 0
        self._num_pend = 0
        self._alloc_outputs()

    def _alloc_outputs(self) -> cython.int:
        r, n = self.max_rows, self.max_tokens
        self.row_rid, self.row_kv_slot = np.zeros(r, np.int32), np.zeros(r, np.int32)
        self.row_loop, self.row_start, self.row_len = (
            np.zeros(r, np.int32),
            np.zeros(r, np.int32),
            np.zeros(r, np.int32),
        )
        self.row_tok_off, self.row_new = np.zeros(r, np.int32), np.zeros(r, np.int32)
        self.row_decode = np.zeros(r, np.int32)
        self._o_dec = self.row_decode
        self.row_exit_lo, self.row_exit_hi = np.zeros(r, np.int32), np.zeros(r, np.int32)
        self.row_log1mq = np.zeros(r, np.float32)
        self.token_ids, self.positions = np.zeros(n, np.int64), np.zeros(n, np.int64)
        self.slot_mapping, self.hidden_src = np.zeros(n, np.int64), np.zeros(n, np.int64)
        p = (n + r) * max(self.num_loops - 1, 1)
        self.prop_src, self.prop_dst = np.zeros(p, np.int64), np.zeros(p, np.int64)
        self.ev_rid, self.ev_token = np.zeros(r, np.int32), np.zeros(r, np.int32)
        self.ev_loop, self.ev_finished = np.zeros(r, np.int32), np.zeros(r, np.int32)
        self._o_rid, self._o_slot, self._o_loop = self.row_rid, self.row_kv_slot, self.row_loop
        self._o_start, self._o_len, self._o_off = self.row_start, self.row_len, self.row_tok_off
        self._o_lo, self._o_hi, self._o_q, self._o_new = (
            self.row_exit_lo,
            self.row_exit_hi,
            self.row_log1mq,
            self.row_new,
        )
        self._o_ids, self._o_pos, self._o_map, self._o_hsrc = (
            self.token_ids,
            self.positions,
            self.slot_mapping,
            self.hidden_src,
        )
        self._o_psrc, self._o_pdst = self.prop_src, self.prop_dst
        self._e_rid, self._e_tok, self._e_loop, self._e_fin = (
            self.ev_rid,
            self.ev_token,
            self.ev_loop,
            self.ev_finished,
        )
        self.num_rows = self.num_step_tokens = self.num_cont_tokens = self.num_prop = self.num_events = 0
        self.num_preempted = self.num_refills = self.num_prefill_tokens = 0
        return 0

    # ---- request lifecycle -------------------------------------------------

    def add(
        self,
        prompt,
        cap_tokens: int,
        min_loops: int,
        max_loops: int,
        log1mq: float,
        prefix: int = -1,
        may_hit: bool = True,
    ) -> int:
        """Queue a request; returns its rid. `cap_tokens` = prompt + max new tokens (the finish length).
        `prefix`: a live add_prefix() rid whose tokens begin the prompt: the request shares its blocks.
        `may_hit`: admission may take prefix-cache hits (False computes every prompt token)."""
        n: cython.int = len(prompt)
        rid: cython.int
        if n < 1 or cap_tokens <= n:
            raise ValueError("a request needs a non-empty prompt and room for at least one new token")
        if not 1 <= min_loops <= max_loops <= self.num_loops:
            raise ValueError(f"bad exit window: loops {min_loops}..{max_loops} of {self.num_loops}")
        if prefix != -1:
            if not (0 <= prefix < self.max_requests and self._is_prefix[prefix]):
                raise ValueError(f"rid {prefix} is not a prefix request")
            m = self._num_prompt[prefix]
            if n <= m or not np.array_equal(self._tokens[prefix][:m], np.asarray(prompt[:m])):
                raise ValueError("the prompt does not extend its prefix request's tokens")
        rid = self._new_request(prompt, cap_tokens)
        self._min_loops[rid], self._max_loops[rid], self._log1mq[rid] = min_loops, max_loops, log1mq
        self._may_hit[rid] = 1 if may_hit else 0
        if prefix == -1:
            self._status[rid] = WAITING
            self._wait_push(rid, False)
        else:
            self._status[rid] = PARKED
            self._prefix_of[rid] = prefix
            self._num_children[prefix] += 1
            self._num_waiting += 1
        return rid

    def add_prefix(self, prompt, may_hit: bool = True) -> int:
        """Queue a prefix request: `prompt` (whole blocks) computed at every loop and never sampled, for the
        requests added with it as their `prefix`; returns its rid. It ends once computed, its blocks
        passing to them, or when the last of them ends. `may_hit` as for add()."""
        n: cython.int = len(prompt)
        rid: cython.int
        if n < 1 or n % self.bt._block_size:
            raise ValueError(f"a prefix is whole {self.bt._block_size}-token blocks, not {n} tokens")
        rid = self._new_request(prompt, n)
        self._min_loops[rid], self._max_loops[rid], self._log1mq[rid] = self.num_loops, self.num_loops, 0.0
        self._may_hit[rid] = 1 if may_hit else 0
        self._is_prefix[rid] = 1
        self._status[rid] = WAITING
        self._wait_push(rid, False)
        return rid

    def _new_request(self, prompt, cap_tokens: cython.int) -> cython.int:
        """A rid for a request of `prompt` finishing at cap_tokens (checked to fit), not queued yet."""
        n: cython.int = len(prompt)
        rid: cython.int
        bs = self.bt._block_size
        if (cap_tokens + bs - 1) // bs * self.num_loops > self.bt._num_blocks:
            raise ValueError(f"{cap_tokens} tokens need more KV blocks than the whole pool holds")
        if cap_tokens > self.bt._max_blocks_per_seq * bs:
            raise ValueError(f"{cap_tokens} tokens exceed the per-request block table")
        if self._num_free_rids == 0:
            raise OverflowError("the scheduler holds max_requests requests already")
        self._num_free_rids -= 1
        rid = self._free_rids[self._num_free_rids]
        toks = np.zeros(cap_tokens, dtype=np.int32)
        toks[:n] = prompt
        depth = np.zeros(cap_tokens, dtype=np.int8)
        depth[:n] = self.num_loops
        self._tokens[rid], self._depths[rid] = toks, depth
        self._hashes[rid] = self.bt.hash_blocks(toks, n) if self.bt._caching else None
        self._num_reg[rid] = 0
        self._cached[rid] = -1
        self._num_prompt[rid] = n
        self._num_tokens[rid] = n
        self._num_done[rid] = 0
        self._cap[rid] = cap_tokens
        self._arrival[rid] = self.arrivals
        self.arrivals += 1
        self._row_loop[rid] = -1
        self._kv_slot[rid] = -1
        self._held[rid] = 0
        return rid

    @cython.initializedcheck(True)
    def hold(self, rid: int, held: bool) -> None:
        """While held, schedule() neither admits the request nor starts its rows: run-ahead decides
        at which launch its prompt starts (engine/riders.py), and releases it for that step."""
        self._held[rid] = 1 if held else 0

    @cython.initializedcheck(True)
    def admit_now(self, rid: int) -> bool:
        """Admit the request at the head of the waiting queue without starting a row: a KV slot, its
        prefix-cache hits (num_computed) and blocks for the rest of its known tokens at every loop.
        False, changing nothing, if none are free."""
        if self._status[rid] != WAITING or self._wait_count == 0 or self._waiting[self._wait_head] != rid:
            return False
        if self._num_free_slots == 0 or self._shared[rid] is not None or self._is_prefix[rid]:
            return False  # shared blocks and prefixes are admitted by schedule() alone
        self._admit(rid)
        if not self._take_kv(rid, self._num_tokens[rid]):
            self._release_slot(rid, False)
            self._status[rid] = WAITING
            return False
        self._load_slot(rid)
        self._wait_pop()
        self._num_waiting -= 1
        return True

    def finish(self, rid: int) -> None:
        """Drop a request wherever it is (finished by the engine, or aborted): frees its KV and rid.
        An unknown or already finished rid is ignored."""
        if 0 <= rid < self.max_requests:
            self._finish(rid)

    @property
    def num_running(self) -> int:
        return self._num_running

    @property
    def num_waiting(self) -> int:
        return self._num_waiting

    @cython.initializedcheck(True)
    def status(self, rid: int) -> int:
        return self._status[rid]

    @cython.initializedcheck(True)
    def kv_epoch(self, rid: int) -> int:
        """Bumped whenever the request loses its KV (preempted, finished): K/V work queued before is void."""
        return self._epoch[rid]

    @cython.initializedcheck(True)
    def cached_tokens(self, rid: int) -> int:
        """Prompt tokens the request's first admission took from the prefix cache (0 before it); readable
        after the request ends, until its rid is reused."""
        return max(self._cached[rid], 0)

    @cython.initializedcheck(True)
    def kv_slot(self, rid: int) -> int:
        """The request's row in the block tables, -1 while it holds no KV."""
        return self._kv_slot[rid]

    @cython.initializedcheck(True)
    def cached_now(self, rid: int) -> int:
        """Prompt tokens the waiting request's admission would take from the prefix cache now (admit_now,
        schedule()); nothing changes."""
        if self._status[rid] != WAITING or not self._may_hit[rid] or self._hashes[rid] is None:
            return 0
        if self._shared[rid] is not None:
            return 0
        hits = self.bt.probe(self._hashes[rid], self._tokens[rid], self._most_hits(rid))
        return hits * cython.cast(cython.int, self.bt._block_size)

    @cython.initializedcheck(True)
    def num_computed(self, rid: int) -> int:
        """Known tokens whose K/V every loop holds (prefix-cache hits included)."""
        return self._num_done[rid]

    @cython.initializedcheck(True)
    def num_tokens(self, rid: int) -> int:
        """Known tokens of the request (prompt and outputs so far)."""
        return self._num_tokens[rid]

    @cython.initializedcheck(True)
    def cap(self, rid: int) -> int:
        """The token count at which the request finishes (prompt + max new tokens)."""
        return self._cap[rid]

    def tokens(self, rid: int):
        """The request's known token ids (prompt then outputs), a copy."""
        return np.array(self._tokens[rid][: self._num_tokens[rid]])

    def depths(self, rid: int):
        """Loops computed per known token (0 for the live token not yet exited), a copy."""
        return np.array(self._depths[rid][: self._num_tokens[rid]])

    # ---- internals ---------------------------------------------------------

    def _finish(self, rid: cython.int) -> cython.int:
        """finish() of a rid in range."""
        prefix: cython.int = -1
        if self._status[rid] == FREE:
            return 0
        if self._status[rid] == PARKED:
            prefix = self._prefix_of[rid]
            self._prefix_of[rid] = -1
            self._num_children[prefix] -= 1
            self._num_waiting -= 1
        elif self._status[rid] == WAITING:
            self._wait_remove(rid)
        else:
            self._release_slot(rid, False)
        if self._shared[rid] is not None:
            self.bt.release(self._shared[rid])
            self._shared[rid] = None
        if self._is_prefix[rid] and self._num_children[rid]:
            self._release_children(rid, 0)  # not computed: they compute the whole prompt themselves
        self._is_prefix[rid] = 0
        self._status[rid] = FREE
        self._tokens[rid] = None
        self._depths[rid] = None
        self._hashes[rid] = None
        self._free_rids[self._num_free_rids] = rid
        self._num_free_rids += 1
        if prefix >= 0 and self._num_children[prefix] == 0:
            self._finish(prefix)  # nobody is left to share it
        return 0

    def _release_children(self, prefix: cython.int, num_blocks: cython.int) -> cython.int:
        """Queue a prefix's parked requests in arrival order, each holding its first num_blocks blocks."""
        kids = np.flatnonzero((np.asarray(self._status) == PARKED) & (np.asarray(self._prefix_of) == prefix))
        for rid in kids[np.argsort(np.asarray(self._arrival)[kids], kind="stable")].tolist():
            if num_blocks:
                self._shared[rid] = self.bt.hold(self._kv_slot[prefix], num_blocks)
                self._num_done[rid] = num_blocks * self.bt._block_size
                self._cached[rid] = self._cached[prefix]  # what its prompt reused, through the prefix
            self._prefix_of[rid] = -1
            self._status[rid] = WAITING
            self._num_waiting -= 1
            self._wait_insert(rid)
        self._num_children[prefix] = 0
        return 0

    def _wait_push(self, rid: cython.int, front: cython.bint) -> cython.void:
        cap: cython.int = self.max_requests
        if front:
            self._wait_head = (self._wait_head - 1 + cap) % cap
            self._waiting[self._wait_head] = rid
        else:
            self._waiting[(self._wait_head + self._wait_count) % cap] = rid
        self._wait_count += 1
        self._num_waiting += 1

    def _wait_insert(self, rid: cython.int) -> cython.void:
        """Queue a request behind every waiting one that arrived before it."""
        cap: cython.int = self.max_requests
        i: cython.int = self._wait_count
        while i > 0 and self._arrival[self._waiting[(self._wait_head + i - 1) % cap]] > self._arrival[rid]:
            self._waiting[(self._wait_head + i) % cap] = self._waiting[(self._wait_head + i - 1) % cap]
            i -= 1
        self._waiting[(self._wait_head + i) % cap] = rid
        self._wait_count += 1
        self._num_waiting += 1

    def _wait_remove(self, rid: cython.int) -> cython.void:
        """Take a request out of the waiting ring, keeping the others' order (aborts are rare)."""
        cap: cython.int = self.max_requests
        i: cython.int
        j: cython.int = 0
        cur: cython.int
        for i in range(self._wait_count):
            cur = self._waiting[(self._wait_head + i) % cap]
            if cur != rid:
                self._waiting[(self._wait_head + j) % cap] = cur
                j += 1
        self._num_waiting -= self._wait_count - j
        self._wait_count = j

    def _release_slot(self, rid: cython.int, keep: cython.bint) -> cython.int:
        """Free the request's KV slot; keep: park a copy of its tokens (it will be recomputed)."""
        i: cython.int
        j: cython.int = 0
        slot: cython.int = self._kv_slot[rid]
        if keep:
            self._tokens[rid] = np.array(self._tokens[rid])
            self._depths[rid] = np.array(self._depths[rid])
        self._epoch[rid] += 1
        self.bt.free(slot)
        self._free_slots[self._num_free_slots] = slot
        self._num_free_slots += 1
        self._kv_slot[rid] = -1
        self._row_loop[rid] = -1
        for i in range(self._num_running):
            if self._running[i] != rid:
                self._running[j] = self._running[i]
                j += 1
        self._num_running = j
        return 0

    def _preempt(self, rid: cython.int) -> cython.int:
        """Free a running request's KV and queue it first for recomputation."""
        self._release_slot(rid, True)
        self._num_done[rid] = 0
        self._num_reg[rid] = 0
        self._status[rid] = WAITING
        self._wait_push(rid, True)
        self.num_preempted += 1
        return 0

    def _chunk_len(self, rid: cython.int, budget: cython.int) -> cython.int:
        left: cython.int = self._num_tokens[rid] - self._num_done[rid]
        return left if left < budget else budget

    def _start_row(self, rid: cython.int, length: cython.int) -> cython.void:
        """A new loop-0 row over the request's next `length` uncomputed tokens."""
        i: cython.int
        d: cython.int
        start: cython.int = self._num_done[rid]
        slot: cython.int = self._kv_slot[rid]
        deepest: cython.int = 0
        live: cython.int = 1 if start + length == self._num_tokens[rid] and not self._is_prefix[rid] else 0
        for i in range(start, start + length - live):
            d = self._sdep[slot, i]
            if d > deepest:
                deepest = d
        if live and self._sdep[slot, start + length - 1] != 0:
            deepest = self.num_loops  # a prompt token samples but still runs every loop
        self._row_loop[rid] = 0
        self._row_start[rid] = start
        self._row_len[rid] = length
        self._row_depth[rid] = deepest
        self._row_live[rid] = live

    def _emit_row(self, r: cython.int, rid: cython.int, off: cython.int, prev: cython.bint) -> cython.int:
        """Write row r's per-row and per-token outputs; returns the token count."""
        i: cython.int
        pos: cython.int
        d: cython.int
        blk: cython.int
        loop: cython.int = self._row_loop[rid]
        start: cython.int = self._row_start[rid]
        n: cython.int = self._row_len[rid]
        slot: cython.int = self._kv_slot[rid]
        bs: cython.int = cython.cast(cython.int, self.bt._block_size)
        self._o_rid[r] = rid
        self._o_slot[r] = slot
        self._o_loop[r] = loop
        self._o_start[r] = start
        self._o_len[r] = n
        self._o_off[r] = off
        self._o_new[r] = 0 if prev else 1
        # A plain decode row: one generated token that has not exited yet (what run-ahead can drive).
        self._o_dec[r] = 1 if n == 1 and self._row_live[rid] and self._row_depth[rid] == 0 else 0
        if not prev and not self._o_dec[r]:
            self.num_prefill_tokens += n
        if self._row_live[rid]:
            self._o_lo[r] = self._min_loops[rid] - 1
            self._o_hi[r] = self._max_loops[rid] - 1
        else:
            self._o_lo[r] = NO_EXIT
            self._o_hi[r] = NO_EXIT
        self._o_q[r] = self._log1mq[rid]
        for i in range(n):
            pos = start + i
            self._o_pos[off + i] = pos
            self._o_ids[off + i] = self._stok[slot, pos]
            self._o_hsrc[off + i] = self._row_prev_off[rid] + i if prev else -1
            d = self._sdep[slot, pos]
            # Past its depth a token's K/V at this plane is a propagated copy: do not overwrite it.
            if d != 0 and d <= loop:
                self._o_map[off + i] = -1
            else:
                blk = self.bt._tables[slot, loop, pos // bs]
                self._o_map[off + i] = cython.cast(cython.longlong, blk) * bs + pos % bs
        self._row_prev_off[rid] = off
        return n

    def _admit(self, rid: cython.int) -> cython.void:
        """Give a waiting request a free KV slot (the caller checked there is one)."""
        slot: cython.int
        self._num_free_slots -= 1
        slot = self._free_slots[self._num_free_slots]
        self._kv_slot[rid] = slot
        self._status[rid] = RUNNING
        # Arrival order, not admission order: a readmitted request keeps its seniority.
        i: cython.int = self._num_running
        while i > 0 and self._arrival[self._running[i - 1]] > self._arrival[rid]:
            self._running[i] = self._running[i - 1]
            i -= 1
        self._running[i] = rid
        self._num_running += 1

    def _load_slot(self, rid: cython.int) -> cython.int:
        """Move an admitted request's tokens and depths into its slot's row (once per admission)."""
        slot: cython.int = self._kv_slot[rid]
        n: cython.int = self._num_tokens[rid]
        cap: cython.int = self._cap[rid]
        self._slot_tok_arr[slot, :n] = self._tokens[rid][:n]
        self._slot_dep_arr[slot, :n] = self._depths[rid][:n]
        self._slot_dep_arr[slot, n:cap] = 0  # a generated token's depth is 0 until it exits
        self._tokens[rid] = self._slot_tok_arr[slot, :cap]
        self._depths[rid] = self._slot_dep_arr[slot, :cap]
        return 0

    # ---- the step ------------------------------------------------------------

    def schedule(self) -> int:
        """Choose the next step's rows; fills the row_*/token arrays and the propagation pairs.

        Rows that continue from the last step come first, in their last-step order
        (hidden_src indexes the last step's tokens); new loop-0 rows follow.
        """
        r: cython.int = 0
        off: cython.int = 0
        k: cython.int
        rid: cython.int
        self.num_preempted = 0
        self.num_refills = 0
        self.num_prefill_tokens = 0
        # 1. Rows in flight continue at their next loop (compacted in place: r <= k).
        for k in range(self.num_rows):
            rid = self._o_rid[k]
            if self._status[rid] == RUNNING and self._row_loop[rid] > 0:
                off += self._emit_row(r, rid, off, True)
                r += 1
        self.num_cont_tokens = off
        # 2. Refill the rows that exits freed, unless the batch must drain first.
        if self.refill or r == 0:
            cont: cython.int = r
            self._off = off
            r = self._start_running_rows(r, 0)
            r = self._start_running_rows(r, 1)
            r = self._admit_waiting(r)
            off = self._off
            if cont > 0:
                self.num_refills = r - cont
        self.num_rows = r
        self.num_step_tokens = off
        self._emit_propagation()
        return r

    def _start_running_rows(self, r: cython.int, prefill: cython.bint) -> cython.int:
        """New loop-0 rows for running requests without one: decode tokens, or (prefill) longer chunks."""
        k: cython.int = 0
        off: cython.int = self._off
        rid: cython.int
        n: cython.int
        while k < self._num_running and r < self.max_rows and off < self.max_tokens:
            rid = self._running[k]
            k += 1
            n = self._num_tokens[rid] - self._num_done[rid]
            if self._row_loop[rid] >= 0 or n <= 0 or (n > 1) != prefill or self._held[rid]:
                continue
            n = self._chunk_len(rid, self.max_tokens - off)
            if not self._reserve(rid, self._num_done[rid] + n, k - 1):
                continue  # no younger idle request to preempt: wait for in-flight rows to finish
            self._start_row(rid, n)
            off += self._emit_row(r, rid, off, False)
            r += 1
        self._off = off
        return r

    def _reserve(self, rid: cython.int, end: cython.int, index: cython.int) -> cython.bint:
        """Blocks for positions [0, end): True if done, False to wait.

        Victims are the youngest running requests with no row in flight, never one
        already in this step's batch (its blocks are about to be written), never the
        requester itself nor an older one: preempting itself while younger rows are in
        flight can livelock two requests that only fit the pool one at a time.
        """
        k: cython.int
        victim: cython.int
        if self.bt._counts[self._kv_slot[rid]] * self.bt._block_size >= end:
            return True  # already covered: the common decode case, without a call
        while not self.bt.allocate(self._kv_slot[rid], end):
            victim = -1
            k = self._num_running - 1
            while k > index:
                # A held request may have a launch in flight writing its blocks.
                if self._row_loop[self._running[k]] < 0 and not self._held[self._running[k]]:
                    victim = self._running[k]
                    break
                k -= 1
            if victim < 0:
                return False
            self._preempt(victim)
        return True

    def _admit_waiting(self, r: cython.int) -> cython.int:
        """Admit waiting requests in order while rows, tokens, slots and blocks allow (no preemption)."""
        off: cython.int = self._off
        rid: cython.int
        n: cython.int
        while self._wait_count > 0 and r < self.max_rows and off < self.max_tokens:
            rid = self._waiting[self._wait_head]
            if self._num_free_slots == 0 or self._held[rid]:
                break
            self._admit(rid)
            if not self._take_kv(rid, self.max_tokens - off):
                self._release_slot(rid, False)  # nothing was loaded into the slot yet
                self._status[rid] = WAITING
                break
            n = self._chunk_len(rid, self.max_tokens - off)
            self._load_slot(rid)
            self._wait_pop()
            self._num_waiting -= 1
            self._start_row(rid, n)
            off += self._emit_row(r, rid, off, False)
            r += 1
        self._off = off
        return r

    def _most_hits(self, rid: cython.int) -> cython.int:
        """Prefix-cache blocks an admission may take: hits stop short of the last prompt token."""
        return (self._num_prompt[rid] - 1) // cython.cast(cython.int, self.bt._block_size)

    def _take_kv(self, rid: cython.int, budget: cython.int) -> cython.bint:
        """Blocks for an admitted request's next chunk within `budget` tokens: its shared blocks or cache
        hits (computed already), then its own. False when the pool lacks them (the caller frees the slot)."""
        slot: cython.int = self._kv_slot[rid]
        bs: cython.int = cython.cast(cython.int, self.bt._block_size)
        hit: cython.int = 0
        end: cython.int
        need: cython.int
        most: cython.int = self._most_hits(rid)
        shared = self._shared[rid]
        if shared is None:
            if self._may_hit[rid] and self._hashes[rid] is not None:
                hit = self.bt.lookup(slot, self._hashes[rid], self._tokens[rid], most)
            self._num_done[rid] = hit * bs
            if not self.bt.allocate(slot, hit * bs + self._chunk_len(rid, budget)):
                self._num_done[rid] = 0
                return False
            if self._hashes[rid] is not None and self._may_hit[rid]:
                self.cache_queries += self._num_tokens[rid]
                self.cache_hits += hit * bs
            if self._cached[rid] < 0:
                self._cached[rid] = hit * bs
            self._num_reg[rid] = hit
            return True
        end = self._num_done[rid] + self._chunk_len(rid, budget)
        need = ((end + bs - 1) // bs - shared.shape[1]) * self.num_loops
        if need > self.bt._num_free + self.bt._num_cached_free:
            return False
        self.bt.adopt(slot, shared)
        self._shared[rid] = None
        return self.bt.allocate(slot, end)

    def _register(self, rid: cython.int) -> cython.int:
        """Cache the request's prompt blocks that every loop has computed (blocks past the prompt never)."""
        full: cython.int = self._num_done[rid]
        if full > self._num_prompt[rid]:
            full = self._num_prompt[rid]
        full = full // cython.cast(cython.int, self.bt._block_size)
        if full > self._num_reg[rid]:
            self._num_reg[rid] = self.bt.cache(
                self._kv_slot[rid], self._hashes[rid], self._tokens[rid], self._num_reg[rid], full
            )
        return 0

    def _wait_pop(self) -> cython.void:
        self._wait_head = (self._wait_head + 1) % self.max_requests
        self._wait_count -= 1

    def _emit_propagation(self) -> cython.void:
        """Turn pending exits into (src, dst) slot pairs, for requests that still hold their KV.

        Same pairs as BlockTable.fill_propagation (source in the exit loop's plane, one pair per
        deeper loop, in order), computed here from the live tables without a call per pair.
        """
        i: cython.int
        j: cython.int
        n: cython.int = 0
        rid: cython.int
        slot: cython.int
        pos: cython.int
        e: cython.int
        blk: cython.int
        at: cython.int
        bs: cython.int = cython.cast(cython.int, self.bt._block_size)
        src: cython.longlong
        for i in range(self._num_pend):
            rid = self._pend_rid[i]
            if self._status[rid] == RUNNING and self._epoch[rid] == self._pend_epoch[i]:
                slot = self._kv_slot[rid]
                pos = self._pend_pos[i]
                e = self._pend_loop[i]
                blk = pos // bs
                at = pos % bs
                src = cython.cast(cython.longlong, self.bt._tables[slot, e, blk]) * bs + at
                for j in range(e + 1, self.num_loops):
                    self._o_psrc[n] = src
                    self._o_pdst[n] = cython.cast(cython.longlong, self.bt._tables[slot, j, blk]) * bs + at
                    n += 1
        self.num_prop = n
        self._num_pend = 0

    def update(self, exited, sampled) -> int:
        """Apply the runner's per-row exit flags and sampled ids (uint8/int arrays, one per row).

        Fills ev_rid/ev_token/ev_loop/ev_finished: one event per sampled token;
        ev_finished = 1 when the request reached its length cap (its rid is freed).
        """
        k: cython.int
        ev: cython.int = 0
        rid: cython.int
        ex: cython.uchar[:] = exited
        smp: cython.int[:] = sampled
        for k in range(self.num_rows):
            rid = self._o_rid[k]
            if self._status[rid] != RUNNING:
                continue
            if self._row_live[rid] and ex[k]:
                self._e_rid[ev] = rid
                self._e_tok[ev] = smp[k]
                self._e_loop[ev] = self._row_loop[rid]
                self._e_fin[ev] = self._take_sample(rid, smp[k])
                ev += 1
                if self._status[rid] == FREE:
                    continue
            self._advance_row(rid)
            # A row that computed prompt positions ended: its whole prompt blocks may join the cache.
            ended: cython.bint = self._row_loop[rid] < 0 and self._row_start[rid] < self._num_prompt[rid]
            if ended and self._hashes[rid] is not None:
                self._register(rid)
            if (
                self._is_prefix[rid]
                and self._row_loop[rid] < 0
                and self._num_done[rid] == self._num_prompt[rid]
            ):
                self._release_children(rid, self._num_prompt[rid] // self.bt._block_size)
                self._finish(rid)  # computed: its requests hold its blocks now
        self.num_events = ev
        return ev

    def _take_sample(self, rid: cython.int, token: cython.int) -> cython.int:
        """The live token exited: record its depth and append the sampled token. 1 if now finished."""
        loop: cython.int = self._row_loop[rid]
        pos: cython.int = self._row_start[rid] + self._row_len[rid] - 1
        slot: cython.int = self._kv_slot[rid]
        if self._sdep[slot, pos] == 0:
            self._sdep[slot, pos] = loop + 1  # a generated token stops here; deeper planes get copies
        self._row_live[rid] = 0
        self._stok[slot, self._num_tokens[rid]] = token
        self._num_tokens[rid] += 1
        if self._num_tokens[rid] >= self._cap[rid]:
            self._finish(rid)
            return 1
        return 0

    def _advance_row(self, rid: cython.int) -> cython.void:
        """After a loop: queue propagation for tokens that stop here; end or continue the row."""
        i: cython.int
        loop: cython.int = self._row_loop[rid]
        start: cython.int = self._row_start[rid]
        end: cython.int = start + self._row_len[rid]
        slot: cython.int = self._kv_slot[rid]
        if loop + 1 < self.num_loops and end > self._num_prompt[rid]:
            i = start if start > self._num_prompt[rid] else self._num_prompt[rid]
            while i < end:
                if self._sdep[slot, i] == loop + 1:
                    self._pend_rid[self._num_pend] = rid
                    self._pend_epoch[self._num_pend] = self._epoch[rid]
                    self._pend_pos[self._num_pend] = i
                    self._pend_loop[self._num_pend] = loop
                    self._num_pend += 1
                i += 1
        if loop + 1 >= self.num_loops or (not self._row_live[rid] and self._row_depth[rid] <= loop + 1):
            self._num_done[rid] = end
            self._row_loop[rid] = -1
        else:
            self._row_loop[rid] = loop + 1

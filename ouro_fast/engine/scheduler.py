"""The engine's scheduler: the compiled LoopScheduler and BlockTable, emitting one StepPlan per step.

The decisions (admission, refill at loop boundaries, budgets, preemption, block
allocation) are made in the compiled core (csrc/, built by pip install .). This
module gives them the step contract of engine/plan.py. There is no silent
fallback: without the compiled modules the import fails and says how to build
them. Tests and benchmarks reach the uncompiled twin through ouro_fast.core_py.
"""

from __future__ import annotations

import numpy as np

from .plan import SamplingTable, StepPlan, StepResult, TokenEvents

try:
    from ..core.block_table import BlockTable
    from ..core.loop_scheduler import FREE, RUNNING, WAITING, LoopScheduler
except ImportError as e:  # pragma: no cover - exercised only on a broken install
    raise ImportError(
        f"ouro_fast's compiled core is missing ({e}). Build it with `pip install .` "
        "(or `python setup.py build_ext --inplace` in a source checkout); a C compiler is required."
    ) from e

__all__ = ["FREE", "RUNNING", "WAITING", "BlockTable", "LoopScheduler", "Scheduler"]


class Scheduler:
    """Owns the request queue, the rows in flight and the KV block pool. Engine-owner thread only.

    `core` (LoopScheduler) and `blocks` (BlockTable) are the compiled objects; the GPU run-ahead
    host side uses their public methods to seat requests in decode lanes and to reserve blocks.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        num_loops: int,
        max_num_seqs: int,
        max_waiting: int,
        max_num_batched_tokens: int,
        max_blocks_per_seq: int,
        refill: bool = True,
        prefix_caching: bool = False,
    ):
        self.capacity = max_num_seqs + max_waiting  # requests held at once: the size of per-rid arrays
        self.blocks = BlockTable(
            num_blocks, block_size, num_loops, max_num_seqs, max_blocks_per_seq, prefix_caching
        )
        self.core = LoopScheduler(self.blocks, self.capacity, max_num_seqs, max_num_batched_tokens, refill)
        self.sampling = SamplingTable.empty(self.capacity)

    # ---- requests ----

    def add(
        self,
        prompt_ids: np.ndarray,
        cap_tokens: int,
        min_loops: int,
        max_loops: int,
        log1mq: float,
        prefix: int = -1,
        may_hit: bool = True,
    ) -> int:
        """Queue a request; returns its rid. OverflowError when the scheduler holds `capacity` requests.
        `prefix`: an add_prefix() rid whose tokens begin the prompt; the request shares its KV blocks.
        `may_hit`: its admission may reuse prefix-cache blocks (False: it computes every prompt token)."""
        return self.core.add(prompt_ids, cap_tokens, min_loops, max_loops, log1mq, prefix, may_hit)

    def add_prefix(self, prompt_ids: np.ndarray, may_hit: bool = True) -> int:
        """Queue the whole blocks of a prompt that several requests share (computed once, never sampled);
        returns its rid. It ends by itself: once computed, or when the last request added on it ends."""
        return self.core.add_prefix(prompt_ids, may_hit)

    def cached_tokens(self, rid: int) -> int:
        """Prompt tokens the request's first admission reused from the prefix cache."""
        return self.core.cached_tokens(rid)

    def finish(self, rid: int) -> None:
        """Forget a request and free its KV (a no-op when the core already freed it at its length cap)."""
        self.core.finish(rid)

    def holds_kv(self, rid: int) -> bool:
        """Whether the request is running (holds a KV slot), as opposed to waiting or finished."""
        return self.core.status(rid) == RUNNING

    @property
    def num_running(self) -> int:
        return self.core.num_running

    @property
    def num_waiting(self) -> int:
        return self.core.num_waiting

    @property
    def num_blocks(self) -> int:
        return self.blocks.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.blocks.num_free_blocks

    @property
    def prefix_cache_queries(self) -> int:
        """Known tokens of the admissions that looked the prefix cache up (vLLM's queries)."""
        return self.core.cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Tokens those admissions reused from the prefix cache (vLLM's hits)."""
        return self.core.cache_hits

    # ---- the step ----

    def schedule(self) -> StepPlan | None:
        """The next step's plan, or None when no row can run."""
        s = self.core
        r = s.schedule()
        if r == 0:
            return None
        n, p = s.num_step_tokens, s.num_prop
        return StepPlan(
            rid=s.row_rid[:r], kv_slot=s.row_kv_slot[:r], loop=s.row_loop[:r], start=s.row_start[:r],
            length=s.row_len[:r], tok_off=s.row_tok_off[:r], exit_lo=s.row_exit_lo[:r],
            exit_hi=s.row_exit_hi[:r], log1mq=s.row_log1mq[:r], decode=s.row_decode[:r],
            token_ids=s.token_ids[:n], positions=s.positions[:n], slot_mapping=s.slot_mapping[:n],
            hidden_src=s.hidden_src[:n], num_carried=s.num_cont_tokens,
            prop_src=s.prop_src[:p], prop_dst=s.prop_dst[:p],
            block_tables=self.blocks.tables, sampling=self.sampling,
            num_refills=s.num_refills, num_preempted=s.num_preempted, num_prefill_tokens=s.num_prefill_tokens,
        )  # fmt: skip

    def update(self, result: StepResult) -> TokenEvents:
        """Apply a step's exits and samples: rows advance a loop or end, exited tokens append theirs."""
        s = self.core
        e = s.update(result.exited, result.sampled)
        return TokenEvents(
            rid=s.ev_rid[:e], token=s.ev_token[:e], loop=s.ev_loop[:e], finished=s.ev_finished[:e]
        )

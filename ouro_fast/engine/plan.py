"""The step contract: what crosses scheduler -> runner -> engine, and nothing else.

Every step is one loop (all layers once) over a set of rows. The scheduler emits
a StepPlan, a runner executes it and returns a StepResult, the scheduler turns
that into TokenEvents, and the engine turns those into request outputs. Both
runners (the PyTorch reference and the GPU runner) consume the same StepPlan.

A row is a run of consecutive tokens of one request at one loop t: a decode row is
one generated token; a prefill row is a chunk of prompt tokens (or of a preempted
request's known tokens, recomputed). Rows are ordered: the rows that continue at
loop t+1 come first, in the last step's order, then rows that start at loop 0.

All arrays are numpy views into the scheduler's buffers: valid until the next
schedule() or update(), never written by a consumer.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# exit_lo / exit_hi of a row whose last token does not sample in this step (a prefill chunk that is not
# the prompt's last, or a row whose token already exited at an earlier loop).
NO_EXIT = 127


@dataclass
class SamplingTable:
    """Per-request sampling settings as arrays indexed by rid (owned by the engine, read by runners)."""

    temperature: np.ndarray  # float32; 0 = greedy
    top_p: np.ndarray  # float32; 1 = off
    top_k: np.ndarray  # int32; 0 = off
    seed: np.ndarray  # int64; -1 = unseeded
    num_outputs: np.ndarray  # int32: tokens generated so far (a seeded request's noise is keyed by it)
    logprobs: np.ndarray  # int32: top log-probabilities to report per token; -1 = none, 0 = the sampled one
    min_p: np.ndarray  # float32; 0 = off
    prompt_logprobs: np.ndarray  # int32: top log-probabilities to report per prompt token; -1 = none
    prompt_done: np.ndarray  # int32: prompt positions already reported (a recomputation skips them)
    prompts: dict  # rid -> prompt ids, for the requests that want prompt logprobs
    # LogitsProcessors: penalties, logit_bias, min_tokens (engine/logits_processors.py).
    processors: object = None
    # Grammars: the next-token masks of requests with structured output (engine/structured.py).
    grammars: object = None

    @classmethod
    def empty(cls, capacity: int) -> SamplingTable:
        return cls(
            temperature=np.ones(capacity, np.float32),
            top_p=np.ones(capacity, np.float32),
            top_k=np.zeros(capacity, np.int32),
            seed=np.full(capacity, -1, np.int64),
            num_outputs=np.zeros(capacity, np.int32),
            logprobs=np.full(capacity, -1, np.int32),
            min_p=np.zeros(capacity, np.float32),
            prompt_logprobs=np.full(capacity, -1, np.int32),
            prompt_done=np.zeros(capacity, np.int32),
            prompts={},
        )


@dataclass(slots=True)
class StepPlan:
    """One step's rows and tokens. R rows, N tokens, P propagation pairs.

    Token i of the step belongs to the row r with tok_off[r] <= i < tok_off[r] + length[r]; row r's
    tokens sit at positions start[r] .. start[r] + length[r] - 1 of its request.
    """

    # ---- per row [R] ----
    rid: np.ndarray  # int32: the request (indexes SamplingTable and the scheduler's per-request state)
    kv_slot: np.ndarray  # int32: the request's row in block_tables
    loop: np.ndarray  # int32: the 0-based loop this row runs
    start: np.ndarray  # int32: position of the row's first token
    length: np.ndarray  # int32: tokens in the row (>= 1)
    tok_off: np.ndarray  # int32: index of the row's first token in this step
    exit_lo: np.ndarray  # int32: first 0-based loop the row's last token may exit at; NO_EXIT: it does not
    exit_hi: np.ndarray  # int32: the loop at which it exits regardless (max_loops - 1); NO_EXIT as above
    log1mq: np.ndarray  # float32: log(1 - exit threshold); exit once log-survival <= this
    decode: np.ndarray  # int32: 1 for a one-token row of a generated token, 0 for a prompt chunk
    # ---- per token [N] ----
    token_ids: np.ndarray  # int64: the token (embedded when the row is at loop 0)
    positions: np.ndarray  # int64: the token's position in its request
    slot_mapping: np.ndarray  # int64: the KV slot written in the row's plane; -1: no write (past its depth)
    hidden_src: np.ndarray  # int64: index of this token in the LAST step, whose output it carries; -1: loop 0
    num_carried: int  # tokens [0, num_carried) carry a hidden state (hidden_src >= 0); the rest embed
    # ---- propagation [P], owed by the last step's exits: copy slot src to dst in every layer, K and V ----
    prop_src: np.ndarray  # int64
    prop_dst: np.ndarray  # int64
    # ---- shared state the runner reads, not per step ----
    # int32 [max_seqs, loops, max_blocks]: block_tables[kv_slot, loop] is a row's table in its plane
    block_tables: np.ndarray
    sampling: SamplingTable
    # ---- step figures ----
    num_refills: int  # rows that started at loop 0 in this step beside rows still in flight
    num_preempted: int  # requests preempted to make room for this step
    num_prefill_tokens: int = 0  # tokens of the rows that start a prompt chunk here (recomputations too)

    @property
    def num_rows(self) -> int:
        return len(self.rid)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_prop(self) -> int:
        return len(self.prop_src)

    def last_tokens(self) -> np.ndarray:
        """int64 [R]: each row's last token index in the step (its gate and sampler input)."""
        return (self.tok_off + self.length - 1).astype(np.int64)

    def may_exit(self) -> bool:
        """Whether any row's last token may exit (and so may need a sample) at this step."""
        return bool((self.exit_lo <= self.loop).any())

    def all_exit(self) -> bool:
        """Whether every row reaches its last loop here: the exits are known without the gate."""
        return bool((self.exit_hi <= self.loop).all())


@dataclass
class TokenLogprobs:
    """A sampled token's log-probability, and the likeliest tokens' ids and log-probabilities, best first."""

    logprob: float
    rank: int  # 1 + how many tokens were likelier
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class StepResult:
    """What a runner returns for a StepPlan: per row, whether its last token exited, and the sample."""

    exited: np.ndarray  # uint8 [R]: 1 when the row's last token exited at this loop (and was sampled)
    sampled: np.ndarray  # int32 [R]: the sampled next token of an exited row (undefined otherwise)
    logits: dict[int, torch.Tensor] | None = None  # row -> float32 logits of its exit (keep_logits only)
    logprobs: dict[int, TokenLogprobs] | None = None  # rid -> its new token's log-probabilities, when asked
    prompt_logprobs: dict[int, list] | None = None  # rid -> [(prompt position, TokenLogprobs)] reported now


@dataclass(slots=True)
class TokenEvents:
    """Tokens that exited in a step and were accepted by the scheduler, in row order [E]."""

    rid: np.ndarray  # int32: the request
    token: np.ndarray  # int32: the new token
    loop: np.ndarray  # int32: the 0-based loop at which the token before it exited, producing it
    finished: np.ndarray  # int32: 1 when the request reached its length cap with this token

    def __len__(self) -> int:
        return len(self.rid)

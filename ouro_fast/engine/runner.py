"""The model runner: executes one scheduled step (one loop for every row) and decides exits.

It owns the tensors: the paged KV cache of every (loop, layer) plane, the hidden
states carried between steps, and each row's running exit statistics. Per step:
propagate last step's exits' K/V, run the loop, evaluate the gate on each row's
last token, apply the exit rule on the device, sample the rows that exit.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..model.attention import PagedBatch, PagedTorchAttention
from ..model.exit_rule import exit_mask, update_log_survival
from ..model.ouro import OuroForCausalLM
from .sampling import Sampler


def allocate_kv_cache(cfg, num_slots: int, dtype: torch.dtype, device) -> torch.Tensor:
    """The paged K/V of every (loop, layer) plane: [2, layers, num_slots, kv_heads, head_dim]."""
    shape = (2, cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, cfg.head_dim)
    return torch.zeros(shape, dtype=dtype, device=device)


@dataclass
class RowSampling:
    """Per-request sampling settings, as arrays indexed by rid (owned by the engine)."""

    temperature: np.ndarray  # float32
    top_p: np.ndarray  # float32
    top_k: np.ndarray  # int32, 0 = off
    seed: np.ndarray  # int64, -1 = unseeded
    num_outputs: np.ndarray  # int32: tokens generated so far


@dataclass
class StepResult:
    exited: np.ndarray  # uint8 [R]
    sampled: np.ndarray  # int32 [R]
    logits: dict[int, torch.Tensor] | None = None  # row -> logits of the exit loop (when kept)


class ModelRunner:
    def __init__(
        self,
        model: OuroForCausalLM,
        num_blocks: int,
        block_size: int,
        vocab_limit: int,
        device: torch.device,
        seed: int = 0,
        keep_logits: bool = False,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.kv_cache = allocate_kv_cache(cfg, num_blocks * block_size, dtype, device)
        self.attn = PagedTorchAttention(self.kv_cache)
        self.sampler = Sampler(vocab_limit, device, seed)
        self.keep_logits = keep_logits
        self.prev_hidden = torch.zeros(0, cfg.hidden_size, dtype=dtype, device=device)
        self.prev_log_surv = torch.zeros(0, dtype=torch.float32, device=device)

    def _tensor(self, arr: np.ndarray, n: int) -> torch.Tensor:
        return torch.from_numpy(arr[:n]).to(self.device, non_blocking=True)

    def _propagate(self, sched) -> None:
        """Copy exited tokens' K/V (every layer, K and V) into the deeper planes they skipped."""
        if sched.num_prop:
            src = self._tensor(sched.prop_src, sched.num_prop)
            dst = self._tensor(sched.prop_dst, sched.num_prop)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _paged_batch(self, sched, tables: np.ndarray) -> PagedBatch:
        r = sched.num_rows
        bs = self.block_size
        rows = []
        for i in range(r):
            end = int(sched.row_start[i] + sched.row_len[i])
            table = tables[sched.row_kv_slot[i], sched.row_loop[i]]
            pos = np.arange(end)
            rows.append(torch.from_numpy(table[pos // bs].astype(np.int64) * bs + pos % bs).to(self.device))
        return PagedBatch(
            slot_mapping=self._tensor(sched.slot_mapping, sched.num_step_tokens),
            row_token_start=sched.row_tok_off[:r].tolist(),
            row_len=sched.row_len[:r].tolist(),
            row_q_start=sched.row_start[:r].tolist(),
            row_kv_slots=rows,
        )

    @torch.inference_mode()
    def execute(self, sched, tables: np.ndarray, sampling: RowSampling) -> StepResult:
        r, n, n_cont = sched.num_rows, sched.num_step_tokens, sched.num_cont_tokens
        self._propagate(sched)
        hidden_src = self._tensor(sched.hidden_src, n_cont)
        h = torch.cat(
            (
                self.prev_hidden[hidden_src],
                self.model.embed(self._tensor(sched.token_ids[n_cont:], n - n_cont)),
            )
        )
        self.attn.batch = self._paged_batch(sched, tables)
        h = self.model.run_loop(h, self._tensor(sched.positions, n), self.attn)

        last = torch.from_numpy((sched.row_tok_off[:r] + sched.row_len[:r] - 1).astype(np.int64)).to(
            self.device
        )
        prev_last = torch.from_numpy(sched.hidden_src[:n].astype(np.int64)).to(self.device)[last]
        log_surv = torch.where(
            prev_last >= 0, self.prev_log_surv[prev_last.clamp(min=0)], torch.zeros((), device=self.device)
        ) if self.prev_log_surv.numel() else torch.zeros(r, device=self.device)  # fmt: skip
        log_surv = update_log_survival(log_surv, self.model.gate_logits(h[last]))
        loops = self._tensor(sched.row_loop, r)
        exits = exit_mask(
            loops, log_surv, self._tensor(sched.row_log1mq, r),
            self._tensor(sched.row_exit_lo, r) + 1, self._tensor(sched.row_exit_hi, r) + 1,
        )  # fmt: skip

        self.prev_hidden = h
        surv = torch.zeros(n, dtype=torch.float32, device=self.device)
        surv[last] = log_surv
        self.prev_log_surv = surv
        return sample_exited(self, sched, h[last], exits.to(torch.uint8).cpu().numpy(), sampling)


def sample_exited(
    runner, sched, h_last: torch.Tensor, exited: np.ndarray, sampling: RowSampling
) -> StepResult:
    """lm_head and the sampler for the rows whose live token exited (exited: uint8 per row, on the host)."""
    r = sched.num_rows
    sampled = np.zeros(r, dtype=np.int32)
    rows = np.flatnonzero(exited)
    kept = None
    if rows.size:
        rids = sched.row_rid[rows]
        # All rows exited (full depth): no gather, and no index copy that would wait for the stream.
        h = h_last if rows.size == r else h_last[torch.from_numpy(rows).to(runner.device)]
        logits = runner.model.logits(h).float()
        seeds = [None if s < 0 else int(s) for s in sampling.seed[rids]]
        ids = runner.sampler(
            logits,
            torch.from_numpy(sampling.temperature[rids]),
            torch.from_numpy(sampling.top_p[rids]),
            torch.from_numpy(sampling.top_k[rids]),
            seeds,
            sampling.num_outputs[rids].tolist(),
        )
        sampled[rows] = ids.cpu().numpy()
        if runner.keep_logits:
            kept = {int(row): logits[i].cpu() for i, row in enumerate(rows)}
    return StepResult(exited, sampled, kept)

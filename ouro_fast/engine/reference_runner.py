"""The reference runner: executes a StepPlan in plain PyTorch (CPU or GPU), the oracle for the GPU runner.

It owns the tensors: the paged KV cache of every (loop, layer) plane, the hidden
states carried between steps, and each row's running exit statistics. Per step:
propagate last step's exits' K/V, run the loop, evaluate the gate on each row's
last token, apply the exit rule, and sample the rows that exit.
"""

from __future__ import annotations

import numpy as np
import torch

from ..model.attention import PagedBatch, PagedTorchAttention, allocate_kv_cache
from ..model.exit_rule import exit_mask, update_log_survival
from ..model.ouro import OuroForCausalLM
from .plan import StepPlan, StepResult
from .sampling import Sampler, prompt_logprobs, sample_exited


class ReferenceRunner:
    def __init__(
        self,
        model: OuroForCausalLM,
        num_blocks: int,
        block_size: int,
        vocab_limit: int,
        device: torch.device,
        seed: int = 0,
        keep_logits: bool = False,
        kv_dtype: torch.dtype | None = None,
    ):
        cfg = model.config
        self.model = model
        self.block_size = block_size
        self.device = device
        dtype = next(model.parameters()).dtype
        self.kv_cache = allocate_kv_cache(cfg, num_blocks * block_size, kv_dtype or dtype, device)
        self.attn = PagedTorchAttention(self.kv_cache)
        self.sampler = Sampler(vocab_limit, device, seed)
        self.keep_logits = keep_logits
        self.num_loops = cfg.total_ut_steps
        self.prev_hidden = torch.zeros(0, cfg.hidden_size, dtype=dtype, device=device)
        self.prev_log_surv = torch.zeros(0, dtype=torch.float32, device=device)

    def _tensor(self, arr: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(arr)).to(self.device, non_blocking=True)

    def _propagate(self, plan: StepPlan) -> None:
        """Copy exited tokens' K/V (every layer, K and V) into the deeper planes they skipped."""
        if plan.num_prop:
            src, dst = self._tensor(plan.prop_src), self._tensor(plan.prop_dst)
            self.kv_cache[:, :, dst] = self.kv_cache[:, :, src]

    def _paged_batch(self, plan: StepPlan) -> PagedBatch:
        bs = self.block_size
        rows = []
        for r in range(plan.num_rows):
            end = int(plan.start[r] + plan.length[r])
            table = plan.block_tables[plan.kv_slot[r], plan.loop[r]]
            pos = np.arange(end)
            rows.append(torch.from_numpy(table[pos // bs].astype(np.int64) * bs + pos % bs).to(self.device))
        return PagedBatch(
            slot_mapping=self._tensor(plan.slot_mapping),
            row_token_start=plan.tok_off.tolist(),
            row_len=plan.length.tolist(),
            row_q_start=plan.start.tolist(),
            row_kv_slots=rows,
        )

    @torch.inference_mode()
    def execute(self, plan: StepPlan) -> StepResult:
        c = plan.num_carried
        self._propagate(plan)
        h = torch.cat(
            (
                self.prev_hidden[self._tensor(plan.hidden_src[:c])],
                self.model.embed(self._tensor(plan.token_ids[c:])),
            )
        )
        self.attn.batch = self._paged_batch(plan)
        h = self.model.run_loop(h, self._tensor(plan.positions), self.attn)

        last_np = plan.last_tokens()
        last = torch.from_numpy(last_np).to(self.device)
        prev_last = torch.from_numpy(plan.hidden_src[last_np].astype(np.int64)).to(self.device)
        if self.prev_log_surv.numel():
            carried = self.prev_log_surv[prev_last.clamp(min=0)]
            log_surv = torch.where(prev_last >= 0, carried, torch.zeros((), device=self.device))
        else:
            log_surv = torch.zeros(plan.num_rows, device=self.device)
        log_surv = update_log_survival(log_surv, self.model.gate_logits(h[last]))
        exits = exit_mask(
            self._tensor(plan.loop), log_surv, self._tensor(plan.log1mq),
            self._tensor(plan.exit_lo) + 1, self._tensor(plan.exit_hi) + 1,
        )  # fmt: skip

        self.prev_hidden = h
        surv = torch.zeros(plan.num_tokens, dtype=torch.float32, device=self.device)
        surv[last] = log_surv
        self.prev_log_surv = surv
        exited = exits.to(torch.uint8).cpu().numpy()
        result = sample_exited(self.model, self.sampler, plan, h[last], exited, self.keep_logits)
        result.prompt_logprobs = prompt_logprobs(
            self.model, plan, h, self.num_loops, self.sampler.vocab_limit
        )
        return result

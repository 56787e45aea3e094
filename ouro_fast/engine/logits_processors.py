"""What a request may ask of its logits before sampling: logit_bias, min_tokens and the repetition, presence
and frequency penalties, applied batched on the logits' device, in vLLM's order.

Their state lives on the device, one row per KV slot (a running request holds one): the bias, the stop ids
that min_tokens holds back, the output token counts and the tokens seen (prompt and output). A slot's row is
built from the request's settings and tokens when the request first samples there (admission, or
readmission after preemption), and each sampled token adds itself on the device, so a decode step reads
nothing back and loops over no row in Python.

A request whose row cannot be built is set aside in `failed` (its logits stay as they are) and the
others are processed: the engine takes `failed` after the step and ends those requests alone.
"""

from __future__ import annotations

import numpy as np
import torch


class LogitsProcessors:
    """Per-request settings (indexed by rid) and the per-slot device state."""

    def __init__(self, capacity: int, num_slots: int, vocab: int, device: torch.device):
        self.vocab, self.num_slots, self.device = vocab, num_slots, torch.device(device)
        self.presence = np.zeros(capacity, np.float32)
        self.frequency = np.zeros(capacity, np.float32)
        self.repetition = np.ones(capacity, np.float32)
        self.min_tokens = np.zeros(capacity, np.int32)
        self.active = np.zeros(capacity, bool)  # rids that ask for any processor
        # rid -> (prompt ids, the live output list, logit_bias, stop ids): what a slot's row is built from.
        self.requests: dict[int, tuple] = {}
        self.owner = np.full(num_slots, -1, np.int64)  # the rid whose state a slot's row holds
        self._state: tuple[torch.Tensor, ...] | None = None  # allocated on first use
        self.failed: dict[int, str] = {}  # rid -> why its processor state failed, until take_failed()
        self.fault_hook = None  # test-only: called with each processed rid; what it raises fails that rid

    def add(self, rid: int, params, prompt_ids: list[int], output_ids: list[int], stop_ids) -> None:
        """Register a request's settings; its output list is read (not copied) when its slot row is built."""
        self.presence[rid] = params.presence_penalty
        self.frequency[rid] = params.frequency_penalty
        self.repetition[rid] = params.repetition_penalty
        self.min_tokens[rid] = params.min_tokens
        stops = sorted(stop_ids) if params.min_tokens else []
        asks = (params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0
                or params.logit_bias or stops)  # fmt: skip
        self.active[rid] = bool(asks)
        if asks:
            self.requests[rid] = (list(prompt_ids), output_ids, dict(params.logit_bias or {}), stops)

    def remove(self, rid: int) -> None:
        self.active[rid] = False
        self.requests.pop(rid, None)
        self.owner[self.owner == rid] = -1

    def any(self, rids: np.ndarray) -> bool:
        return bool(self.active[rids].any())

    def apply(
        self, logits: torch.Tensor, rids: np.ndarray, slots: np.ndarray, num_outputs: np.ndarray
    ) -> torch.Tensor:
        """New logits [rows, >= vocab] for rows of requests `rids` in KV slots `slots`, each having made
        `num_outputs` tokens so far; the rows that ask for nothing are unchanged."""
        rows = np.flatnonzero(self.active[rids])
        if len(rows) and (self.fault_hook is not None or (self.owner[slots[rows]] != rids[rows]).any()):
            rows = self._prepare(rows, rids, slots.astype(np.int64))
        if not len(rows):
            return logits
        rids, slots = rids[rows], slots[rows].astype(np.int64)
        counts, seen, bias, stop = self._state
        dev, v = self.device, self.vocab
        r, s = torch.from_numpy(rows).to(dev), torch.from_numpy(slots).to(dev)
        x = logits[r, :v] + bias[s]
        held = torch.from_numpy(num_outputs[rows] < self.min_tokens[rids]).to(dev)[:, None]
        x = x.masked_fill(held & stop[s], float("-inf"))
        rep = torch.from_numpy(self.repetition[rids]).to(dev)[:, None]
        x = torch.where(seen[s], torch.where(x > 0, x / rep, x * rep), x)
        c = counts[s].float()
        x = x - torch.from_numpy(self.frequency[rids]).to(dev)[:, None] * c
        x = x - torch.from_numpy(self.presence[rids]).to(dev)[:, None] * (c > 0).float()
        out = logits.clone()
        out[r, :v] = x
        return out

    def _prepare(self, rows: np.ndarray, rids: np.ndarray, slots: np.ndarray) -> np.ndarray:
        """Build the slot rows of requests sampling in a slot for the first time (rare); the rows whose
        request fails here are dropped and the request set aside in `failed`."""
        keep = []
        for row in rows.tolist():
            rid, slot = int(rids[row]), int(slots[row])
            try:
                if self.fault_hook is not None:
                    self.fault_hook(rid)
                if self.owner[slot] != rid:
                    self._build(slot, rid)
            except Exception as e:
                self.failed[rid] = f"its sampling state failed: {type(e).__name__}: {e}"
                self.remove(rid)
                continue
            keep.append(row)
        return np.asarray(keep, dtype=np.int64)

    def take_failed(self) -> dict[int, str]:
        """The requests set aside since the last call (rid -> why); the caller ends them."""
        failed, self.failed = self.failed, {}
        return failed

    def count(self, rids: np.ndarray, slots: np.ndarray, ids: np.ndarray) -> None:
        """Add the tokens just sampled to their slots' counts, on the device (only rows that ask for any)."""
        mine = self.active[rids] & (self.owner[slots] == rids)
        if mine.any():
            counts, seen, _, _ = self._state
            s = torch.from_numpy(slots[mine].astype(np.int64)).to(self.device)
            t = torch.from_numpy(ids[mine].astype(np.int64)).to(self.device)
            counts.index_put_((s, t), torch.ones_like(t, dtype=torch.int32), accumulate=True)
            seen[s, t] = True

    def _build(self, slot: int, rid: int) -> None:
        if self._state is None:
            n, v, dev = self.num_slots, self.vocab, self.device
            self._state = (
                torch.zeros(n, v, dtype=torch.int32, device=dev),  # output token counts
                torch.zeros(n, v, dtype=torch.bool, device=dev),  # prompt or output tokens
                torch.zeros(n, v, dtype=torch.float32, device=dev),  # logit_bias
                torch.zeros(n, v, dtype=torch.bool, device=dev),  # the ids min_tokens holds back
            )
        counts, seen, bias, stop = self._state
        prompt, output, logit_bias, stops = self.requests[rid]
        dev = self.device
        for t in (counts, seen, bias, stop):
            t[slot].zero_()
        out = torch.tensor(output, dtype=torch.int64, device=dev)
        counts[slot].index_add_(0, out, torch.ones_like(out, dtype=torch.int32))
        seen[slot, torch.tensor(prompt, dtype=torch.int64, device=dev)] = True
        seen[slot] |= counts[slot] > 0
        if logit_bias:
            ids = torch.tensor([int(t) for t in logit_bias], dtype=torch.int64, device=dev)
            bias[slot].index_put_(
                (ids,), torch.tensor(list(logit_bias.values()), device=dev), accumulate=True
            )
        if stops:
            stop[slot, torch.tensor([t for t in stops if t < self.vocab], dtype=torch.int64, device=dev)] = (
                True
            )
        self.owner[slot] = rid

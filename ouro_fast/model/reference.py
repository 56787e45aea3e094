"""The dense reference: Ouro written straight from the spec, for one sequence, as the engine's oracle.

It shares no code with ouro.py or attention.py (only the weights): contiguous K/V
per (loop, layer) plane, explicit softmax, no paging, no batching. Decoding runs
each token loop by loop, applies the exit rule after every loop, and copies the
exited token's K/V into the deeper planes it skipped (last-exited propagation).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from .config import OuroConfig
from .exit_rule import exit_loop, first_exit


@dataclass
class Generation:
    tokens: list[int] = field(default_factory=list)
    exit_loops: list[int] = field(default_factory=list)
    logits: list[torch.Tensor] = field(default_factory=list)  # the exit loop's logits per output token


class DenseReference:
    def __init__(
        self,
        weights: dict[str, torch.Tensor],
        cfg: OuroConfig,
        max_len: int = 512,
        vocab_limit: int | None = None,
        device: str | torch.device = "cpu",
    ):
        self.device = torch.device(device)  # fp32 throughout; a GPU only makes it faster
        self.w = {k: v.detach().to(self.device, torch.float32) for k, v in weights.items()}
        self.cfg = cfg
        self.vocab_limit = vocab_limit  # ids at or above it are never produced (tokenizer smaller than vocab)
        self.max_len = max_len
        self.reset()

    def reset(self) -> None:
        c = self.cfg
        shape = (c.total_ut_steps, c.num_hidden_layers, self.max_len, c.num_key_value_heads, c.head_dim)
        self.k = torch.zeros(shape, device=self.device)
        self.v = torch.zeros(shape, device=self.device)

    def _rms(self, x, name):
        return self.w[name] * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + self.cfg.rms_norm_eps))

    def _rope(self, x, positions):
        d = x.shape[-1]
        half = d // 2
        i = torch.arange(half, dtype=torch.float64, device=x.device)
        angle = positions.double()[:, None] * self.cfg.rope_theta ** (-2.0 * i / d)
        cos, sin = angle.cos().float()[:, None, :], angle.sin().float()[:, None, :]
        x1, x2 = x[..., :half], x[..., half:]
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def _attend(self, q, loop, layer, end, start):
        c = self.cfg
        group = c.num_attention_heads // c.num_key_value_heads
        keys = self.k[loop, layer, :end].repeat_interleave(group, dim=1)
        vals = self.v[loop, layer, :end].repeat_interleave(group, dim=1)
        scores = torch.einsum("nhd,shd->hns", q, keys) / math.sqrt(c.head_dim)
        q_pos = torch.arange(start, start + q.shape[0], device=q.device)[:, None]
        scores = scores.masked_fill(torch.arange(end, device=q.device)[None, :] > q_pos, float("-inf"))
        return torch.einsum("hns,shd->nhd", scores.softmax(-1), vals)

    def _loop(self, h, start, loop):
        """One loop over all layers for tokens at positions start..start+n-1, writing plane `loop`."""
        c, w = self.cfg, self.w
        n = h.shape[0]
        end = start + n
        positions = torch.arange(start, end, device=h.device)
        for layer in range(c.num_hidden_layers):
            p = f"model.layers.{layer}."
            x = self._rms(h, p + "input_layernorm.weight")
            q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, c.num_attention_heads, c.head_dim)
            k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, c.num_key_value_heads, c.head_dim)
            q, k = self._rope(q, positions), self._rope(k, positions)
            self.k[loop, layer, start:end], self.v[loop, layer, start:end] = k, v
            a = self._attend(q, loop, layer, end, start).reshape(n, -1) @ w[p + "self_attn.o_proj.weight"].T
            h = h + self._rms(a, p + "input_layernorm_2.weight")
            m = self._rms(h, p + "post_attention_layernorm.weight")
            gate, up = m @ w[p + "mlp.gate_proj.weight"].T, m @ w[p + "mlp.up_proj.weight"].T
            mlp = (torch.nn.functional.silu(gate) * up) @ w[p + "mlp.down_proj.weight"].T
            h = h + self._rms(mlp, p + "post_attention_layernorm_2.weight")
        return self._rms(h, "model.norm.weight")

    def _gate(self, h):
        return (h @ self.w["model.early_exit_gate.weight"].T + self.w["model.early_exit_gate.bias"]).squeeze(
            -1
        )

    def _logits(self, h):
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return h @ head.T

    def prefill(self, ids: list[int], start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Run tokens at positions start.. through ALL loops; returns logits [T, n, V] and gates [T, n]."""
        h = self.w["model.embed_tokens.weight"][torch.tensor(ids, device=self.device)]
        logits, gates = [], []
        for loop in range(self.cfg.total_ut_steps):
            h = self._loop(h, start, loop)
            logits.append(self._logits(h))
            gates.append(self._gate(h))
        return torch.stack(logits), torch.stack(gates)

    def generate(
        self,
        prompt: list[int],
        max_new_tokens: int,
        threshold: float | None = None,
        min_loops: int = 1,
        max_loops: int | None = None,
        choose=None,
    ) -> Generation:
        """Greedy generation with per-token early exit and last-exited propagation. `choose(logits, tokens)`
        picks each token from the exit loop's logits and the tokens so far (default: the argmax)."""
        c = self.cfg
        threshold = c.early_exit_threshold if threshold is None else threshold
        max_loops = c.total_ut_steps if max_loops is None else max_loops
        self.reset()
        out = Generation()
        self._choose = choose or (lambda logits, tokens: int(logits.argmax()))
        logits, gates = self.prefill(prompt)
        # The prompt ran every loop; its last token's output is read at the loop the rule picks.
        e = exit_loop(gates[:, -1].tolist(), threshold, min_loops, max_loops)
        self._emit(out, logits[e, -1], e)
        pos = len(prompt)
        while len(out.tokens) < max_new_tokens:
            h = self.w["model.embed_tokens.weight"][torch.tensor([out.tokens[-1]], device=self.device)]
            seen: list[float] = []
            for loop in range(c.total_ut_steps):
                h = self._loop(h, pos, loop)
                seen.append(float(self._gate(h)[0]))
                if first_exit(seen, threshold, min_loops, max_loops) is not None:
                    break
            # Deeper planes get this token's K/V from its exit loop.
            self.k[loop + 1 :, :, pos] = self.k[loop, :, pos]
            self.v[loop + 1 :, :, pos] = self.v[loop, :, pos]
            self._emit(out, self._logits(h)[0], loop)
            pos += 1
        return out

    def _emit(self, out: Generation, logits: torch.Tensor, loop: int) -> None:
        if self.vocab_limit is not None:
            logits = logits.clone()
            logits[self.vocab_limit :] = float("-inf")
        out.tokens.append(self._choose(logits, out.tokens))
        out.exit_loops.append(loop)
        out.logits.append(logits)

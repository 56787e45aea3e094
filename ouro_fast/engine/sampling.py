"""Per-request sampling parameters and the batched token sampler."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch

from .plan import StepPlan, StepResult, TokenLogprobs
from .structured import StructuredOutput

# Temperatures below this sample greedily: logits / temperature would overflow float32.
GREEDY_EPS = 1e-5
MAX_LOGPROBS = 20  # the most top log-probabilities a token reports, as OpenAI's API allows
_MASK64 = (1 << 64) - 1


@dataclass
class SamplingParams:
    """What a request asks of the sampler, the stop conditions and Ouro's exit policy.

    min_loops / max_loops / exit_threshold: None means the model defaults
    (1, num_loops, config.early_exit_threshold). top_k 0 or -1 means off.
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False  # the text keeps the stop string that ended it
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    min_loops: int | None = None
    max_loops: int | None = None
    exit_threshold: float | None = None
    # Log-probabilities of each sampled token and of the `logprobs` most likely ones (0: the sampled
    # token's alone), from the logits that chose it, before temperature; None: none.
    logprobs: int | None = None
    # The same for each prompt token (from the prompt's last loop; the first token has none); None: none.
    prompt_logprobs: int | None = None
    # Logits processors, as vLLM applies them (engine/logits_processors.py), and min_p after temperature.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    min_tokens: int = 0
    logit_bias: dict[int, float] | None = None  # token id -> added to its logit
    # What the output must match (a JSON schema, a regex, ...): engine/structured.py; None: anything.
    structured: StructuredOutput | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self, num_loops: int) -> None:
        """Raises ValueError naming the first bad field; returns None when all are valid."""
        _check(
            _is_int(self.max_tokens) and self.max_tokens >= 1,
            "max_tokens",
            "an integer >= 1",
            self.max_tokens,
        )
        _check(
            _is_real(self.temperature) and 0 <= self.temperature <= 3.0e38,  # stays finite in float32
            "temperature",
            "a finite number >= 0",
            self.temperature,
        )
        _check(_is_real(self.top_p) and 0 < self.top_p <= 1, "top_p", "in (0, 1]", self.top_p)
        _check(
            _is_int(self.top_k) and -1 <= self.top_k < 2**31, "top_k", "an integer in [-1, 2**31)", self.top_k
        )
        if self.seed is not None:
            _check(
                _is_int(self.seed) and 0 <= self.seed < 2**63, "seed", "an integer in [0, 2**63)", self.seed
            )
        _check(
            isinstance(self.stop, (list, tuple)) and all(isinstance(s, str) and s for s in self.stop),
            "stop",
            "a list of non-empty strings",
            self.stop,
        )
        _check(
            isinstance(self.stop_token_ids, (list, tuple))
            and all(_is_int(t) and t >= 0 for t in self.stop_token_ids),
            "stop_token_ids",
            "a list of integers >= 0",
            self.stop_token_ids,
        )
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None:
                ok = _is_int(value) and 0 <= value <= MAX_LOGPROBS
                _check(ok, name, f"an integer in [0, {MAX_LOGPROBS}]", value)
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_is_real(value) and -2 <= value <= 2, name, "in [-2, 2]", value)
        rep = self.repetition_penalty
        _check(_is_real(rep) and 0 < rep <= 100, "repetition_penalty", "in (0, 100]", rep)
        _check(_is_real(self.min_p) and 0 <= self.min_p <= 1, "min_p", "in [0, 1]", self.min_p)
        ok = _is_int(self.min_tokens) and 0 <= self.min_tokens <= self.max_tokens
        _check(ok, "min_tokens", f"an integer in [0, max_tokens={self.max_tokens}]", self.min_tokens)
        bias = self.logit_bias or {}
        ok = isinstance(bias, dict) and all(_is_int(t) and t >= 0 and _is_real(v) and -100 <= v <= 100
                                            for t, v in bias.items())  # fmt: skip
        _check(ok, "logit_bias", "a map of token ids to numbers in [-100, 100]", self.logit_bias)
        if self.structured is not None:
            ok = isinstance(self.structured, StructuredOutput)
            _check(ok, "structured", "a StructuredOutput", self.structured)
            self.structured.validate()
        lo = 1 if self.min_loops is None else self.min_loops
        hi = num_loops if self.max_loops is None else self.max_loops
        _check(_is_int(lo) and 1 <= lo <= num_loops, "min_loops", f"an integer in [1, {num_loops}]", lo)
        _check(_is_int(hi) and lo <= hi <= num_loops, "max_loops", f"an integer in [{lo}, {num_loops}]", hi)
        if self.exit_threshold is not None:
            _check(
                _is_real(self.exit_threshold) and 0 <= self.exit_threshold <= 1,
                "exit_threshold",
                "in [0, 1]",
                self.exit_threshold,
            )

    def exit_policy(self, num_loops: int, default_threshold: float) -> tuple[int, int, float]:
        """(min_loops, max_loops, exit_threshold) of validated params, with the model defaults filled in."""
        lo = 1 if self.min_loops is None else self.min_loops
        hi = num_loops if self.max_loops is None else self.max_loops
        q = default_threshold if self.exit_threshold is None else self.exit_threshold
        return lo, hi, float(q)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_real(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _check(ok: bool, name: str, expected: str, got: object) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {got!r}")


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def row_seed(seed: int, output_index: int) -> int:
    """The generator seed for token `output_index` of a request seeded with `seed`."""
    return _splitmix64(_splitmix64(seed) ^ output_index) & ((1 << 63) - 1)


class Sampler:
    """Samples one token id per row of a logits batch.

    Ids >= vocab_limit are never produced. Greedy rows (temperature < GREEDY_EPS)
    take the argmax; other rows sample from softmax(logits / temperature) after
    top-k then top-p filtering, by the Gumbel-max trick. A seeded row's token
    depends only on its logits, parameters, seed and output_index, never on
    the rest of the batch; unseeded rows draw from the sampler's own generator.

    With fused=True (the GPU runner), a batch whose rows are all greedy or plain
    unseeded temperature sampling (no top-k, top-p or seed) takes one Triton launch
    (kernels.sample.sample_gumbel): same distribution, its noise from Philox streams
    keyed by the sampler seed and a per-call counter instead of the torch generator.
    """

    def __init__(self, vocab_limit: int, device: torch.device | str, seed: int = 0, fused: bool = False):
        if vocab_limit < 1:
            raise ValueError(f"vocab_limit must be >= 1, got {vocab_limit}")
        self.vocab_limit = vocab_limit
        self.device = torch.device(device)
        self._generator = torch.Generator(device=self.device)
        self._generator.manual_seed(seed)
        # One generator reseeded per seeded row: no allocation per row.
        self._row_generator = torch.Generator(device=self.device)
        self.fused = fused
        self._seed = seed
        self._fused_calls = 0
        self._pinned: tuple[torch.Tensor, torch.Tensor] | None = None

    def __call__(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_p: torch.Tensor,
        top_k: torch.Tensor,
        seeds: list[int | None],
        output_index: list[int],
        min_p: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """logits [R, V]; temperature, top_p, top_k, min_p [R] (on the CPU they cost no device sync);
        seeds and output_index: one entry per row. Returns int64 ids [R] on logits' device."""
        rows = logits.shape[0]
        if not (len(temperature) == len(top_p) == len(top_k) == len(seeds) == len(output_index) == rows):
            raise ValueError(
                "temperature, top_p, top_k, seeds and output_index need one entry per logits row"
            )
        vocab = min(self.vocab_limit, logits.shape[1])
        uses_min_p = min_p is not None and bool((min_p > 0).any())
        if self.fused and rows and not uses_min_p and self._plain(temperature, top_p, top_k, seeds):
            return self._fused_sample(logits, temperature, vocab)
        x = logits[:, :vocab].float()
        ids = x.argmax(dim=-1)
        temp_cpu = temperature.detach().to("cpu", torch.float32)
        sampled = (temp_cpu >= GREEDY_EPS).nonzero().flatten().tolist()
        if not sampled:
            return ids
        top_k_cpu = top_k.detach().to("cpu", torch.int64)[sampled]
        top_p_cpu = top_p.detach().to("cpu", torch.float32)[sampled]
        device = x.device
        index = torch.tensor(sampled, device=device)
        scaled = x[index] / temp_cpu[sampled].to(device)[:, None]
        if uses_min_p:
            scaled = mask_min_p(scaled, min_p.detach().to("cpu", torch.float32)[sampled].to(device))
        if bool((top_k_cpu > 0).any()) or bool((top_p_cpu < 1).any()):
            scaled = mask_top_k_top_p(scaled, top_k_cpu.to(device), top_p_cpu.to(device))
        noise = self._uniform_noise(
            scaled.shape, [seeds[r] for r in sampled], [output_index[r] for r in sampled]
        )
        gumbel = -torch.log(-torch.log(noise.clamp_(min=torch.finfo(torch.float32).tiny)))
        ids[index] = (scaled + gumbel).argmax(dim=-1)
        return ids

    @staticmethod
    def _plain(temperature, top_p, top_k, seeds) -> bool:
        """Every row greedy or unfiltered, unseeded sampling: the fused kernel's domain."""
        if any(s is not None for s in seeds):
            return False
        sampled = temperature.detach().cpu() >= GREEDY_EPS
        return not bool(
            ((top_k.detach().cpu() > 0) & sampled).any() or ((top_p.detach().cpu() < 1) & sampled).any()
        )

    def _fused_sample(self, logits: torch.Tensor, temperature: torch.Tensor, vocab: int) -> torch.Tensor:
        from ..kernels.sample import sample_gumbel  # here: triton is needed only by the GPU runner

        rows = logits.shape[0]
        # Per-row Philox seeds from (sampler seed, call, row): deterministic for a given engine seed.
        base = row_seed(self._seed, self._fused_calls)
        self._fused_calls += 1
        seeds = [row_seed(base, r) for r in range(rows)]
        temps, seed_t = self._staged(rows)
        temps[:rows] = temperature.detach().to("cpu", torch.float32)
        seed_t[:rows] = torch.tensor(seeds, dtype=torch.int64)
        dev = logits.device
        # Pinned sources: the copies queue behind the logits instead of waiting for them.
        t_dev = temps[:rows].to(dev, non_blocking=True)
        s_dev = seed_t[:rows].to(dev, non_blocking=True)
        return sample_gumbel(logits, t_dev, s_dev, GREEDY_EPS, vocab)

    def _staged(self, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        # Reused between calls: each call's ids are read back (a sync) before the next call fills them.
        if self._pinned is None or self._pinned[0].numel() < rows:
            pin = self.device.type == "cuda"
            n = max(64, rows)
            self._pinned = (torch.empty(n, dtype=torch.float32, pin_memory=pin),
                            torch.empty(n, dtype=torch.int64, pin_memory=pin))  # fmt: skip
        return self._pinned

    def _uniform_noise(
        self, shape: torch.Size, seeds: list[int | None], output_index: list[int]
    ) -> torch.Tensor:
        """Uniform [0, 1) noise, one row per sampled row; seeded rows from their own stream."""
        noise = torch.empty(shape, dtype=torch.float32, device=self.device)
        unseeded = [i for i, s in enumerate(seeds) if s is None]
        if len(unseeded) == len(seeds):
            return noise.uniform_(generator=self._generator)
        if unseeded:
            draw = torch.empty((len(unseeded), shape[1]), dtype=torch.float32, device=self.device)
            noise[torch.tensor(unseeded, device=self.device)] = draw.uniform_(generator=self._generator)
        for i, s in enumerate(seeds):
            if s is not None:
                self._row_generator.manual_seed(row_seed(s, output_index[i]))
                noise[i].uniform_(generator=self._row_generator)
        return noise


def mask_min_p(scaled: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf every token less probable than min_p times the likeliest one (after temperature)."""
    probs = scaled.softmax(dim=-1)
    keep = probs >= min_p[:, None] * probs.max(dim=-1, keepdim=True).values
    return scaled.masked_fill(~keep, -math.inf)


def mask_top_k_top_p(scaled: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Masks to -inf all but each row's top_k logits (k <= 0: all), then all but the smallest
    prefix of those, by probability, whose mass reaches top_p (always at least one token)."""
    vocab = scaled.shape[1]
    # Stable, so equal logits keep index order and top_k=1 agrees with argmax.
    sorted_logits, order = scaled.sort(dim=-1, descending=True, stable=True)
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), vocab)
    drop = torch.arange(vocab, device=scaled.device)[None, :] >= k[:, None]
    probs = sorted_logits.masked_fill(drop, -math.inf).softmax(dim=-1)
    mass_before = probs.cumsum(dim=-1) - probs
    # Rows with top_p == 1 skip the test: cumsum rounding could otherwise drop their tail.
    drop |= (mass_before >= top_p[:, None]) & (top_p[:, None] < 1)
    drop[:, 0] = False
    mask = torch.empty_like(drop).scatter_(1, order, drop)
    return scaled.masked_fill(mask, -math.inf)


def sample_exited(
    model, sampler: Sampler, plan: StepPlan, h_last: torch.Tensor, exited: np.ndarray, keep_logits: bool
) -> StepResult:
    """lm_head and the sampler for a StepPlan's rows whose last token exited (exited: uint8 [R] on the host);
    returns the step's StepResult. h_last [R, hidden]: each row's last token's output."""
    sampled = np.zeros(plan.num_rows, dtype=np.int32)
    rows = np.flatnonzero(exited)
    kept = logprobs = None
    if rows.size:
        rids = plan.rid[rows]
        # All rows exited (full depth): no gather, and no index copy that would wait for the stream.
        h = h_last if rows.size == plan.num_rows else h_last[torch.from_numpy(rows).to(h_last.device)]
        logits = model.logits(h).float()
        s = plan.sampling
        slots = plan.kv_slot[rows]
        proc = s.processors
        chosen = logits
        if proc is not None and proc.any(rids):
            chosen = proc.apply(logits, rids, slots, s.num_outputs[rids])
        if s.grammars is not None and s.grammars.any(rids):
            chosen = s.grammars.apply(chosen, rids)
        seeds = [None if v < 0 else int(v) for v in s.seed[rids]]
        ids = sampler(
            chosen,
            torch.from_numpy(s.temperature[rids]),
            torch.from_numpy(s.top_p[rids]),
            torch.from_numpy(s.top_k[rids]),
            seeds,
            s.num_outputs[rids].tolist(),
            torch.from_numpy(s.min_p[rids]),
        )
        sampled[rows] = ids.cpu().numpy()
        if proc is not None:
            proc.count(rids, slots, sampled[rows])
        if (s.logprobs[rids] >= 0).any():
            logprobs = token_logprobs(logits, sampled[rows], rids, s.logprobs[rids], sampler.vocab_limit)
        if keep_logits:
            kept = {int(row): logits[i].cpu() for i, row in enumerate(rows)}
    return StepResult(exited, sampled, kept, logprobs)


def token_logprobs(
    logits: torch.Tensor, ids: np.ndarray, rids: np.ndarray, wanted: np.ndarray, vocab: int
) -> dict[int, TokenLogprobs]:
    """rid -> the sampled token's log-probability and the `wanted` most likely ones, for the rows that want
    them (wanted >= 0), from float32 logits [rows, >= vocab] before temperature."""
    rows = np.flatnonzero(wanted >= 0)
    index = torch.from_numpy(rows).to(logits.device)
    lp = torch.log_softmax(logits[index, :vocab], dim=-1)
    chosen = lp.gather(1, torch.from_numpy(ids[rows].astype(np.int64)).to(lp.device)[:, None])
    rank = (lp > chosen).sum(dim=-1) + 1
    k = int(wanted[rows].max())
    top_lp, top_ids = lp.topk(k, dim=-1) if k else (lp[:, :0], lp[:, :0].long())
    chosen, rank, top_lp, top_ids = chosen[:, 0].tolist(), rank.tolist(), top_lp.tolist(), top_ids.tolist()
    out = {}
    for i, r in enumerate(rows):
        n = int(wanted[r])
        out[int(rids[r])] = TokenLogprobs(chosen[i], rank[i], top_ids[i][:n], top_lp[i][:n])
    return out


def prompt_logprobs(model, plan: StepPlan, hidden: torch.Tensor, num_loops: int, vocab: int) -> dict | None:
    """rid -> [(position, TokenLogprobs)] of the prompt tokens whose predicting position this step finished:
    the rows of requests that want prompt logprobs, at the prompt's last loop. hidden [N, ...]: the step's
    output per token. Positions already reported (a recomputed prompt) are not reported again."""
    s = plan.sampling
    table = s.prompt_logprobs
    rows = [
        r
        for r in np.flatnonzero(plan.loop == num_loops - 1)
        if table[plan.rid[r]] >= 0 and not plan.decode[r]
    ]
    out: dict[int, list] = {}
    for r in rows:
        rid = int(plan.rid[r])
        prompt = s.prompts[rid]
        start, length, off = int(plan.start[r]), int(plan.length[r]), int(plan.tok_off[r])
        # Position p's logits predict prompt token p + 1; the prompt's last position predicts the reply.
        first = max(start, int(s.prompt_done[rid]))
        last = min(start + length, len(prompt) - 1)
        if last <= first:
            continue
        targets = np.asarray(prompt[first + 1 : last + 1], np.int32)
        logits = model.logits(hidden[off + first - start : off + last - start]).float()
        wanted = np.full(len(targets), table[rid], np.int32)
        lps = token_logprobs(logits, targets, np.arange(len(targets)), wanted, vocab)
        out[rid] = [(first + 1 + i, lps[i]) for i in range(len(targets))]
        s.prompt_done[rid] = last
    return out or None

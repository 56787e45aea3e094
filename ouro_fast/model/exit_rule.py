"""Ouro's early-exit rule, in float32.

lambda_t = sigmoid(g_t); a token exits at the first loop t whose cumulative exit
probability CDF_t = 1 - prod_{j<=t}(1 - lambda_j) reaches the threshold q,
clamped to [min_loops, max_loops] loops. We track the survival S_t = 1 - CDF_t
in log space (log S_t = sum_j logsigmoid(-g_j)), so that CDF_t >= q becomes
log S_t <= log(1 - q): no rounding of the CDF up to 1.0, and q >= 1.0 never exits
before max_loops. min_loops and max_loops are loop COUNTS (1..T).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def log_one_minus(threshold: float) -> float:
    """log(1 - q): -inf for q >= 1 (never exit early), +inf for q <= 0 (exit at min_loops)."""
    if threshold >= 1.0:
        return -math.inf
    if threshold <= 0.0:
        return math.inf
    return math.log1p(-threshold)


def update_log_survival(log_surv: torch.Tensor, gate_logit: torch.Tensor) -> torch.Tensor:
    """log S_t = log S_{t-1} + log(1 - sigmoid(g_t)), in float32."""
    return log_surv.float() + F.logsigmoid(-gate_logit.float())


def exit_mask(
    loop_idx: torch.Tensor,
    log_surv: torch.Tensor,
    log1mq: torch.Tensor,
    min_loops: torch.Tensor,
    max_loops: torch.Tensor,
) -> torch.Tensor:
    """Whether each token exits after 0-based loop `loop_idx`, given log S up to that loop."""
    done = loop_idx + 1
    reached = (log1mq > -math.inf) & (log_surv <= log1mq)
    return (done >= max_loops) | ((done >= min_loops) & reached)


def first_exit(gate_logits: list[float], threshold: float, min_loops: int, max_loops: int) -> int | None:
    """0-based loop at which a token with these per-loop gate logits exits; None if it runs past them."""
    log1mq = log_one_minus(threshold)
    log_surv = torch.zeros((), dtype=torch.float32)
    for t, g in enumerate(gate_logits):
        log_surv = update_log_survival(log_surv, torch.tensor(g, dtype=torch.float32))
        n = t + 1
        if n >= max_loops or (n >= min_loops and log1mq > -math.inf and float(log_surv) <= log1mq):
            return t
    return None


def exit_loop(gate_logits: list[float], threshold: float, min_loops: int, max_loops: int) -> int:
    """0-based exit loop of one token given all T gate logits (the last loop if none triggers)."""
    t = first_exit(gate_logits, threshold, min_loops, max_loops)
    return len(gate_logits) - 1 if t is None else t

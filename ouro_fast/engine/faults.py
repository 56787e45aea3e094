"""Test-only fault injection: one stage of the engine step raises for a chosen request.

Off by default: only EngineConfig.test_faults (the server's OURO_FAST_TEST_FAULTS) arms it, and the
engine logs a warning when it does. The spec is "STAGE:SEED@TOKENS,...": once a request whose
sampling seed is SEED has received TOKENS tokens (0: at once), STAGE raises InjectedFault for it,
once per request, where a real failure of that stage would. Batch stages (the step's plan, the
model call, the scheduler update) fail every request holding KV; request stages (its sampling
state, its detokenization, its output) fail that request alone. The sample stage runs in the
logits processors, so it fires only for requests that ask for one (a penalty, logit_bias, min_tokens).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

BATCH_STAGES = ("schedule", "execute", "update")
REQUEST_STAGES = ("sample", "detokenize", "output")
STAGES = BATCH_STAGES + REQUEST_STAGES


class InjectedFault(RuntimeError):
    """What an armed stage raises in place of a real failure."""


@dataclass(frozen=True)
class Fault:
    stage: str
    seed: int
    tokens: int


def parse_faults(spec: str) -> tuple[Fault, ...]:
    """The faults of a "STAGE:SEED@TOKENS,..." spec; ValueError naming the part that is not one."""
    faults = []
    for part in filter(None, (p.strip() for p in spec.split(","))):
        stage, _, rest = part.partition(":")
        seed, _, tokens = rest.partition("@")
        try:
            fault = Fault(stage.strip(), int(seed), int(tokens or 0))
        except ValueError:
            fault = None
        if fault is None or fault.stage not in STAGES or fault.tokens < 0:
            raise ValueError(
                f"test fault {part!r} is not STAGE:SEED@TOKENS with STAGE one of {', '.join(STAGES)}"
            )
        faults.append(fault)
    return tuple(faults)


class FaultInjector:
    """The armed faults of one engine; `fire` is called at each stage with the requests it handles."""

    def __init__(self, faults: tuple[Fault, ...] = ()):
        self.armed = {(f.stage, f.seed): f.tokens for f in faults}
        self.stages = frozenset(f.stage for f in faults)
        self.fired: Counter[str] = Counter()  # stage -> faults raised
        self._done: set[tuple[str, str]] = set()  # (request id, stage) already fired

    def fire(self, stage: str, requests) -> None:
        """Raise InjectedFault for the first of `requests` (engine Requests) armed at this stage."""
        if stage not in self.stages:
            return
        for req in requests:
            tokens = self.armed.get((stage, req.params.seed))
            if tokens is None or len(req.output_ids) < tokens or (req.request_id, stage) in self._done:
                continue
            self._done.add((req.request_id, stage))
            self.fired[stage] += 1
            raise InjectedFault(f"injected {stage} fault for request {req.request_id} (test_faults)")

    def forget(self, request_id: str) -> None:
        """The request has ended: its entries go (request ids may be reused)."""
        if self._done:
            self._done -= {(request_id, stage) for stage in self.stages}

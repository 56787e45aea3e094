"""IncrementalDetokenizer: per-step text deltas for every running request, from sampled token ids.

The engine-owner thread calls `step` once per engine step with the ids each
request sampled; it returns each request's text delta. All decodes of a step go
to the tokenizer in at most two `decode_batch` calls (one per skip_special_tokens
setting in use). The per-token decisions (offsets, UTF-8 and stop holdback) live
in the compiled core, ouro_fast.core.detok, whose rules are documented there.

For a byte-level BPE tokenizer (Ouro's), the deltas of a request plus its
`finish` flush concatenate to exactly tokenizer.decode(output_ids,
skip_special_tokens=...), cut before the first stop string to appear in it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from types import ModuleType
from typing import Protocol

from ouro_fast.core import detok as compiled_core

# Trailing prompt tokens decoded as context for the first output tokens (vLLM uses 5 too).
SEED_TOKENS = 5


class Decoder(Protocol):
    """What IncrementalDetokenizer needs from a tokenizer (tokenizers.Tokenizer has it)."""

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...

    def decode_batch(self, sequences: list[list[int]], skip_special_tokens: bool = True) -> list[str]: ...


def special_ids(tokenizer: object) -> frozenset[int]:
    """Ids that skip_special_tokens=True drops, when the tokenizer tells (tokenizers.Tokenizer does)."""
    added = getattr(tokenizer, "get_added_tokens_decoder", None)
    if added is None:
        return frozenset()
    return frozenset(i for i, tok in added().items() if getattr(tok, "special", False))


class IncrementalDetokenizer:
    """Turns each running request's sampled ids into text deltas, one batch per engine step.

    Only the engine-owner thread may call it. Keys are request keys (ints).
    """

    def __init__(self, tokenizer: Decoder, core: ModuleType | None = None):
        """tokenizer: a tokenizers.Tokenizer or anything with its decode/decode_batch;
        core: the module holding DetokState (the compiled one unless the twin is passed)."""
        self._tokenizer = tokenizer
        self._core = core if core is not None else compiled_core
        self._special = special_ids(tokenizer)
        self._states: dict[int, object] = {}
        self.fault_hook = None  # test-only: called with each key given to step; what it raises fails that key

    def add(
        self,
        key: int,
        prompt_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: Iterable[str] = (),
        include_stop: bool = False,
    ) -> None:
        """Start a request. Empty stop strings are ignored; a key already present is a ValueError.
        include_stop: the text keeps the stop string that ended it."""
        if key in self._states:
            raise ValueError(f"request {key} is already being detokenized")
        skip_ids = self._special if skip_special_tokens else frozenset()
        seed, seed_chars = self._seed(prompt_ids, skip_special_tokens, skip_ids)
        stops = tuple(s for s in stop if s)
        self._states[key] = self._core.DetokState(
            seed, seed_chars, skip_special_tokens, skip_ids, stops, include_stop
        )

    def _seed(self, prompt_ids: Sequence[int], skip: bool, skip_ids: frozenset[int]) -> tuple[list[int], int]:
        """The prompt's last tokens as context, shortened until they end on a whole character.

        A seed ending inside a UTF-8 character would let the first output bytes complete it,
        and the output text would then differ from decoding the output ids alone.
        """
        seed = [i for i in prompt_ids[-SEED_TOKENS:] if i not in skip_ids]
        text = self._tokenizer.decode(seed, skip_special_tokens=skip) if seed else ""
        while seed and text.endswith(self._core.REPLACEMENT_CHAR):
            seed.pop()
            text = self._tokenizer.decode(seed, skip_special_tokens=skip) if seed else ""
        return seed, len(text)

    def step(
        self, updates: Mapping[int, Sequence[int]], failed: dict[int, Exception] | None = None
    ) -> dict[int, tuple[str, bool]]:
        """Append each request's new ids; return key -> (text delta, stop_hit) for every key given,
        in the order given. A key that was never added is a KeyError.

        stop_hit stays True once a stop string was found; ids given after that are ignored.
        failed: when given, a key whose ids, decode or stop check raise is left out of the result and
        put here with its error, and the other keys go on; otherwise the first error is raised.
        """
        groups: dict[bool, tuple[list[int], list[object]]] = {True: ([], []), False: ([], [])}
        errors: dict[int, Exception] = {}
        for key, ids in updates.items():
            state = self._states[key]
            try:
                if self.fault_hook is not None:
                    self.fault_hook(key)
                # The tokenizer wants Python ints: convert anything else (e.g. a numpy row) once here.
                state.extend(ids if type(ids) is list else [int(i) for i in ids])
            except Exception as e:
                errors[key] = e
                continue
            keys, states = groups[state.skip_special_tokens]
            keys.append(key)
            states.append(state)
        results: dict[int, tuple[str, bool]] = dict.fromkeys(k for k in updates if k not in errors)
        for skip, (keys, states) in groups.items():
            if states:
                for key, state, delta in zip(keys, states, self._decode_each(states, skip)):
                    if isinstance(delta, Exception):
                        errors[key] = delta
                        del results[key]
                    else:
                        results[key] = (delta, state.stopped)
        if errors and failed is None:
            raise next(iter(errors.values()))
        if failed is not None:
            failed.update(errors)
        return results

    def _decode_each(self, states: list, skip: bool) -> list:
        """Each state's delta, or the exception its own decode or stop check raised."""
        try:
            windows = self._core.plan_windows(states)
            texts = self._tokenizer.decode_batch(windows, skip_special_tokens=skip) if windows else []
        except Exception:
            return [self._decode_one(state, skip) for state in states]  # find whose decode fails
        return self._core.apply_decoded(states, texts, False)

    def _decode_one(self, state, skip: bool):
        try:
            return self._decode([state], skip, final=False)[0]
        except Exception as e:
            return e

    def finish(self, key: int) -> str:
        """Flush the request: the text still held back, cut at a stop string if one appears in it.

        Nothing more is emitted for it afterwards; call `remove` to forget it.
        """
        state = self._states[key]
        return self._decode([state], state.skip_special_tokens, final=True)[0]

    def _decode(self, states: list, skip: bool, final: bool) -> list[str]:
        windows = self._core.plan_windows(states)
        texts = self._tokenizer.decode_batch(windows, skip_special_tokens=skip) if windows else []
        deltas = self._core.apply_decoded(states, texts, final)
        for delta in deltas:
            if isinstance(delta, Exception):
                raise delta
        return deltas

    def stopped(self, key: int) -> bool:
        """Whether a stop string ended the request's text."""
        return self._states[key].stopped

    def text(self, key: int) -> str:
        """All text emitted for the request so far (deltas and flush)."""
        return self._states[key].text()

    def remove(self, key: int) -> None:
        """Forget the request; removing an unknown key does nothing."""
        self._states.pop(key, None)

    def __len__(self) -> int:
        return len(self._states)

    def __contains__(self, key: int) -> bool:
        return key in self._states

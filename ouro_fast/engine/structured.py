"""Structured output: a grammar (a JSON schema, any JSON object, a regex, a choice, an EBNF grammar) decides
which tokens a request may sample next.

xgrammar compiles each distinct grammar once against the tokenizer's vocabulary (GrammarCache: the most
recently used MAX_COMPILED, by spec). The server compiles a request's grammar on a worker thread before the
request reaches the engine, so an invalid one is a 400 and the engine-owner thread finds it compiled. Each
request that asks for one holds a matcher that advances with every token the request accepts. Its row of a
token bitmask for the next token is filled by a worker thread while the device runs the next loops: the
engine starts the fill (`start_fill`) right after a step and waits for it (`wait_fill`) only where a row may
sample next; with early exit the token may be sampled at any later loop. Rows due together are filled in
one call on xgrammar's threads (half the host's cores), outside the GIL, so the engine-owner thread and the
server's event loop go on meanwhile. The sampler masks the logits of the rows that have a grammar on the
logits' device; rows without one pay nothing.
"""

from __future__ import annotations

import json
import re
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np
import torch

KINDS = ("json", "json_object", "regex", "choice", "grammar")
MAX_COMPILED = 256  # compiled grammars kept: a server sent ever new schemas must not grow without bound
CACHE_LIMIT_BYTES = 256 << 20  # xgrammar's own cache of compiled grammars, for the same reason
# xgrammar's rule for a character of a length-bounded string lets raw control characters through, which JSON
# forbids; its unbounded strings already exclude them, as this does.
_LOOSE_CHAR, _JSON_CHAR = r"([^\"\\\r\n])", r"([^\0-\x1f\"\\])"
# xgrammar's errors start with "[time] source:line: " and sometimes a failed check's text: not for clients.
_NOISE = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*|Check failed: \(.*?\) is false:\s*")


@dataclass(frozen=True)
class StructuredOutput:
    """What a request's output must match. kind: one of KINDS; spec: the JSON schema (JSON text), the
    regex, the EBNF grammar, or for a choice a JSON list of the strings allowed (json_object: empty)."""

    kind: str
    spec: str = ""

    def validate(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"structured output kind must be one of {', '.join(KINDS)}; got {self.kind!r}")
        if self.kind == "choice":
            choices = json.loads(self.spec)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise ValueError("choice must be a non-empty list of non-empty strings")

    def ebnf(self) -> str:
        """The grammar of a choice: one alternative per string, JSON's escapes being EBNF's."""
        return "root ::= " + " | ".join(json.dumps(c) for c in json.loads(self.spec))


def encoded_vocab(tokenizer) -> list[str]:
    """An OuroTokenizer's (byte-level BPE) tokens by id, as xgrammar reads a vocabulary."""
    vocab = tokenizer.raw.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for token, i in vocab.items():
        encoded[i] = token
    return encoded


def grammar_compiler(encoded: list[str], vocab_size: int, stop_ids):
    """xgrammar's compiler for a vocabulary: the slow part of Grammars (xgrammar's first import, a second
    or more, and the vocabulary's preprocessing). CPU work only, so any thread may build it; ids beyond
    `encoded` are never allowed."""
    import xgrammar

    byte_level, stops = xgrammar.VocabType.BYTE_LEVEL, sorted(stop_ids)
    info = xgrammar.TokenizerInfo(encoded, byte_level, vocab_size=vocab_size, stop_token_ids=stops)
    return xgrammar.GrammarCompiler(info, max_threads=1, cache_limit_bytes=CACHE_LIMIT_BYTES)


class GrammarCache:
    """Compiled grammars by spec, the MAX_COMPILED most recently used, for any thread: the server's worker
    threads compile requests' grammars before submitting them and the engine-owner thread looks them up.
    Two threads that miss the same spec at once both compile it (the same result; rare)."""

    def __init__(self, compiler: Future | None, build=None):
        """compiler: a Future of grammar_compiler's result (being built on another thread), or None to
        build it with build() on first use (its ImportError, when xgrammar is missing, reaches that use)."""
        self._future, self._build = compiler, build
        self._lock = threading.Lock()
        self._compiled: OrderedDict[StructuredOutput, object] = OrderedDict()

    def compiler(self):
        """xgrammar's compiler, waiting for its build if it is still running."""
        with self._lock:
            if self._future is None:
                self._future = Future()
                try:
                    self._future.set_result(self._build())
                except BaseException as e:  # every later use raises it too
                    self._future.set_exception(e)
        return self._future.result()

    def cached(self, want: StructuredOutput) -> bool:
        """Whether want is compiled already (a lookup: any thread, the event loop's too)."""
        with self._lock:
            return want in self._compiled

    def compile(self, want: StructuredOutput):
        """The compiled grammar; ValueError saying what is wrong with an invalid one."""
        with self._lock:
            if want in self._compiled:
                self._compiled.move_to_end(want)
                return self._compiled[want]
        want.validate()
        grammar = _compile(self.compiler(), want)
        with self._lock:
            self._compiled[want] = grammar
            if len(self._compiled) > MAX_COMPILED:
                self._compiled.popitem(last=False)
        return grammar

    def __len__(self) -> int:
        return len(self._compiled)


def _compile(c, want: StructuredOutput):
    import xgrammar

    try:
        if want.kind in ("json", "json_object"):
            schema = want.spec if want.kind == "json" else '{"type": "object"}'  # any object, as OpenAI's
            ebnf = str(xgrammar.Grammar.from_json_schema(schema, any_whitespace=False))
            return c.compile_grammar(ebnf.replace(_LOOSE_CHAR, _JSON_CHAR))
        if want.kind == "regex":
            return c.compile_regex(want.spec)
        if want.kind == "choice":
            return c.compile_grammar(want.ebnf())
        return c.compile_grammar(want.spec)
    except RuntimeError as e:
        raise ValueError(f"invalid {want.kind}: {_clean(e)}") from None


class Grammars:
    """The live matchers and next-token bitmask rows of requests (by rid), on a GrammarCache's grammars."""

    def __init__(self, cache: GrammarCache, vocab_size: int, capacity: int, device):
        """cache: the compiled grammars of this vocabulary."""
        import xgrammar

        self.xgr = xgrammar
        self.cache = cache
        self.batch = xgrammar.BatchGrammarMatcher("auto")
        self.matchers: dict[int, object] = {}
        self.stale: set[int] = set()  # rids whose next-token row is not filled yet
        self.filling: frozenset[int] = frozenset()  # rids whose rows the worker is filling now
        self._fill: Future | None = None
        self._worker = ThreadPoolExecutor(1, thread_name_prefix="ouro-grammar")
        self.active = np.zeros(capacity, bool)
        self.device = torch.device(device)
        pin = self.device.type == "cuda"
        self.bitmask = xgrammar.allocate_token_bitmask(capacity, vocab_size)
        if pin:
            self.bitmask = self.bitmask.pin_memory()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, stop_ids, capacity: int, device) -> Grammars:
        """From an OuroTokenizer, building its compiler here."""
        cache = GrammarCache(None, lambda: grammar_compiler(encoded_vocab(tokenizer), vocab_size, stop_ids))
        cache.compiler()
        return cls(cache, vocab_size, capacity, device)

    def compile(self, want: StructuredOutput):
        """The compiled grammar (cached); ValueError saying what is wrong with an invalid one."""
        return self.cache.compile(want)

    def add(self, rid: int, want: StructuredOutput) -> None:
        """Start request rid's matcher; its first token's mask is filled now."""
        matcher = self.xgr.GrammarMatcher(self.compile(want))
        self.matchers[rid] = matcher
        self.active[rid] = True
        self.stale.add(rid)

    def remove(self, rid: int) -> None:
        if rid in self.filling:
            self.wait_fill()  # the worker writes its row: a new request in rid must not be overwritten
        self.matchers.pop(rid, None)
        self.stale.discard(rid)
        self.active[rid] = False

    def start_fill(self) -> None:
        """Start filling, on the worker thread, the next-token rows of the requests that accepted a token
        since their last fill (after the fill in flight, if any, ends)."""
        if not self.stale:
            return
        self.wait_fill()
        matchers, rids = self._take_stale()
        self.filling = frozenset(rids)
        self._fill = self._worker.submit(self._fill_rows, matchers, rids)

    def _take_stale(self) -> tuple[list, list[int]]:
        rids = sorted(self.stale)
        self.stale.clear()
        return [self.matchers[r] for r in rids], rids

    def _fill_rows(self, matchers: list, rids: list[int]) -> None:
        if len(rids) == 1:
            matchers[0].fill_next_token_bitmask(self.bitmask, rids[0])
        else:
            self.batch.batch_fill_next_token_bitmask(matchers, self.bitmask, rids)

    def fill_done(self) -> bool:
        """No fill is in flight, or the one in flight has ended (wait_fill then returns at once)."""
        return self._fill is None or self._fill.done()

    def wait_fill(self) -> None:
        """Wait for the fill in flight; its rows are then final. Re-raises the worker's error."""
        fill, self._fill = self._fill, None
        self.filling = frozenset()
        if fill is not None:
            fill.result()

    def fill_pending(self) -> None:
        """Fill every row not filled yet, and wait until they are (the rows not started yet on this thread:
        handing them to the worker only to wait would cost more)."""
        self.wait_fill()
        if self.stale:
            self._fill_rows(*self._take_stale())

    def any(self, rids: np.ndarray) -> bool:
        return bool(self.active[rids].any())

    def apply(self, logits: torch.Tensor, rids: np.ndarray) -> torch.Tensor:
        """Logits [rows, >= vocab] of requests `rids` with each grammar row's disallowed tokens at -inf (a
        copy; the input keeps the raw logits that log-probabilities are taken from)."""
        self.fill_pending()
        rows = np.flatnonzero(self.active[rids])
        own = torch.from_numpy(rids[rows].astype(np.int64))
        masks = self.bitmask[own].to(logits.device, non_blocking=True)
        full = torch.full((logits.shape[0], masks.shape[1]), -1, dtype=torch.int32, device=logits.device)
        full[torch.from_numpy(rows).to(logits.device)] = masks
        out = logits.clone()
        self.xgr.apply_token_bitmask_inplace(out, full, vocab_size=min(out.shape[1], masks.shape[1] * 32))
        return out

    def accept(self, rid: int, token: int) -> bool:
        """Advance rid's matcher by its sampled token (its next row is filled later); False if the grammar
        rejects the token."""
        if rid in self.filling:
            self.wait_fill()  # a matcher is not advanced while the worker reads it
        matcher = self.matchers[rid]
        if not matcher.accept_token(token):
            return False
        if not matcher.is_terminated():
            self.stale.add(rid)
        return True

    def complete(self, rid: int) -> bool:
        """The grammar has ended: the request accepted a stop token where the grammar may end."""
        return self.matchers[rid].is_terminated()


def _clean(error: Exception) -> str:
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    return _NOISE.sub("", _NOISE.sub("", first)).strip()

"""Per-request bookkeeping of incremental detokenization: offsets, UTF-8 holdback, stop strings.

The owner of the tokenizer (ouro_fast.engine.detokenizer) asks `plan_windows`
which token windows to decode, decodes them all in one batch, and hands the
texts back to `apply_decoded`, which returns each request's text delta. The
method is vLLM's prefix/read offsets: a request's window is its tokens from
prefix_offset on; window[:read] was emitted already and serves as context,
so the text of the new tokens is decode(window)[len(decode(window[:read])):].

What a caller may rely on (for decoders where the text of a token run does not
depend on tokens before a clean character boundary, such as byte-level BPE):
the deltas of a request, up to and including its final flush, concatenate to
the text its tokens decode to at once, cut before the first stop string to
appear in it (the occurrence that ends earliest; at a tie, the one starting
earliest). A delta never ends inside a UTF-8 character (a trailing U+FFFD is
held until the next token completes it, or until the flush), never contains
any part of that stop string, and while the request runs the last
max(len(stop)) - 1 characters are held back so a stop string split over
several tokens is still caught.

Compiled as ouro_fast.core.detok; importable uncompiled as ouro_fast.core_py.detok.
"""

import cython

REPLACEMENT_CHAR = "\ufffd"


@cython.cfunc
@cython.exceptval(-2, check=False)  # -1 is a result (no stop string in the text)
def _stop_cut(text: str, stops: tuple, keep: cython.bint) -> cython.Py_ssize_t:
    """Where text is cut for the first stop string to appear in it (before it, or after it with keep),
    -1 when none does.

    "First to appear" is the occurrence that ends earliest (the one a token stream completes
    first); of those ending at the same character, the one that starts earliest.
    """
    best_end: cython.Py_ssize_t = -1
    best_at: cython.Py_ssize_t = -1
    at: cython.Py_ssize_t
    end: cython.Py_ssize_t
    for stop in stops:
        at = text.find(stop)
        if at < 0:
            continue
        end = at + len(stop)
        if best_end < 0 or end < best_end or (end == best_end and at < best_at):
            best_end, best_at = end, at
    return best_end if keep and best_at >= 0 else best_at


class DetokState:
    """One request's detokenization state; only the engine-owner thread touches it.

    The window holds the request's tokens from prefix_offset on (older ones are
    dropped as the offsets advance), so its size stays a few tokens. Compiled, it
    cannot be subclassed; its C attributes and C methods are declared in detok.pxd.
    """

    def __init__(
        self,
        seed: list,
        seed_chars: cython.Py_ssize_t,
        skip_special_tokens: cython.bint,
        skip_ids: frozenset,
        stop: tuple,
        include_stop: cython.bint = False,
    ):
        """seed: trailing prompt tokens used as context, ending at a clean character boundary;
        seed_chars: len(decode(seed)); skip_ids: ids that decode to nothing with this
        request's skip_special_tokens (dropped on entry); stop: non-empty stop strings;
        include_stop: the text ends after the stop string that ended it, not before."""
        self._window = list(seed)
        self._read = len(self._window)
        self._prefix_chars = seed_chars
        self._skip_special = skip_special_tokens
        self._skip_ids = skip_ids
        self._stops = stop
        self._include_stop = include_stop
        self._holdback = max([len(s) for s in stop], default=1) - 1
        self._pending = ""
        self._emitted = []
        self._stopped = False
        self._finished = False

    @property
    def skip_special_tokens(self) -> bool:
        return self._skip_special

    @property
    def stopped(self) -> bool:
        """True once a stop string was found; the text is cut before it and nothing more is emitted."""
        return self._stopped

    @property
    def finished(self) -> bool:
        """True after the final flush or a stop; later tokens are ignored."""
        return self._finished

    def extend(self, ids: list) -> None:
        """Append a step's sampled ids (ignored once finished)."""
        if self._finished:
            return
        if self._skip_ids:
            # Skipped special tokens decode to nothing: keeping them out bounds the window.
            self._window.extend([i for i in ids if i not in self._skip_ids])
        else:
            self._window.extend(ids)

    def text(self) -> str:
        """All text emitted so far."""
        if len(self._emitted) > 1:
            self._emitted = ["".join(self._emitted)]
        return self._emitted[0] if self._emitted else ""

    def _windows_needed(self) -> cython.Py_ssize_t:
        """How many windows this state needs decoded now: none, the full one, or prefix and full."""
        if self._finished or self._read >= len(self._window):
            return 0
        return 2 if self._prefix_chars < 0 else 1

    def _plan(self, windows: list) -> cython.int:
        n: cython.Py_ssize_t = self._windows_needed()
        if n == 2:
            windows.append(self._window[: self._read])
        if n >= 1:
            windows.append(self._window)
        return 0

    def _apply(self, decoded: list, at: cython.Py_ssize_t, n: cython.Py_ssize_t, final: cython.bint) -> str:
        """Take this state's n decoded windows from decoded[at:] and return its delta."""
        if self._finished:
            return ""
        piece: str = ""
        if n:
            if n == 2:
                self._prefix_chars = len(decoded[at])
            full: str = decoded[at + n - 1]
            if final:
                piece = full[self._prefix_chars :]
            elif len(full) > self._prefix_chars and not full.endswith(REPLACEMENT_CHAR):
                piece = full[self._prefix_chars :]
                # Advance: the tokens just emitted become the next step's context.
                del self._window[: self._read]
                self._read = len(self._window)
                self._prefix_chars = -1
        return self._emit(piece, final)

    def _emit(self, piece: str, final: cython.bint) -> str:
        """Add newly decoded text; return what may be emitted now after stop and holdback rules."""
        text: str = self._pending + piece
        if final:
            self._finished = True
        cut: cython.Py_ssize_t
        if self._stops:
            cut = _stop_cut(text, self._stops, self._include_stop)
            if cut >= 0:
                self._stopped = True
                self._finished = True
                self._pending = ""
                return self._take(text[:cut])
        keep: cython.Py_ssize_t = 0 if final else self._holdback
        if len(text) <= keep:
            self._pending = text
            return ""
        cut = len(text) - keep
        self._pending = text[cut:]
        return self._take(text[:cut])

    def _take(self, out: str) -> str:
        if out:
            self._emitted.append(out)
        return out


@cython.ccall
def plan_windows(states: list) -> list:
    """The token windows to decode for states, in the order apply_decoded consumes them."""
    windows: list = []
    state: DetokState
    for state in states:
        state._plan(windows)
    return windows


@cython.ccall
def apply_decoded(states: list, decoded: list, final: cython.bint) -> list:
    """Each state's text delta, given the decoded texts of plan_windows(states) (made with the
    states' skip_special_tokens). final flushes everything left and finishes the states.
    A state whose own text fails (e.g. its stop check) gets the exception in place of its delta,
    and the others go on."""
    state: DetokState
    at: cython.Py_ssize_t = 0
    for state in states:
        at += state._windows_needed()
    if at != len(decoded):
        raise ValueError(f"apply_decoded got {len(decoded)} texts for a plan of {at}")
    deltas: list = []
    n: cython.Py_ssize_t
    at = 0
    for state in states:
        n = state._windows_needed()
        try:
            deltas.append(state._apply(decoded, at, n, final))
        except Exception as e:
            deltas.append(e)
        at += n
    return deltas

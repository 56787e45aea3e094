# C interface of ouro_fast.core.detok (implemented in detok.py).
#
# Everything here handles Python strings and lists, so nothing runs without the GIL; the C
# declarations spare the per-token calls Python's method lookup and argument boxing.
# _stop_cut, plan_windows and apply_decoded are C functions too, declared in detok.py: nothing
# cimports them, and a declaration here would export them (__pyx_capi__), which keeps the C
# compiler from inlining them.

cimport cython


@cython.final
cdef class DetokState:
    cdef list _window  # the request's tokens from prefix_offset on
    cdef Py_ssize_t _read  # _window[:_read] was emitted already (the context)
    cdef Py_ssize_t _prefix_chars  # len(decode(_window[:_read])), -1 until decoded
    cdef bint _skip_special
    cdef frozenset _skip_ids
    cdef tuple _stops
    cdef bint _include_stop  # the emitted text keeps the stop string that ended it
    cdef Py_ssize_t _holdback
    cdef str _pending  # decoded text held back by the stop-string and holdback rules
    cdef list _emitted
    cdef bint _stopped
    cdef bint _finished

    cdef Py_ssize_t _windows_needed(self) except -1
    cdef int _plan(self, list windows) except -1
    cdef str _apply(self, list decoded, Py_ssize_t at, Py_ssize_t n, bint final)
    cdef str _emit(self, str piece, bint final)
    cdef str _take(self, str out)


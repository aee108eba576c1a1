# cython: boundscheck=False, wraparound=False, cdivision=False
"""The ``/score`` body's ``token_ids`` read from its JSON text into the u32 bytes block keys hash.

Re-exported by ``_lookup``; anything but a plain array of ints in [0, 2**32) returns None and
is left to the general decode.
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from libc.stdint cimport uint64_t


cdef extern from "string.h":
    void* memmem(const void* haystack, size_t size, const void* needle, size_t length) nogil


cdef inline bint _space(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


def json_token_ids(object raw, Py_ssize_t max_length):
    """Reference: msgspec.json.decode; tests/unit/indexer/native/test_lookup.py::test_json_token_ids_equal_the_general_decode

    A buffer holding exactly a JSON array, as little-endian u32 bytes; None unless it is
    at most ``max_length`` plain integers in [0, 2**32) (the caller then decodes it)."""
    cdef Py_buffer view
    cdef Py_ssize_t pos = 0, end, after = 0
    PyObject_GetBuffer(raw, &view, PyBUF_SIMPLE)
    cdef const unsigned char* p = <const unsigned char*> view.buf
    try:
        end = view.len
        while end > 0 and _space(p[end - 1]):
            end -= 1
        while pos < end and _space(p[pos]):
            pos += 1
        # The closing bracket stops every scan of the array (no digit, space or comma).
        if end - pos < 2 or p[pos] != 91 or p[end - 1] != 93:  # '[' ... ']'
            return None
        packed = _json_array(p, pos, end, max_length, &after)
        return packed if after == end else None
    finally:
        PyBuffer_Release(&view)


def json_token_span(object body, Py_ssize_t max_length):
    """Reference: msgspec.json.decode; tests/unit/indexer/native/test_lookup.py::test_json_token_span_finds_the_array_and_reads_it

    ``(ids, start, end)`` of the first array after ``"token_ids":`` in an object's text,
    read as :func:`json_token_ids` does; None if there is none, it is not one it reads, or
    the text does not end with ``}``. Whether it is at the top level is the caller's to check."""
    cdef Py_buffer view
    cdef Py_ssize_t pos, end, after = 0
    cdef const unsigned char* found
    PyObject_GetBuffer(body, &view, PyBUF_SIMPLE)
    cdef const unsigned char* p = <const unsigned char*> view.buf
    try:
        end = view.len
        while end > 0 and _space(p[end - 1]):
            end -= 1
        # The object's closing brace stops every scan below (no digit, space or comma).
        if end == 0 or p[end - 1] != 125:  # '}'
            return None
        found = <const unsigned char*> memmem(p, end, b'"token_ids"', 11)
        if found is NULL:
            return None
        pos = (found - p) + 11
        while _space(p[pos]):
            pos += 1
        if p[pos] != 58:  # ':'
            return None
        pos += 1
        while _space(p[pos]):
            pos += 1
        if p[pos] != 91:  # '['
            return None
        packed = _json_array(p, pos, end, max_length, &after)
        return None if packed is None else (packed, pos, after)
    finally:
        PyBuffer_Release(&view)


cdef extern from "Python.h":
    bytes PyBytes_FromStringAndSize(const char* v, Py_ssize_t size)
    int _PyBytes_Resize(PyObject** string, Py_ssize_t size) except -1


cdef extern from "kv_inline.h":
    void kv_store_le32(unsigned char* out, unsigned int v) noexcept nogil


cdef inline Py_ssize_t _json_uint(const unsigned char* p, Py_ssize_t pos, uint64_t* value) noexcept nogil:
    # Past the JSON integer at p[pos] (its value in *value), or -1 unless it is one in
    # [0, 2**32) with no leading 0. Digits are read two at a time after the first (a digit
    # is never the buffer's last byte: a bracket or brace closes it), 11 at most.
    cdef Py_ssize_t start = pos
    cdef unsigned char d0 = p[pos] - 48, d1
    if d0 > 9:
        return -1
    cdef uint64_t v = d0
    pos += 1
    while pos - start < 11:
        d0 = p[pos] - 48
        if d0 > 9:
            break
        d1 = p[pos + 1] - 48
        if d1 > 9:
            v = v * 10 + d0
            pos += 1
            break
        v = v * 100 + d0 * 10 + d1
        pos += 2
    if v >> 32 or (p[start] == 48 and pos - start > 1):
        return -1  # past u32, or a leading 0
    value[0] = v
    return pos


cdef object _json_array(
    const unsigned char* p, Py_ssize_t pos, Py_ssize_t end, Py_ssize_t max_length,
    Py_ssize_t* after,
):
    # The u32 bytes of the array opening at p[pos], *after set past its ']'; None unless a
    # plain array of at most max_length u32. A byte before end that is no digit, space or
    # comma must stop every scan. The ids go straight into the bytes returned: made for the
    # most the array can hold (a digit and a separator each), then shrunk in place.
    cdef Py_ssize_t n = 0
    cdef uint64_t value = 0
    cdef unsigned char c
    pos += 1
    cdef Py_ssize_t most = (end - pos) // 2
    if most > max_length:
        most = max_length
    while _space(p[pos]):
        pos += 1
    if p[pos] == 93:  # "[]"
        after[0] = pos + 1
        return b""
    cdef bytes out = PyBytes_FromStringAndSize(NULL, 4 * most)
    cdef unsigned char* buf = <unsigned char*> PyBytes_AS_STRING(out)
    cdef PyObject* raw
    while True:
        pos = _json_uint(p, pos, &value)
        if pos < 0 or n >= most:
            return None
        kv_store_le32(buf + 4 * n, <unsigned int> value)
        n += 1
        c = p[pos]
        if c == 44:  # ',' right after the id: the compact spelling, tested first
            pos += 1
            if p[pos] > 32:  # no space next (a space, tab, CR and LF are all <= 32)
                continue
            while _space(p[pos]):
                pos += 1
            continue
        while _space(c):
            pos += 1
            c = p[pos]
        if c == 44:  # ','
            pos += 1
            while _space(p[pos]):
                pos += 1
            continue
        if c == 93:  # the closing bracket
            after[0] = pos + 1
            if n == most:
                return out
            # Shrunk in place: ``_PyBytes_Resize`` wants the only reference, so ``raw``
            # takes over the one ``out`` held (on failure it frees the object and raises).
            raw = <PyObject*> out
            Py_INCREF(out)
            out = None
            _PyBytes_Resize(&raw, 4 * n)
            resized = <bytes> raw  # a new reference; the one ``raw`` held is dropped next
            Py_DECREF(resized)
            return resized
        return None  # a fraction, an exponent, anything else

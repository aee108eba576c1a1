# cython: boundscheck=False, wraparound=False, cdivision=False
"""The read path's compiled loops: what ``POST /score`` costs per candidate after the lookup.

Each function is the compiled twin of a pure-Python reference that stays the fallback when
the extension is not built, and the tests hold the two to the same answers on random input
(``tests/unit/indexer/native/test_lookup.py``):

* :func:`set_bits` - ``kvindex.indexer.index.memory._numbers``: the stream numbers of a
  holders bitmap (a Python int of up to the fleet's width);
* :func:`load_penalties` - ``kvindex.api.decision.policies.load_penalties``: one load penalty per
  candidate, the same IEEE operations in the same order (built with ``-ffp-contract=off``,
  so no fused multiply-add changes a rounding), hence bit-equal floats;
* :func:`best_tied` - ``kvindex.api.decision.policies.tie_order``: the indices of the best ``top_k`` in
  (score, load) order, a draw only for each tie the ``top_k`` reaches;
* :func:`penalty_floors`, :func:`ascending`, :func:`penalties_within` -
  ``kvindex.api.decision.penalty_floors``: a floor under each penalty until a time, the candidates
  by floor, and the exact penalties of those that can be among the ``top_k`` lowest (no
  Python twin: without them the scorer computes every penalty, and the tests hold these
  to ``load_penalties``);
* :func:`kth_smallest` - ``sorted(values)[k - 1]`` without sorting the fleet;
* :func:`best_matches` - ``kvindex.api.score._py_best_matches``: each replica's best match
  over its streams, from the holders alone;
* :func:`contenders` - ``kvindex.api.score._py_contenders``: the holders a bound keeps;
* :func:`json_token_ids` - a ``/score`` body's ``token_ids`` array read into the u32 bytes the
  block keys hash (``kvindex.api.schemas.decode_score_request``; anything but a plain array
  of ints in [0, 2**32) is left to the full decode).

Nothing here keeps state or holds a lock; every input is checked as the reference checks it
(a wrong type raises ``TypeError``, as the Python code would).
"""

from cpython.buffer cimport PyBUF_SIMPLE, PyBuffer_Release, PyObject_GetBuffer
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_GET_SIZE
from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.ref cimport Py_DECREF, Py_INCREF
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.math cimport INFINITY, pow
from libc.stdint cimport uint64_t
from libc.stdlib cimport calloc, free, malloc, qsort


cdef extern from "string.h":
    void* memmem(const void* haystack, size_t size, const void* needle, size_t length) nogil


cdef extern from "Python.h":
    ctypedef struct PyMemberDef:
        Py_ssize_t offset
        int type
    ctypedef struct PyMemberDescrObject:
        PyMemberDef* d_member
    ctypedef struct PyTypeObject
    PyTypeObject* Py_TYPE(object o)
    bint PyFloat_CheckExact(object o)
    double PyFloat_AS_DOUBLE(object o)
    bint PyLong_CheckExact(object o)
    double PyLong_AsDouble(object o) except? -1.0
    int T_OBJECT_EX


_LOAD_FIELDS = ("ts", "waiting", "running", "kv_usage")
cdef PyTypeObject* _load_type = NULL
"""The type whose field offsets ``_load_offsets`` holds (None learnt yet)."""
cdef Py_ssize_t _load_offsets[4]


cdef bint _learn_load_type(object load):
    """Remember where ``type(load)`` keeps the four fields a penalty reads, when each is a
    plain slot (a member descriptor of an object, as a msgspec Struct's fields are): an
    attribute read is then one load from memory. False when they are not."""
    global _load_type
    cdef object cls = type(load), descriptor
    cdef PyMemberDef* member
    cdef Py_ssize_t offsets[4]
    cdef int i
    for i in range(4):
        descriptor = getattr(cls, _LOAD_FIELDS[i], None)
        if type(descriptor) is not _member_descriptor:
            return False
        member = (<PyMemberDescrObject*> <PyObject*> descriptor).d_member
        if member.type != T_OBJECT_EX:
            return False
        offsets[i] = member.offset
    for i in range(4):
        _load_offsets[i] = offsets[i]
    _load_type = Py_TYPE(load)
    return True


class _Slots:
    __slots__ = ("x",)


_member_descriptor = type(_Slots.x)


cdef inline object _field(object load, int i):
    """Field ``i`` of ``_LOAD_FIELDS`` of a load of the learnt type (NULL: unset)."""
    cdef PyObject* value = (<PyObject**> ((<char*> <PyObject*> load) + _load_offsets[i]))[0]
    if value is NULL:
        return getattr(load, _LOAD_FIELDS[i])  # raises AttributeError, as the reference
    return <object> value


cdef inline double _number(object x) except? -1.0:
    """``<double> x``, without the float made on the way for an int (the same value: an
    int converts to the nearest double either way)."""
    if PyFloat_CheckExact(x):
        return PyFloat_AS_DOUBLE(x)
    if PyLong_CheckExact(x):
        return PyLong_AsDouble(x)
    return <double> x


cdef struct _Weights:
    double in_flight, tokens, half_life, waiting, running, routed, kv


cdef inline _Weights _weights(
    double w_in_flight, double w_tokens, double half_life, double w_waiting, double w_running,
    double w_routed, double w_kv,
) noexcept:
    cdef _Weights w
    w.in_flight, w.tokens, w.half_life = w_in_flight, w_tokens, half_life
    w.waiting, w.running, w.routed, w.kv = w_waiting, w_running, w_routed, w_kv
    return w


cdef enum:
    _CONSTANT = 0  # the penalty does not depend on the clock
    _DECAYS = 1  # it can only fall as the clock advances (its load's recency decays)
    _UNKNOWN = 2  # a negative input: no bound over time is claimed


cdef double _penalty(object found, double now, const _Weights* w, int* kind) except? -1.0:
    """A replica's load penalty from its ``CountedLoad`` (``found``; None: none stored), as
    of ``now``, and in ``kind`` how it moves with the clock; see ``load_penalties``."""
    cdef object c, load, routed, in_flight, num_requests, num_tokens
    cdef double first_hand, prefill, age, recency, queue, ts, waiting, running, kv_usage
    kind[0] = _CONSTANT
    if found is None:
        return w.in_flight * 0.0 + w.tokens * 0.0
    c = found
    if PyTuple_Check(c) and PyTuple_GET_SIZE(c) == 3:  # a CountedLoad (a NamedTuple)
        load = <object> PyTuple_GET_ITEM(c, 0)
        routed = <object> PyTuple_GET_ITEM(c, 1)
        in_flight = <object> PyTuple_GET_ITEM(c, 2)
    else:
        load, routed, in_flight = c
    if PyTuple_Check(in_flight) and PyTuple_GET_SIZE(in_flight) == 2:
        num_requests = <object> PyTuple_GET_ITEM(in_flight, 0)
        num_tokens = <object> PyTuple_GET_ITEM(in_flight, 1)
    else:
        num_requests, num_tokens = in_flight
    first_hand = w.in_flight * _number(num_requests)
    prefill = w.tokens * _number(num_tokens)
    if load is None:
        return first_hand + prefill
    if Py_TYPE(load) is _load_type or (_load_type is NULL and _learn_load_type(load)):
        ts, waiting = _number(_field(load, 0)), _number(_field(load, 1))
        running, kv_usage = _number(_field(load, 2)), _number(_field(load, 3))
    else:
        ts, waiting = _number(load.ts), _number(load.waiting)
        running, kv_usage = _number(load.running), _number(load.kv_usage)
    age = now - ts
    if w.half_life:
        recency = pow(0.5, (0.0 if age < 0.0 else age) / w.half_life)
    else:
        recency = 1.0
    queue = (w.waiting * waiting + w.running * running) * recency
    queue = queue + w.routed * _number(routed)
    queue = queue if queue > first_hand else first_hand
    if waiting < 0.0 or running < 0.0 or kv_usage < 0.0 or not (recency == recency):
        kind[0] = _UNKNOWN
    elif w.half_life and (w.waiting * waiting + w.running * running != 0.0 or w.kv * kv_usage != 0.0):
        kind[0] = _DECAYS
    return queue + w.kv * kv_usage * recency + prefill


cdef inline object _counted_of(dict counted, object replica):
    cdef PyObject* found = PyDict_GetItem(counted, replica)
    return None if found is NULL else <object> found


def load_penalties(
    list replicas,
    dict counted,
    double now,
    double w_in_flight,
    double w_tokens,
    double half_life,
    double w_waiting,
    double w_running,
    double w_routed,
    double w_kv,
):
    """Each replica's load penalty from ``counted`` (replica -> ``CountedLoad``: load or
    None, answers since, (requests, tokens) in flight), as of ``now``, in the order of
    ``replicas``; see ``kvindex.api.decision.policies.load_penalties``. A load's fields are read
    from its slots when its type keeps them there (``_learn_load_type``), else by name."""
    cdef Py_ssize_t n = PyList_GET_SIZE(replicas), i
    cdef list out = [None] * n
    cdef int kind
    cdef _Weights w = _weights(
        w_in_flight, w_tokens, half_life, w_waiting, w_running, w_routed, w_kv
    )
    for i in range(n):
        found = _counted_of(counted, <object> PyList_GET_ITEM(replicas, i))
        out[i] = _penalty(found, now, &w, &kind)
    return out


def penalty_floors(
    list replicas,
    dict counted,
    double until,
    double w_in_flight,
    double w_tokens,
    double half_life,
    double w_waiting,
    double w_running,
    double w_routed,
    double w_kv,
):
    """A floor under each replica's :func:`load_penalties` at any time up to ``until``
    (from its first use on), in the order of ``replicas``: the penalty itself when it does
    not depend on the clock; when its load's recency decays, the penalty at ``until``
    less a margin (1e-12 of it: a rounding of ``pow`` that is not monotone cannot cross
    it), the penalty only falling as time passes; ``-inf`` when an input is negative."""
    cdef Py_ssize_t n = PyList_GET_SIZE(replicas), i
    cdef list out = [None] * n
    cdef int kind
    cdef double value
    cdef _Weights w = _weights(
        w_in_flight, w_tokens, half_life, w_waiting, w_running, w_routed, w_kv
    )
    for i in range(n):
        found = _counted_of(counted, <object> PyList_GET_ITEM(replicas, i))
        value = _penalty(found, until, &w, &kind)
        if kind == _DECAYS:
            value = value - (value * 1e-12 + 1e-300)
        elif kind == _UNKNOWN or not (value == value):
            value = -INFINITY
        out[i] = value
    return out


cdef struct Floor:
    double value
    Py_ssize_t index


cdef int _compare_floors(const void* a, const void* b) noexcept nogil:
    cdef const Floor* x = <const Floor*> a
    cdef const Floor* y = <const Floor*> b
    if x.value != y.value:
        return -1 if x.value < y.value else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


def ascending(list values):
    """The indices of ``values`` (floats, none NaN) in ascending order of value, a tie in
    index order: ``sorted(range(len(values)), key=values.__getitem__)``."""
    cdef Py_ssize_t n = PyList_GET_SIZE(values), i
    cdef Floor* rows = <Floor*> malloc((n if n else 1) * sizeof(Floor))
    if rows is NULL:
        raise MemoryError()
    try:
        for i in range(n):
            rows[i].value = <double> <object> PyList_GET_ITEM(values, i)
            rows[i].index = i
        qsort(rows, n, sizeof(Floor), _compare_floors)
        return [rows[i].index for i in range(n)]
    finally:
        free(rows)


cdef inline Py_ssize_t _keep_smallest(
    double* best, Py_ssize_t kept, Py_ssize_t k, double value
) noexcept:
    """Insert ``value`` into the ascending ``best[0:kept]`` capped at ``k``; the new count."""
    cdef Py_ssize_t j
    if kept == k and not value < best[k - 1]:
        return kept
    j = kept if kept < k else k - 1
    while j > 0 and value < best[j - 1]:
        best[j] = best[j - 1]
        j -= 1
    best[j] = value
    return kept + 1 if kept < k else kept


def penalties_within(
    list replicas,
    dict counted,
    double now,
    list order,
    list floors,
    list exact,
    Py_ssize_t k,
    double w_in_flight,
    double w_tokens,
    double half_life,
    double w_waiting,
    double w_running,
    double w_routed,
    double w_kv,
):
    """``(penalties, positions, kth)``: the load penalty as of ``now`` (as
    :func:`load_penalties`) of every replica that can be among the ``k`` lowest, at its
    position in a list of ``len(replicas)`` (``inf`` elsewhere), the positions computed,
    and the ``k``-th lowest penalty of all (``1 <= k <= len(replicas)``).

    Computed: the positions ``exact`` (whose floors are out of date, and the holders,
    which the caller scores), then the others in ``order`` (ascending ``floors``, each a
    floor under its replica's penalty as of ``now``) while a floor is at most the ``k``-th
    lowest penalty computed so far: every later one is above it, so neither is among the
    ``k`` lowest nor ties with the ``k``-th."""
    cdef Py_ssize_t n = PyList_GET_SIZE(replicas), i, at, kept = 0
    if k < 1 or k > n:
        raise IndexError("k out of range")
    if PyList_GET_SIZE(order) != n or PyList_GET_SIZE(floors) != n:
        raise ValueError("order, floors and replicas differ in length")
    cdef _Weights w = _weights(
        w_in_flight, w_tokens, half_life, w_waiting, w_running, w_routed, w_kv
    )
    cdef list out = [INFINITY] * n, positions = []
    cdef int kind
    cdef double value
    cdef unsigned char* seen = <unsigned char*> calloc(n, 1)
    cdef double* best = <double*> malloc(k * sizeof(double))
    if seen is NULL or best is NULL:
        free(seen)
        free(best)
        raise MemoryError()
    try:
        for index in exact:
            at = index
            if at < 0 or at >= n:
                raise IndexError("position out of range")
            if seen[at]:
                continue
            seen[at] = 1
            found = _counted_of(counted, <object> PyList_GET_ITEM(replicas, at))
            value = _penalty(found, now, &w, &kind)
            out[at] = value
            positions.append(at)
            kept = _keep_smallest(best, kept, k, value)
        for i in range(n):
            at = <object> PyList_GET_ITEM(order, i)
            if at < 0 or at >= n:
                raise IndexError("position out of range")
            if seen[at]:
                continue
            if kept == k and <double> <object> PyList_GET_ITEM(floors, at) > best[k - 1]:
                break
            seen[at] = 1
            found = _counted_of(counted, <object> PyList_GET_ITEM(replicas, at))
            value = _penalty(found, now, &w, &kind)
            out[at] = value
            positions.append(at)
            kept = _keep_smallest(best, kept, k, value)
        return out, positions, best[k - 1]
    finally:
        free(seen)
        free(best)


cdef struct Row:
    double minus_score
    double penalty
    double draw
    Py_ssize_t index


cdef int _compare_keys(const void* a, const void* b) noexcept nogil:
    """(minus score, penalty, index) order: the draw left out."""
    cdef const Row* x = <const Row*> a
    cdef const Row* y = <const Row*> b
    if x.minus_score != y.minus_score:
        return -1 if x.minus_score < y.minus_score else 1
    if x.penalty != y.penalty:
        return -1 if x.penalty < y.penalty else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef int _compare_draws(const void* a, const void* b) noexcept nogil:
    """(draw, index) order: within a tied group."""
    cdef const Row* x = <const Row*> a
    cdef const Row* y = <const Row*> b
    if x.draw != y.draw:
        return -1 if x.draw < y.draw else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef inline bint _same_key(const Row* x, const Row* y) noexcept nogil:
    return x.minus_score == y.minus_score and x.penalty == y.penalty


cdef int _draw_group(Row* group, Py_ssize_t size, object draw) except -1:
    """One ``draw()`` per row of a tied group (in index order, as it comes), then the
    group in (draw, index) order."""
    cdef Py_ssize_t i
    for i in range(size):
        group[i].draw = <double> draw()
    qsort(group, size, sizeof(Row), _compare_draws)
    return 0


def best_tied(list minus_scores, list penalties, object draw, object top_k, list positions):
    """Indices of the best ``top_k`` (None or 0: every one) of the rows at ``positions``
    (None: every row), best first, in ascending (minus score, penalty) order, a tie in both broken
    by chance: one ``draw()`` per row of each tied group the ``top_k`` reaches (the groups
    in order, a group's rows in index order), then (draw, index) within the group. No draw
    for a row alone in its group or beyond the ``top_k``; see
    ``kvindex.api.decision.policies.tie_order`` (the reference)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(minus_scores), m, i, j, k, kept = 0, at, start
    cdef Py_ssize_t num_tied = 0
    if PyList_GET_SIZE(penalties) != n:
        raise ValueError("minus_scores and penalties differ in length")
    m = n if positions is None else PyList_GET_SIZE(positions)
    if top_k is None or top_k == 0:
        k = m
    elif top_k < 0:
        raise ValueError("top_k must be None or >= 0")
    else:
        k = m if top_k >= m else top_k
    if k == 0:
        return []
    cdef Row* rows = <Row*> malloc(m * sizeof(Row))
    cdef Row* tied = <Row*> malloc(m * sizeof(Row))
    if rows is NULL or tied is NULL:
        free(rows)
        free(tied)
        raise MemoryError()
    cdef Row row, last
    try:
        for i in range(m):
            at = i if positions is None else <object> PyList_GET_ITEM(positions, i)
            if at < 0 or at >= n:
                raise IndexError("position out of range")
            rows[i].minus_score = <double> <object> PyList_GET_ITEM(minus_scores, at)
            rows[i].penalty = <double> <object> PyList_GET_ITEM(penalties, at)
            rows[i].draw = 0.0
            rows[i].index = at
        if k == m:
            qsort(rows, m, sizeof(Row), _compare_keys)
            kept = m
        else:  # the best k kept sorted in rows[0:k] (insertion: k is small next to m)
            for i in range(m):
                row = rows[i]
                if kept == k and _compare_keys(&row, &rows[k - 1]) >= 0:
                    continue
                j = kept if kept < k else k - 1
                while j > 0 and _compare_keys(&row, &rows[j - 1]) < 0:
                    rows[j] = rows[j - 1]
                    j -= 1
                rows[j] = row
                if kept < k:
                    kept += 1
        # The group the k-th row ends in may go on past it: all of its rows, by index.
        last = rows[k - 1]
        start = k - 1
        while start > 0 and _same_key(&rows[start - 1], &last):
            start -= 1
        for i in range(start, k):
            tied[num_tied] = rows[i]
            num_tied += 1
        if k < m:
            for i in range(m):
                at = i if positions is None else <object> PyList_GET_ITEM(positions, i)
                row.minus_score = <double> <object> PyList_GET_ITEM(minus_scores, at)
                row.penalty = <double> <object> PyList_GET_ITEM(penalties, at)
                row.index = at
                if _same_key(&row, &last) and row.index > last.index:
                    tied[num_tied] = row
                    num_tied += 1
            qsort(tied, num_tied, sizeof(Row), _compare_keys)  # by index (one key)
        # The groups before it, in order, then it.
        i = 0
        while i < start:
            j = i + 1
            while j < start and _same_key(&rows[j], &rows[i]):
                j += 1
            if j - i > 1:
                _draw_group(&rows[i], j - i, draw)
            i = j
        if num_tied > 1:
            _draw_group(tied, num_tied, draw)
        out = [rows[i].index for i in range(start)]
        out.extend([tied[i].index for i in range(k - start)])
        return out
    finally:
        free(rows)
        free(tied)


cdef extern from "Python.h":
    object _PyDict_NewPresized(Py_ssize_t minused)
    PyObject* PyDict_GetItemWithError(object p, object key) except? NULL


def best_matches(list runs, list replica_of, list rank_of, bint unique):
    """``(matches, ranks)`` from the holders' ``runs`` (``(match, stream indices)`` pairs,
    ``kvindex.indexer.index.protocol.HeldRuns``): per replica (``replica_of[i]``) the
    longest match over its streams, a tie going to the lowest rank (``rank_of[i]``), and
    that rank when it is not 0 (absent: 0); see ``kvindex.api.score._py_best_matches``.
    ``unique``: no replica has two streams (nothing to compare: each holder is its
    replica's best). ``matches`` is made at its final size (no regrowth per holder)."""
    cdef Py_ssize_t i, num_blocks, most, rank, best_rank, total = 0
    cdef Py_ssize_t n = PyList_GET_SIZE(replica_of)
    cdef PyObject* known
    cdef PyObject* found_rank
    cdef object match, replica, at
    cdef tuple run
    if PyList_GET_SIZE(rank_of) != n:
        raise ValueError("replica_of and rank_of differ in length")
    for run in runs:
        total += len(<list> run[1])
    cdef dict matches = _PyDict_NewPresized(total), ranks = {}
    for run in runs:
        match = run[0]
        num_blocks = len(match.tiers)
        if num_blocks == 0:
            continue
        for at in <list> run[1]:
            i = at
            if i < 0 or i >= n:
                raise IndexError("stream index out of range")
            replica = <object> PyList_GET_ITEM(replica_of, i)
            rank = <object> PyList_GET_ITEM(rank_of, i)
            known = NULL if unique else PyDict_GetItemWithError(matches, replica)
            if known is not NULL:
                most = len((<object> known).tiers)
                if num_blocks < most:
                    continue
                if num_blocks == most:
                    found_rank = PyDict_GetItemWithError(ranks, replica)
                    best_rank = 0 if found_rank is NULL else <object> found_rank
                    if rank > best_rank:
                        continue
            matches[replica] = match
            if rank:
                ranks[replica] = rank
            elif known is not NULL:
                ranks.pop(replica, None)
    return matches, ranks


def contenders(
    list runs,
    list position_of,
    list replica_of,
    dict matches,
    list penalties,
    double per_block,
    double threshold,
):
    """``{replica: matches[replica]}`` for each replica with a holder stream ``i`` of a run
    (``(match, stream indices)``, a match of one block at least) such that
    ``penalties[position_of[i]] - per_block * len(match.tiers) <= threshold`` (the same
    IEEE operations as Python's); see ``kvindex.api.score._py_contenders``. Per holder two
    list reads and a compare: no hashing but for the replicas kept."""
    cdef dict out = {}
    cdef Py_ssize_t i, at, n = PyList_GET_SIZE(position_of), num_penalties = PyList_GET_SIZE(penalties)
    cdef double penalty, most
    cdef object match, index, replica
    cdef tuple run
    if PyList_GET_SIZE(replica_of) != n:
        raise ValueError("position_of and replica_of differ in length")
    cdef Py_ssize_t num_blocks
    for run in runs:
        match = run[0]
        num_blocks = len(match.tiers)
        if num_blocks == 0:  # no match: none of its streams holds anything
            continue
        most = per_block * <double> num_blocks
        for index in <list> run[1]:
            i = index
            if i < 0 or i >= n:
                raise IndexError("stream index out of range")
            at = <object> PyList_GET_ITEM(position_of, i)
            if at < 0 or at >= num_penalties:
                raise IndexError("position out of range")
            penalty = <double> <object> PyList_GET_ITEM(penalties, at)
            if penalty - most <= threshold:
                replica = <object> PyList_GET_ITEM(replica_of, i)
                if replica not in out:
                    out[replica] = matches[replica]
    return out


cdef inline bint _space(unsigned char c) noexcept nogil:
    return c == 32 or c == 10 or c == 13 or c == 9


def json_token_ids(object raw, Py_ssize_t max_length):
    """The token ids of a JSON array (a buffer holding exactly it, as ``msgspec.Raw`` keeps
    it) as little-endian u32 bytes, what the block keys hash; None unless it is an array of
    at most ``max_length`` JSON integers each in [0, 2**32) (no sign, fraction or exponent:
    the caller then decodes it the general way, which says what is wrong with it)."""
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
    """``(ids, start, end)``: the ids of the first array that follows the bytes
    ``"token_ids"``, a colon and spaces in a JSON object's text (``body[start:end]`` is the
    array), as :func:`json_token_ids` reads them; None when there is no such array, it is
    not one it reads, or the text does not end with ``}``. Where the array sits in the
    object (top level or not) is for the caller to check."""
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


cdef extern from *:
    """
    #include <stdint.h>
    #include <string.h>

    static inline void kv_store_le32(unsigned char* out, uint32_t v) {
    #if defined(__BYTE_ORDER__) && __BYTE_ORDER__ == __ORDER_BIG_ENDIAN__
        v = __builtin_bswap32(v);
    #endif
        memcpy(out, &v, 4);
    }
    """
    void kv_store_le32(unsigned char* out, unsigned int v) noexcept nogil


cdef inline Py_ssize_t _json_uint(const unsigned char* p, Py_ssize_t pos, uint64_t* value) noexcept nogil:
    """Past the JSON integer at ``p[pos]`` (its value in ``*value``), or -1 unless it is one
    in [0, 2**32) (a digit first, no leading 0). Digits are read two at a time after the
    first (a digit is never the buffer's last byte: a bracket or brace closes it), 11 at
    most: the loop is bounded, and 11 digits are past u32."""
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
    """The u32 bytes of the array opening at ``p[pos]`` (``[``), ``*after`` set past its
    ``]``; None unless it is a plain array of ints in [0, 2**32) of at most ``max_length``.
    A byte before ``end`` that is no digit, space or comma must stop every scan.

    The ids are written straight into the bytes object returned: made for the most ids the
    array's bytes can hold (two bytes each at least: a digit and a comma or the closing
    bracket), left uninitialised, and shrunk in place to the ids read (no zeroing, no copy)."""
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


def kth_smallest(list values, Py_ssize_t k):
    """The ``k``-th smallest of ``values`` (1: the smallest), as ``sorted(values)[k - 1]``
    (floats; ``1 <= k <= len(values)``, else ``IndexError``), keeping the ``k`` smallest seen
    by insertion (``k`` is small next to the fleet)."""
    cdef Py_ssize_t n = PyList_GET_SIZE(values), i, j, kept = 0
    if k < 1 or k > n:
        raise IndexError("k out of range")
    cdef double* best = <double*> malloc(k * sizeof(double))
    if best is NULL:
        raise MemoryError()
    cdef double value
    try:
        for i in range(n):
            value = <double> <object> PyList_GET_ITEM(values, i)
            if kept == k and not value < best[k - 1]:
                continue
            j = kept if kept < k else k - 1
            while j > 0 and value < best[j - 1]:
                best[j] = best[j - 1]
                j -= 1
            best[j] = value
            if kept < k:
                kept += 1
        return best[k - 1]
    finally:
        free(best)

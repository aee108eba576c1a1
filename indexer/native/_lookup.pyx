# cython: boundscheck=False, wraparound=False, cdivision=False
"""The read path's compiled loops after the lookup: load penalties, the best ``top_k``, the
holders' best matches. None keeps state; a wrong input type raises ``TypeError``."""

from cpython.dict cimport PyDict_GetItem, PyDict_Next
from cpython.list cimport PyList_GET_ITEM, PyList_GET_SIZE
from cpython.object cimport PyObject
from cpython.tuple cimport PyTuple_Check, PyTuple_GET_ITEM, PyTuple_GET_SIZE
from libc.math cimport INFINITY, pow
from libc.stdlib cimport calloc, free, malloc, qsort

from kvindex.indexer.native._json import json_token_ids, json_token_span  # callers read them here


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
cdef PyTypeObject* _load_type = NULL  # the type whose field offsets _load_offsets holds
cdef Py_ssize_t _load_offsets[4]


cdef bint _learn_load_type(object load):
    """Learn the slots of ``type(load)``'s fields a penalty reads (False: not all slots)."""
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
    # <double> x, without making a float on the way for an int (the same nearest double).
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
    """A replica's penalty from its ``CountedLoad`` (None: none); ``kind``: how it moves."""
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
    """Reference: tests.oracles.lookup.load_penalties; tests/unit/indexer/native/test_lookup.py::test_load_penalties_compiled_equal_python

    Each replica's load penalty as of ``now``, in the order of ``replicas``: the same IEEE
    operations in the same order (built with ``-ffp-contract=off``), so bit-equal floats."""
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
    """Reference: tests.oracles.lookup.load_penalties; tests/unit/indexer/native/test_lookup.py::test_penalty_floors_are_under_every_penalty_until_their_time

    A floor under each penalty up to ``until``: the one at ``until`` less 1e-12 of it when it
    decays (``pow`` may round non-monotonically); ``-inf`` for a negative input."""
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
    """Reference: builtins.sorted; tests/unit/indexer/native/test_lookup.py::test_ascending_is_the_stable_sort_of_the_indices

    ``sorted(range(len(values)), key=values.__getitem__)`` for floats, none NaN."""
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
    # Insert value into the ascending best[0:kept] capped at k; returns the new count.
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
    """Reference: tests.oracles.lookup.load_penalties; tests/unit/indexer/native/test_lookup.py::test_penalties_within_computes_every_one_that_can_be_among_the_k_lowest

    ``(penalties, positions, kth)``: the penalty of each replica that can be among the ``k``
    lowest (``inf`` elsewhere): ``exact``, then ``order`` while a floor is at most the kth."""
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
    # (minus score, penalty, index) order: the draw left out.
    cdef const Row* x = <const Row*> a
    cdef const Row* y = <const Row*> b
    if x.minus_score != y.minus_score:
        return -1 if x.minus_score < y.minus_score else 1
    if x.penalty != y.penalty:
        return -1 if x.penalty < y.penalty else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef int _compare_draws(const void* a, const void* b) noexcept nogil:
    # (draw, index) order: within a tied group.
    cdef const Row* x = <const Row*> a
    cdef const Row* y = <const Row*> b
    if x.draw != y.draw:
        return -1 if x.draw < y.draw else 1
    return -1 if x.index < y.index else (1 if x.index > y.index else 0)


cdef inline bint _same_key(const Row* x, const Row* y) noexcept nogil:
    return x.minus_score == y.minus_score and x.penalty == y.penalty


cdef int _draw_group(Row* group, Py_ssize_t size, object draw) except -1:
    # One draw() per row of a tied group (in index order), then (draw, index) order.
    cdef Py_ssize_t i
    for i in range(size):
        group[i].draw = <double> draw()
    qsort(group, size, sizeof(Row), _compare_draws)
    return 0


def best_tied(list minus_scores, list penalties, object draw, object top_k, list positions):
    """Reference: kvindex.api.decision.policies.tie_order; tests/unit/indexer/native/test_lookup.py::test_best_tied_compiled_equals_python

    Indices of the best ``top_k`` (None or 0: all) of the rows at ``positions`` (None: all);
    one ``draw()`` per row of each tied group the ``top_k`` reaches, in index order."""
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
    """Reference: tests.oracles.lookup.best_matches; tests/unit/indexer/native/test_lookup.py::test_best_matches_compiled_equal_python

    ``(matches, ranks)``: per replica its longest match, a tie to the lowest rank (when not 0)."""
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
    """Reference: tests.oracles.lookup.contenders; tests/unit/indexer/native/test_lookup.py::test_contenders_compiled_equal_python

    ``{replica: matches[replica]}`` for each replica with a holder stream ``i`` such that
    ``penalties[position_of[i]] - per_block * len(match.tiers) <= threshold``."""
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


def kth_smallest(list values, Py_ssize_t k):
    """Reference: builtins.sorted; tests/unit/indexer/native/test_lookup.py::test_kth_smallest_is_the_sorted_list_at_k

    ``sorted(values)[k - 1]``, the ``k`` smallest kept by insertion (``k`` is small)."""
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

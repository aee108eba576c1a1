"""kvindex.indexer.native._lookup: the read path's compiled loops agree with their Python twins.

The install builds the extension (setup.py), so these tests require it, as ``test_core.py``
does. Random inputs (hypothesis) judge agreement, bit for bit where floats are returned: the
load penalty of random fleets (missing loads, loads from the
future, requests in flight, a zero half-life, integer weights), and the best ``top_k`` of
random scores with ties on every key, the random generator left in the same state, the
k-th smallest of random scores, and each replica's best match and the contenders from random
holders' runs (data-parallel ranks, ties in length, matches of no block).
"""

from __future__ import annotations

import random
import struct
from typing import Annotated, cast

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvindex.api.decision import policies
from kvindex.api.decision.policies import Weights, penalty_weights
from kvindex.api.load.model import CountedLoad, InFlight, Load
from kvindex.indexer.domain.events import Tier
from kvindex.indexer.index.protocol import HeldRuns, PrefixMatch
from kvindex.indexer.native import _lookup
from tests.oracles import lookup as oracle

NOW = 1_000_000.0


def _bits(values: list[float]) -> list[bytes]:
    """Each float's IEEE bytes (so 0.0 and -0.0 differ, as equal floats may not)."""
    return [struct.pack("<d", float(v)) for v in values]


_LOAD = st.builds(
    Load,
    running=st.floats(0, 500) | st.integers(0, 64).map(float),
    waiting=st.floats(0, 500),
    kv_usage=st.floats(0, 1),
    ts=st.floats(NOW - 1_000, NOW + 5),  # a load from the future reads as age 0
    source=st.just("push"),
)
_COUNTED = st.builds(
    CountedLoad,
    load=st.none() | _LOAD,
    routed=st.integers(0, 50),
    in_flight=st.builds(InFlight, st.integers(0, 20), st.integers(0, 100_000)),
)
_WEIGHTS = st.builds(
    Weights,
    waiting=st.floats(0, 5) | st.integers(0, 3),
    running=st.floats(0, 5),
    kv_usage=st.floats(0, 5),
    routed=st.floats(0, 5) | st.integers(0, 3),
    in_flight=st.floats(0, 5),
    in_flight_tokens=st.floats(0, 0.01),
    load_half_life_s=st.sampled_from([0.0, 0.5, 10.0]) | st.floats(0.01, 100),
)


@settings(max_examples=300)
@given(st.lists(st.none() | _COUNTED, max_size=40), _WEIGHTS, st.floats(-5, 5))
def test_load_penalties_compiled_equal_python(
    counted: list[CountedLoad | None], weights: Weights, shift: float
) -> None:
    replicas = [f"r{i}" for i in range(len(counted))]
    loads = {r: c for r, c in zip(replicas, counted, strict=True) if c is not None}
    now = NOW + shift
    compiled = policies.load_penalties(replicas, loads, now, weights)
    reference = oracle.load_penalties(replicas, loads, now, weights)
    assert _bits(compiled) == _bits(reference)


def test_load_penalties_take_the_python_loop_for_other_containers() -> None:
    loads = {"a": CountedLoad(Load(1.0, 2.0, 0.5, NOW - 3.0, "push"), 2)}
    weights = Weights()
    as_tuple = policies.load_penalties(("a", "b"), loads, NOW, weights)
    assert as_tuple == policies.load_penalties(["a", "b"], loads, NOW, weights)


class _ByName:
    """A load whose fields are not slots: the compiled loop reads them by name."""

    def __init__(self, running: float, waiting: float, kv_usage: float, ts: float) -> None:
        self.running, self.waiting, self.kv_usage, self.ts = running, waiting, kv_usage, ts


class _OtherSlots:
    """A load of another slotted type than the one the compiled loop learnt."""

    __slots__ = ("kv_usage", "running", "ts", "waiting")

    def __init__(self, running: float, waiting: float, kv_usage: float, ts: float) -> None:
        self.running, self.waiting, self.kv_usage, self.ts = running, waiting, kv_usage, ts


def test_load_penalties_read_loads_of_other_types_and_int_fields_alike() -> None:
    fields = (3, 2.5, 0.25, NOW - 7.0)  # an int count: a Load built in code may hold one
    others = [Load(*fields, source="push"), _ByName(*fields), _OtherSlots(*fields)]
    loads = {
        f"r{i}": CountedLoad(cast("Load", load), 2, InFlight(1, 9)) for i, load in enumerate(others)
    }
    replicas = [*loads, "missing"]
    weights = Weights()
    compiled = policies.load_penalties(replicas, loads, NOW, weights)
    assert _bits(compiled) == _bits(oracle.load_penalties(replicas, loads, NOW, weights))
    assert compiled[0] == compiled[1] == compiled[2]


_SCORE = st.sampled_from([-1.0, -0.5, 0.0, 0.25]) | st.floats(-2, 2)


@settings(max_examples=400)
@given(
    st.lists(st.tuples(_SCORE, st.sampled_from([0.0, 0.1]) | st.floats(0, 2)), max_size=60),
    st.none() | st.integers(0, 70),
    st.integers(0, 2**32),
    st.data(),
)
def test_best_tied_compiled_equals_python(
    rows: list[tuple[float, float]], top_k: int | None, seed: int, data: st.DataObject
) -> None:
    """The same indices and the same draws taken (the generator's state after), over every
    row or a subset of them (``positions``, in any order)."""
    minus_scores = [m for m, _ in rows]
    penalties = [p for _, p in rows]
    positions: list[int] | None = None
    if data.draw(st.booleans()) and len(rows) > 0:
        shuffled: list[int] = data.draw(st.permutations(list(range(len(rows)))))
        positions = shuffled[: data.draw(st.integers(0, len(rows)))]
    compiled_rng, python_rng = random.Random(seed), random.Random(seed)
    compiled = _lookup.best_tied(minus_scores, penalties, compiled_rng.random, top_k, positions)
    python = policies.tie_order(minus_scores, penalties, python_rng.random, top_k, positions)
    assert compiled == python
    assert compiled_rng.getstate() == python_rng.getstate()


def test_best_tied_draws_only_for_the_ties_the_top_k_reaches() -> None:
    draws: list[int] = []

    def draw() -> float:
        draws.append(1)
        return 0.5 - 0.1 * len(draws)  # later draws are smaller: a tie reverses

    minus = [0.0, 0.0, 1.0, 2.0, 2.0, 3.0, 3.0]
    penalties = [0.0] * 7
    assert _lookup.best_tied(minus, penalties, draw, 1, None) == [1]  # the first tie: 2 draws
    assert len(draws) == 2
    draws.clear()
    assert _lookup.best_tied(minus, penalties, draw, 3, None) == [1, 0, 2]  # 2 is alone
    assert len(draws) == 2
    draws.clear()
    assert _lookup.best_tied(minus, penalties, draw, 4, None) == [1, 0, 2, 4]  # 3 and 4 tie
    assert len(draws) == 4
    draws.clear()
    assert _lookup.best_tied([0.0, 0.0], [1.0, 0.5], draw, None, None) == [1, 0]  # load first
    assert not draws


def test_best_tied_with_tied_draws_orders_by_index() -> None:
    assert _lookup.best_tied([0.0, 0.0, 0.0], [1.0, 1.0, 1.0], lambda: 0.5, 2, None) == [0, 1]


def test_best_tied_checks_its_inputs() -> None:
    with pytest.raises(ValueError, match="differ in length"):
        _lookup.best_tied([0.0], [], random.random, None, None)
    with pytest.raises(IndexError):
        _lookup.best_tied([0.0], [0.0], random.random, 1, [3])
    with pytest.raises(ValueError, match="top_k"):
        _lookup.best_tied([0.0], [0.0], random.random, -1, None)


_TIMES = st.floats(-20, 20)


@settings(max_examples=300)
@given(st.lists(st.none() | _COUNTED, max_size=40), _WEIGHTS, _TIMES, st.floats(0, 30), st.data())
def test_penalty_floors_are_under_every_penalty_until_their_time(
    counted: list[CountedLoad | None],
    weights: Weights,
    shift: float,
    ahead: float,
    data: st.DataObject,
) -> None:
    replicas = [f"r{i}" for i in range(len(counted))]
    loads = {r: c for r, c in zip(replicas, counted, strict=True) if c is not None}
    until = NOW + shift + ahead
    floors = _lookup.penalty_floors(replicas, loads, until, *penalty_weights(weights))
    for now in (NOW + shift, until, data.draw(st.floats(NOW - 1_000, until))):
        penalties = policies.load_penalties(replicas, loads, now, weights)
        assert all(f <= p for f, p in zip(floors, penalties, strict=True))
    at_until = policies.load_penalties(replicas, loads, until, weights)
    assert all(f >= p - 1e-9 * (1 + p) for f, p in zip(floors, at_until, strict=True))


@given(st.lists(st.sampled_from([0.0, 1.0, -float("inf")]) | st.floats(-5, 5), max_size=60))
def test_ascending_is_the_stable_sort_of_the_indices(values: list[float]) -> None:
    assert _lookup.ascending(values) == sorted(range(len(values)), key=values.__getitem__)


@settings(max_examples=300)
@given(
    st.lists(st.none() | _COUNTED, min_size=1, max_size=40),
    _WEIGHTS,
    st.floats(0, 30),
    st.data(),
)
def test_penalties_within_computes_every_one_that_can_be_among_the_k_lowest(
    counted: list[CountedLoad | None], weights: Weights, ahead: float, data: st.DataObject
) -> None:
    """Exact penalties where computed (the ``exact`` positions and the walk), ``inf``
    elsewhere; the ``k``-th lowest of all; each one left out above it."""
    replicas = [f"r{i}" for i in range(len(counted))]
    loads = {r: c for r, c in zip(replicas, counted, strict=True) if c is not None}
    now = NOW + data.draw(_TIMES)
    until = now + ahead
    args = penalty_weights(weights)
    floors = _lookup.penalty_floors(replicas, loads, until, *args)
    order = _lookup.ascending(floors)
    n = len(replicas)
    exact = data.draw(st.lists(st.integers(0, n - 1), max_size=6))
    k = data.draw(st.integers(1, n))
    got, positions, kth = _lookup.penalties_within(
        replicas, loads, now, order, floors, exact, k, *args
    )
    penalties = policies.load_penalties(replicas, loads, now, weights)
    assert kth == sorted(penalties)[k - 1]
    assert set(exact) <= set(positions) and len(positions) == len(set(positions))
    for i in range(n):
        if i in positions:
            assert _bits([got[i]]) == _bits([penalties[i]])
        else:
            assert got[i] == float("inf") and penalties[i] > kth


def test_penalties_within_checks_its_inputs() -> None:
    loads: dict[str, CountedLoad] = {}
    args = penalty_weights(Weights())
    with pytest.raises(IndexError, match="k out of range"):
        _lookup.penalties_within(["a"], loads, NOW, [0], [0.0], [], 2, *args)
    with pytest.raises(ValueError, match="differ in length"):
        _lookup.penalties_within(["a", "b"], loads, NOW, [0], [0.0], [], 1, *args)
    with pytest.raises(IndexError, match="position out of range"):
        _lookup.penalties_within(["a"], loads, NOW, [0], [0.0], [5], 1, *args)


@given(st.lists(_SCORE, min_size=1, max_size=60), st.data())
def test_kth_smallest_is_the_sorted_list_at_k(values: list[float], data: st.DataObject) -> None:
    k = data.draw(st.integers(1, len(values)))
    assert _lookup.kth_smallest(values, k) == sorted(values)[k - 1]


def test_kth_smallest_rejects_a_k_out_of_range() -> None:
    for k in (0, 3):
        with pytest.raises(IndexError):
            _lookup.kth_smallest([1.0, 2.0], k)


@given(st.lists(st.integers(0, 2**32 - 1), max_size=30), st.sampled_from(["", " ", "\n "]))
def test_json_token_span_finds_the_array_and_reads_it(ids: list[int], space: str) -> None:
    array = "[" + f",{space}".join(map(str, ids)) + "]"
    body = f'{{"model": "m", "token_ids"{space}:{space}{array}{space}}}'.encode()
    found = _lookup.json_token_span(body, 100)
    assert found is not None
    packed, start, end = found
    assert body[start:end] == array.encode()
    assert (
        packed == struct.pack(f"<{len(ids)}I", *ids) == _lookup.json_token_ids(array.encode(), 100)
    )
    assert packed == _general_decode(
        msgspec.json.encode(msgspec.json.decode(body)["token_ids"]), 100
    )


def test_json_token_span_leaves_other_bodies_alone() -> None:
    for body in (
        b'{"model": "m", "token_ids": [1, 2]',  # no closing brace
        b'{"model": "m", "token_ids": null}',
        b'{"model": "m", "token_ids": [1, -2]}',
        b'{"model": "m", "token_ids": [1, 2, 3]}',  # past max_length (2)
        b'{"model": "m"}',
    ):
        assert _lookup.json_token_span(body, 2) is None


@st.composite
def _held(draw: st.DrawFn) -> tuple[HeldRuns, list[str], list[int]]:
    """Random holders' runs over streams of a few replicas (some with several ranks), each
    stream in one run at most, with matches of 0 to 4 blocks on random tiers."""
    num_streams = draw(st.integers(0, 30))
    replica_of = [f"r{draw(st.integers(0, 9))}" for _ in range(num_streams)]
    rank_of = [draw(st.integers(0, 3)) for _ in range(num_streams)]
    indices = draw(st.permutations(list(range(num_streams))))
    runs: HeldRuns = []
    while indices:
        size = draw(st.integers(1, len(indices)))
        tiers = draw(st.lists(st.sampled_from(list(Tier)), max_size=4))
        runs.append((PrefixMatch(tuple(tiers)), list(indices[:size])))
        indices = indices[size:]
    return runs, replica_of, rank_of


@settings(max_examples=300)
@given(_held())
def test_best_matches_compiled_equal_python(held: tuple[HeldRuns, list[str], list[int]]) -> None:
    runs, replica_of, rank_of = held
    unique = len(set(replica_of)) == len(replica_of)
    compiled = _lookup.best_matches(runs, replica_of, rank_of, unique)
    assert compiled == oracle.best_matches(runs, replica_of, rank_of, unique)
    matches, ranks = compiled
    for replica, match in matches.items():  # the longest over its streams, then lowest rank
        mine = [(m, rank_of[i]) for m, run in runs for i in run if replica_of[i] == replica]
        longest = max(len(m.tiers) for m, _ in mine)
        rank = min(r for m, r in mine if len(m.tiers) == longest)
        assert (len(match.tiers), ranks.get(replica, 0)) == (longest, rank)
        assert 0 not in ranks.values()
    assert all(any(m.tiers for m, _ in runs) for _ in matches)


@settings(max_examples=300)
@given(_held(), st.lists(_SCORE, min_size=10, max_size=10), _SCORE, st.floats(0, 0.5))
def test_contenders_compiled_equal_python(
    held: tuple[HeldRuns, list[str], list[int]],
    penalties: list[float],
    threshold: float,
    per_block: float,
) -> None:
    runs, replica_of, rank_of = held
    matches, _ = oracle.best_matches(runs, replica_of, rank_of, False)
    position_of = [int(r[1:]) for r in replica_of]
    compiled = _lookup.contenders(
        runs, position_of, replica_of, matches, penalties, per_block, threshold
    )
    assert compiled == oracle.contenders(
        runs,
        position_of,
        replica_of,
        matches=matches,
        penalties=penalties,
        per_block=per_block,
        threshold=threshold,
    )
    expected = {  # the bound on each replica's best match, as the scorer first wrote it
        r: m
        for r, m in matches.items()
        if penalties[int(r[1:])] - per_block * len(m.tiers) <= threshold
    }
    assert compiled == expected


def test_best_matches_and_contenders_check_their_indices() -> None:
    runs: HeldRuns = [(PrefixMatch((Tier.GPU,)), [3])]
    with pytest.raises(IndexError):
        _lookup.best_matches(runs, ["a"], [0], True)
    with pytest.raises(ValueError, match="differ in length"):
        _lookup.best_matches(runs, ["a"], [], True)
    with pytest.raises(IndexError):
        _lookup.contenders(runs, [0], ["a"], {}, [0.0], 0.1, 0.0)


@given(
    st.lists(
        st.integers(1, 9).map(lambda digits: 10**digits - 1)
        | st.sampled_from([0, 10**9, 2**32 - 1])
        | st.integers(0, 2**32 - 1)
    ),
    st.lists(st.sampled_from(["", " ", "\n", "\t", "\r\n"]), min_size=2, max_size=2),
)
def test_json_token_ids_reads_ids_of_every_length_in_any_spacing(
    ids: list[int], spaces: list[str]
) -> None:
    before, after = spaces
    array = "[" + ",".join(f"{before}{i}{after}" for i in ids) + "]"
    packed = _lookup.json_token_ids(array.encode(), len(ids))
    assert packed == struct.pack(f"<{len(ids)}I", *ids)
    assert type(packed) is bytes


@pytest.mark.parametrize(
    "array",
    [b"[01]", b"[1,02]", b"[4294967296]", b"[99999999999]", b"[1.5]", b"[1e3]", b"[-1]",
     b"[1,]", b"[,1]", b"[1 2]", b'[1,"2"]', b"[1,null]", b"[1,,2]", b"[00]"],
)  # fmt: skip
def test_json_token_ids_refuses_what_is_no_plain_array_of_u32(array: bytes) -> None:
    assert _lookup.json_token_ids(array, 10) is None
    assert _lookup.json_token_span(b'{"model": "m", "token_ids": ' + array + b"}", 10) is None


_U32 = Annotated[int, msgspec.Meta(ge=0, lt=2**32)]
_JSON_ITEM = st.integers(0, 2**32 - 1).map(str) | st.sampled_from(
    ["-1", "-0", "01", "1.5", "1e3", "1.0", "4294967296", "null", '"2"', "[]", ""]
)
_JSON_SEPARATOR = st.sampled_from([",", ", ", " ,", ",\n\t", ",,"])


def _general_decode(raw: bytes, max_length: int) -> bytes | None:
    """The ids as the general decode reads them (typed as ``token_ids``), packed."""
    try:
        ids = msgspec.json.decode(raw, type=list[_U32])
    except msgspec.DecodeError:
        return None
    return struct.pack(f"<{len(ids)}I", *ids) if len(ids) <= max_length else None


@settings(max_examples=400)
@given(
    st.lists(_JSON_ITEM, max_size=12),
    _JSON_SEPARATOR,
    st.sampled_from(["", " ", "\r\n"]),
    st.integers(0, 12),
    st.booleans(),
)
def test_json_token_ids_equal_the_general_decode(
    items: list[str], separator: str, space: str, max_length: int, closed: bool
) -> None:
    """None or the general decode's ids, and those whenever the array is plain u32s."""
    raw = f"{space}[{space}{separator.join(items)}{space}{']' if closed else ''}{space}".encode()
    got = _lookup.json_token_ids(raw, max_length)
    expected = _general_decode(raw, max_length)
    assert got is None or got == expected
    plain = all(item.isdigit() and (item == "0" or item[0] != "0") for item in items)
    if plain and closed and separator != ",," and expected is not None:
        assert got == expected


def test_json_token_ids_takes_max_length_ids_and_no_more() -> None:
    ids = [2**32 - 1, 0] * 50_000
    array = msgspec.json.encode(ids)
    assert _lookup.json_token_ids(array, len(ids)) == struct.pack(f"<{len(ids)}I", *ids)
    assert _lookup.json_token_ids(array, len(ids) - 1) is None
    # Short ids far apart: the ids read are a fraction of what the bytes could hold.
    sparse = ("[" + ",".join(["7" + " " * 30] * 1000) + "]").encode()
    assert _lookup.json_token_ids(sparse, 10**6) == struct.pack("<1000I", *[7] * 1000)

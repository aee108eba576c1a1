"""Types of the compiled ``_lookup`` (see ``_lookup.pyx``)."""

from collections.abc import Callable

from kvindex.api.load.model import CountedLoad
from kvindex.indexer.index.protocol import PrefixMatch
from kvindex.indexer.native._json import json_token_ids as json_token_ids
from kvindex.indexer.native._json import json_token_span as json_token_span

def load_penalties(
    replicas: list[str],
    counted: dict[str, CountedLoad],
    now: float,
    w_in_flight: float,
    w_tokens: float,
    half_life: float,
    w_waiting: float,
    w_running: float,
    w_routed: float,
    w_kv: float,
) -> list[float]: ...
def penalty_floors(
    replicas: list[str],
    counted: dict[str, CountedLoad],
    until: float,
    w_in_flight: float,
    w_tokens: float,
    half_life: float,
    w_waiting: float,
    w_running: float,
    w_routed: float,
    w_kv: float,
) -> list[float]: ...
def ascending(values: list[float]) -> list[int]: ...
def penalties_within(
    replicas: list[str],
    counted: dict[str, CountedLoad],
    now: float,
    order: list[int],
    floors: list[float],
    exact: list[int],
    k: int,
    w_in_flight: float,
    w_tokens: float,
    half_life: float,
    w_waiting: float,
    w_running: float,
    w_routed: float,
    w_kv: float,
) -> tuple[list[float], list[int], float]: ...
def best_tied(
    minus_scores: list[float],
    penalties: list[float],
    draw: Callable[[], float],
    top_k: int | None,
    positions: list[int] | None,
) -> list[int]: ...
def best_matches(
    runs: list[tuple[PrefixMatch, list[int]]],
    replica_of: list[str],
    rank_of: list[int],
    unique: bool,
) -> tuple[dict[str, PrefixMatch], dict[str, int]]: ...
def contenders(
    runs: list[tuple[PrefixMatch, list[int]]],
    position_of: list[int],
    replica_of: list[str],
    matches: dict[str, PrefixMatch],
    penalties: list[float],
    per_block: float,
    threshold: float,
) -> dict[str, PrefixMatch]: ...
def kth_smallest(values: list[float], k: int) -> float: ...

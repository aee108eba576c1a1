"""``POST /score`` as a library call: request → keys → index lookup → policy → response.

The read path, step by step (the README's diagram numbers them the same way):

1. resolve the model and its candidates (the registry's replicas serving it);
2. tokens from ``token_ids``, or ``prompt`` / ``messages`` through the model's tokenizer
   (the caller's choice; the app's is :class:`kvindex.api.tokenize.choice.ModelTokenizers`),
   or ``block_keys`` as given;
3. block keys with ``kvindex.indexer.domain.keys`` (the indexer's own key function) at the model's
   block size (as its replicas publish it); then the first ``[[rules]]`` entry matching the
   request (:mod:`kvindex.api.decision.routing_rules`: model, workload, user, headers, prompt
   length, tools) chooses its policy and weights, unless the request chose them;
4. longest cached prefix per (replica, rank) from the index — if the store is
   unreachable, the answer is made from load alone and says ``degraded``;
5. load per replica (pushed or scraped), with its age, and the requests in flight to it
   that proxies reserved (``LoadStore.get_counted`` reads both);
6. the policy scores every candidate and keeps the best ``top_k``
   (:func:`kvindex.api.decision.policies.decide`); only those become entries, every term reported,
   the rest counted (``num_candidates``, ``num_matched``).

Cost per request, for ``kv_aware`` (the default; no temperature): the lookup, then the load
penalties the answer needs. From 128 candidates on, with a ``top_k`` that leaves some out,
they come from floors kept per candidate list and weights
(:mod:`~kvindex.api.decision.penalty_floors`): a changed replica's floor made again (the load
store's :class:`~kvindex.api.load.store.LoadChanges`: an answer counted changes one), then
exact penalties only for the replicas whose floor may be among the ``top_k`` lowest and
the holders whose floor, less the most their match can add, may be; the floors are made
again (a pass over the fleet) once the clock passes a 16th of the load half-life. Below
that, or with every candidate explained, every penalty is computed
(:func:`~kvindex.api.decision.policies.load_penalties`, one compiled loop). A random draw is made
only for a tie the ``top_k`` reaches (:func:`~kvindex.api.decision.policies.tie_order`, as ``rank``
draws: the same law of answers as a draw per candidate). Left per candidate: C-speed
copies of the fleet's lists (the load read's dict, the answer's list of penalties; specs
sorted once per change). Everything else
follows the holders, not the fleet: the index answers its holders alone, by index in the
streams asked, in runs of one match (:func:`~kvindex.indexer.index.protocol.holders_of`;
the memory index walks the matched prefix and names no other stream); each replica's best
match and :func:`_contenders` (the holders that may rank among the ``top_k`` whatever
their freshness: a bound on what a match can add) are a compiled pass over those runs,
two list reads per holder, no hashing; the stream list (with each stream's replica, rank
and candidate position) is kept while the registry's ``streams_version`` and the
candidates stay the same. The cache term only for the contenders (one credit per shared
match) with the freshness it needs; candidates, terms, freshness and load views, entries
and their JSON for the best ``top_k`` alone, ordered as ``rank`` orders them (ties: lower
load, then the draw), so ``best`` and the entries are those of the plain path
(``tests/unit/api/test_score_equivalence.py``). An answer of ``bench/score.py``'s lookup
(memory store, 1,024 replicas of which 256 hold a 64-block prefix, default ``top_k``)
costs 2.05 M instructions where it cost 3.00 M with a penalty and a draw per candidate
(callgrind, 200 answers; at 32 replicas, 32,768 blocks, 1.55 M and 1.54 M): about 130
penalties computed instead of 1,024, no draw without a tie. A body's ``token_ids`` are read
as u32 bytes
(:func:`~kvindex.api.schemas.decode_score_request`), no Python int per token. Other
policies, and ``kv_aware`` with a temperature (a softmax over every score), build a
candidate and a score per replica.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvindex.api.config.settings import ApiSettings
from kvindex.api.decision.penalty_floors import PenaltyFloors, Walk
from kvindex.api.decision.penalty_floors import pays as _floors_pay
from kvindex.api.decision.policies import (
    Candidate,
    Decision,
    LoadInput,
    Policy,
    Scored,
    ScoringError,
    Weights,
    decide,
    kv_aware,
    load_penalties,
    tie_order,
    tier_credit,
)
from kvindex.api.decision.routing_rules import WORKLOAD_HEADER, RoutingRule, RuleInput, first_match
from kvindex.api.load.model import CountedLoad, Load, is_newer_or_same
from kvindex.api.load.store import LoadChanges, LoadStore
from kvindex.api.schemas import (
    FreshnessView,
    LoadView,
    ScoreEntry,
    ScoreRequest,
    ScoreResponse,
)
from kvindex.api.tokenize.protocol import Tokenizer
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.events import StreamId, Tier
from kvindex.indexer.domain.keys import (
    BlockKeyError,
    block_keys,
    chain_keys,
    model_root,
    request_extra_keys,
)
from kvindex.indexer.fleet.registry import Freshness, RegistryView, StreamFreshness
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    BlockIndex,
    HeldRuns,
    IndexUnavailableError,
    PrefixMatch,
    holders_of,
)

_KEY_LIMIT = 2**64

_Matches = dict[str, PrefixMatch]
_compiled_best: Callable[..., list[int]] | None = None  # as policies.tie_order
_compiled_kth: Callable[[list[float], int], float] | None = None
_compiled_matches: (
    Callable[[HeldRuns, list[str], list[int], bool], tuple[_Matches, dict[str, int]]] | None
)
_compiled_matches = None
_compiled_contenders: Callable[..., _Matches] | None = None  # as _py_contenders
"""The compiled :func:`_best`, :func:`_kth_smallest`, :meth:`_Lookup.resolve` and
:func:`_contenders` loops (None: not built, the Python ones serve)."""
try:
    from kvindex.indexer.native import _lookup
except ImportError:
    pass
else:
    _compiled_best, _compiled_kth = _lookup.best_tied, _lookup.kth_smallest
    _compiled_matches, _compiled_contenders = _lookup.best_matches, _lookup.contenders

_MAX_FLOORS = 8
"""Weights whose penalty floors a scorer keeps (the default, and rules' or requests')."""


DEGRADED_REASONS = ("index_unavailable", "fleet_unreadable", "no_healthy_candidate")
"""Why an answer can be ``degraded``: the index store could not be read (the answer uses
load alone), the fleet state could not be (it uses the last one read), or every candidate
is unhealthy (all of them are ranked, rather than none). Each degraded answer reports each
of its reasons once to the scorer's ``on_degraded``."""


class RequestError(KvIndexError):
    """A request that cannot be scored as sent (422); names the field."""


class UnknownModelError(KvIndexError):
    """The model is served by no known replica (404); names the known models."""


@dataclass(slots=True)
class _Lookup:
    """What the index answered (its holders, by index in the streams asked), then, once
    resolved against those streams (:meth:`resolve`), the best match per replica (over its
    ranks) and which rank holds it."""

    runs: HeldRuns = field(default_factory=list)
    matches: dict[str, PrefixMatch] = field(default_factory=dict)
    ranks: dict[str, int] = field(default_factory=dict)
    """The rank of each replica's best match when it is not 0 (absent: rank 0, the usual
    one: nothing kept per holder without data parallelism)."""
    degraded: str | None = None

    def num_matched(self) -> int:
        """Replicas holding at least the first block (only those are kept in ``matches``)."""
        return len(self.matches)

    def resolve(self, streams: _Ranked) -> None:
        """Each replica's best match over its streams (the longest; a tie: the lowest
        rank), from the runs, whose indices are into ``streams.streams``: compiled when
        built (one C pass over the holders, no stream read), else
        :func:`_py_best_matches`."""
        if not self.runs:
            return
        best_matches = _compiled_matches or _py_best_matches
        self.matches, self.ranks = best_matches(
            self.runs, streams.replica_of, streams.rank_of, streams.unique
        )


_Streams = tuple[StreamId, ...]


@dataclass(frozen=True, slots=True)
class _Ranked:
    """What the ranked candidates' stream list gives, made once per basis."""

    streams: _Streams
    position: dict[str, int]
    """Each candidate's index in the ranked list."""
    streams_of: dict[str, _Streams]
    """Each candidate's streams (declared ranks and ranks heard of)."""
    replica_of: list[str]
    """Each stream's replica, by its index in ``streams``."""
    rank_of: list[int]
    """Each stream's rank, by its index in ``streams``."""
    position_of: list[int]
    """Each stream's replica's index in the ranked list, by the stream's index."""
    unique: bool
    """No replica has two streams (data parallelism): each holder is its replica's best."""


@dataclass(slots=True)
class _Specs:
    """What the registry's specs give the scorer, made once per change of the specs."""

    specs: list[ReplicaSpec]
    serving: dict[str, list[str]]
    """Per model, the replicas serving it, by id."""
    connecting: frozenset[str]
    """Replicas in connect mode (whose events stream can be down)."""


def _specs_memo(specs: list[ReplicaSpec]) -> _Specs:
    serving: dict[str, list[str]] = {}
    for r in specs:
        serving.setdefault(r.model, []).append(r.id)
    connecting = frozenset(r.id for r in specs if r.events is not None)
    return _Specs(specs, serving, connecting)


def _lookup_of(found: HeldRuns | IndexUnavailableError) -> _Lookup:
    """The index's holders, to be resolved (:meth:`_Lookup.resolve`), or its outage as
    ``degraded``."""
    if isinstance(found, IndexUnavailableError):
        return _Lookup(degraded=f"index store unavailable: {found}")
    return _Lookup(found)


def _py_best_matches(
    runs: HeldRuns, replica_of: list[str], rank_of: list[int], unique: bool
) -> tuple[_Matches, dict[str, int]]:
    """:meth:`_Lookup.resolve`'s (matches, ranks that are not 0) in Python: the reference
    of the compiled loop, and the fallback (``unique``, no replica with two streams, only
    spares the compiled loop its compares)."""
    matches: _Matches = {}
    ranks: dict[str, int] = {}
    for match, run in runs:
        num_blocks = len(match.tiers)
        if not num_blocks:
            continue
        for i in run:
            replica, rank = replica_of[i], rank_of[i]
            best = matches.get(replica)
            if best is not None:
                most = len(best.tiers)
                if num_blocks < most or (num_blocks == most and rank > ranks.get(replica, 0)):
                    continue
            matches[replica] = match
            if rank:
                ranks[replica] = rank
            elif best is not None:
                ranks.pop(replica, None)
    return matches, ranks


def _all_streams(
    replicas: Sequence[str], specs: Sequence[ReplicaSpec], heard: Sequence[StreamId]
) -> _Ranked:
    """Every rank of every replica (declared or heard of), sorted."""
    wanted = set(replicas)
    streams = {StreamId(r.id, rank) for r in specs if r.id in wanted for rank in range(r.dp_size)}
    streams.update(s for s in heard if s.replica in wanted)
    ordered = tuple(sorted(streams))
    streams_of: dict[str, list[StreamId]] = {}
    for stream in ordered:
        streams_of.setdefault(stream.replica, []).append(stream)
    position = {r: i for i, r in enumerate(replicas)}
    by_replica = {r: tuple(s) for r, s in streams_of.items()}
    replica_of, rank_of = [s.replica for s in ordered], [s.rank for s in ordered]
    position_of = [position[r] for r in replica_of]
    unique = len(ordered) == len(by_replica)
    return _Ranked(ordered, position, by_replica, replica_of, rank_of, position_of, unique)


class Scorer:
    """Answers score requests. Safe to share across concurrent requests of one event loop.

    ``tokenizers`` gives a model's tokenizer, or None when it has none (a ``prompt`` or
    ``messages`` request is then a 422); ``blocking_store``: the index and load store do
    network I/O, so their reads run in a worker thread; ``clock`` dates load ages.
    """

    def __init__(
        self,
        settings: ApiSettings,
        index: BlockIndex,
        registry: RegistryView,
        loads: LoadStore,
        *,
        tokenizers: Callable[[str], Tokenizer | None],
        blocking_store: bool,
        clock: Callable[[], float] = time.time,
        on_degraded: Callable[[str], None] = lambda _reason: None,
    ) -> None:
        self._settings = settings
        self._index = index
        self._holders = holders_of(index)
        self._registry = registry
        self._loads = loads
        self._tokenizers = tokenizers
        self._blocking = blocking_store
        self._clock = clock
        self._on_degraded = on_degraded
        self._rng = random.Random(settings.seed)
        self._turns: defaultdict[str, itertools.count[int]] = defaultdict(itertools.count)
        """Per model, the next round-robin turn."""
        self._last_loads: dict[str, Load] = {}
        self._last_read: dict[str, CountedLoad] = {}
        """The last load read, folded into ``_last_loads`` only when an outage needs it (a
        read is per request; an outage is rare)."""
        self._streams_memo: tuple[int, list[str], _Ranked] | None = None
        """The registry's streams version and the candidates the streams were made for."""
        self._specs_memo: _Specs | None = None
        self._answers: list[str] = []
        """Answers made since the last load read: counted in the store by the next read."""
        self._health_policy = settings.health_policy()
        self._default_weights = settings.weights.as_dict()
        self._changes = loads if isinstance(loads, LoadChanges) else None
        self._floors: dict[Weights, PenaltyFloors] = {}
        """Per weights, the penalty floors of the last candidate list scored with them
        (:mod:`~kvindex.api.decision.penalty_floors`; the last :data:`_MAX_FLOORS`)."""
        self._last_floors: tuple[Weights, PenaltyFloors] | None = None

    def note_load(self, replica: str, load: Load) -> None:
        """Remember a load this process accepted (``POST /load``), so that an answer made
        while the load store is unreachable still uses it; an older load changes nothing."""
        if is_newer_or_same(load, self._last_loads.get(replica)):
            self._last_loads[replica] = load

    def forget(self, replica: str) -> None:
        """Drop what is remembered of a removed replica."""
        self._last_loads.pop(replica, None)
        self._last_read.pop(replica, None)
        self._answers = [a for a in self._answers if a != replica]

    def _note_routed(self, best: str | None, loads: dict[str, CountedLoad]) -> None:
        """Count an answer toward its replica's load (in the store, with the next read:
        every API process sharing the store sees it, and it costs no round trip)."""
        counted = loads.get(best) if best is not None else None
        if best is not None and counted is not None and counted.load is not None:
            self._answers.append(best)

    def known_models(self) -> list[str]:
        configured = {m.name for m in self._settings.models}
        return sorted(configured | set(self._registry.models()))

    async def score(
        self,
        request: ScoreRequest,
        headers: Mapping[str, str] | None = None,
        *,
        packed_tokens: bytes | None = None,
    ) -> ScoreResponse:
        """The answer to ``request``: every candidate scored, the best ``top_k`` explained
        (:meth:`top_k`), the others counted only (their entries are never built).
        ``headers`` (the HTTP request's, looked up by lower-case name) are what
        ``[[rules]]`` may match besides the body. ``packed_tokens``: the request's token
        ids as little-endian u32 bytes, in place of its ``token_ids`` (None then; as
        :func:`~kvindex.api.schemas.decode_score_request` reads a body): the same answer."""
        specs = self._registry.replicas()
        outage = self._registry.outage()
        candidates = self._candidates(request, specs, outage)
        block_size = self.block_size(request.model)
        num_tokens, keys = await self._keys(request, block_size, packed_tokens)
        rule = self._rule(request, num_tokens, headers or {})
        weights = self._weights(request, rule)
        policy = self._policy(request, rule)
        unhealthy = self._unhealthy(candidates, specs)
        ranked = [r for r in candidates if r not in unhealthy] if unhealthy else candidates
        ranked = ranked or candidates
        streams = self._streams(ranked)
        lookup, loads, version = await self._read(keys, streams.streams, ranked)
        lookup.resolve(streams)
        if policy is Policy.KV_AWARE and not weights.temperature:
            seen = _Seen(lookup, loads, {}, self._clock(), version)
            seen, decision = self._decide_kv_aware(
                ranked, streams, seen, keys=keys, request=request, weights=weights
            )
        else:
            seen = _Seen(lookup, loads, self._statuses(), self._clock())
            cands = [seen.candidate(r) for r in ranked]
            decision = self._decide(policy, cands, keys, request, weights)
        if not request.dry_run:
            self._note_routed(decision.best, loads)
        no_healthy = _no_healthy(unhealthy) if unhealthy and ranked is candidates else None
        degraded = self._degraded(lookup.degraded, outage, no_healthy)
        return ScoreResponse(
            model=request.model,
            block_size=block_size,
            num_tokens=num_tokens,
            num_blocks=len(keys),
            best=decision.best,
            policy=policy.value,
            weights=self._weights_view(weights),
            scores=[seen.entry(s, block_size) for s in decision.ranked],
            num_candidates=len(ranked),
            num_matched=lookup.num_matched(),
            degraded=degraded,
            rule=rule.name if rule is not None else None,
            unhealthy=unhealthy,
        )

    def _degraded(
        self, index_outage: str | None, fleet_outage: str | None, no_healthy: str | None
    ) -> str | None:
        """Why the answer is degraded (None: it is not); each reason reported once."""
        whys = (index_outage, fleet_outage, no_healthy)
        degraded = {r: why for r, why in zip(DEGRADED_REASONS, whys, strict=True) if why}
        for reason in degraded:
            self._on_degraded(reason)
        return "; ".join(degraded.values()) or None

    def top_k(self, request: ScoreRequest) -> int | None:
        """Entries the answer explains: the request's ``top_k``, else ``default_top_k``;
        None for every candidate (a ``top_k`` of 0)."""
        top_k = request.top_k if request.top_k is not None else self._settings.default_top_k
        return top_k or None

    # --- 1. model, candidates, policy, weights ------------------------------------------

    def _candidates(
        self, request: ScoreRequest, specs: list[ReplicaSpec], outage: str | None
    ) -> list[str]:
        """The replicas to rank (the model's serving list itself when the request names
        none: shared while the specs stay the same, never to be changed, so that the stream
        list made for it is found by identity). A model no replica serves is unknown (404)
        only when the fleet read is current: during an outage it has no candidates (a
        degraded answer)."""
        serving = self._specs(specs).serving.get(request.model, [])
        if not serving and request.model not in self.known_models():
            if outage is not None:
                return []
            raise UnknownModelError(
                f"unknown model {request.model!r}; known models: {self.known_models()}"
            )
        if request.candidates is None:
            return serving
        unknown = sorted(set(request.candidates) - set(serving))
        if unknown:
            raise RequestError(
                f"candidates: {unknown} do not serve {request.model!r} (serving: {serving})"
            )
        return list(dict.fromkeys(request.candidates))

    def _specs(self, specs: list[ReplicaSpec]) -> _Specs:
        """What the specs give, remembered while they are the same (compared item by item,
        by identity first: the registry hands out the same specs until they change)."""
        memo = self._specs_memo
        if memo is not None and memo.specs == specs:
            memo.specs = specs  # equal but new objects (a re-read): compare by identity next
            return memo
        memo = self._specs_memo = _specs_memo(specs)
        return memo

    def _rule(
        self, request: ScoreRequest, num_tokens: int, headers: Mapping[str, str]
    ) -> RoutingRule | None:
        """The first ``[[rules]]`` entry matching the request (None: none does)."""
        rules = self._settings.rules
        if not rules:
            return None
        seen = RuleInput(
            model=request.model,
            num_tokens=num_tokens,
            workload=request.workload or headers.get(WORKLOAD_HEADER),
            user=request.user,
            has_tools=request.has_tools,
            headers=headers,
        )
        return first_match(rules, seen)

    def _policy(self, request: ScoreRequest, rule: RoutingRule | None) -> Policy:
        """The request's policy, else the rule's, the model's, the API's default."""
        spec = self._settings.model(request.model)
        name = (
            request.policy
            or (rule.policy if rule else None)
            or (spec.policy if spec else None)
            or self._settings.default_policy
        )
        policy = _POLICY_OF.get(name)  # a dict lookup: an enum call costs a microsecond
        if policy is None:
            raise RequestError(f"policy: {name!r} is not one of {[p.value for p in Policy]}")
        return policy

    def _weights_view(self, weights: Weights) -> dict[str, float]:
        """``weights.as_dict()``, the settings' own made once (a copy per answer)."""
        if weights is self._settings.weights:
            return dict(self._default_weights)
        return weights.as_dict()

    def _weights(self, request: ScoreRequest, rule: RoutingRule | None) -> Weights:
        """The API's weights, overridden by the rule's, then by the request's."""
        base = self._settings.weights
        if rule is not None and rule.weights:
            base = base.overridden(rule.weight_overrides())  # checked when loaded
        try:
            return base.overridden(request.weights)
        except ScoringError as exc:
            raise RequestError(f"weights: {exc}") from exc

    def block_size(self, model: str) -> int:
        spec = self._settings.model(model)
        if spec is not None and spec.block_size:
            return spec.block_size
        return self._registry.block_size(model) or self._settings.default_block_size

    # --- 2-3. tokens and keys ------------------------------------------------------------

    async def _keys(
        self, request: ScoreRequest, block_size: int, packed: bytes | None = None
    ) -> tuple[int, list[int]]:
        """(tokens in the prompt, its block keys); ``packed``: its token ids as u32 bytes."""
        given = [
            name
            for name in ("token_ids", "prompt", "messages", "block_keys")
            if getattr(request, name) is not None or (name == "token_ids" and packed is not None)
        ]
        if len(given) != 1:
            raise RequestError(
                "give exactly one of token_ids, prompt, messages, block_keys"
                f" (got {given or 'none'})"
            )
        if request.block_size is not None and request.block_size != block_size:
            raise RequestError(
                f"block_size: the request assumes {request.block_size} but {request.model!r}"
                f" uses {block_size} tokens per block"
            )
        if request.block_keys is not None:
            keys = request.block_keys
            if keys and max(keys) >= _KEY_LIMIT:  # one C pass (msgspec checked they are >= 0)
                raise RequestError("block_keys: every key must be an unsigned 64-bit integer")
            return len(keys) * block_size, keys
        if packed is not None:
            return len(packed) // 4, _packed_keys(request, packed, block_size)
        tokens = request.token_ids
        if tokens is None:
            tokens = await self._tokenize(request)
        try:
            keys = block_keys(
                request.model,
                tokens,
                block_size,
                lora_name=request.lora_name,
                cache_salt=request.cache_salt,
            )
        except BlockKeyError as exc:
            raise RequestError(f"token_ids: {exc}") from exc
        return len(tokens), keys

    async def _tokenize(self, request: ScoreRequest) -> list[int]:
        tokenizer = self._tokenizers(request.model)
        field_name = "prompt" if request.prompt is not None else "messages"
        if tokenizer is None:
            raise RequestError(
                f"{field_name}: no tokenizer for model {request.model!r}; send token_ids or"
                " block_keys, or configure [[models]] tokenizer"
            )
        if request.prompt is not None:
            return await tokenizer.encode_prompt(request.prompt)
        assert request.messages is not None
        return await tokenizer.encode_messages(request.messages)

    # --- 4. lookup -------------------------------------------------------------------------

    async def _read(
        self, keys: list[int], streams: _Streams, replicas: Sequence[str]
    ) -> tuple[_Lookup, dict[str, CountedLoad], int | None]:
        """The request's two store reads (index, then load with the answers made since the
        last read counted first), in one worker-thread hop when the stores block (a hop
        costs about as much as a Redis round trip on loopback). Answers that could not be
        counted (the load store unreachable) are dropped: counted after the outage, they
        would weigh on loads measured after they were made. The version: the load store's
        change version read just before its read (None: the loads are not the store's,
        or it keeps none), for the penalty floors (:meth:`_penalties`)."""
        answers, self._answers = self._answers, []
        if self._blocking:
            found, loads, version = await asyncio.to_thread(
                self._read_stores, keys, streams, replicas, answers
            )
        else:
            found, loads, version = self._read_stores(keys, streams, replicas, answers)
        if loads is None:
            version = None
        return _lookup_of(found), self._loads_seen(loads, replicas), version

    def _read_stores(
        self, keys: list[int], streams: _Streams, replicas: Sequence[str], answers: list[str]
    ) -> tuple[HeldRuns | IndexUnavailableError, dict[str, CountedLoad] | None, int | None]:
        """Both reads (and the load store's change version just before its read); an
        unreachable store is returned as its error (index) or None (load) so that the other
        read still happens."""
        found: HeldRuns | IndexUnavailableError
        try:
            found = self._holders(keys, streams)
        except IndexUnavailableError as exc:
            found = exc
        changes = self._changes
        version = changes.change_version() if changes is not None else None
        try:
            loads = self._loads.get_counted(replicas, answers)
        except IndexUnavailableError:
            loads = None
        return found, loads, version

    def _streams(self, replicas: list[str]) -> _Ranked:
        """Every stream of the candidates (and of each one); remembered until the candidates
        or the registry's :meth:`~kvindex.indexer.fleet.registry.RegistryView.streams_version`
        change (the version is read first, so a list made from a later fleet is at worst
        made again)."""
        version = self._registry.streams_version()
        memo = self._streams_memo
        if memo is not None and memo[0] == version and (memo[1] is replicas or memo[1] == replicas):
            return memo[2]
        specs, heard = self._registry.replicas(), self._registry.stream_ids()
        streams = _all_streams(replicas, specs, heard)
        self._streams_memo = (version, replicas, streams)  # never changed (_candidates)
        return streams

    # --- 5. load ---------------------------------------------------------------------------

    def _loads_seen(
        self, loads: dict[str, CountedLoad] | None, replicas: Sequence[str]
    ) -> dict[str, CountedLoad]:
        """Remember what was read; when the load store was unreachable, what was last read
        (with no answers counted)."""
        if loads is not None:
            self._last_read = loads
            return loads
        read, self._last_read = self._last_read, {}
        for replica, counted in read.items():
            if counted.load is not None:
                self.note_load(replica, counted.load)
        last = self._last_loads
        return {r: CountedLoad(last[r], 0) for r in replicas if r in last}

    def _unhealthy(self, candidates: Sequence[str], specs: list[ReplicaSpec]) -> dict[str, str]:
        """Candidates out of routing, and why: ejected (failed health checks, an open
        breaker), or a connect-mode events stream down for ``events_down_after_s``. Costs
        an attribute read per judged replica and per stream not connected (none in bind
        mode: its streams have no connection to lose)."""
        health = self._registry.replica_health()
        judged = [
            r for r, h in health.items() if h.check_ejected or h.breaker_open_until is not None
        ]
        connecting = self._specs(specs).connecting
        down = self._registry.disconnected() if connecting else []
        down = [s for s in down if s.replica in connecting]
        if not judged and not down:
            return {}
        now, policy = self._clock(), self._health_policy
        wanted = set(candidates)
        out: dict[str, str] = {}
        for replica in judged:
            if replica in wanted and health[replica].ejection(now, policy) is not None:
                out[replica] = health[replica].describe(now, policy)
        after_s = self._settings.events_down_after_s
        for replica, statuses in _by_replica(self._registry.freshness(down)).items():
            if replica in wanted and replica not in out:
                why = _events_down(statuses, after_s)
                if why is not None:
                    out[replica] = why
        return {r: out[r] for r in candidates if r in out}

    def _statuses(
        self, streams: Sequence[StreamId] | None = None
    ) -> dict[str, list[StreamFreshness]]:
        """Every stream's freshness (``streams`` only, when given), by replica."""
        return _by_replica(self._registry.freshness(streams))

    # --- 6. decision -----------------------------------------------------------------------

    def _decide_kv_aware(
        self,
        ranked: list[str],
        streams: _Ranked,
        seen: _Seen,
        *,
        keys: list[int],
        request: ScoreRequest,
        weights: Weights,
    ) -> tuple[_Seen, Decision]:
        """``kv_aware`` without a temperature, as :func:`decide` ranks it, at a cost per
        candidate of one load penalty and one random draw: the cache term (and the
        freshness it needs) only for the replicas that matched, the candidates, terms and
        freshness views only for the ``top_k`` explained
        (:func:`~kvindex.api.decision.policies.rank`'s
        order: score, then lower load, then the candidate's draw)."""
        rng = copy.copy(self._rng) if request.dry_run else self._rng
        matches, num_blocks, streams_of = seen.lookup.matches, len(keys), streams.streams_of
        top_k = self.top_k(request)
        walk = self._penalties(ranked, streams, seen, weights, top_k)
        if isinstance(walk, list):
            penalties = bounds = walk
            positions, threshold = None, None
        else:  # floors under the others' penalties bound the contenders as well
            penalties, positions, threshold = walk.penalties, walk.positions, walk.kth
            bounds = walk.bounds()
        contenders = _contenders(
            seen.lookup,
            bounds,
            streams,
            top_k=top_k,
            num_blocks=num_blocks,
            weights=weights,
            threshold=threshold,
        )
        if not isinstance(walk, list):
            walk.complete(map(streams.position.__getitem__, contenders))
        held = self._registry.freshness([s for r in contenders for s in streams_of.get(r, ())])
        states = _states(held)
        credit_of: dict[str, tuple[float, float]] = {}
        minus_scores = _minus_scores(
            penalties,
            contenders,
            states,
            position=streams.position,
            credit_of=credit_of,
            num_blocks=num_blocks,
            weights=weights,
        )
        order = _best(minus_scores, penalties, rng, top_k, positions)
        winners = [ranked[i] for i in order]
        chosen = set(winners)
        seen.statuses.update(_by_replica([s for s in held if s.stream.replica in chosen]))
        rest = [s for r in winners if r not in matches for s in streams_of.get(r, ())]
        seen.statuses.update(self._statuses(rest))
        cands = [seen.candidate(r) for r in winners]
        scored = kv_aware(cands, num_blocks, weights, [credit_of.get(r) for r in winners])
        assert all(s.score == -minus_scores[i] for s, i in zip(scored, order, strict=True))
        return seen, Decision(winners[0] if winners else None, scored)

    def _penalties(
        self,
        ranked: list[str],
        streams: _Ranked,
        seen: _Seen,
        weights: Weights,
        top_k: int | None,
    ) -> list[float] | Walk:
        """Each candidate's load penalty by its position in ``ranked``, as far as the
        answer needs them: from the penalty floors kept for these candidates and weights
        (:class:`~kvindex.api.decision.penalty_floors.PenaltyFloors`, brought up to date with the
        load store's changes, made again when they no longer hold), those that can be among
        the ``top_k`` lowest (a :class:`~kvindex.api.decision.penalty_floors.Walk`: the holders that
        may rank are added once the contenders are known). Else (fewer candidates than
        floors pay for, every one explained, loads not read from the store, or no
        compiled loops): every one."""
        changes, version = self._changes, seen.version
        if changes is None or version is None or not _floors_pay(len(ranked), top_k):
            return load_penalties(ranked, seen.loads, seen.now, weights)
        assert top_k is not None
        kept, loads = self._floors, seen.loads
        last = self._last_floors  # the same weights object as the last answer's: no hashing
        floors = last[1] if last is not None and last[0] is weights else kept.get(weights)
        if floors is not None and floors.holds(ranked, seen.now):
            changed = changes.changed_since(floors.version)
            if changed is None or not floors.note_changed(
                changed, streams.position, loads, version
            ):
                floors = None
        else:
            floors = None
        if floors is None:
            floors = PenaltyFloors(ranked, weights, loads, now=seen.now, version=version)
            kept.pop(weights, None)
            if len(kept) >= _MAX_FLOORS:
                del kept[next(iter(kept))]  # the weights least recently made again
            kept[weights] = floors
        self._last_floors = (weights, floors)
        return floors.walk(loads, seen.now, top_k)

    def _decide(
        self,
        policy: Policy,
        cands: list[Candidate],
        keys: list[int],
        request: ScoreRequest,
        weights: Weights,
    ) -> Decision:
        """The policy's decision (:func:`~kvindex.api.decision.policies.decide`); RequestError (422)
        when the request lacks what the policy needs."""
        turns, rng = self._turns[request.model], self._rng
        if request.dry_run:  # decide on copies: the next real answer is as if none was asked
            turns, rng = copy.copy(turns), copy.copy(rng)
        try:
            return decide(
                policy,
                cands,
                keys,
                weights,
                session=request.session,
                turns=turns,
                rng=rng,
                top_k=self.top_k(request),
            )
        except ScoringError as exc:
            raise RequestError(str(exc)) from exc


@dataclass(frozen=True, slots=True)
class _Seen:
    """What one answer read (matches, loads, stream freshness, one clock reading for every
    load's age), turned into a policy's :class:`Candidate` for every candidate and into a
    :class:`ScoreEntry` only for those the answer explains."""

    lookup: _Lookup
    loads: dict[str, CountedLoad]
    statuses: dict[str, list[StreamFreshness]]
    now: float
    version: int | None = None
    """The load store's change version before the loads were read (None: not the store's)."""

    def state(self, replica: str) -> Freshness:
        """The replica's freshness: its least fresh stream's."""
        statuses = self.statuses.get(replica, ())
        return statuses[0].freshness if len(statuses) == 1 else _freshness(statuses)

    def candidate(self, replica: str) -> Candidate:
        """The replica as the policy sees it (per candidate per request: kept lean)."""
        state = self.state(replica)
        tiers = self.lookup.matches.get(replica, NO_MATCH).tiers
        counted = self.loads.get(replica)
        if counted is None:
            return Candidate(replica, tiers, state, None)
        load, routed, in_flight = counted
        load_input = None
        if load is not None:
            age = max(0.0, self.now - load.ts)  # Load.age_s, inlined
            load_input = LoadInput(load.running, load.waiting, load.kv_usage, age, routed)
        num_requests, num_tokens = in_flight
        return Candidate(replica, tiers, state, load_input, num_requests, num_tokens)

    def entry(self, scored: Scored, block_size: int) -> ScoreEntry:
        """The explained entry of a ranked candidate."""
        replica = scored.replica
        match = self.lookup.matches.get(replica, NO_MATCH)
        load_view = None
        counted = self.loads.get(replica)
        load = counted.load if counted is not None else None
        if counted is not None and load is not None:
            routed = counted.routed
            age = max(0.0, self.now - load.ts)
            numbers = (load.running, load.waiting, load.kv_usage)
            load_view = LoadView(*numbers, age, load.source, routed)
        return ScoreEntry(
            replica=replica,
            rank=self.lookup.ranks.get(replica, 0),
            matched_blocks=match.num_blocks,
            matched_tokens=match.num_blocks * block_size,
            tiers=_tier_counts(match.tiers),
            load=load_view,
            freshness=_freshness_view(self.statuses.get(replica, ()))[1],
            terms=scored.terms,
            score=scored.score,
        )


def _contenders(
    lookup: _Lookup,
    penalties: list[float],
    streams: _Ranked,
    *,
    top_k: int | None,
    num_blocks: int,
    weights: Weights,
    threshold: float | None = None,
) -> dict[str, PrefixMatch]:
    """The replicas that matched and may be among the best ``top_k`` whatever their
    freshness (every one when ``top_k`` keeps them all), each with its best match; a pass
    over the holders' runs (:attr:`_Lookup.runs`), compiled when built. ``threshold``:
    the ``top_k``-th smallest penalty when the caller knows it (the penalty floors' walk).

    Why the others cannot: no credit is negative, so no minus score is above its
    candidate's penalty, and the ``top_k``-th smallest penalty bounds the ``top_k``-th
    smallest minus score. A match of ``n`` blocks adds at most ``n`` times the best tier's
    weight at the largest freshness factor, over the prompt's blocks (rounded up: the
    bound holds for the float arithmetic of :func:`~kvindex.api.decision.policies.tier_credit`);
    a replica whose penalty less that most is still above the bound ranks after ``top_k``
    others, so its freshness is never read and its minus score is left at its penalty,
    which changes neither the ``top_k`` nor their order. A replica's streams may hold
    shorter matches than its best: one passing the bound means its best does.
    """
    matches = lookup.matches
    if top_k is None or top_k >= len(penalties) or not matches or num_blocks <= 0:
        return matches
    w = weights
    factor = max(1.0, w.replaying_factor, w.stale_factor)
    per_block = w.cache * max(w.gpu, w.cpu, w.other) * factor / num_blocks
    per_block = per_block * (1.0 + 1e-9) + 1e-300  # above any rounding of the real credit
    if threshold is None:
        threshold = _kth_smallest(penalties, top_k)
    contenders = _compiled_contenders or _py_contenders
    runs, position_of, replica_of = lookup.runs, streams.position_of, streams.replica_of
    return contenders(
        runs,
        position_of,
        replica_of,
        matches=matches,
        penalties=penalties,
        per_block=per_block,
        threshold=threshold,
    )


def _py_contenders(
    runs: HeldRuns,
    position_of: list[int],
    replica_of: list[str],
    *,
    matches: _Matches,
    penalties: list[float],
    per_block: float,
    threshold: float,
) -> _Matches:
    """Each replica with a holder stream whose penalty less ``per_block`` per block of its
    match is within ``threshold``, with its best match, in Python (the reference of the
    compiled loop, and the fallback)."""
    out: _Matches = {}
    for match, run in runs:
        if not match.tiers:  # no match: none of its streams holds anything
            continue
        most = per_block * len(match.tiers)
        for i in run:
            if penalties[position_of[i]] - most <= threshold:
                out.setdefault(replica_of[i], matches[replica_of[i]])
    return out


def _kth_smallest(values: list[float], k: int) -> float:
    """``sorted(values)[k - 1]``, compiled when built (no sort of the fleet)."""
    if _compiled_kth is not None:
        return _compiled_kth(values, k)
    return sorted(values)[k - 1]


def _minus_scores(
    penalties: list[float],
    matches: dict[str, PrefixMatch],
    states: dict[str, Freshness],
    *,
    position: dict[str, int],
    credit_of: dict[str, tuple[float, float]],
    num_blocks: int,
    weights: Weights,
) -> list[float]:
    """Each candidate's ``kv_aware`` score, negated: its load penalty, less the cache credit
    of its match at its freshness for the replicas that matched (no record: stale), whose
    :func:`~kvindex.api.decision.policies.tier_credit` (credit, factor) goes into ``credit_of``."""
    minus_scores = penalties.copy()
    # Credit per (match, freshness): the holders of one prefix share its match object, and
    # come one after another (the last pair is checked first: no hashing).
    credits: dict[tuple[int, str], tuple[float, float]] = {}
    last: tuple[PrefixMatch, Freshness, tuple[float, float]] | None = None
    state_of = states.get
    for replica, match in matches.items():
        i, state = position[replica], state_of(replica, _STALE)
        if last is not None and last[0] is match and last[1] is state:
            credit = last[2]
        else:  # keyed by the state's value: an enum member hashes in Python
            key = (id(match), state._value_)  # the matches live until the answer is made
            known = credits.get(key)
            if known is None:
                known = credits[key] = tier_credit(match.tiers, state, num_blocks, weights)
            credit = known
            last = (match, state, credit)
        credit_of[replica] = credit
        minus_scores[i] = penalties[i] - credit[0]  # == -(credit - penalty), exactly
    return minus_scores


def _packed_keys(request: ScoreRequest, packed: bytes, block_size: int) -> list[int]:
    """:func:`~kvindex.indexer.domain.keys.block_keys` of token ids given as u32 bytes (the same
    keys: ``block_keys`` hashes those bytes)."""
    num_blocks = len(packed) // 4 // block_size if block_size > 0 else 0
    extras = request_extra_keys(num_blocks, request.lora_name, request.cache_salt)
    try:
        return chain_keys(model_root(request.model), packed, block_size, extras)
    except BlockKeyError as exc:
        raise RequestError(f"token_ids: {exc}") from exc


def _by_replica(statuses: Sequence[StreamFreshness]) -> dict[str, list[StreamFreshness]]:
    out: dict[str, list[StreamFreshness]] = {}
    for status in statuses:
        out.setdefault(status.stream.replica, []).append(status)
    return out


def _best(
    minus_scores: list[float],
    penalties: list[float],
    rng: random.Random,
    top_k: int | None,
    positions: list[int] | None = None,
) -> list[int]:
    """Indices of the best ``top_k`` (None: every one), best first, in
    :func:`~kvindex.api.decision.policies.rank`'s order: score, then lower load, then chance (a
    draw from ``rng`` per candidate of each tie the ``top_k`` reaches, and none
    otherwise: :func:`~kvindex.api.decision.policies.tie_order`). ``positions``: the only
    candidates that can be among the ``top_k`` (None: every one; the others' minus scores
    are above the ``top_k``-th, so none ties with those kept). Compiled when the extension
    is built (``_lookup.best_tied``: the best ``top_k`` kept by insertion, then the draws),
    else the Python reference; the two agree (``tests/unit/indexer/native``)."""
    if _compiled_best is not None:
        return _compiled_best(minus_scores, penalties, rng.random, top_k, positions)
    return tie_order(minus_scores, penalties, rng.random, top_k, positions)


def _events_down(statuses: Sequence[StreamFreshness], after_s: float) -> str | None:
    """Why a connect-mode replica's events are down (None: they are not): a stream never
    connected nor heard from, or disconnected and silent for ``after_s`` (its blocks cannot
    be vouched for, and the replica is most likely gone)."""
    for status in statuses:
        if status.connected:
            continue
        gone, silent = status.disconnected_s, status.silent_s
        if gone is None and silent is None:
            return "events stream never connected"
        if gone is not None and gone >= after_s and (silent is None or silent >= after_s):
            return f"events stream disconnected {gone:.1f}s"
    return None


def _no_healthy(unhealthy: dict[str, str]) -> str:
    whys = "; ".join(f"{replica}: {why}" for replica, why in sorted(unhealthy.items()))
    return f"no healthy candidate, every one ranked ({whys})"


def _tier_counts(tiers: tuple[Tier, ...]) -> dict[str, int]:
    """Matched blocks by tier name; one pass in the common case (all on GPU, or none)."""
    num_gpu = tiers.count(_GPU)
    if num_gpu == len(tiers):
        return {"gpu": num_gpu, "cpu": 0, "other": 0}
    return {name: tiers.count(tier) for tier, name in _TIER_NAMES}


_GPU = Tier.GPU  # read through the class, an enum member costs ~0.2 µs (Python 3.11)
_TIER_NAMES = tuple((tier, tier.name.lower()) for tier in Tier)
_WORST = {Freshness.LIVE: 0, Freshness.REPLAYING: 1, Freshness.STALE: 2}


def _states(statuses: Sequence[StreamFreshness]) -> dict[str, Freshness]:
    """Each replica's freshness (its least fresh stream's, as :func:`_freshness`), for the
    replicas of ``statuses`` (one pass, no list per replica)."""
    out: dict[str, Freshness] = {}
    worst, rank = out.get, _WORST.__getitem__
    for status in statuses:
        replica, state = status.stream.replica, status.freshness
        known = worst(replica)
        if known is None or rank(state) > rank(known):
            out[replica] = state
    return out


_STALE = Freshness.STALE
_POLICY_OF: dict[object, Policy] = {p.value: p for p in Policy}


def _freshness(statuses: Sequence[StreamFreshness]) -> Freshness:
    """A replica is as fresh as its least fresh stream; never heard of counts as stale."""
    if not statuses:
        return Freshness.STALE
    return max((s.freshness for s in statuses), key=_WORST.__getitem__)


def _freshness_view(statuses: Sequence[StreamFreshness]) -> tuple[Freshness, FreshnessView]:
    # ``_value_`` is ``value`` without the enum property's cost (~0.15 µs on Python 3.11).
    if len(statuses) == 1:  # one stream (no data parallelism): the replica's view is its own
        status = statuses[0]
        state = status.freshness
        return state, FreshnessView(state._value_, status.lag_s, status.silent_s)
    state = _freshness(statuses)
    lags = [s.lag_s for s in statuses if s.lag_s is not None]
    silent = [s.silent_s for s in statuses if s.silent_s is not None]
    view = FreshnessView(
        state=state._value_,
        lag_s=max(lags) if lags else None,
        silent_s=min(silent) if silent else None,
    )
    return state, view

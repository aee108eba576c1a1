"""``POST /score`` as a library call, one request's steps in order: candidates, block keys,
the ``[[rules]]`` entry, one read of the index and the loads, the decision, the answer.
RequestError is a 422, UnknownModelError a 404; a store outage answers ``degraded``."""

from __future__ import annotations

import copy
import itertools
import random
import time
from collections import defaultdict
from collections.abc import Callable, Collection, Coroutine, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.api.answer import DEGRADED_REASONS
from kvindex.api.config.settings import ApiSettings, ModelSpec
from kvindex.api.decision.candidates import Seen, by_replica
from kvindex.api.decision.fast_kv_aware import FastKvAware
from kvindex.api.decision.policies import (
    Candidate,
    Decision,
    Policy,
    ScoringError,
    Weights,
    decide,
)
from kvindex.api.decision.routing_rules import WORKLOAD_HEADER, RoutingRule, RuleInput, first_match
from kvindex.api.health.routing import health_policy, no_healthy, out_of_routing
from kvindex.api.load.model import CountedLoad, Load, is_newer_or_same
from kvindex.api.load.store import LoadChanges, LoadStore
from kvindex.api.lookup.matches import Lookup, RankedStreams, Streams, ranked_streams
from kvindex.api.loop.off_loop import OffLoop
from kvindex.api.reasons import Decided, Reasons, kept_reads, response_of
from kvindex.api.schemas import ScoreRequest, ScoreResponse
from kvindex.api.tokenize.protocol import (
    NO_OPTIONS,
    ChatOptions,
    Head,
    Tokenizer,
    as_heading,
    as_packed,
)
from kvindex.indexer.domain.errors import KvIndexError
from kvindex.indexer.domain.keys import (
    BlockKeyError,
    block_keys,
    chain_keys,
    model_root,
    request_extra_keys,
)
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec
from kvindex.indexer.index.protocol import (
    NO_MATCH,
    BlockIndex,
    HeldRuns,
    IndexUnavailableError,
    holders_of,
)

__all__ = [
    "DEGRADED_REASONS",
    "Ranking",
    "Reasons",
    "RequestError",
    "Scorer",
    "UnknownModelError",
]

_KEY_LIMIT = 2**64
HEAD_CHARS_PER_TOKEN = 16
"""A prompt's head holds at least this many characters per token of a block (~3 blocks)."""
_POLICY_OF: dict[object, Policy] = {p.value: p for p in Policy}


class RequestError(KvIndexError):
    """A request that cannot be scored as sent (422); names the field."""


class UnknownModelError(KvIndexError):
    """The model is served by no known replica (404); names the known models."""


@dataclass(slots=True)
class _Specs:
    """What the registry's specs give the scorer, made once per change of the specs."""

    specs: list[ReplicaSpec]
    serving: dict[str, list[str]]
    connecting: frozenset[str]
    """Replicas in connect mode (whose events stream can be down)."""

    @classmethod
    def of(cls, specs: list[ReplicaSpec]) -> _Specs:
        serving: dict[str, list[str]] = {}
        for r in specs:
            serving.setdefault(r.model, []).append(r.id)
        return cls(specs, serving, frozenset(r.id for r in specs if r.events is not None))


@dataclass(frozen=True, slots=True)
class Ranking:
    """The candidates best first, each with the prompt's tokens it holds cached."""

    num_tokens: int
    ranked: tuple[tuple[str, int], ...]
    """(replica, matched tokens), as :meth:`Scorer.score`'s ``scores`` list them."""
    reasons: Reasons | None = None
    """What :meth:`Scorer.score` would explain of them (``ranking``'s ``explain``)."""
    rest: Callable[[], Coroutine[Any, Any, bytes]] | None = None
    """Decided on the prompt's head (``num_tokens`` estimated): its whole tokenization, owed
    once the answer is out (it keeps the ids for the prompt's next turn)."""


class Scorer:
    """Answers score requests. Safe to share across concurrent requests of one event loop."""

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
        distrusted: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        self._settings = settings
        self._heads = not any(
            r.min_prompt_tokens is not None or r.max_prompt_tokens is not None
            for r in settings.rules
        )  # a rule on the prompt's tokens needs them all
        self._distrusted = distrusted
        self._holders = holders_of(index)
        self._registry = registry
        self._loads = loads
        self._tokenizers = tokenizers
        self._off_loop = OffLoop(blocking_store)
        self._clock = clock
        self._on_degraded = on_degraded
        self._rng = random.Random(settings.seed)
        self._turns: defaultdict[str, itertools.count[int]] = defaultdict(itertools.count)
        self._last_loads: dict[str, Load] = {}
        self._last_read: dict[str, CountedLoad] = {}
        self._streams_memo: tuple[int, list[str], RankedStreams] | None = None
        self._specs_memo: _Specs | None = None
        self._answers: list[str] = []
        """Answers made since the last load read: counted in the store by the next read."""
        self._health_policy = health_policy(settings)
        self._default_weights = settings.weights.as_dict()
        self._model_specs: dict[str, ModelSpec] = {}
        for spec in settings.models:  # the first of a name, as ``ApiSettings.model`` finds it
            self._model_specs.setdefault(spec.name, spec)
        self._changes = loads if isinstance(loads, LoadChanges) else None
        self._kv_aware = FastKvAware(registry, self._changes)
        self._keys_memo = KeysMemo()

    def note_load(self, replica: str, load: Load) -> None:
        """Remember an accepted load for answers made while the load store is unreachable."""
        if is_newer_or_same(load, self._last_loads.get(replica)):
            self._last_loads[replica] = load

    def forget(self, replica: str) -> None:
        self._last_loads.pop(replica, None)
        self._last_read.pop(replica, None)
        self._answers = [a for a in self._answers if a != replica]

    def _note_routed(self, best: str | None, loads: dict[str, CountedLoad]) -> None:
        """Count an answer toward its replica's load (in the store, with the next read)."""
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
        top_k = self.top_k(request)
        made = await self._decided(request, headers or {}, packed_tokens, top_k=top_k)
        weights = self._weights_view(made.weights)
        return response_of(request.model, made, made.decision.ranked, weights)

    async def ranking(
        self,
        request: ScoreRequest,
        headers: Mapping[str, str] | None = None,
        *,
        explain: int = 0,
        head_first: bool = False,
    ) -> Ranking:
        """:meth:`score`'s order and matches alone, the same decision (a router's need: no
        entry explained). ``explain`` > 0: at most that many ranked (``top_k`` lowered to it),
        with the :class:`Reasons` that :meth:`score` would word for them, worded when read.
        ``head_first``: a long prompt no replica holds the start of may be decided on its
        :class:`Head` (see :meth:`_keys`), the rest tokenized later (``Ranking.rest``)."""
        top_k = self.top_k(request)
        if explain:
            top_k = explain if top_k is None else min(top_k, explain)
        made = await self._decided(
            request,
            headers or {},
            None,
            top_k=top_k,
            explain=False,
            gather=explain > 0,
            head_first=head_first,
        )
        matches, block_size = made.seen.lookup.matches, made.block_size
        ranked = tuple(
            (s.replica, matches.get(s.replica, NO_MATCH).num_blocks * block_size)
            for s in made.decision.ranked
        )
        rest = made.head.rest if made.head is not None else None
        if not explain:
            return Ranking(made.num_tokens, ranked, rest=rest)
        view = self._default_weights if made.weights is self._settings.weights else None
        return Ranking(made.num_tokens, ranked, Reasons(request.model, made, view), rest)

    async def _decided(
        self,
        request: ScoreRequest,
        headers: Mapping[str, str],
        packed_tokens: bytes | None,
        *,
        top_k: int | None,
        explain: bool = True,
        gather: bool = False,
        head_first: bool = False,
    ) -> Decided:
        """Every step of an answer but its assembly, the best ``top_k`` kept; ``explain``
        False: no terms, and no freshness unless ``gather`` (a ranking's reasons: then the
        reads kept are the ranked candidates' alone)."""
        specs = self._registry.replicas()
        outage = self._registry.outage()
        candidates = self._candidates(request, specs, outage)
        block_size = self.block_size(request.model)
        head_chars = HEAD_CHARS_PER_TOKEN * block_size if head_first and self._heads else 0
        num_tokens, keys, head = await self._keys(request, block_size, packed_tokens, head_chars)
        rule = self._rule(request, num_tokens, headers)
        weights = self._weights(request, rule)
        policy = self._policy(request, rule)
        if head is not None and policy is not Policy.KV_AWARE:
            num_tokens, keys, head = *await self._whole(request, head, block_size), None
        unhealthy = self._unhealthy(candidates, specs)
        ranked = [r for r in candidates if r not in unhealthy] if unhealthy else candidates
        ranked = ranked or candidates
        streams = self._streams(ranked)
        lookup, loads, version = await self._read(keys, streams.streams, ranked)
        lookup.resolve(streams)
        if head is not None and lookup.num_matched():  # its start is held: the whole decides
            num_tokens, keys, head = *await self._whole(request, head, block_size), None
            lookup, loads, version = await self._read(keys, streams.streams, ranked)
            lookup.resolve(streams)
        distrusted = self._distrusted()
        lean = policy is Policy.KV_AWARE and not weights.temperature
        if lean:
            seen = Seen(lookup, loads, {}, self._clock(), version)
            rng = copy.copy(self._rng) if request.dry_run else self._rng
            decision = self._kv_aware.decide(
                ranked,
                streams,
                seen,
                num_blocks=len(keys),
                top_k=top_k,
                weights=weights,
                rng=rng,
                explain=explain,
                distrusted=distrusted,
                gather=gather,
            )
        else:
            seen = Seen(lookup, loads, by_replica(self._registry.freshness()), self._clock())
            cands = [seen.candidate(r) for r in ranked]
            decision = self._decide(
                policy, cands, keys, request, weights, top_k=top_k, distrusted=distrusted
            )
        if not request.dry_run:
            self._note_routed(decision.best, loads)
        all_out = no_healthy(unhealthy) if unhealthy and ranked is candidates else None
        degraded = self._degraded(lookup.degraded, outage, all_out)
        num_matched = lookup.num_matched()
        if gather:
            seen = kept_reads(seen, decision.ranked)
        return Decided(
            decision, seen, policy, weights, rule, unhealthy, degraded, block_size,
            num_tokens, len(keys), len(ranked), num_matched, distrusted, explain or not lean,
            head,
        )  # fmt: skip

    async def _whole(
        self, request: ScoreRequest, head: Head, block_size: int
    ) -> tuple[int, list[int]]:
        """A head's prompt tokenized whole: its tokens and block keys."""
        packed = await head.rest()
        return len(packed) // 4, _packed_keys(request, packed, block_size)

    def _degraded(
        self, index_outage: str | None, fleet_outage: str | None, no_healthy: str | None
    ) -> str | None:
        if index_outage is None and fleet_outage is None and no_healthy is None:
            return None  # the common answer: no dict, no join
        whys = (index_outage, fleet_outage, no_healthy)
        degraded = {r: why for r, why in zip(DEGRADED_REASONS, whys, strict=True) if why}
        for reason in degraded:
            self._on_degraded(reason)
        return "; ".join(degraded.values()) or None

    def top_k(self, request: ScoreRequest) -> int | None:
        """The request's ``top_k``, else ``default_top_k``; None for every candidate."""
        top_k = request.top_k if request.top_k is not None else self._settings.default_top_k
        return top_k or None

    # --- 1-2. candidates, policy, weights ----------------------------------------------------

    def _candidates(
        self, request: ScoreRequest, specs: list[ReplicaSpec], outage: str | None
    ) -> list[str]:
        """The replicas to rank: the model's serving list itself when the request names none
        (never changed: the stream memo finds it by identity)."""
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
        memo = self._specs_memo
        if memo is not None and memo.specs == specs:
            memo.specs = specs  # equal but new objects (a re-read): compare by identity next
            return memo
        memo = self._specs_memo = _Specs.of(specs)
        return memo

    def _rule(
        self, request: ScoreRequest, num_tokens: int, headers: Mapping[str, str]
    ) -> RoutingRule | None:
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
        spec = self._model_specs.get(request.model)
        name = (
            request.policy
            or (rule.policy if rule else None)
            or (spec.policy if spec else None)
            or self._settings.default_policy
        )
        policy = _POLICY_OF.get(name)  # a dict lookup: cheaper than an enum call
        if policy is None:
            raise RequestError(f"policy: {name!r} is not one of {[p.value for p in Policy]}")
        return policy

    def _weights_view(self, weights: Weights) -> dict[str, float]:
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
        spec = self._model_specs.get(model)
        if spec is not None and spec.block_size:
            return spec.block_size
        return self._registry.block_size(model) or self._settings.default_block_size

    # --- 2. tokens and keys ------------------------------------------------------------------

    async def _keys(
        self, request: ScoreRequest, block_size: int, packed: bytes | None, head_chars: int
    ) -> tuple[int, list[int], Head | None]:
        """(tokens in the prompt, its block keys, None); ``packed``: the token ids as u32
        bytes. ``head_chars`` > 0: a prompt or conversation may be tokenized only as far as
        its :class:`Head` (then given last, the tokens estimated and the keys the head's)."""
        _check_fields(request, packed, block_size)
        if request.block_keys is not None:
            keys = request.block_keys
            if keys and max(keys) >= _KEY_LIMIT:  # one C pass (msgspec checked they are >= 0)
                raise RequestError("block_keys: every key must be an unsigned 64-bit integer")
            return len(keys) * block_size, keys, None
        tokens = request.token_ids
        if tokens is None and packed is None:
            tokenized = await self._tokenize(request, head_chars)
            if isinstance(tokenized, Head):
                keys = _packed_keys(request, tokenized.packed, block_size)
                if keys:
                    return tokenized.num_tokens, keys, tokenized
                tokenized = await tokenized.rest()
            if isinstance(tokenized, bytes):  # a tokenizer cache hands a hit out as one object
                return (
                    len(tokenized) // 4,
                    self._keys_memo.keys(request, tokenized, block_size),
                    None,
                )
            tokens = tokenized
        if packed is not None:  # the caller's bytes, new each request: nothing to remember
            return len(packed) // 4, _packed_keys(request, packed, block_size), None
        assert tokens is not None
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
        return len(tokens), keys, None

    async def _tokenize(self, request: ScoreRequest, head_chars: int) -> list[int] | bytes | Head:
        """The request's ids: packed u32 bytes when its tokenizer hands them out so; with
        ``head_chars``, a Head when its tokenizer makes one."""
        tokenizer = self._tokenizers(request.model)
        field_name = "prompt" if request.prompt is not None else "messages"
        if tokenizer is None:
            raise RequestError(
                f"{field_name}: no tokenizer for model {request.model!r}; send token_ids or"
                " block_keys, or configure [[models]] tokenizer"
            )
        heads = as_heading(tokenizer) if head_chars else None
        if heads is not None:
            if request.prompt is not None:
                return await heads.prompt_head(request.prompt, head_chars)
            assert request.messages is not None
            return await heads.messages_head(request.messages, _chat_options(request), head_chars)
        packs = as_packed(tokenizer)
        if packs is not None:
            if request.prompt is not None:
                return await packs.packed_prompt(request.prompt)
            assert request.messages is not None
            return await packs.packed_messages(request.messages, _chat_options(request))
        if request.prompt is not None:
            return await tokenizer.encode_prompt(request.prompt)
        assert request.messages is not None
        return await tokenizer.encode_messages(request.messages, _chat_options(request))

    # --- 3. lookup and load ------------------------------------------------------------------

    async def _read(
        self, keys: list[int], streams: Streams, replicas: Sequence[str]
    ) -> tuple[Lookup, dict[str, CountedLoad], int | None]:
        """The index and load reads (answers since the last read counted first), in one hop."""
        answers, self._answers = self._answers, []
        found, loads, version = await self._off_loop(
            self._read_stores, keys, streams, replicas, answers
        )
        if loads is None:
            version = None
        return Lookup.of(found), self._loads_seen(loads, replicas), version

    def _read_stores(
        self, keys: list[int], streams: Streams, replicas: Sequence[str], answers: list[str]
    ) -> tuple[HeldRuns | IndexUnavailableError, dict[str, CountedLoad] | None, int | None]:
        """Both reads and the load version; an unreachable store gives its error or None."""
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

    def _streams(self, replicas: list[str]) -> RankedStreams:
        """The candidates' streams, remembered until they or the registry's streams change."""
        version = self._registry.streams_version()
        memo = self._streams_memo
        if memo is not None and memo[0] == version and (memo[1] is replicas or memo[1] == replicas):
            return memo[2]
        specs, heard = self._registry.replicas(), self._registry.stream_ids()
        streams = ranked_streams(replicas, specs, heard)
        self._streams_memo = (version, replicas, streams)  # never changed (_candidates)
        return streams

    def _loads_seen(
        self, loads: dict[str, CountedLoad] | None, replicas: Sequence[str]
    ) -> dict[str, CountedLoad]:
        """What was read; when the store was unreachable, what was last read (no answers)."""
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
        return out_of_routing(
            candidates,
            self._registry,
            self._specs(specs).connecting,
            clock=self._clock,
            policy=self._health_policy,
            events_down_after_s=self._settings.events_down_after_s,
        )

    # --- 4. decision (other policies) --------------------------------------------------------

    def _decide(
        self,
        policy: Policy,
        cands: list[Candidate],
        keys: list[int],
        request: ScoreRequest,
        weights: Weights,
        *,
        top_k: int | None,
        distrusted: Collection[str],
    ) -> Decision:
        """:func:`~kvindex.api.decision.policies.decide`; RequestError for what it lacks."""
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
                top_k=top_k,
                distrusted=distrusted,
            )
        except ScoringError as exc:
            raise RequestError(str(exc)) from exc


def _check_fields(request: ScoreRequest, packed: bytes | None, block_size: int) -> None:
    """RequestError for a prompt's forms mixed, chat options without messages, or a block
    size the model does not use."""
    _check_one_input(request, packed)
    if request.messages is None and _has_chat_options(request):
        raise RequestError(f"{', '.join(ChatOptions.__struct_fields__)}: only with messages")
    if request.block_size is not None and request.block_size != block_size:
        raise RequestError(
            f"block_size: the request assumes {request.block_size} but {request.model!r}"
            f" uses {block_size} tokens per block"
        )


def _check_one_input(request: ScoreRequest, packed: bytes | None) -> None:
    """RequestError unless exactly one of the prompt's forms is given (four checks: no list)."""
    num_given = (
        (request.token_ids is not None or packed is not None)
        + (request.prompt is not None)
        + (request.messages is not None)
        + (request.block_keys is not None)
    )
    if num_given != 1:
        names = ("token_ids", "prompt", "messages", "block_keys")
        given = [n for n in names if getattr(request, n) is not None]
        if packed is not None and "token_ids" not in given:
            given.insert(0, "token_ids")
        raise RequestError(
            f"give exactly one of token_ids, prompt, messages, block_keys (got {given or 'none'})"
        )


def _has_chat_options(request: ScoreRequest) -> bool:
    return (
        request.tools is not None
        or request.documents is not None
        or request.chat_template_kwargs is not None
        or not request.add_generation_prompt
        or request.continue_final_message
    )


def _chat_options(request: ScoreRequest) -> ChatOptions:
    if not _has_chat_options(request):
        return NO_OPTIONS  # the tokenizer cache's key skips their fields for this one
    return ChatOptions(
        request.tools,
        request.documents,
        request.chat_template_kwargs,
        request.add_generation_prompt,
        request.continue_final_message,
    )


class KeysMemo:
    """Block keys of packed ids handed in again as the same object (a tokenizer cache's hit):
    made once, equal to :func:`_packed_keys`. Holds at most ``max_keys`` keys (an entry
    counts one more; the ids they were made of kept too), the oldest dropped first; a list
    handed out is shared: never changed."""

    def __init__(self, max_keys: int = 32_768) -> None:
        self.max_keys = max_keys
        self._num_kept = 0
        self._id_to_entry: dict[int, tuple[bytes, tuple[object, ...], list[int]]] = {}
        """``id(packed)`` → (packed: alive while kept, so its id is not reused; the keys'
        other inputs; the keys)."""

    def keys(self, request: ScoreRequest, packed: bytes, block_size: int) -> list[int]:
        inputs = (request.model, request.lora_name, request.cache_salt, block_size)
        entries = self._id_to_entry
        entry = entries.get(id(packed))
        if entry is not None and entry[0] is packed and entry[1] == inputs:
            return entry[2]
        keys = _packed_keys(request, packed, block_size)
        if entry is not None:  # the same ids under other inputs: the newest kept
            self._num_kept -= len(entries.pop(id(packed))[2]) + 1
        if len(keys) < self.max_keys:
            entries[id(packed)] = (packed, inputs, keys)
            self._num_kept += len(keys) + 1
        while self._num_kept > self.max_keys:
            self._num_kept -= len(entries.pop(next(iter(entries)))[2]) + 1
        return keys


def _packed_keys(request: ScoreRequest, packed: bytes, block_size: int) -> list[int]:
    num_blocks = len(packed) // 4 // block_size if block_size > 0 else 0
    extras = request_extra_keys(num_blocks, request.lora_name, request.cache_salt)
    try:
        return chain_keys(model_root(request.model), packed, block_size, extras)
    except BlockKeyError as exc:
        raise RequestError(f"token_ids: {exc}") from exc

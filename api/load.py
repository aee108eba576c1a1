"""Replica load: what it is, where it is kept, and how it is scraped from vLLM.

The scorer trades cache hits against each replica's load. Load arrives two ways:

* pushed (``POST /load``): a replica or router reports running and waiting requests and
  KV-cache usage (``source = "push"``);
* scraped: :class:`MetricsScraper` GETs each replica's vLLM Prometheus ``/metrics``
  (``source = "scrape"``), parsed by :func:`parse_vllm_metrics`.

Load lives in the same kind of store as the index (:class:`MemoryLoadStore` in-process,
:class:`RedisLoadStore` shared) so several API processes on one Redis agree. Each
:class:`Load` carries the time it was measured; the scorer weighs old load less
(:meth:`Load.age_s`). Stores keep the newest load per replica: a put never replaces a
load measured later, so a late scrape cannot hide a fresh push, nor the reverse.

Stores also count *answers*: how many ``/score`` answers chose a replica since its current
load was stored (:meth:`LoadStore.get_counted`). In Redis every API process sharing the
store counts into the same counter, so answers from all of them weigh as load until the
replica reports again.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import NamedTuple, Protocol, TypeAlias, cast

import httpx
import msgspec
import redis
from prometheus_client.parser import text_string_to_metric_families

from kvindex.indexer.errors import KvIndexError
from kvindex.indexer.index.redis import unavailable_on_connection_errors
from kvindex.indexer.redis_schema import Schema, answers_field, check_name

logger = logging.getLogger(__name__)

SOURCES = ("push", "scrape")
"""Allowed values of :attr:`Load.source`."""

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = "vllm:kv_cache_usage_perc"
GPU_USAGE_OLD = "vllm:gpu_cache_usage_perc"
"""The name of :data:`KV_USAGE` before vLLM 0.10 (read only when the new one is absent)."""
_TOTAL = "_total"
_WANTED = frozenset(
    name + suffix for name in (RUNNING, WAITING, KV_USAGE, GPU_USAGE_OLD) for suffix in ("", _TOTAL)
)


class LoadError(KvIndexError):
    """A load that is invalid (the message names the field) or could not be obtained."""


class Load(msgspec.Struct, frozen=True):
    """One replica's load at one instant. Always valid: checked on construction and decode.

    Raises :class:`LoadError` naming the field when a count or ``ts`` is negative, the
    usage is outside [0, 1], any number is not finite, or ``source`` is not one of
    :data:`SOURCES`.
    """

    running: float
    """Requests being processed (summed over data-parallel engines)."""
    waiting: float
    """Requests queued (summed over data-parallel engines)."""
    kv_usage: float
    """Fraction of KV-cache blocks in use, 0..1 (the busiest engine's)."""
    ts: float
    """When it was measured, unix seconds (the measurer's wall clock)."""
    source: str
    """``"push"`` (``POST /load``) or ``"scrape"`` (:class:`MetricsScraper`)."""

    def __post_init__(self) -> None:
        self.validated()

    def validated(self) -> Load:
        """``self`` once checked (construction already checks; this states it at call sites)."""
        for name in ("running", "waiting", "ts"):
            _check_number(name, getattr(self, name), high=math.inf)
        _check_number("kv_usage", self.kv_usage, high=1.0)
        if self.source not in SOURCES:
            raise LoadError(f"source must be one of {SOURCES}, got {self.source!r}")
        return self

    def age_s(self, now: float) -> float:
        """Seconds since it was measured; 0 for a load stamped in the future (clock skew)."""
        return max(0.0, now - self.ts)


def _check_number(name: str, value: object, *, high: float) -> None:
    # bool is an int: reject it explicitly, it is never a measurement.
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise LoadError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or not 0.0 <= value <= high:
        bounds = "in [0, 1]" if high == 1.0 else ">= 0"
        raise LoadError(f"{name} must be a finite number {bounds}, got {value!r}")


def is_newer_or_same(new: Load, old: Load | None) -> bool:
    """The store rule: ``new`` replaces ``old`` unless ``old`` was measured strictly later.

    At equal timestamps the later write wins (a repeated put is idempotent).
    """
    return old is None or new.ts >= old.ts


class CountedLoad(NamedTuple):
    """A replica's stored load and the answers that chose it since it was stored."""

    load: Load
    routed: int


class LoadStore(Protocol):
    """The latest load of each replica, and the answers that chose it since.

    Implementations are safe to call from any thread.
    """

    def put(self, replica: str, load: Load) -> None:
        """Keep ``load`` unless the stored one is newer (:func:`is_newer_or_same`), atomically.

        Raises ``SchemaError`` for a replica id unusable in a Redis key.
        """
        ...

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        """The stored load of each replica; replicas without one are absent."""
        ...

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        """Count ``answers`` (the replica each chose) first, then read each replica's load
        with the answers counted for it since that load was stored (replicas without a
        load are absent). A put that stores a newer load starts its replica's count again;
        one that stores an equal ``ts`` (the same measurement) does not.

        An answer made on a load that a newer one replaced meanwhile counts toward the newer
        one: at most the answers in flight are over-counted, never lost.
        """
        ...

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        """The replicas this process is to scrape now: each one no other caller claimed in
        the last ``hold_s`` seconds (every one, for a store serving one process). API
        processes sharing a store thus scrape each replica once a round, not once each."""
        ...

    def remove(self, replica: str) -> None:
        """Forget the replica's load and answers (a no-op for an unknown replica)."""
        ...

    def close(self) -> None:
        """Release connections. The store must not be used afterwards."""
        ...


class MemoryLoadStore:
    """In-process :class:`LoadStore` (one API process). Thread-safe (one lock)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._replica_to_load: dict[str, Load] = {}
        self._answers: dict[str, int] = {}
        """Per replica: answers that chose it since its load was stored."""

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        with self._lock:
            old = self._replica_to_load.get(replica)
            if is_newer_or_same(load, old):
                self._replica_to_load[replica] = load
                if old is None or load.ts > old.ts:
                    self._answers.pop(replica, None)

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        with self._lock:
            return {r: self._replica_to_load[r] for r in replicas if r in self._replica_to_load}

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        with self._lock:
            counts = self._answers
            for replica in answers:
                counts[replica] = counts.get(replica, 0) + 1
            loads = self._replica_to_load
            return {r: CountedLoad(loads[r], counts.get(r, 0)) for r in replicas if r in loads}

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        return set(replicas)

    def remove(self, replica: str) -> None:
        with self._lock:
            self._replica_to_load.pop(replica, None)
            self._answers.pop(replica, None)

    def close(self) -> None:
        """Nothing to release."""


# KEYS[1] the load HASH; ARGV: replica, ts of the new load, the new load (JSON).
# Returns 1 when stored, 0 when the stored load is newer. An undecodable stored value
# counts as older: it is overwritten rather than blocking the replica forever.
_PUT_IF_NEWER_LUA = """
local old = redis.call('HGET', KEYS[1], ARGV[1])
local newer = true
if old then
  local ok, decoded = pcall(cjson.decode, old)
  if ok and type(decoded) == 'table' then
    local old_ts = tonumber(decoded['ts'])
    if old_ts and old_ts > tonumber(ARGV[2]) then
      return 0
    end
    newer = not (old_ts and old_ts == tonumber(ARGV[2]))
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
if newer then
  redis.call('HDEL', KEYS[1], ARGV[4])  -- a new measurement: its answers start from 0
end
return 1
"""

_ENCODER = msgspec.json.Encoder()
_DECODER = msgspec.json.Decoder(Load)


class RedisLoadStore:
    """Shared :class:`LoadStore`: one HASH (``Schema.load``) replica id → load as JSON.

    A put is one Lua script (compare ``ts``, then set: atomic across API processes); a
    ``get_many`` is one HMGET; a ``get_counted`` is one round trip (an HINCRBY per answer,
    then an HMGET). A replica's answers are its field ``<replica>/answers`` of the same
    HASH (no replica id contains ``/``), so every call touches one key; the put script
    deletes that field when it stores a newer load. Every method raises
    :class:`IndexUnavailableError` when Redis cannot be reached. A stored value that
    cannot be decoded reads as absent (logged). Scrape claims are short-lived keys
    (``Schema.scrape_claim``, SET NX PX).
    """

    def __init__(self, client: redis.Redis, schema: Schema | None = None) -> None:
        self._client = client
        self._schema = schema or Schema()
        self._key = self._schema.load
        self._put = client.register_script(_PUT_IF_NEWER_LUA)

    @property
    def client(self) -> redis.Redis:
        """The connection (shared with the index of the same deployment)."""
        return self._client

    def put(self, replica: str, load: Load) -> None:
        check_name("replica id", replica)
        with unavailable_on_connection_errors():
            args: list[str | bytes] = [
                replica,
                repr(load.ts),
                _ENCODER.encode(load),
                answers_field(replica),
            ]
            self._put(keys=[self._key], args=args)

    def get_many(self, replicas: Sequence[str]) -> dict[str, Load]:
        wanted = list(dict.fromkeys(replicas))
        if not wanted:
            return {}
        with unavailable_on_connection_errors():
            values = self._client.hmget(self._key, wanted)
        loads = {r: _decode(r, v) for r, v in zip(wanted, values, strict=True) if v is not None}
        return {r: load for r, load in loads.items() if load is not None}

    def get_counted(
        self, replicas: Sequence[str], answers: Sequence[str] = ()
    ) -> dict[str, CountedLoad]:
        wanted = list(dict.fromkeys(replicas))
        fields = [f for r in wanted for f in (r, answers_field(r))]
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            for replica in answers:
                pipe.hincrby(self._key, answers_field(replica), 1)
            if fields:
                pipe.hmget(self._key, fields)
            # An unreadable count (not an integer) fails its HINCRBY alone; it reads as 0
            # until the replica's next load replaces it.
            replies = pipe.execute(raise_on_error=False) if answers or fields else []
        if fields and isinstance(replies[-1], redis.RedisError):
            raise replies[-1]
        values = cast("list[bytes | None]", replies[-1]) if fields else []
        out: dict[str, CountedLoad] = {}
        for i, replica in enumerate(wanted):
            value, count = values[2 * i], values[2 * i + 1]
            load = None if value is None else _decode(replica, value)
            if load is not None:
                out[replica] = CountedLoad(load, _parse_count(count))
        return out

    def claim_scrapes(self, replicas: Sequence[str], hold_s: float) -> set[str]:
        wanted = list(dict.fromkeys(replicas))
        if not wanted:
            return set()
        hold_ms = max(1, round(hold_s * 1000))
        with unavailable_on_connection_errors(), self._client.pipeline(False) as pipe:
            for replica in wanted:
                pipe.set(self._schema.scrape_claim(replica), b"1", nx=True, px=hold_ms)
            won = pipe.execute()
        return {replica for replica, ok in zip(wanted, won, strict=True) if ok}

    def remove(self, replica: str) -> None:
        with unavailable_on_connection_errors():
            self._client.hdel(self._key, replica, answers_field(replica))

    def close(self) -> None:
        self._client.close()


def _parse_count(raw: bytes | None) -> int:
    """A stored answer count; 0 when absent or unreadable."""
    try:
        return max(int(raw), 0) if raw is not None else 0
    except ValueError:
        return 0


def _decode(replica: str, raw: bytes | str) -> Load | None:
    try:
        return _DECODER.decode(raw)
    except (msgspec.DecodeError, LoadError) as exc:
        logger.warning("ignoring the undecodable stored load of %s: %s", replica, exc)
        return None


def parse_vllm_metrics(text: str, *, now: float, model: str | None = None) -> Load:
    """A scraped :class:`Load` (stamped ``now``) from a vLLM ``/metrics`` exposition.

    * running / waiting: summed over every label set (one per data-parallel ``engine``);
    * KV usage: the **max** over label sets of ``vllm:kv_cache_usage_perc``, or of the
      older ``vllm:gpu_cache_usage_perc`` when the new name is absent;
    * a name is read as written or, when absent so, with a ``_total`` suffix;
    * with ``model``, only samples whose ``model_name`` label equals it count;
    * any other metric, HELP/TYPE line or label is ignored; an absent metric reads as 0.

    Raises :class:`LoadError` when the text does not parse, when none of the metrics above
    is present (for ``model``), or when a value is invalid (e.g. usage above 1).
    """
    values, models_seen = _collect(text, model)
    if not values:
        wanted = "" if model is None else f" for model_name={model!r}"
        seen = f" (model_name labels seen: {sorted(models_seen)})" if model is not None else ""
        raise LoadError(f"no vLLM load metrics{wanted} in the exposition{seen}")
    usage = _named(values, KV_USAGE) or _named(values, GPU_USAGE_OLD) or [0.0]
    return Load(
        running=math.fsum(_named(values, RUNNING)),
        waiting=math.fsum(_named(values, WAITING)),
        kv_usage=max(usage),
        ts=now,
        source="scrape",
    )


def _collect(text: str, model: str | None) -> tuple[dict[str, list[float]], set[str]]:
    """Values of the wanted samples by sample name, and every ``model_name`` label seen."""
    name_to_values: dict[str, list[float]] = defaultdict(list)
    models_seen: set[str] = set()
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in _WANTED:
                    continue
                label = sample.labels.get("model_name")
                if label is not None:
                    models_seen.add(label)
                if model is None or label == model:
                    name_to_values[sample.name].append(float(sample.value))
    except ValueError as exc:
        raise LoadError(f"unparseable metrics exposition: {exc}") from exc
    return name_to_values, models_seen


def _named(values: dict[str, list[float]], name: str) -> list[float]:
    return values.get(name) or values.get(name + _TOTAL) or []


ScrapeTarget: TypeAlias = tuple[str, str | None, str | None]
"""``(replica id, base URL or None, model name or None)``; no URL: not scraped."""


@dataclass(frozen=True, slots=True)
class ScrapeStats:
    """Scrape counters of one replica (a snapshot)."""

    num_scrapes: int = 0
    """Scrapes attempted (successes and failures)."""
    num_failures: int = 0
    """Scrapes that failed: connection, timeout, HTTP status, parse or store error."""
    last_error: str | None = None
    """Why the latest scrape failed; None when it succeeded (or none ran yet)."""
    last_success_ts: float | None = None
    """``ts`` of the latest load scraped and stored."""
    num_left_to_peers: int = 0
    """Rounds another API process sharing the load store scraped it instead."""


_CLAIM_SHARE = 0.8
"""A scrape claim lasts this share of the interval: gone before the next round starts."""


class MetricsScraper:
    """Scrapes every replica's ``{base_url}/metrics`` each ``interval_s`` into a store.

    Each round asks ``targets()`` for the current replicas (so replicas added or removed at
    run time are picked up), claims them in the store (API processes sharing a Redis store
    scrape each replica once a round between them) and scrapes its claims concurrently;
    each request has its own ``timeout_s`` deadline (connect to last byte) and its load is
    stored as soon as it is parsed, so a slow or dead replica never delays the others'
    results. Rounds start every ``interval_s``, or when the last one ended if it took
    longer: a round lasts at most ``timeout_s`` plus two store calls, so keep
    ``timeout_s <= interval_s`` for a steady cadence. Nothing a replica sends can stop the
    scraper: every failure is counted in :meth:`stats`. ``start`` and ``stop`` run on the
    scraper's event loop; :meth:`stats` may be called from any thread.
    """

    def __init__(
        self,
        store: LoadStore,
        client: httpx.AsyncClient,
        targets: Callable[[], Iterable[ScrapeTarget]],
        *,
        interval_s: float = 1.0,
        timeout_s: float = 0.5,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if not (interval_s > 0 and timeout_s > 0):
            raise ValueError(f"interval_s and timeout_s must be > 0, got {interval_s}, {timeout_s}")
        self._store = store
        self._targets = targets
        self._client = client
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._clock = clock
        self._lock = threading.Lock()
        self._replica_to_stats: dict[str, ScrapeStats] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Start scraping in a task on the running loop (first round right away); returns
        at once. Raises RuntimeError when already running."""
        if self._task is not None:
            raise RuntimeError("the scraper is already running")
        self._task = asyncio.get_running_loop().create_task(self._run(), name="metrics-scraper")

    async def stop(self) -> None:
        """Cancel the task and wait until it and its requests are gone (idempotent)."""
        task, self._task = self._task, None
        if task is None:
            return
        task.cancel()
        # wait(), not "await task": a cancellation of stop() itself must still propagate.
        await asyncio.wait([task])
        if not task.cancelled() and task.exception() is not None:
            logger.error("the metrics scraper had failed", exc_info=task.exception())

    def stats(self) -> dict[str, ScrapeStats]:
        """Counters per replica of the latest round's targets (a copy)."""
        with self._lock:
            return dict(self._replica_to_stats)

    async def scrape_once(self) -> None:
        """One round: every target this process claims (:meth:`LoadStore.claim_scrapes`),
        concurrently; returns once each succeeded or failed."""
        targets = await self._claimed(self._current_targets())
        await asyncio.gather(*(self._scrape(r, url, model) for r, url, model in targets))

    async def _claimed(
        self, targets: list[tuple[str, str, str | None]]
    ) -> list[tuple[str, str, str | None]]:
        """The targets no other API process scrapes this round. Claims expire before the
        next round (``_CLAIM_SHARE`` of the interval), so a process that stops scraping is
        taken over within a round. Claims that cannot be made: scrape everything (each
        store call then fails or succeeds on its own)."""
        if not targets:
            return targets
        replicas = [r for r, _, _ in targets]
        hold_s = self._interval_s * _CLAIM_SHARE
        try:
            mine = await asyncio.to_thread(self._store.claim_scrapes, replicas, hold_s)
        except Exception:
            logger.debug("claiming this round's scrapes failed; scraping every replica")
            return targets
        for replica in set(replicas) - mine:
            self._record(replica, left_to_peers=True)
        return [t for t in targets if t[0] in mine]

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            started = loop.time()
            await self.scrape_once()
            await asyncio.sleep(max(0.0, started + self._interval_s - loop.time()))

    def _current_targets(self) -> list[tuple[str, str, str | None]]:
        try:
            listed = list(self._targets())
        except Exception:
            logger.exception("listing the replicas to scrape failed; skipping this round")
            return []
        # One request per replica id (the last entry wins), only for replicas with a URL.
        replica_to_target = {r: (r, url, model) for r, url, model in listed if url}
        with self._lock:
            for gone in self._replica_to_stats.keys() - replica_to_target.keys():
                del self._replica_to_stats[gone]
        return list(replica_to_target.values())

    async def _scrape(self, replica: str, base_url: str, model: str | None) -> None:
        try:
            load = await self._fetch(base_url, model)
            # A thread: a Redis store must not block the loop (socket timeouts, retries).
            await asyncio.to_thread(self._store.put, replica, load)
        except Exception as exc:
            self._record(replica, error=_describe(exc, self._timeout_s))
        else:
            self._record(replica, success_ts=load.ts)

    async def _fetch(self, base_url: str, model: str | None) -> Load:
        url = metrics_url(base_url)
        # httpx's timeout is per phase; this bounds the whole request (slow trickles too).
        async with asyncio.timeout(self._timeout_s):
            response = await self._client.get(url, timeout=self._timeout_s)
        if response.status_code != httpx.codes.OK:
            raise LoadError(f"GET {url}: HTTP {response.status_code}")
        return parse_vllm_metrics(response.text, now=self._clock(), model=model)

    def _record(
        self,
        replica: str,
        *,
        success_ts: float | None = None,
        error: str | None = None,
        left_to_peers: bool = False,
    ) -> None:
        with self._lock:
            old = self._replica_to_stats.get(replica, ScrapeStats())
            if left_to_peers:
                self._replica_to_stats[replica] = replace(
                    old, num_left_to_peers=old.num_left_to_peers + 1
                )
                return
            new = replace(old, num_scrapes=old.num_scrapes + 1, last_error=error)
            if error is None:
                new = replace(new, last_success_ts=success_ts)
            else:
                new = replace(new, num_failures=old.num_failures + 1)
            self._replica_to_stats[replica] = new
        if error is not None and old.last_error is None:
            logger.warning("scraping the load of %s fails: %s", replica, error)
        elif error is None and old.last_error is not None:
            logger.info("scraping the load of %s works again", replica)


def metrics_url(base_url: str) -> str:
    """``{base_url}/metrics`` (one slash between them)."""
    return base_url.rstrip("/") + "/metrics"


def _describe(exc: Exception, timeout_s: float) -> str:
    if isinstance(exc, TimeoutError | httpx.TimeoutException):
        return f"timed out after {timeout_s:g} s"
    text = str(exc)
    if isinstance(exc, LoadError):
        return text  # our own messages say what failed
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__

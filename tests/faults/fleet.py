"""A whole kvindex deployment as real processes, for fault tests.

One redis-server (append-only file fsynced at every write, or none), ``kvindex indexer
--store redis`` subscribed in connect mode to simulated replicas (``kvindex replica-sim``,
vLLM's wire format, a replay ROUTER unless told), and ``kvindex api`` on the same Redis.
Every part sits on fixed loopback ports chosen at build time, so a test can kill one and
start it again at the same address. :meth:`FaultFleet.stop` ends every process, stopped
or not; the ``fleet`` fixture calls it whatever the test did.

The oracle: a replica's real cache is what its pool holds (``POST /kvsim/cached``, read
only), the index's belief is what ``POST /score`` credits it with (``matched_blocks``),
both for the same prompts.
"""

from __future__ import annotations

import itertools
import shutil
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvindex.clients.fake_vllm.tokenizer import (
    tokenize_text,
)
from tests.support.processes import Child, http_ok, kvindex_child, redis_child
from tests.support.redis_server import free_ports

MODEL = "fault-model"
BLOCK_SIZE = 16
REPLAY_TIMEOUT_S = 2.0
"""The indexer's ``replay_timeout_s``: a replay that stalls this long is given up."""
PROBE_INTERVAL_S = 5.0
"""The indexer's ``probe_interval_s``: how often a quiet stream is probed by replay (half
the default, so the quiet-restart test waits less; the bound scales with it)."""


@dataclass(frozen=True, slots=True)
class FleetShape:
    """What a fault test deploys; every field has the default most tests want."""

    replica_ids: tuple[str, ...] = ("r1", "r2")
    aof: bool = True
    """Redis keeps an append-only file (a kill -9 then loses nothing acknowledged)."""
    replay: bool = True
    """Replicas serve replay (vLLM's ROUTER); False: a gap cannot be repaired."""
    send_hwm: int = 0
    """Replicas' PUB high-water mark (0: unbounded, nothing is ever dropped)."""
    capacity_blocks: int = 64
    """Blocks per replica pool: small, so traffic evicts."""
    indexer_ids: tuple[str, ...] = ()
    """Sharded indexers: one ``kvindex indexer`` per id (its ``indexer_id``, its own status
    port); empty: one indexer with the default id."""
    lease_ttl_s: float = 10.0
    """The indexers' ``lease_ttl_s``."""


@dataclass
class Replica:
    id: str
    child: Child
    http_port: int
    events_port: int
    replay_port: int | None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"


@dataclass(frozen=True, slots=True)
class Mismatch:
    """One prompt on which the index and a replica disagree."""

    prompt: int
    """Index into the prompts checked."""
    replica: str
    credited: int
    """Blocks ``/score`` credits the replica with (0 for a replica not ``live`` when dead)."""
    held: int
    """Leading blocks of the prompt the replica's pool holds."""
    state: str

    @property
    def wrong_route(self) -> bool:
        """Credit for a block the replica does not hold."""
        return self.credited > self.held


@dataclass
class FaultFleet:
    shape: FleetShape
    workdir: Path
    redis: Child
    redis_port: int
    indexer: Child
    api: Child
    api_port: int
    replicas: dict[str, Replica] = field(default_factory=dict)
    more_indexers: dict[str, Child] = field(default_factory=dict)
    """The indexers after the first, by ``indexer_id`` (``shape.indexer_ids[1:]``)."""
    _http: httpx.Client = field(default_factory=lambda: httpx.Client(timeout=5, trust_env=False))

    # --- lifecycle ---------------------------------------------------------------------------

    @classmethod
    def build(cls, shape: FleetShape, workdir: Path) -> FaultFleet:
        """Choose ports and write the config; starts nothing (see :meth:`start`)."""
        ids = shape.indexer_ids or ("",)
        # Every port of the fleet in one choice: ports chosen call by call can repeat.
        ports = iter(free_ports(3 + 3 * len(shape.replica_ids) + len(ids)))
        redis_port, api_port, status_port = next(ports), next(ports), next(ports)
        replicas = {rid: _replica(rid, shape, workdir, ports) for rid in shape.replica_ids}
        config = workdir / "kvindex.toml"
        config.write_text(_config_toml(redis_port, api_port, status_port, replicas.values()))
        redis_dir = workdir / "redis"
        redis_dir.mkdir()
        indexers = [_indexer(i, config, workdir, shape.lease_ttl_s, next(ports)) for i in ids]
        indexer, more = indexers[0], dict(zip(ids[1:], indexers[1:], strict=True))
        api = kvindex_child(
            "api",
            ["api", "--config", str(config)],
            workdir / "api.log",
            http_ok(api_port, "/healthz"),
        )
        redis = redis_child(redis_port, redis_dir, aof=shape.aof)
        return cls(shape, workdir, redis, redis_port, indexer, api, api_port, replicas, more)

    @property
    def indexers(self) -> list[Child]:
        return [self.indexer, *self.more_indexers.values()]

    def start(self) -> None:
        """Start every part (in parallel), then wait until every stream is live."""
        self.redis.start()
        children = [r.child for r in self.replicas.values()] + [*self.indexers, self.api]
        for child in children:
            child.spawn()
        for child in children:  # they start together: a busy 2-core machine needs longer
            child.wait_ready(timeout_s=max(15.0, 4.0 * len(children)))
        self.wait_live(self.replicas, timeout_s=30.0)  # a setup wait, not a bound under test
        for replica in self.replicas:
            self._warm_up(replica)

    def _warm_up(self, replica: str, timeout_s: float = 5.0) -> None:
        """Send requests to ``replica`` until the index credits one: its stream is then
        subscribed for good (ZeroMQ's slow joiner), so no test frame is lost to it."""
        deadline = time.monotonic() + timeout_s
        for attempt in itertools.count():
            prompt = f"warm-up {replica} {attempt} " + " ".join(str(i) for i in range(16))
            self.complete(replica, prompt)
            time.sleep(0.05)
            entries = {e["replica"]: e for e in self.score(prompt)["scores"]}
            if entries[replica]["matched_blocks"] == 1:
                return
            assert time.monotonic() < deadline, f"{replica}'s requests are never indexed"

    def stop(self) -> None:
        """Stop every process this fleet started (stopped ones included): all asked at
        once, then each waited for (killed if it lingers)."""
        children = [
            self.api,
            *self.indexers,
            *(r.child for r in self.replicas.values()),
            self.redis,
        ]
        for child in children:
            child.terminate()
        for child in children:
            child.stop()
        self._http.close()

    def logs(self) -> str:
        children = [
            *self.indexers,
            self.api,
            self.redis,
            *(r.child for r in self.replicas.values()),
        ]
        return "\n".join(f"--- {c.name}\n{c.tail()}" for c in children)

    def restart_redis(self, *, empty: bool) -> None:
        """Start Redis again on its port, from its append-only file or ``empty``."""
        if empty:
            for path in self.redis.log.parent.iterdir():
                if path.is_dir():
                    shutil.rmtree(path)  # appendonlydir/
                elif path != self.redis.log:
                    path.unlink()
        self.redis.start()

    @property
    def api_url(self) -> str:
        return f"http://127.0.0.1:{self.api_port}"

    # --- traffic -----------------------------------------------------------------------------

    def complete(self, replica: str, prompt: str) -> int:
        """One completion on ``replica`` (1 output token); the cached tokens it reports."""
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 1}
        response = self._http.post(f"{self.replicas[replica].base_url}/v1/completions", json=body)
        assert response.status_code == 200, response.text
        cached: int = response.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
        return cached

    def drive(self, prompts: Sequence[str], replicas: Sequence[str] | None = None) -> None:
        """Send prompt i to replica ``i mod len(replicas)`` (all replicas by default)."""
        targets = list(replicas or self.replicas)
        for i, prompt in enumerate(prompts):
            self.complete(targets[i % len(targets)], prompt)

    # --- reading -----------------------------------------------------------------------------

    def held(self, replica: str, prompts: Sequence[str]) -> list[int]:
        """Leading cached blocks of each prompt in the replica's pool (its real cache)."""
        url = f"{self.replicas[replica].base_url}/kvsim/cached"
        response = self._http.post(url, json={"prompts": list(prompts)})
        assert response.status_code == 200, response.text
        counts: list[int] = response.json()["num_cached_blocks"]
        return counts

    def score(self, prompt: str) -> dict[str, Any]:
        body = {"model": MODEL, "token_ids": tokenize_text(prompt)}
        response = self._http.post(f"http://127.0.0.1:{self.api_port}/score", json=body)
        assert response.status_code == 200, response.text
        answer: dict[str, Any] = response.json()
        return answer

    def streams(self) -> dict[str, dict[str, Any]]:
        """Rank 0's stream view of every replica, from the API's ``/replicas``."""
        response = self._http.get(f"http://127.0.0.1:{self.api_port}/replicas")
        if response.status_code != 200:
            return {}
        views = (
            response.json()["replicas"] if isinstance(response.json(), dict) else response.json()
        )
        return {v["id"]: v["streams"][0] for v in views if v["streams"]}

    def wait_live(self, replicas: Iterable[str], timeout_s: float) -> None:
        wanted = set(replicas)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            streams = self.streams()
            if all(streams.get(r, {}).get("freshness", {}).get("state") == "live" for r in wanted):
                return
            time.sleep(0.05)
        raise AssertionError(f"streams of {sorted(wanted)} not live: {self.streams()}")

    def mismatches(self, prompts: Sequence[str], dead: Iterable[str] = ()) -> list[Mismatch]:
        """Every (prompt, replica) where ``/score`` and the replica's pool disagree. A
        ``dead`` replica holds nothing, and is credited only while its stream says live. A
        degraded answer (made without the index) agrees with no replica: it is reported
        as a mismatch crediting nothing, whatever the replica holds."""
        gone = set(dead)
        truth = {r: self.held(r, prompts) for r in self.replicas if r not in gone}
        found: list[Mismatch] = []
        for i, prompt in enumerate(prompts):
            answer = self.score(prompt)
            for entry in answer["scores"]:
                rid, state = entry["replica"], entry["freshness"]["state"]
                credited = entry["matched_blocks"]
                if rid in gone and state != "live":
                    credited = 0
                held = truth[rid][i] if rid in truth else 0
                if answer["degraded"] is not None or credited != held:
                    credited = 0 if answer["degraded"] is not None else credited
                    found.append(Mismatch(i, rid, credited, held, state))
        return found


def _replica(rid: str, shape: FleetShape, workdir: Path, ports: Iterator[int]) -> Replica:
    http_port, events_port, replay_free = next(ports), next(ports), next(ports)
    replay_port = replay_free if shape.replay else None
    replay = f"tcp://127.0.0.1:{replay_port}" if replay_port else ""
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(http_port),
        "--events", f"tcp://127.0.0.1:{events_port}", "--bind-events", "--replay", replay,
        "--capacity-blocks", str(shape.capacity_blocks), "--block-size", str(BLOCK_SIZE),
        "--speed", "1000", "--seed", "7", "--send-hwm", str(shape.send_hwm),
        "--send-buffer-bytes", str(65_536 if shape.send_hwm else 0),
    ]  # fmt: skip
    child = kvindex_child(
        f"replica {rid}", args, workdir / f"{rid}.log", http_ok(http_port, "/health")
    )
    return Replica(rid, child, http_port, events_port, replay_port)


def _indexer(indexer_id: str, config: Path, workdir: Path, lease_ttl_s: float, free: int) -> Child:
    """``kvindex indexer`` on the fleet's config (``indexer_id`` "": the default one, on
    the config's status port; else that id, on a status port of its own, ``free``)."""
    args = ["indexer", "--config", str(config), "--store", "redis", "--stats-every", "0"]
    status_port = int(config.read_text().split("status_port = ")[1].split()[0])
    if indexer_id:
        status_port = free
        args += ["--status-port", str(status_port)]
    child = kvindex_child(
        f"indexer {indexer_id}".strip(),
        args,
        workdir / f"indexer{'-' if indexer_id else ''}{indexer_id}.log",
        http_ok(status_port, "/healthz"),
    )
    child.env = {"KVINDEX_INDEXER_ID": indexer_id, "KVINDEX_LEASE_TTL_S": str(lease_ttl_s)}
    return child


def _config_toml(
    redis_port: int, api_port: int, status_port: int, replicas: Iterable[Replica]
) -> str:
    """Indexer keys at the top (short back-offs and replay timeout: faults heal fast; its
    status port free), the API's in ``[api]`` (no scraping: load is not under test)."""
    lines = [
        f'redis_url = "redis://127.0.0.1:{redis_port}/0"',
        f"status_port = {status_port}",
        f"replay_timeout_s = {REPLAY_TIMEOUT_S}",
        f"probe_interval_s = {PROBE_INTERVAL_S}",
        "reconnect_min_s = 0.05",
        "reconnect_max_s = 0.2",
    ]
    for r in replicas:
        lines += ["[[replicas]]", f'id = "{r.id}"', f'model = "{MODEL}"']
        lines.append(f'events = "tcp://127.0.0.1:{r.events_port}"')
        if r.replay_port is not None:
            lines.append(f'replay = "tcp://127.0.0.1:{r.replay_port}"')
    lines += ["[api]", 'host = "127.0.0.1"', f"port = {api_port}", "scrape_interval_s = 0.0"]
    return "\n".join(lines) + "\n"


def prompts_of(family: str, count: int, *, num_words: int = 40, shared: int = 16) -> list[str]:
    """``count`` prompts of ``num_words`` words (one token each): the first ``shared``
    words are common to a quarter of them (prefixes shared across prompts), the rest unique."""
    return [
        " ".join(
            [f"{family}-s{i % 4}-{j}" for j in range(shared)]
            + [f"{family}-{i}-{j}" for j in range(num_words - shared)]
        )
        for i in range(count)
    ]


def wait_agreement(fleet: FaultFleet, prompts: Sequence[str], timeout_s: float = 10.0) -> None:
    """Wait until the index agrees with every replica on ``prompts`` (before a fault)."""
    deadline = time.monotonic() + timeout_s
    while (found := fleet.mismatches(prompts)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert found == [], f"no agreement before the fault: {found[:6]}"

"""The same event streams into ``kvindex serve`` and Dynamo's standalone indexer
(``python -m dynamo.indexer``), the same calls to both; run inside a private network namespace
(Dynamo's HTTP server binds 0.0.0.0): ``unshare -n python -m tests.support.dynamo_parity``.

Workers are registered on both through ``POST /register`` (one instance with three data-parallel
ranks among them), fed stores (GPU, CPU where a rank offloads, a LoRA), removals and a clear, then
one is unregistered; after each phase every prompt of a sample is asked of both (``POST /query``:
matched tokens per instance, rank and tier) and ``GET /workers`` compared. A sentinel block per
stream, seen on both, ends each phase. Prints one JSON object: the agreement per phase and the
first disagreements."""

from __future__ import annotations

import argparse
import http.client
import json
import random
import subprocess
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvindex.clients.fake_vllm.publisher import EventPublisher
from kvindex.indexer.domain.events import AllBlocksCleared, BlockRemoved, BlockStored, Event, Tier
from tests.support.processes import KVINDEX, Child, http_ok
from tests.support.redis_server import free_ports

BS = 4
MODEL = "m"
LORA = "ad1"
STREAMS = ((1, 0), (2, 0), (2, 1), (2, 2), (3, 0))
OFFLOADING = ((2, 1), (2, 2))
"""Streams whose engine offloads every block it stores to CPU too (vLLM's offloading connector)."""
Stream = tuple[int, int]


def call(port: int, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    try:
        data = None if body is None else json.dumps(body)
        connection.request(method, path, data, {"content-type": "application/json"})
        answer = connection.getresponse()
        raw = answer.read()
    finally:
        connection.close()
    try:
        return answer.status, json.loads(raw) if raw else None
    except ValueError:
        return answer.status, raw.decode(errors="replace")


def engine_hash(parent: int | None, tokens: list[int], lora: str | None) -> int:
    """An engine's chained block hash: equal tokens after an equal parent hash alike anywhere."""
    seed = (parent or 0).to_bytes(8, "little") + (lora or "").encode()
    return xxhash.xxh3_64_intdigest(seed + b"".join(t.to_bytes(4, "little") for t in tokens)) >> 1


@dataclass
class Chain:
    tokens: list[int]
    lora: str | None
    hashes: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        parent = None
        for i in range(0, len(self.tokens), BS):
            parent = engine_hash(parent, self.tokens[i : i + BS], self.lora)
            self.hashes.append(parent)


class Fleet:
    """The publishers and what each stream holds on GPU, so stores are only of new blocks."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        ports = free_ports(len(STREAMS))
        self.pubs = {
            s: EventPublisher(f"tcp://127.0.0.1:{p}", encoding="array", rank=s[1], bind=True)
            for s, p in zip(STREAMS, ports, strict=True)
        }
        self.endpoints = {s: f"tcp://127.0.0.1:{p}" for s, p in zip(STREAMS, ports, strict=True)}
        self.held: dict[Stream, set[int]] = {s: set() for s in STREAMS}
        self.num_sentinels = 0

    def send(self, stream: Stream, events: list[Event]) -> None:
        self.pubs[stream].publish(events)

    def store(self, stream: Stream, chain: Chain, tier: Tier = Tier.GPU) -> None:
        """The chain's blocks not held yet, in events of 1 to 3 blocks (vLLM's order)."""
        held = self.held[stream]
        first = 0
        while first < len(chain.hashes) and (tier != Tier.GPU or chain.hashes[first] in held):
            first += 1 if tier == Tier.GPU else len(chain.hashes)
        i = first if tier == Tier.GPU else 0
        while i < len(chain.hashes):
            j = min(len(chain.hashes), i + self.rng.randint(1, 3))
            parent = chain.hashes[i - 1] if i else None
            toks = chain.tokens[i * BS : j * BS]
            self.send(stream, [BlockStored(chain.hashes[i:j], parent, toks, BS, tier, chain.lora)])
            if tier == Tier.GPU:
                held.update(chain.hashes[i:j])
            i = j

    def remove(self, stream: Stream, hashes: list[int], tier: Tier = Tier.GPU) -> None:
        self.send(stream, [BlockRemoved(hashes, tier)])
        if tier == Tier.GPU:
            self.held[stream].difference_update(hashes)

    def clear(self, stream: Stream) -> None:
        self.send(stream, [AllBlocksCleared()])
        self.held[stream].clear()

    def sentinels(self) -> dict[Stream, list[int]]:
        """A new block on every stream; seen on both servers, everything sent before is."""
        self.num_sentinels += 1
        out = {}
        for k, stream in enumerate(STREAMS):
            tokens = [60000 + 97 * self.num_sentinels + 11 * k + i for i in range(BS)]
            self.send(
                stream, [BlockStored([engine_hash(None, tokens, None)], None, tokens, BS, Tier.GPU)]
            )
            out[stream] = tokens
        return out

    def close(self) -> None:
        for pub in self.pubs.values():
            pub.close()


def wait_seen(ports: list[int], tokens_of: dict[Stream, list[int]], timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    for (instance, rank), tokens in tokens_of.items():
        for port in ports:
            while True:
                _, answer = call(port, "POST", "/query", {"token_ids": tokens, "model_name": MODEL})
                if answer.get("scores", {}).get(str(instance), {}).get(str(rank)) == BS:
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"port {port}: block on {instance}/{rank} never seen: {answer}"
                    )
                time.sleep(0.02)


def matched(answer: Any) -> Any:
    """What must be equal: matched tokens per instance and rank (``scores``; each instance's
    ``gpu``, ``cpu``, ``disk``, ``longest_matched`` and ``dp``); not ``frequencies``."""
    if not isinstance(answer, dict):
        return answer
    return {"scores": answer.get("scores"), "instances": answer.get("instances")}


def compare_queries(
    ports: list[int], prompts: list[tuple[list[int], str | None]]
) -> dict[str, Any]:
    agree, nonempty = 0, 0
    differ: list[dict[str, Any]] = []
    for tokens, lora in prompts:
        body: dict[str, Any] = {"token_ids": tokens, "model_name": MODEL}
        if lora is not None:
            body["lora_name"] = lora
        kv, dyn = (call(port, "POST", "/query", body) for port in ports)
        if kv[0] == dyn[0] and matched(kv[1]) == matched(dyn[1]):
            agree += 1
            nonempty += bool(isinstance(kv[1], dict) and kv[1].get("instances"))
        elif len(differ) < 3:
            differ.append({"tokens": len(tokens), "lora": lora, "kvindex": kv, "dynamo": dyn})
    return {
        "prompts": len(prompts),
        "agree": agree,
        "nonempty": nonempty,
        "differ": differ,
    }


def compare_workers(ports: list[int]) -> dict[str, Any]:
    kv, dyn = (call(port, "GET", "/workers") for port in ports)
    by_id = [
        {w["instance_id"]: w for w in answer} if isinstance(answer, list) else answer
        for _, answer in (kv, dyn)
    ]
    return {"agree": kv[0] == dyn[0] and by_id[0] == by_id[1], "kvindex": kv[1], "dynamo": dyn[1]}


def workload(rng: random.Random) -> list[Chain]:
    shared = [[rng.randrange(30000) for _ in range(BS * rng.randint(1, 6))] for _ in range(6)]
    chains = []
    for _ in range(60):
        prefix = shared[rng.randrange(len(shared))]
        extra = [rng.randrange(30000) for _ in range(BS * rng.randint(1, 6))]
        chains.append(Chain(prefix + extra, LORA if rng.random() < 0.2 else None))
    return chains


def prompts_of(rng: random.Random, chains: list[Chain]) -> list[tuple[list[int], str | None]]:
    out: list[tuple[list[int], str | None]] = []
    for chain in chains:
        tail = [rng.randrange(30000) for _ in range(rng.randint(0, 2 * BS + 3))]
        out.append((chain.tokens + tail, chain.lora))
        out.append((chain.tokens[: rng.randint(1, len(chain.tokens))], chain.lora))
    out.append(([rng.randrange(30000) for _ in range(40)], None))
    return out


def phase_one(fleet: Fleet, chains: list[Chain]) -> None:
    """Stores on GPU (also on CPU where offloading), then removals of chains' last blocks, as an
    LRU evicts (a middle block removed, then another worker unregistered: Dynamo 1.6.1 credits
    the blocks past the gap, kvindex stops at it; docs/guides/dynamo-indexer-api.md)."""
    rng = fleet.rng
    placed = []
    for chain in chains:
        stream = STREAMS[rng.randrange(len(STREAMS))]
        fleet.store(stream, chain)
        placed.append((stream, chain))
        if stream in OFFLOADING:
            fleet.store(stream, chain, Tier.CPU)
    for stream, chain in placed:
        if rng.random() < 0.3:
            fleet.remove(stream, chain.hashes[-rng.randint(1, 2) :])


def phase_two(fleet: Fleet, chains: list[Chain]) -> None:
    """A clear on one stream, then new stores there and elsewhere."""
    fleet.clear((1, 0))
    for chain in chains[:8]:
        fleet.store((1, 0), chain)
    for chain in chains[8:14]:
        fleet.store((2, 2), chain)
        fleet.store((2, 2), chain, Tier.CPU)


def run(args: argparse.Namespace) -> dict[str, Any]:
    subprocess.run(["ip", "link", "set", "lo", "up"], check=True)
    out_dir = Path(args.out)
    rng = random.Random(args.seed)
    kv_port, dyn_port, peer_port = free_ports(3)
    ports = [kv_port, dyn_port]
    result: dict[str, Any] = {}
    with ExitStack() as stack:
        dyn_env = {"DYN_LOG": "warn"}
        dynamo = Child(
            "dynamo",
            [args.dynamo_python, "-m", "dynamo.indexer", "--port", str(dyn_port), "--threads", "1"],
            out_dir / "dynamo.log",
            http_ok(dyn_port, "/health"),
            env=dyn_env,
        )
        extra = []
        if args.dump:  # Dynamo's /dump served: kvindex keeps its journal
            (out_dir / "kvindex.toml").write_text("[api]\ndynamo_dump = true\n")
            extra = ["--config", str(out_dir / "kvindex.toml")]
        kvindex = Child(
            "kvindex",
            [
                str(KVINDEX),
                "serve",
                "--host",
                "127.0.0.1",
                "--port",
                str(kv_port),
                "--stats-every",
                "0",
                *extra,
            ],
            out_dir / "kvindex.log",
            http_ok(kv_port, "/healthz"),
        )
        for child in (dynamo, kvindex):
            stack.callback(child.stop)
            child.start(30)
        fleet = Fleet(rng)
        stack.callback(fleet.close)
        for instance, rank in STREAMS:
            body = {
                "instance_id": instance,
                "endpoint": fleet.endpoints[(instance, rank)],
                "model_name": MODEL,
                "block_size": BS,
                "dp_rank": rank,
            }
            statuses = [call(port, "POST", "/register", body)[0] for port in ports]
            if statuses != [201, 201]:
                raise RuntimeError(f"register {instance}/{rank}: {statuses}")
        deadline = time.monotonic() + 20
        while True:  # a slow joiner loses what is sent before it subscribes: probe till seen
            try:
                wait_seen(ports, fleet.sentinels(), timeout_s=1.0)
                break
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
        chains = workload(rng)
        prompts = prompts_of(rng, chains)
        phase_one(fleet, chains)
        wait_seen(ports, fleet.sentinels())
        result["stores_and_removals"] = compare_queries(ports, prompts)
        result["workers"] = compare_workers(ports)
        phase_two(fleet, chains)
        wait_seen(ports, fleet.sentinels())
        result["after_clear"] = compare_queries(ports, prompts)
        body = {"instance_id": 3, "model_name": MODEL}  # 1.6.1 drops every rank even given one
        result["unregister"] = [call(port, "POST", "/unregister", body) for port in ports]
        result["after_unregister"] = compare_queries(ports, prompts)
        result["workers_after_unregister"] = compare_workers(ports)
        if args.peers:
            result["peers"] = try_peers(args, kv_port, peer_port, prompts, out_dir)
    return result


def try_peers(
    args: argparse.Namespace,
    kv_port: int,
    port: int,
    prompts: list[tuple[list[int], str | None]],
    out_dir: Path,
) -> dict[str, Any]:
    """A Dynamo indexer started with ``--peers`` kvindex: does it answer as kvindex does, LoRA
    prompts included (kvindex's ``/dump`` carries a LoRA block in its tokens hash, as Dynamo's)?"""
    peer = Child(
        "dynamo-peer",
        [
            args.dynamo_python,
            "-m",
            "dynamo.indexer",
            "--port",
            str(port),
            "--peers",
            f"http://127.0.0.1:{kv_port}",
            "--threads",
            "1",  # as the other Dynamo here: with more, it applied a child before its parent
        ],
        out_dir / "peer.log",
        http_ok(port, "/health"),
        env={"DYN_LOG": "info"},
    )
    try:
        peer.start(30)
        time.sleep(1.0)
        return {
            "started": True,
            "queries": compare_queries([kv_port, port], prompts),
            "workers": compare_workers([kv_port, port])["dynamo"],
            "log": peer.tail(100_000),  # whole: warnings may follow the recovery's line
        }
    except Exception as exc:
        return {"started": False, "error": str(exc)[-1500:]}
    finally:
        peer.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--dynamo-python", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--peers", action="store_true")
    parser.add_argument("--dump", action="store_true", help="kvindex with api.dynamo_dump")
    print(json.dumps(run(parser.parse_args())))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""SGLang's own KV-event code driven without a model or a GPU: run by the Python of a venv
holding ``sglang`` (installed ``--no-deps``; see the Makefile's ``.venv-sglang``), never by
kvindex's. Imports nothing of kvindex.

SGLang's package ``__init__`` pulls in torch, so its modules are loaded from their files with
empty parent packages. What runs is SGLang's: ``ZmqEventPublisher`` (framing, sequence numbers,
replay, data-parallel port offsets), its event structs and ``KVEventBatch``, and its
``KVCacheEventRecorder`` (which events a radix-tree node gives: parent links, coalescing,
``cache_salt``, LoRA names and their hash namespaces). Only the per-page hash strings come from
a stand-in (SGLang's are a compiled extension): a SHA-256 chain over the pages' token ids.

``python sglang_engine.py '<KVEventsConfig JSON + dp_size, page_size>'`` runs one engine per
DP rank, driven by commands on stdin (``tests/integration/test_sglang_publisher.py``).
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import sys
import sysconfig
import time
import types
from collections.abc import Sequence
from pathlib import Path
from typing import Any

SGLANG_VERSION = "0.5.23"
_MODULES = ("sglang.srt.disaggregation.kv_events", "sglang.srt.mem_cache.events")


def _site_root() -> Path:
    return Path(sysconfig.get_paths()["purelib"]) / "sglang"


def _package(name: str, path: Path) -> None:
    if name not in sys.modules:
        module = types.ModuleType(name)
        module.__path__ = [str(path)]
        sys.modules[name] = module


def _load(name: str) -> Any:
    if name in sys.modules:
        return sys.modules[name]
    root = _site_root()
    path = root.joinpath(*name.split(".")[1:]).with_suffix(".py")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no module file {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _hash_stand_in() -> types.ModuleType:
    """``sglang.srt.mem_cache.utils`` as the recorder uses it (that module needs torch)."""
    utils = types.ModuleType("sglang.srt.mem_cache.utils")

    def chain(node: Any, page_size: int, prior: str | None, seed: str) -> list[str]:
        tokens = list(node.key.token_ids)
        values = []
        for start in range(0, len(tokens), page_size):
            page = b"".join(t.to_bytes(4, "little") for t in tokens[start : start + page_size])
            prior = hashlib.sha256(seed.encode() + bytes.fromhex(prior or "") + page).hexdigest()
            values.append(prior)
        return values

    def compute_node_hash_values(node: Any, page_size: int) -> list[str]:
        parent = node.parent
        prior = parent.hash_value[-1] if parent is not None and parent.hash_value else None
        return chain(node, page_size, prior, "")

    def compute_node_event_hash_values(node: Any, page_size: int) -> list[str]:
        if node.event_hash_value is None:
            parent = node.parent
            prior = None
            if parent is not None and parent.event_hash_value:
                prior = parent.event_hash_value[-1]
            seed = f"{node.key.extra_key}\0{node.key.cache_salt}" if prior is None else ""
            node.event_hash_value = chain(node, page_size, prior, seed)
        return list(node.event_hash_value)

    def hash_str_to_int64(value: str) -> int:
        unsigned = int(value[:16], 16)
        return unsigned - (1 << 64) if unsigned >= 1 << 63 else unsigned

    utils.compute_node_hash_values = compute_node_hash_values  # type: ignore[attr-defined]
    utils.compute_node_event_hash_values = compute_node_event_hash_values  # type: ignore[attr-defined]
    utils.hash_str_to_int64 = hash_str_to_int64  # type: ignore[attr-defined]
    return utils


def load_sglang() -> tuple[Any, Any]:
    """SGLang's ``kv_events`` and ``mem_cache.events`` modules, from this venv's install."""
    root = _site_root()
    for name in ("sglang", "sglang.srt", "sglang.srt.utils", "sglang.srt.mem_cache"):
        _package(name, root.joinpath(*name.split(".")[1:]))
    _package("sglang.srt.disaggregation", root / "srt" / "disaggregation")
    sys.modules.setdefault("sglang.srt.mem_cache.utils", _hash_stand_in())
    kv_events, events = (_load(name) for name in _MODULES)
    return kv_events, events


class Key:
    """SGLang's ``RadixKey`` as the recorder reads it."""

    is_bigram = False

    def __init__(self, token_ids: Sequence[int], extra_key: str | None, salt: str | None):
        self.token_ids = list(token_ids)
        self.extra_key = extra_key
        self.cache_salt = salt

    def __len__(self) -> int:
        return len(self.token_ids)


class Node:
    """A radix-tree node: its own pages, and its parent (the root has an empty key)."""

    def __init__(self, parent: Node | None, tokens: Sequence[int], **namespace: str | None):
        self.parent = parent
        self.key = Key(tokens, namespace.get("extra_key"), namespace.get("cache_salt"))
        self.hash_value: list[str] | None = None if parent is not None else []
        self.event_hash_value: list[str] | None = None if parent is not None else []

    def prefix(self) -> list[int]:
        above = self.parent.prefix() if self.parent is not None else []
        return above + self.key.token_ids


class Engine:
    """One scheduler's KV cache events: SGLang's recorder feeding SGLang's publisher."""

    def __init__(self, config: dict[str, Any], rank: int, page_size: int) -> None:
        self.kv_events, events = load_sglang()
        self.recorder = events.KVCacheEventRecorder(enabled=True, page_size=page_size)
        self.publisher = self.kv_events.EventPublisherFactory.create(json.dumps(config), rank)
        self.root = Node(None, [])

    def lora(self, lora_name: str, lora_id: str) -> str:
        """Register an adapter as the scheduler does for its requests; its ``extra_key``."""
        request = types.SimpleNamespace(extra_key=f"adapter:{lora_id}", lora_id=lora_id)
        self.recorder.lora_names.register(request, lora_name)
        return str(request.extra_key)

    def store(self, node: Node, *, medium: str = "GPU", session_id: str | None = None) -> None:
        medium_value = self.kv_events.StorageMedium(medium)
        self.recorder.record_store(node, medium_value, session_id=session_id)

    def remove(self, node: Node, *, medium: str = "GPU") -> None:
        self.recorder.record_remove(node, self.kv_events.StorageMedium(medium))

    def clear(self) -> None:
        self.recorder.record_all_cleared()

    def step(self) -> None:
        """End of a scheduler step: what was recorded goes out as one batch."""
        events = self.recorder.take()
        if events:
            self.publisher.publish(self.kv_events.KVEventBatch(ts=time.time(), events=events))

    def close(self) -> None:
        self.publisher.shutdown()


def serve(config: dict[str, Any], page_size: int) -> None:
    """One engine per DP rank, driven by JSON lines on stdin (``store``, ``remove``,
    ``clear``: a node, named per rank, and its rank; ``step``; ``quit``), each answered ``ok``
    on stdout."""
    engines = [Engine(config, rank, page_size) for rank in range(int(config.pop("dp_size")))]
    nodes: dict[str, Node] = {}
    print("ready", flush=True)
    for line in sys.stdin:
        command = json.loads(line)
        op = command["op"]
        if op == "quit":
            break
        if op == "step":
            for engine in engines:
                engine.step()
        else:
            rank = command["rank"]
            _apply(engines[rank], nodes, {**command, "node": f"{rank}/{command.get('node')}"})
        print("ok", flush=True)
    for engine in engines:
        engine.close()


def _apply(engine: Engine, nodes: dict[str, Node], command: dict[str, Any]) -> None:
    op, name = command["op"], command.get("node", "")
    if op == "clear":
        engine.clear()
    elif op == "remove":
        engine.remove(nodes[name], medium=command.get("medium", "GPU"))
    elif op == "store":
        if name not in nodes:
            parent_name = f"{command['rank']}/{command['parent']}" if command.get("parent") else ""
            parent = nodes[parent_name] if parent_name else engine.root
            lora = command.get("lora_name")
            extra_key = engine.lora(lora, command["lora_id"]) if lora else None
            salt = command.get("cache_salt")
            nodes[name] = Node(parent, command["tokens"], extra_key=extra_key, cache_salt=salt)
        engine.store(nodes[name], medium=command.get("medium", "GPU"), session_id="session-1")
    else:
        raise ValueError(f"unknown op {op!r}")


if __name__ == "__main__":
    settings = json.loads(sys.argv[1])
    serve(settings, int(settings.pop("page_size")))

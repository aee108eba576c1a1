"""``DynamoFront``: Dynamo's standalone-indexer calls as kvindex does them — a registered rank
is a replica of one stream (:mod:`~kvindex.api.dynamo.instances`), unregistering purges it, a
query reads the index once. Refusals raise :class:`DynamoApiError` with Dynamo's status."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from kvindex.api.config.settings import ApiSettings
from kvindex.api.dynamo.instances import instance_of_name, rank_of, registered, replica_id
from kvindex.api.dynamo.overlap import overlap
from kvindex.api.dynamo.schemas import (
    Listener,
    Overlap,
    QueryByHashRequest,
    QueryRequest,
    RegisterRequest,
    UnregisterRequest,
    Worker,
)
from kvindex.api.loop.off_loop import OffLoop
from kvindex.indexer.domain.errors import KvIndexError, SettingsError
from kvindex.indexer.domain.events import StreamId
from kvindex.indexer.domain.keys import block_keys
from kvindex.indexer.fleet.registry import RegistryView
from kvindex.indexer.fleet.replica import ReplicaSpec, check_endpoint
from kvindex.indexer.index.protocol import BlockIndex, prefix_holders

GROUP = "default"
"""kvindex keeps one routing group per model."""
_U64 = (1 << 64) - 1


class DynamoApiError(KvIndexError):
    """A call refused, with the HTTP status Dynamo's indexer answers it with."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ReadPathParts:
    """What the front uses of a read path (``ApiCore``'s)."""

    settings: ApiSettings
    registry: RegistryView
    index: BlockIndex
    off_loop: OffLoop
    remove_replica: Callable[[ReplicaSpec], Awaitable[None]]  # purges, then unregisters
    forget_model: Callable[[str], None]  # the model's replicas changed


class DynamoFront:
    """Dynamo's calls over one read path; block sizes registered here are this process's."""

    def __init__(self, parts: ReadPathParts) -> None:
        self._parts = parts
        self._registry = parts.registry
        self._registered_block_size: dict[str, int] = {}

    # --- the fleet ---------------------------------------------------------------------------

    async def register(self, request: RegisterRequest) -> None:
        """One rank's stream subscribed; 409 when the rank is there or the block size differs."""
        _check_group(request.routing_group, 422)
        try:
            check_endpoint("endpoint", request.endpoint)
        except SettingsError as exc:
            raise DynamoApiError(400, f"invalid ZMQ endpoint: {exc}") from None
        model, known = request.model_name, self.known_block_size(request.model_name)
        if known is not None and known != request.block_size:
            raise DynamoApiError(
                409,
                f"block_size mismatch for model={model} routing_group={GROUP}: "
                f"existing={known}, requested={request.block_size}",
            )
        rid = replica_id(request.instance_id, request.dp_rank)
        if await self._parts.off_loop(self._registry.get, rid) is not None:
            raise DynamoApiError(
                409, f"instance {request.instance_id} dp_rank {request.dp_rank} already registered"
            )
        spec = ReplicaSpec(id=rid, model=model, events=request.endpoint)
        await self._parts.off_loop(self._registry.add, spec)
        self._registered_block_size.setdefault(model, request.block_size)
        self._parts.forget_model(model)

    async def unregister(self, request: UnregisterRequest) -> None:
        """Every rank of the instance (or the one named) purged and unregistered; 404 if none."""
        _check_group(request.routing_group, 404)
        specs = await self._parts.off_loop(self._registry.replicas)
        chosen = [s for s in specs if s.model == request.model_name and _is_instance(s, request)]
        if not chosen:
            raise DynamoApiError(404, f"instance {request.instance_id} not found")
        for spec in chosen:
            await self._parts.remove_replica(spec)

    async def workers(self) -> list[Worker]:
        """Every replica as Dynamo's instances, ordered by instance id."""
        specs = await self._parts.off_loop(self._registry.replicas)
        down = set(await self._parts.off_loop(self._registry.disconnected))
        workers: dict[int, Worker] = {}
        for spec in specs:
            for rank in range(spec.dp_size):
                stream = StreamId(spec.id, rank)
                instance, dp_rank = rank_of(stream)
                worker = workers.get(instance)
                if worker is None:
                    worker = workers[instance] = self._worker(instance, spec.model)
                endpoint = spec.events_for_rank(rank)
                status = "inactive" if endpoint is not None and stream in down else "active"
                worker.endpoints[str(dp_rank)] = endpoint
                worker.listeners[str(dp_rank)] = Listener(endpoint, status)
        for worker in workers.values():
            active = any(lis.status == "active" for lis in worker.listeners.values())
            worker.status = "active" if active else "inactive"
        return [workers[i] for i in sorted(workers)]

    def _worker(self, instance: int, model: str) -> Worker:
        return Worker(instance, "zmq", "active", model, GROUP, self.block_size(model), {}, {})

    # --- queries -----------------------------------------------------------------------------

    async def query(self, request: QueryRequest) -> Overlap:
        """Matched tokens of the prompt's blocks (kvindex's keys, LoRA included)."""
        streams = await self._streams(request.model_name, request.routing_group)
        size = self.block_size(request.model_name)
        keys = block_keys(request.model_name, request.token_ids, size, lora_name=request.lora_name)
        return await self._overlap(keys, streams, size)

    async def query_by_hash(self, request: QueryByHashRequest) -> Overlap:
        """As :meth:`query` for kvindex block keys given (i64 or u64, the same 64 bits)."""
        streams = await self._streams(request.model_name, request.routing_group)
        keys = [h & _U64 for h in request.block_hashes]
        return await self._overlap(keys, streams, self.block_size(request.model_name))

    async def _streams(self, model: str, group: str | None) -> list[StreamId]:
        _check_group(group, 404, model)
        specs = [s for s in await self._parts.off_loop(self._registry.replicas) if s.model == model]
        if not specs:
            raise DynamoApiError(404, f"no indexer for model={model} routing_group={GROUP}")
        streams = {StreamId(s.id, r) for s in specs for r in range(s.dp_size)}
        ids = {s.id for s in specs}
        heard = await self._parts.off_loop(self._registry.stream_ids)
        streams.update(s for s in heard if s.replica in ids)
        return sorted(streams)

    async def _overlap(self, keys: list[int], streams: Sequence[StreamId], size: int) -> Overlap:
        if not keys:
            return overlap({}, size)
        matches = await self._parts.off_loop(prefix_holders, self._parts.index, keys, streams)
        return overlap(matches, size)

    # --- block sizes -------------------------------------------------------------------------

    def known_block_size(self, model: str) -> int | None:
        """The model's configured block size, else its streams', else the one registered here."""
        spec = self._parts.settings.model(model)
        if spec is not None and spec.block_size:
            return spec.block_size
        return self._registry.block_size(model) or self._registered_block_size.get(model)

    def block_size(self, model: str) -> int:
        known = self.known_block_size(model)
        return known if known is not None else self._parts.settings.default_block_size


def _check_group(group: str | None, status: int, model: str | None = None) -> None:
    if group is None or group == GROUP:
        return
    if model is not None:
        raise DynamoApiError(status, f"no indexer for model={model} routing_group={group}")
    raise DynamoApiError(status, f"routing_group {group!r}: kvindex keeps one, {GROUP!r}")


def _is_instance(spec: ReplicaSpec, request: UnregisterRequest) -> bool:
    named = registered(spec.id)
    if named is not None:
        same = named.instance_id == request.instance_id
        return same and request.dp_rank in (None, named.dp_rank)
    if instance_of_name(spec.id) != request.instance_id:
        return False
    if request.dp_rank is not None and spec.dp_size > 1:
        raise DynamoApiError(
            422,
            f"instance {request.instance_id} is kvindex replica {spec.id!r}: its ranks "
            "are unregistered together (omit dp_rank)",
        )
    return request.dp_rank in (None, 0)

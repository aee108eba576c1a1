"""A synthetic fleet's prefix caches, for the read-path benchmark (``score.py``).

The fleet serves one model. Replica ``i`` belongs to group ``i % 4``; each group has its own
system prompt (64 blocks, shared by every replica of the group). Chained after it, a replica
holds its own conversations (32 to 384 blocks each, random tokens) until it holds
``ceil(blocks / replicas)`` blocks.

The measured prompt (512 blocks = 8,192 tokens) is group 0's system prompt followed by one
conversation, of which the first three replicas of group 0 hold a long, a middling and a
short part (prompt blocks matched: 480, 256, 96). The other replicas of group 0 match the
system prompt alone (64); the other groups match nothing. :meth:`Fleet.expected` says so
per replica, and the benchmark checks every answer against it.

Blocks are cached as a vLLM replica publishes them: ``BlockStored`` events of at most 128
blocks (a chunked-prefill step), each chained to its parent's engine hash. Engine hashes are
the vLLM stand-ins' own (:mod:`kvindex.clients.fake_vllm.engine_hash`) from a per-replica
root: uniform over u64, different on every replica. Token
ids are uniform below 2**17 (Llama 3's vocabulary has 128,256). Everything is
deterministic per seed, and a replica's chunks are generated only when asked for, so the
whole fleet is never in memory at once.
"""

from __future__ import annotations

import random
import sys
from array import array
from dataclasses import dataclass, field

from kvindex.clients.fake_vllm.engine_hash import engine_chain, engine_root
from kvindex.indexer.domain.events import BlockStored, Tier
from kvindex.indexer.domain.keys import block_keys, chain_keys, model_root
from kvindex.indexer.index.protocol import Op, OpKind

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
BLOCK_SIZE = 16
PROMPT_BLOCKS = 512
"""The measured prompt: 8,192 tokens."""
SYSTEM_BLOCKS = 64
NUM_GROUPS = 4
"""Groups of replicas, each with its own system prompt."""
CONVERSATION_BLOCKS = (32, 384)
EVENT_BLOCKS = 128
"""Most blocks in one ``BlockStored`` (one chunked-prefill step of 2,048 tokens)."""
LONG_MATCHES = (480, 256, 96)
"""Prompt blocks matched by the first three replicas of group 0."""

_TOKEN_BYTES = 4
_BLOCK_BYTES = BLOCK_SIZE * _TOKEN_BYTES
_LOW_BIT = bytes(b & 1 for b in range(256))
_STORE, _GPU = OpKind.STORE, Tier.GPU


def random_token_bytes(rng: random.Random, num_blocks: int) -> bytes:
    """``num_blocks`` blocks of token ids below 2**17, as little-endian u32."""
    num_tokens = num_blocks * BLOCK_SIZE
    raw = rng.randbytes(3 * num_tokens)
    out = bytearray(_TOKEN_BYTES * num_tokens)
    out[0::4] = raw[0::3]
    out[1::4] = raw[1::3]
    out[2::4] = raw[2::3].translate(_LOW_BIT)
    return bytes(out)


def token_list(token_bytes: bytes) -> list[int]:
    """Token ids from little-endian u32 bytes."""
    tokens = array("I")
    tokens.frombytes(token_bytes)
    if sys.byteorder != "little":
        tokens.byteswap()
    return tokens.tolist()


def replica_id(i: int) -> str:
    return f"r{i}"


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive blocks of one sequence cached by one event."""

    token_bytes: bytes
    parent_hash: int | None
    keys: list[int]
    hashes: list[int]

    def ops(self) -> list[Op]:
        """The index ops the indexer makes of this chunk's ``BlockStored``."""
        return [(_STORE, _GPU, h, k) for h, k in zip(self.hashes, self.keys, strict=True)]

    def event(self) -> BlockStored:
        """The chunk as vLLM publishes it."""
        return BlockStored(
            block_hashes=self.hashes,
            parent_hash=self.parent_hash,
            token_ids=token_list(self.token_bytes),
            block_size=BLOCK_SIZE,
            tier=Tier.GPU,
        )


@dataclass(slots=True)
class _Chain:
    """Appends blocks to one sequence: knows the parent's key and engine hash (None: the
    sequence starts at the replica's engine-hash ``root``)."""

    root: int
    key: int
    hash: int | None

    def extend(self, token_bytes: bytes) -> list[Chunk]:
        chunks = []
        stride = EVENT_BLOCKS * _BLOCK_BYTES
        for start in range(0, len(token_bytes), stride):
            part = token_bytes[start : start + stride]
            keys = chain_keys(self.key, part, BLOCK_SIZE)
            parent = self.root if self.hash is None else self.hash
            hashes = engine_chain(parent, token_list(part), BLOCK_SIZE)
            chunks.append(Chunk(part, self.hash, keys, hashes))
            self.key, self.hash = keys[-1], hashes[-1]
        return chunks

    def fork(self) -> _Chain:
        return _Chain(self.root, self.key, self.hash)


@dataclass(frozen=True, slots=True)
class FleetConfig:
    replicas: int = 32
    blocks: int = 1_000_000
    """Blocks in the whole index (rounded up to a multiple of ``replicas``)."""
    seed: int = 0

    @property
    def blocks_per_replica(self) -> int:
        return -(-self.blocks // self.replicas)

    def check(self) -> None:
        """Raise ValueError unless every replica has room for its part of the prompt."""
        wanted = max(LONG_MATCHES) + CONVERSATION_BLOCKS[0]
        if self.replicas < 1 or self.blocks_per_replica < wanted:
            raise ValueError(
                f"need >= 1 replica and >= {wanted} blocks per replica, got"
                f" {self.replicas} replicas and {self.blocks_per_replica} blocks each"
            )


@dataclass(slots=True)
class Fleet:
    """What every replica caches, and what the measured prompt matches where."""

    config: FleetConfig
    system: list[bytes] = field(default_factory=list)
    conversation: bytes = b""

    def __post_init__(self) -> None:
        self.config.check()
        rng = random.Random(f"kvindex-bench/{self.config.seed}/shared")
        self.system = [random_token_bytes(rng, SYSTEM_BLOCKS) for _ in range(NUM_GROUPS)]
        self.conversation = random_token_bytes(rng, PROMPT_BLOCKS - SYSTEM_BLOCKS)

    @property
    def replica_ids(self) -> list[str]:
        return [replica_id(i) for i in range(self.config.replicas)]

    @property
    def num_blocks(self) -> int:
        """Blocks in the whole index once every replica's chunks are stored."""
        return self.config.replicas * self.config.blocks_per_replica

    def prompt_tokens(self) -> list[int]:
        return token_list(self.system[0] + self.conversation)

    def prompt_keys(self) -> list[int]:
        return block_keys(MODEL, self.prompt_tokens(), BLOCK_SIZE)

    def probe_tokens(self, group: int) -> list[int]:
        """A prompt of group ``group``'s system prompt alone: every replica of the group
        matches all of it, every other replica nothing (so one probe per group shows that
        every replica is looked up)."""
        return token_list(self.system[group])

    def probe_expected(self, group: int) -> dict[str, int]:
        return {
            replica_id(i): SYSTEM_BLOCKS if i % NUM_GROUPS == group else 0
            for i in range(self.config.replicas)
        }

    def held(self, i: int) -> int:
        """Blocks of the measured conversation replica ``i`` holds."""
        group0 = range(0, self.config.replicas, NUM_GROUPS)
        for rank, replica in enumerate(group0[: len(LONG_MATCHES)]):
            if replica == i:
                return LONG_MATCHES[rank] - SYSTEM_BLOCKS
        return 0

    def expected(self) -> dict[str, int]:
        """Prompt blocks each replica's cache matches."""
        return {
            replica_id(i): SYSTEM_BLOCKS + self.held(i) if i % NUM_GROUPS == 0 else 0
            for i in range(self.config.replicas)
        }

    def chunks(self, i: int) -> list[Chunk]:
        """Everything replica ``i`` caches, in the order it caches it."""
        rng = random.Random(f"kvindex-bench/{self.config.seed}/replica/{i}")
        root = _Chain(engine_root(rng.getrandbits(64)), model_root(MODEL), None)
        out = root.extend(self.system[i % NUM_GROUPS])
        budget = self.config.blocks_per_replica - SYSTEM_BLOCKS
        held = self.held(i)
        if held:
            out += root.fork().extend(self.conversation[: held * _BLOCK_BYTES])
            budget -= held
        while budget > 0:
            size = min(budget, rng.randint(*CONVERSATION_BLOCKS))
            out += root.fork().extend(random_token_bytes(rng, size))
            budget -= size
        return out

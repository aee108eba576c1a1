"""The vLLM stand-ins' engine hashes: chained, seeded by their root, not kvindex's keys."""

from __future__ import annotations

import pytest

from kvindex.clients.fake_vllm.engine_hash import engine_chain, engine_root
from kvindex.indexer.domain.keys import chain_keys, tokens_to_bytes

TOKENS = list(range(100, 132))  # 4 blocks of 8


def test_the_root_is_a_function_of_the_seed_or_random() -> None:
    assert engine_root(0) == engine_root(0) != engine_root(1)
    assert engine_root("model-a") != engine_root("model-b")
    assert engine_root(None) != engine_root(None)
    assert 0 <= engine_root(3) < 2**64


def test_full_blocks_only_chained_from_the_parent() -> None:
    whole = engine_chain(5, [*TOKENS, 1, 2, 3], 8)
    assert len(whole) == 4  # the partial block has no hash
    assert engine_chain(whole[1], TOKENS[16:], 8) == whole[2:]
    assert engine_chain(6, TOKENS, 8) != whole  # another root, other hashes everywhere
    assert len(set(whole) | set(engine_chain(6, TOKENS, 8))) == 8


def test_a_block_hash_depends_on_its_prefix_and_its_extra_keys() -> None:
    plain = engine_chain(5, TOKENS, 8)
    changed = engine_chain(5, [0, *TOKENS[1:]], 8)
    assert all(a != b for a, b in zip(plain, changed, strict=True))  # every later block too
    salted = engine_chain(5, TOKENS, 8, [("salt",), None, None, None])
    assert salted[0] != plain[0] and len(set(salted) & set(plain)) == 0
    assert engine_chain(5, TOKENS, 8, [None, (), None, None]) == plain  # nothing extra
    with pytest.raises(ValueError, match="3 extra keys for 4 blocks"):
        engine_chain(5, TOKENS, 8, [None, None, None])


def test_engine_hashes_are_not_kvindex_block_keys() -> None:
    """The indexer must map them, as with a real vLLM: the same tokens and the same
    parent give other values than kvindex's key function."""
    keys = chain_keys(5, tokens_to_bytes(TOKENS), 8)
    assert not set(engine_chain(5, TOKENS, 8)) & set(keys)

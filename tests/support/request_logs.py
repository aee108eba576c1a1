"""Request logs of a known structure, and a small byte-level BPE tokenizer trained here.

The tokenizer is trained in a few milliseconds on the words the logs use (no download);
being byte-level, it encodes any text (timestamps, ids) without unknown tokens.
"""

from __future__ import annotations

import gzip
import json
import random
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import tokenizers
from tokenizers import decoders, models, pre_tokenizers, trainers

_WORDS = (
    "the a of to and in is for on with as by at from that this be are or it not an"
    " answer user question policy rule must never always reply customer order refund"
    " account shipping product price support agent polite brief clear tool call json"
    " data when if then else only please thank you help check status return item"
    " invoice date time name email address phone number message system assistant"
)
WORDS = _WORDS.split()


def text(rng: random.Random, num_words: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(num_words))


def make_tokenizer(path: Path) -> Path:
    """A byte-level BPE of ~600 tokens trained on :data:`WORDS`, saved at ``path``."""
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(7)
    corpus = [text(rng, 30) for _ in range(200)] + ["0123456789:-TZ"]
    trainer = trainers.BpeTrainer(
        vocab_size=600, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(path))
    return path


def write_log(path: Path, rows: Sequence[Any], *, gz: bool = False) -> Path:
    data = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()
    path.write_bytes(gzip.compress(data) if gz else data)
    return path


def chat(system: str, question: str, **extra: Any) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}, {"role": "user", "content": question}]
    return {"model": "m", "messages": messages, **extra}


RULES_WORDS = 500


def timestamped_rules(n: int, seed: int = 1) -> list[dict[str, Any]]:
    """A timestamp first, then long shared rules, then a short user question."""
    rng = random.Random(seed)
    rules = text(random.Random(99), RULES_WORDS)
    rows = []
    for i in range(n):
        ts = f"2026-12-02T{i // 60 % 24:02d}:{i % 60:02d}:{rng.randrange(60):02d}Z"
        rows.append(chat(f"Current time: {ts}\n{rules}", text(rng, 12), timestamp=1_000 + i))
    return rows


def shared_system(n: int, seed: int = 2) -> list[dict[str, Any]]:
    """One long system prompt, then a varied user turn."""
    rng = random.Random(seed)
    system = text(random.Random(98), RULES_WORDS)
    return [chat(system, text(rng, rng.randint(10, 40))) for _ in range(n)]


def several_systems(n: int, num_systems: int = 8, seed: int = 3) -> list[dict[str, Any]]:
    """``num_systems`` distinct system prompts, uniformly used, then a varied user turn."""
    rng = random.Random(seed)
    systems = [text(random.Random(50 + s), 300) for s in range(num_systems)]
    return [chat(systems[i % num_systems], text(rng, rng.randint(10, 40))) for i in range(n)]


def several_systems_texts(n: int, num_systems: int = 4, seed: int = 6) -> list[str]:
    """Completions prompts: one of ``num_systems`` long instructions, then a varied question."""
    rng = random.Random(seed)
    systems = [text(random.Random(80 + s), 200) for s in range(num_systems)]
    return [f"{systems[i % num_systems]}\n{text(rng, 20)}" for i in range(n)]


def unique_prompts(n: int, seed: int = 4) -> list[dict[str, Any]]:
    """Short completions prompts that share nothing."""
    rng = random.Random(seed)
    return [{"model": "m", "prompt": f"{i} {text(rng, 25)}"} for i in range(n)]


def multi_turn(num_chats: int, turns: int, seed: int = 5) -> list[dict[str, Any]]:
    """Chats behind one short system prompt; each turn resends the whole history."""
    rng = random.Random(seed)
    system = text(random.Random(97), 40)
    rows = []
    histories = [[{"role": "system", "content": system}] for _ in range(num_chats)]
    for _ in range(turns):
        for history in histories:
            history.append({"role": "user", "content": text(rng, 30)})
            rows.append({"model": "m", "messages": list(history)})
            history.append({"role": "assistant", "content": text(rng, 60)})
    return rows

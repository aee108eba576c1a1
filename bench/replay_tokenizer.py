"""A Hugging Face ``tokenizer.json`` that tokenizes the router replay's prompts as its fake
workers do, so that ``kvindex proxy`` can run the replay with a local tokenizer.

The replay (``router_replay/router_trace_replay.py`` beside the shared benchmarks) builds a
prompt from 64-character blocks of lowercase hex, and its workers' ``/tokenize``, render
routes and KV events make 16 tokens of each block: ``int(group, 16) + 1`` for each group of
four hex digits. Here: a WordLevel model whose vocabulary maps ``"0000"`` → 1 …
``"ffff"`` → 65536, a pre-tokenizer that cuts the text every four characters, no special
tokens and no normalizer. On the replay's prompts the ids are the workers'; on other text
(the warm-up request, a tail shorter than four characters, uppercase) they are ``[UNK]``
(0), which only costs that request its cache hits.

    python bench/replay_tokenizer.py --out /path/to/tokenizer.json

prints one JSON line: the path, the vocabulary size and a check of a few blocks.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import tokenizers
from tokenizers import Regex, models, pre_tokenizers

GROUP_CHARS = 4
UNK = "[UNK]"


def vocabulary() -> dict[str, int]:
    """Every four-hex-digit group (lowercase) → its value + 1, and ``[UNK]`` → 0."""
    vocab = {f"{value:04x}": value + 1 for value in range(16**GROUP_CHARS)}
    vocab[UNK] = 0
    return vocab


def replay_tokenizer() -> tokenizers.Tokenizer:
    """The tokenizer described above."""
    tokenizer = tokenizers.Tokenizer(models.WordLevel(vocabulary(), unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(
        Regex(f".{{1,{GROUP_CHARS}}}"), behavior="isolated"
    )
    return tokenizer


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="Where to write tokenizer.json.")
    args = parser.parse_args()
    started = time.perf_counter()
    tokenizer = replay_tokenizer()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(args.out))
    sample = "0123456789abcdef" * 4  # one 64-character block
    ids = tokenizers.Tokenizer.from_file(str(args.out)).encode(sample).ids
    line = {
        "tokenizer": str(args.out),
        "vocab_size": tokenizer.get_vocab_size(),
        "sample_ids": ids[:4],
        "seconds": round(time.perf_counter() - started, 3),
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()

"""A tiny model and a conversation shared by the tokenizer tests.

The local tokenizer is a tiny WordLevel model trained here on a few sentences, with a BOS
added by a TemplateProcessing post-processor; the ``model_dir`` fixture (conftest) lays it
out in ``tmp_path`` like a Hugging Face model directory. :func:`ok` answers like vLLM's
``/tokenize`` (for an ``httpx.MockTransport``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import httpx
import tokenizers
from tokenizers import models, pre_tokenizers, processors, trainers

BOS, EOS = "<s>", "</s>"
ROLE_TOKENS = ["<|system|>", "<|user|>", "<|assistant|>"]
SYSTEM = "you are a terse helpful assistant"
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "what is the capital of france"},
    {"role": "assistant", "content": "paris"},
    {"role": "user", "content": "and what about germany then"},
]
CORPUS = [m["content"] for m in CONVERSATION] + ["the quick brown fox jumps over the lazy dog"]
# HF style: the template adds BOS itself, each turn ends with EOS.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}\n"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}\n"
    "{{ raise_exception('unknown role ' + message['role']) }}\n"
    "{% endif %}\n"
    "<|{{ message['role'] }}|> {{ message['content'] }} {{ eos_token }}\n"
    "{% endfor %}\n"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_tokenizer() -> tokenizers.Tokenizer:
    """WordLevel over CORPUS; BOS/EOS/role markers special; BOS prepended by the post-processor."""
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", BOS, EOS, *ROLE_TOKENS]
    tok.train_from_iterator(CORPUS, trainers.WordLevelTrainer(special_tokens=specials))
    tok.add_special_tokens(specials)
    bos_id = tok.token_to_id(BOS)
    assert bos_id is not None
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def token_id(raw: tokenizers.Tokenizer, token: str) -> int:
    found = raw.token_to_id(token)
    assert found is not None
    return found


def words(raw: tokenizers.Tokenizer, text: str) -> list[int]:
    return raw.encode(text, add_special_tokens=False).ids


def contains(haystack: Sequence[int], needle: Sequence[int]) -> bool:
    n = len(needle)
    return any(list(haystack[i : i + n]) == list(needle) for i in range(len(haystack) - n + 1))


Handler = Callable[[httpx.Request], httpx.Response]


def ok(tokens: list[int]) -> Handler:
    """A replica answering ``tokens`` at ``/tokenize``, without render routes (as vLLM without
    ``--enable-scale-out``: 404 there)."""
    body = {"count": len(tokens), "max_model_len": 4096, "tokens": tokens, "token_strs": None}

    def answer(request: httpx.Request) -> httpx.Response:
        if request.url.path.endswith("/render"):
            return httpx.Response(404, json={"detail": "Not Found"})
        return httpx.Response(200, json=body)

    return answer

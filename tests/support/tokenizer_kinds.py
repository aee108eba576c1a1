"""Small tokenizers of the kinds real models ship, trained here in milliseconds (no download),
each with a chat template whose turn markers are special tokens, as a model's are.

- ``byte_level_bpe``: GPT-2/Llama-3 style (ByteLevel pre-tokenizer), ChatML template.
- ``metaspace_bpe``: SentencePiece style (Metaspace, ``prepend_scheme="first"``, NFKC),
  ``[INST]`` template.
- ``prepend_bpe``: Llama-2 style (a ``Prepend("▁")`` normalizer, no pre-tokenizer), ``<s>``.
- ``word_level``: whitespace words, BOS added by a post-processor, ``<|role|>`` template.

Each also has an added token that strips the spaces on its left (``<mask>``), which a cut
must not precede. :func:`write_model` lays one out like a Hugging Face model directory."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import tokenizers
from tokenizers import (
    AddedToken,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from tests.support.request_logs import WORDS, text

CHATML = (  # tools and a template variable (``enable_thinking``) as Qwen's templates have
    "{% if tools %}<|im_start|>system\n# Tools\n{% for t in tools %}{{ t | tojson }}\n"
    "{% endfor %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% endif %}{% endif %}"
)
INST = (
    "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
    " {{ m['content'] }}{{ eos_token }}{% else %}[INST] {{ m['content'] }} [/INST]"
    "{% endif %}{% endfor %}"
)
ROLES = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} "
    "{{ eos_token }}\n{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
MASK = "<mask>"


def _corpus() -> list[str]:
    rng = random.Random(7)
    chinese = "第{}条租约规定\uff0c租户支付费用。今天天气很好\uff0c我们去公园散步\uff1f"
    return (
        [text(rng, 30) for _ in range(200)]
        + ["0123456789:-TZ é漢 Ünïcödé"]
        + [chinese.format(n) for n in range(20)]  # merges inside Chinese words
    )


def _specials(tok: tokenizers.Tokenizer, names: list[str]) -> None:
    tok.add_special_tokens(names)
    tok.add_tokens([AddedToken(MASK, lstrip=True, special=True, normalized=False)])


def byte_level_bpe() -> tuple[tokenizers.Tokenizer, str, dict[str, str]]:
    tok = tokenizers.Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=600, initial_alphabet=alphabet)
    )
    _specials(tok, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"])
    return tok, CHATML, {"eos_token": "<|endoftext|>"}


def metaspace_bpe() -> tuple[tokenizers.Tokenizer, str, dict[str, str]]:
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    tok.decoder = decoders.Metaspace(prepend_scheme="first")
    tok.train_from_iterator(
        _corpus(), trainers.BpeTrainer(vocab_size=500, special_tokens=["<unk>"])
    )
    _specials(tok, ["<s>", "</s>", "[INST]", "[/INST]"])
    return tok, INST, {"bos_token": "<s>", "eos_token": "</s>"}


def prepend_bpe() -> tuple[tokenizers.Tokenizer, str, dict[str, str]]:
    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback()])
    bytes_ = [f"<0x{b:02X}>" for b in range(256)]
    trainer = trainers.BpeTrainer(vocab_size=700, special_tokens=["<unk>", *bytes_])
    tok.train_from_iterator(_corpus(), trainer)
    _specials(tok, ["<s>", "</s>", "[INST]", "[/INST]"])
    return tok, INST, {"bos_token": "<s>", "eos_token": "</s>"}


def word_level() -> tuple[tokenizers.Tokenizer, str, dict[str, str]]:
    tok = tokenizers.Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    specials = ["<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>"]
    tok.train_from_iterator(_corpus(), trainers.WordLevelTrainer(special_tokens=specials))
    _specials(tok, specials)
    bos = tok.token_to_id("<s>")
    assert bos is not None
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", bos)]
    )
    return tok, ROLES, {"bos_token": "<s>", "eos_token": "</s>"}


KINDS: dict[str, Callable[[], tuple[tokenizers.Tokenizer, str, dict[str, str]]]] = {
    "byte_level_bpe": byte_level_bpe,
    "metaspace_bpe": metaspace_bpe,
    "prepend_bpe": prepend_bpe,
    "word_level": word_level,
}
"""Each kind: (the tokenizer, its chat template, its special tokens by config name)."""


def write_model(directory: Path, kind: str = "byte_level_bpe", *, bos: bool = False) -> Path:
    """``tokenizer.json``, ``chat_template.jinja`` and ``tokenizer_config.json`` of ``kind``
    in ``directory``; the tokenizer's path. ``bos``: its post-processor puts the kind's EOS
    token before every text, as Llama 3's puts its BOS."""
    tok, template, special_tokens = KINDS[kind]()
    if bos:
        token = special_tokens["eos_token"]
        tok.post_processor = processors.TemplateProcessing(
            single=f"{token} $A", special_tokens=[(token, tok.token_to_id(token))]
        )
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "tokenizer.json"
    tok.save(str(path))
    (directory / "chat_template.jinja").write_text(template)
    (directory / "tokenizer_config.json").write_text(json.dumps(special_tokens))
    return path


__all__ = ["KINDS", "WORDS", "write_model"]

"""``kvindex proxy`` with a local ``tokenizer.json`` in front of replica-sims that tokenize with
the same files (``--tokenizer``): the proxy's block keys are the engines', so a
conversation's next turn is routed to the replica holding its start and matches there."""

from __future__ import annotations

import json
import re
import shutil
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest

from tests.integration.test_proxy_forwarding import MODEL, Proxy, _start, stack
from tests.support.tokenizer_kinds import write_model

__all__ = ["stack"]


def _matched(proxy: Proxy) -> tuple[float, float]:
    """(requests, the sum of their matched fractions) the proxy has counted."""
    metrics = proxy.metrics()
    found = {
        name: float(value)
        for name, value in re.findall(
            r"^kvindex_proxy_matched_fraction_(count|sum)(?:\{[^}]*\})? (\S+)$", metrics, re.M
        )
    }
    return found.get("count", 0.0), found.get("sum", 0.0)


def _next_turn_matched(proxy: Proxy, deadline_s: float) -> float:
    """Three conversations, then one's next turn sent until it matches (the sims' events
    reach the proxy's index meanwhile) or ``deadline_s`` passes; its matched fraction."""
    system = "answer the customer about the order " * 20
    with proxy.client() as client:
        for topic in ("refund", "shipping", "invoice"):
            turn = [
                {"role": "system", "content": system + topic},
                {"role": "user", "content": f"{topic} status please " * 8},
            ]
            client.chat.completions.create(model=MODEL, messages=turn, max_tokens=2)  # type: ignore[arg-type]
        next_turn = [*turn, {"role": "assistant", "content": "w1 w2"}]
        next_turn.append({"role": "user", "content": "and the refund"})
        count, total = _matched(proxy)
        matched, deadline = 0.0, time.monotonic() + deadline_s
        while matched <= 0.5 and time.monotonic() < deadline:
            time.sleep(0.2)
            client.chat.completions.create(model=MODEL, messages=next_turn, max_tokens=2)  # type: ignore[arg-type]
            new_count, new_total = _matched(proxy)
            matched = (new_total - total) / max(1.0, new_count - count)
            count, total = new_count, new_total
    return matched


@pytest.mark.parametrize(
    ("sims_tokenize", "found"), [("same", "configured"), ("toy", "configured"), ("same", "hub")]
)
def test_a_next_turn_matches_what_the_engines_hold(
    stack: ExitStack,
    tmp_path: Path,
    sims_tokenize: str,
    found: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """With the sims on the proxy's tokenizer the next turn matches most of its blocks; with
    the sims on their toy one (the control) nothing matches. The proxy's files are named by
    the config, or (no ``tokenizer`` set) found in the Hugging Face hub cache."""
    tokenizer = write_model(tmp_path / "model")
    config = tmp_path / "kvindex.toml"
    if found == "configured":
        config.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    else:
        config.write_text(f'[[models]]\nname = "{MODEL}"\n')
        monkeypatch.setenv("HF_HUB_CACHE", str(_hub_of(tmp_path / "hub", tokenizer.parent)))
    extra = ["--tokenizer", str(tokenizer)] if sims_tokenize == "same" else []
    _, proxy = _start(stack, tmp_path, {"r1": extra, "r2": extra}, ("--config", str(config)))
    matched = _next_turn_matched(proxy, 10.0 if sims_tokenize == "same" else 2.0)
    assert (matched > 0.5) == (sims_tokenize == "same")
    if found == "hub":  # tokenized in process: the replicas answered the check's probe alone
        log = proxy.child.log.read_text()
        assert "(the Hugging Face hub cache)" in log
        assert "the hub cache's tokenizer tokenizes as the replicas do" in log
        metrics = proxy.metrics()
        assert _counter(metrics, "kvindex_tokenizer_answers_total") == 2  # prompt, chat
        assert f'kvindex_tokenizer_hub{{model="{MODEL}",verdict="agrees"}} 1.0' in metrics


def _hub_of(hub: Path, files: Path) -> Path:
    """A hub cache holding ``files`` as the current snapshot of ``MODEL``."""
    root = hub / f"models--{MODEL}"
    shutil.copytree(files, root / "snapshots" / "abc")
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text("abc")
    return hub


def _counter(text: str, name: str, labels: str = "") -> float:
    """The sum of ``name``'s samples whose labels hold ``labels``."""
    pattern = rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$"
    found = re.findall(pattern, text, re.M)
    return sum(float(value) for held, value in found if labels in held)


def _minified(n: int) -> str:  # JSON with no space: no split point, word heads
    items = [{"parcel": f"p{n}-{k}", "status": "missing"} for k in range(40)]
    return json.dumps({"case": n, "items": items}, separators=(",", ":"))


_CONTENTS = {
    "words": lambda n: f"case {n}: " + f"the parcel {n} went missing " * 80,
    "json": _minified,
}


@pytest.mark.parametrize("content", sorted(_CONTENTS))
@pytest.mark.parametrize("head_first", [True, False])
def test_a_long_prompt_no_replica_holds_is_chosen_for_on_its_head_and_predicted_exactly(
    stack: ExitStack, tmp_path: Path, head_first: bool, content: str
) -> None:
    """Never-seen long chats (of words; of minified JSON, which no split rule cuts) are
    chosen for on their heads (counted), the rest tokenized while the replica answers: each
    prediction has the exact count (``exact``, no ``token_mismatch``), and each chat sent
    again lands where its whole is held."""
    tokenizer = write_model(tmp_path / "model")
    config = tmp_path / "kvindex.toml"
    flag = "true" if head_first else "false"
    config.write_text(
        f'[proxy]\nhead_first = {flag}\n[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n'
    )
    extra = ["--tokenizer", str(tokenizer)]
    _, proxy = _start(stack, tmp_path, {"r1": extra, "r2": extra}, ("--config", str(config)))
    chats = [[{"role": "user", "content": _CONTENTS[content](n)}] for n in range(4)]
    with proxy.client() as client:
        for chat in chats:
            client.chat.completions.create(model=MODEL, messages=chat, max_tokens=2)  # type: ignore[arg-type]
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:  # the first answers' blocks reach the index
            text = proxy.metrics()
            if _counter(text, "kvindex_proxy_predictions_total") == len(chats):
                break
            time.sleep(0.1)
        assert _counter(text, "kvindex_proxy_head_decisions_total") == (4 if head_first else 0)
        assert _counter(text, "kvindex_proxy_predictions_total", 'outcome="exact"') == 4, text
        count, total = _matched(proxy)
        matched, deadline = 0.0, time.monotonic() + 10
        while matched <= 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
            client.chat.completions.create(model=MODEL, messages=chats[2], max_tokens=2)  # type: ignore[arg-type]
            new_count, new_total = _matched(proxy)
            matched = (new_total - total) / max(1.0, new_count - count)
            count, total = new_count, new_total
    assert matched > 0.9
    (last,) = httpx.get(f"{proxy.base_url}/decisions?limit=1", trust_env=False).json()
    assert not last["head"]  # matched: its start was held, the whole decided
    first_times = httpx.get(f"{proxy.base_url}/decisions?limit=100", trust_env=False).json()
    for receipt in first_times[:4]:  # the exact count, estimated or not
        assert receipt["head"] == head_first
        assert receipt["num_tokens"] == receipt["prompt_tokens"], receipt
    text = proxy.metrics()
    assert _counter(text, "kvindex_proxy_predictions_total", 'outcome="token_mismatch"') == 0
    assert _counter(text, "kvindex_proxy_head_rest_failures_total") == 0


_DOCUMENTS = {
    "english": (" ".join(f"clause {n} of the lease says the tenant pays" for n in range(80)),
                " question {}: who pays"),
    "chinese": ("".join(f"第{n}条租约规定\uff0c租户支付费用。" for n in range(120)),
                "问题{}\uff1a谁付钱\uff1f"),
    "json": ("".join(_minified(n) for n in range(3)), ',"q{}":"who_pays"'),  # word anchors
}  # fmt: skip


@pytest.mark.parametrize("language", sorted(_DOCUMENTS))
def test_a_prompt_that_starts_as_an_earlier_one_is_predicted_exactly_with_its_bos(
    stack: ExitStack, tmp_path: Path, language: str
) -> None:
    """A byte-level BPE tokenizer that adds a BOS (Llama 3's shape) before a completions
    prompt with no added token: a prompt starting as an earlier one (a long document, then a
    question; Chinese prose is cut before its punctuation) is encoded from its last anchor,
    lands where the document is held, and each prediction counts the engine's own tokens
    (``exact``, no ``token_mismatch``)."""
    tokenizer = write_model(tmp_path / "model", bos=True)
    config = tmp_path / "kvindex.toml"
    config.write_text(f'[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    extra = ["--tokenizer", str(tokenizer)]
    _, proxy = _start(stack, tmp_path, {"r1": extra, "r2": extra}, ("--config", str(config)))
    document, asked = _DOCUMENTS[language]
    with proxy.client() as client:
        client.completions.create(model=MODEL, prompt=document, max_tokens=2)
        count, total = _matched(proxy)
        matched, deadline, sent = 0.0, time.monotonic() + 10, 1
        while matched <= 0.9 and time.monotonic() < deadline:
            time.sleep(0.2)
            question = document + asked.format(sent)
            client.completions.create(model=MODEL, prompt=question, max_tokens=2)
            sent += 1
            new_count, new_total = _matched(proxy)
            matched = (new_total - total) / max(1.0, new_count - count)
            count, total = new_count, new_total
    assert matched > 0.9
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:  # every answer's prediction is judged
        text = proxy.metrics()
        if _counter(text, "kvindex_proxy_predictions_total") == sent:
            break
        time.sleep(0.1)
    assert _counter(text, "kvindex_proxy_predictions_total", 'outcome="exact"') == sent, text
    assert _counter(text, "kvindex_proxy_predictions_total", 'outcome="token_mismatch"') == 0
    reused = _counter(text, "kvindex_tokenizer_local_texts_total", 'kind="reused"')
    assert reused >= sent - 1, text  # each question encoded from the document's last anchor

"""kvindex.api.tokenize.chat_template: the HF environment, the sandbox, the template files."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvindex.api.tokenize.chat_template import ChatTemplate, load_chat_template
from kvindex.api.tokenize.protocol import ChatOptions, TokenizerError


def test_environment_matches_transformers() -> None:
    """trim_blocks/lstrip_blocks, HF's tojson (no HTML escaping), loop controls, generation."""
    source = (
        "{% for m in messages %}\n"
        "  {% generation %}{{ m['role'] }}={{ m['content'] | tojson }}{% endgeneration %}\n"
        "  {% if loop.index == 2 %}{% break %}{% endif %}\n"
        "{% endfor %}\n"
        "{{ strftime_now('%Y') | length }}"
    )
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": "héllo <b>"},
        {"role": "a", "content": 1},
        {},
    ]
    assert ChatTemplate(source).render(messages) == 'user="héllo <b>"a=14'


def test_template_syntax_error_fails_at_load() -> None:
    with pytest.raises(TokenizerError, match="syntax error"):
        ChatTemplate("{% for m in messages %}")


def test_sandbox_blocks_unsafe_access() -> None:
    for source in ["{{ messages.__class__.__mro__ }}", "{{ messages.append(1) }}"]:
        with pytest.raises(TokenizerError, match=r"rejected.*unsafe"):
            ChatTemplate(source).render([])


def test_named_templates_use_default(tmp_path: Path) -> None:
    templates = [{"name": "tool_use", "template": "T"}, {"name": "default", "template": "D"}]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": templates}))
    template = load_chat_template(tmp_path / "tokenizer.json")
    assert template is not None
    assert template.render([]) == "D"


def test_sibling_jinja_file_wins_over_config(tmp_path: Path) -> None:
    config = {"chat_template": "config", "bos_token": "<s>"}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    (tmp_path / "chat_template.jinja").write_text("jinja {{ bos_token }}")
    template = load_chat_template(tmp_path / "tokenizer.json")
    assert template is not None
    assert template.render([]) == "jinja <s>"


def test_explicit_chat_template_path(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    (tmp_path / "mine.jinja").write_text("mine {{ eos_token }}")
    (tmp_path / "other.json").write_text(json.dumps({"chat_template": "other {{ eos_token }}"}))
    mine = load_chat_template(tmp_path / "tokenizer.json", tmp_path / "mine.jinja")
    other = load_chat_template(tmp_path / "tokenizer.json", tmp_path / "other.json")
    assert mine is not None and other is not None
    assert mine.render([]) == "mine </s>"
    assert other.render([]) == "other "  # special tokens come from the given config


@pytest.mark.parametrize(
    ("name", "content", "match"),
    [
        ("tokenizer_config.json", "{ broken", "invalid JSON"),
        ("tokenizer_config.json", "[1, 2]", "expected a JSON object"),
        ("tokenizer_config.json", '{"chat_template": 3}', "must be a string or a list"),
        ("chat_template.jinja", "{% if %}", "syntax error"),
    ],
)
def test_bad_template_files(tmp_path: Path, name: str, content: str, match: str) -> None:
    (tmp_path / name).write_text(content)
    with pytest.raises(TokenizerError, match=match):
        load_chat_template(tmp_path / "tokenizer.json")


def test_explicit_template_path_must_exist_and_have_a_template(tmp_path: Path) -> None:
    with pytest.raises(TokenizerError, match="no such file"):
        load_chat_template(tmp_path / "tokenizer.json", tmp_path / "missing.jinja")
    (tmp_path / "empty.json").write_text("{}")
    with pytest.raises(TokenizerError, match="has no chat_template"):
        load_chat_template(tmp_path / "tokenizer.json", tmp_path / "empty.json")


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {}}}]


def test_tools_documents_and_template_variables_are_rendered() -> None:
    """A chat's other members reach the template as vLLM passes them: ``tools`` and
    ``documents`` by name, ``chat_template_kwargs`` as variables (the template's own names
    win over a kwarg of the same name)."""
    template = ChatTemplate(
        "{% if tools %}T:{{ tools[0]['function']['name'] }} {% endif %}"
        "{% if documents %}D:{{ documents | length }} {% endif %}"
        "{% for m in messages %}{{ m['content'] }} {% endfor %}"
        "{% if add_generation_prompt %}>{% endif %}"
        "{% if think is defined %}think={{ think }}{% endif %}"
    )
    hi = [{"role": "user", "content": "hi"}]
    assert template.render(hi) == "hi >"
    options = ChatOptions(
        tools=TOOLS,
        documents=[{"text": "a"}, {"text": "b"}],
        chat_template_kwargs={"think": False, "messages": "ignored"},
    )
    assert template.render(hi, options) == "T:get_weather D:2 hi >think=False"
    assert template.render(hi, ChatOptions(add_generation_prompt=False)) == "hi "


def test_continue_final_message_cuts_after_its_content() -> None:
    """The rendered text ends with the last message's content, the template's end of turn
    cut off (whether the template keeps the content's trailing space or strips it)."""
    keeps = ChatTemplate(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}</s>{% endfor %}"
    )
    strips = ChatTemplate(
        "{% for m in messages %}[{{ m['role'] }}]{{ m['content'] | trim }}</s>{% endfor %}"
    )
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "The answer is "}]
    go_on = ChatOptions(add_generation_prompt=False, continue_final_message=True)
    assert keeps.render(chat, go_on) == "[user]hi</s>[assistant]The answer is "
    assert strips.render(chat, go_on) == "[user]hi</s>[assistant]The answer is"
    parts: list[dict[str, Any]] = [
        *chat[:1],
        {"role": "assistant", "content": [{"type": "text", "text": "Go"}]},
    ]
    by_parts = ChatTemplate(
        "{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{{ m['content'][0]['text'] }}{% endif %}|{% endfor %}"
    )
    assert by_parts.render(parts, go_on) == "hi|Go"
    with pytest.raises(TokenizerError, match="cannot both be true"):
        keeps.render(chat, ChatOptions(continue_final_message=True))
    with pytest.raises(TokenizerError, match="no text to continue"):
        keeps.render([{"role": "user", "content": ""}], go_on)
    with pytest.raises(TokenizerError, match="dropped the last message"):
        ChatTemplate("nothing").render(chat, go_on)

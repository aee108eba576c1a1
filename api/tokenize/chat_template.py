"""Hugging Face chat templates: compiled as ``transformers`` does, found where its files are."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.parser
import jinja2.sandbox

from kvindex.api.tokenize.protocol import NO_OPTIONS, ChatOptions, TokenizerError

_CHAT_TEMPLATE_FILE = "chat_template.jinja"
_TOKENIZER_CONFIG_FILE = "tokenizer_config.json"
_SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token")


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}…{% endgeneration %}`` (HF's assistant-mask marker) renders its body."""

    def __init__(self, environment: jinja2.Environment) -> None:
        super().__init__(environment)
        self.tags = {"generation"}  # the parser reads the instance's tags

    def parse(self, parser: jinja2.parser.Parser) -> list[jinja2.nodes.Node]:
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> NoReturn:
    raise jinja2.TemplateError(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # HF's override: plain json.dumps, not Jinja's HTML-escaping tojson (tokens would differ).
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _chat_environment() -> jinja2.sandbox.ImmutableSandboxedEnvironment:
    """The environment ``transformers`` compiles chat templates in (same options and helpers)."""
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


class ChatTemplate:
    def __init__(self, source: str, *, special_tokens: dict[str, str] | None = None) -> None:
        self.special_tokens: dict[str, str] = dict(special_tokens or {})
        try:
            self._template = _chat_environment().from_string(source)
        except jinja2.TemplateSyntaxError as exc:
            raise TokenizerError(f"chat template: syntax error line {exc.lineno}: {exc}") from exc

    def render(self, messages: list[dict[str, Any]], options: ChatOptions = NO_OPTIONS) -> str:
        """The conversation as text, as vLLM renders a chat request with these options: the
        template's variables from ``chat_template_kwargs`` (its own names win), the text
        cut after the last message's content when ``continue_final_message``."""
        continued = options.continue_final_message
        if continued and options.add_generation_prompt:
            raise TokenizerError(
                "continue_final_message and add_generation_prompt cannot both be true"
            )
        variables = {
            **(options.chat_template_kwargs or {}),
            **self.special_tokens,
            "messages": messages,
            "add_generation_prompt": options.add_generation_prompt,
            "tools": options.tools,
            "documents": options.documents,
        }
        try:
            text = self._template.render(**variables)
        except jinja2.TemplateError as exc:
            raise TokenizerError(f"chat template rejected the messages: {exc}") from exc
        except Exception as exc:  # a template may fail on any input (KeyError, TypeError, ...)
            raise TokenizerError(f"chat template failed on the messages: {exc!r}") from exc
        return _continued(text, messages) if continued else text


def _continued(text: str, messages: list[dict[str, Any]]) -> str:
    """``text`` ending where the last message's content ends (the template's end-of-turn
    cut off), so the engine goes on writing that message."""
    content = messages[-1].get("content") if messages else None
    if isinstance(content, list):  # parts: the last text part is what is continued
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        content = texts[-1] if texts else None
    if not isinstance(content, str) or not content.strip():
        raise TokenizerError("continue_final_message: the last message has no text to continue")
    at = text.rfind(content.strip())
    if at < 0:
        raise TokenizerError("continue_final_message: the template dropped the last message")
    kept = content.lstrip()  # the template may keep the content's trailing spaces, or not
    if text[at : at + len(kept)] != kept:
        kept = content.strip()
    return text[: at + len(kept)]


def _read_text(path: Path, what: str) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TokenizerError(f"{what} {path}: unreadable: {exc}") from exc


def _read_config(path: Path) -> dict[str, Any]:
    """A ``tokenizer_config.json`` as a dict; TokenizerError when unreadable or not an object."""
    try:
        config = json.loads(_read_text(path, "tokenizer config"))
    except json.JSONDecodeError as exc:
        raise TokenizerError(f"tokenizer config {path}: invalid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise TokenizerError(f"tokenizer config {path}: expected a JSON object")
    return config


def _special_tokens(config: dict[str, Any]) -> dict[str, str]:
    """``bos_token``/``eos_token`` of a config; HF stores each as a string or an AddedToken."""
    found: dict[str, str] = {}
    for name in _SPECIAL_TOKEN_NAMES:
        value = config.get(name)
        if isinstance(value, dict):
            value = value.get("content")
        if isinstance(value, str):
            found[name] = value
    return found


def _config_template(config: dict[str, Any], path: Path) -> str | None:
    """The config's ``chat_template``: a string, or HF's named list (its ``default`` entry)."""
    source = config.get("chat_template")
    if source is None or isinstance(source, str):
        return source
    if isinstance(source, list):
        for entry in source:
            if isinstance(entry, dict) and entry.get("name") == "default":
                template = entry.get("template")
                if isinstance(template, str):
                    return template
        return None
    raise TokenizerError(f"tokenizer config {path}: chat_template must be a string or a list")


def load_chat_template(
    tokenizer_path: Path, chat_template_path: Path | None = None
) -> ChatTemplate | None:
    config_path = tokenizer_path.parent / _TOKENIZER_CONFIG_FILE
    jinja_path: Path | None = tokenizer_path.parent / _CHAT_TEMPLATE_FILE
    if chat_template_path is not None:
        if not chat_template_path.is_file():
            raise TokenizerError(f"chat template {chat_template_path}: no such file")
        if chat_template_path.suffix == ".json":
            config_path, jinja_path = chat_template_path, None
        else:
            jinja_path = chat_template_path
    config = _read_config(config_path) if config_path.is_file() else {}
    if jinja_path is not None and jinja_path.is_file():
        source: str | None = _read_text(jinja_path, "chat template")
    else:
        source = _config_template(config, config_path)
    if source is None and chat_template_path is not None:
        raise TokenizerError(f"chat template {chat_template_path}: has no chat_template")
    return None if source is None else ChatTemplate(source, special_tokens=_special_tokens(config))

"""Settings layers of every process kind: file < env < command line; SettingsError names the key."""

from __future__ import annotations

import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvindex.indexer.domain.errors import SettingsError

# The read path's tables; the rest is the indexer's.
SECTIONS = ("api", "models", "rules", "proxy", "picker", "discovery")


@dataclass(frozen=True)
class ConfigFile:
    path: Path | None = None
    values: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def read(cls, path: Path | None) -> ConfigFile:
        return cls(path, read_toml(path)) if path is not None else cls()

    def top_level(self) -> dict[str, Any]:
        return {k: v for k, v in self.values.items() if k not in SECTIONS}

    def table(self, name: str) -> Any:
        return self.values.get(name)


def read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise SettingsError(f"config file {path}: {exc.strerror}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise SettingsError(f"config file {path}: {exc}") from exc


def layered(
    file_values: Mapping[str, Any],
    env_values: Mapping[str, Any],
    overrides: Mapping[str, Any] | None,
) -> dict[str, Any]:
    values = dict(file_values)
    values.update(env_values)
    values.update({k: v for k, v in (overrides or {}).items() if v is not None})
    return values


def read_token(path: str, *, key: str) -> str:
    """The token in a file, stripped; SettingsError names the key and file, never the token."""
    try:
        with open(path, encoding="utf-8") as handle:
            token = handle.read().strip()
    except OSError as exc:
        raise SettingsError(f"{key} {path}: {exc.strerror}") from None
    if not token:
        raise SettingsError(f"{key} {path}: the file is empty")
    return token


_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def _boolean(text: str) -> bool:
    word = text.strip().lower()
    if word not in _TRUE | _FALSE:
        raise ValueError(text)
    return word in _TRUE


def _names(text: str) -> tuple[str, ...]:
    return tuple(part.strip() for part in text.split(",") if part.strip())


_PARSERS: tuple[tuple[str, Callable[[str], Any], str], ...] = (
    ("tuple[str", _names, "a comma-separated list"),
    ("int", int, "an integer"),
    ("float", float, "a number"),
    ("bool", _boolean, "a boolean (true/false)"),
    ("str", str, "a string"),
)


def from_env_text(variable: str, text: str, kind: str) -> Any:
    for prefix, parse, wanted in _PARSERS:
        if kind.startswith(prefix):
            try:
                return parse(text)
            except ValueError:
                raise SettingsError(f"{variable} must be {wanted}, got {text!r}") from None
    raise SettingsError(f"{variable}: a {kind} setting cannot be read from the environment")

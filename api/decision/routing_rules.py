"""Routing rules per workload (``[[rules]]``): which policy and weights a request gets; the
first rule whose conditions all hold wins; a bad table is a SettingsError naming its key."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from typing import Any

from kvindex.api.decision.policies import Policy, ScoringError, Weights
from kvindex.indexer.domain.errors import SettingsError

WORKLOAD_HEADER = "x-kvindex-workload"


@dataclass(frozen=True, slots=True)
class RuleInput:
    """What a rule can see of one request."""

    model: str
    num_tokens: int
    workload: str | None = None
    user: str | None = None
    has_tools: bool = False
    headers: Mapping[str, str] = field(default_factory=dict)
    """Looked up by lower-case name."""


Values = tuple[str, ...]
"""Accepted values of a condition (any of them); empty: no condition."""


@dataclass(frozen=True, slots=True)
class RoutingRule:
    """One ``[[rules]]`` table: conditions (all must hold) and what it chooses."""

    name: str
    """Named in ``/score``'s answer and in errors."""
    model: Values = ()
    """Model names the rule applies to (empty: every model)."""
    workload: Values = ()
    """The request's workload (``workload`` field, else the ``x-kvindex-workload`` header)."""
    user: Values = ()
    """The request's ``user``."""
    headers: tuple[tuple[str, Values], ...] = ()
    """Request headers (lower-case name, accepted values), e.g. a tenant header."""
    min_prompt_tokens: int | None = None
    """Shortest prompt the rule applies to (tokens)."""
    max_prompt_tokens: int | None = None
    """Longest prompt the rule applies to (tokens)."""
    tools: bool | None = None
    """True: only requests offering tools; False: only requests without; None: either."""
    policy: str | None = None
    """Policy of a matched request."""
    weights: tuple[tuple[str, float], ...] = ()
    """Weight overrides of a matched request (names as in ``[api.weights]``)."""

    def __post_init__(self) -> None:
        key = f"rules.{self.name}"
        if not isinstance(self.name, str) or not self.name:
            raise SettingsError(f"rules: a rule name must be a non-empty string, got {self.name!r}")
        for name in ("model", "workload", "user"):
            _check_values(f"{key}.{name}", getattr(self, name))
        for header, accepted in self.headers:
            _check_values(f"{key}.headers.{header}", accepted)
        for name in ("min_prompt_tokens", "max_prompt_tokens"):
            _check_count(f"{key}.{name}", getattr(self, name))
        low, high = self.min_prompt_tokens, self.max_prompt_tokens
        if low is not None and high is not None and low > high:
            raise SettingsError(f"{key}: min_prompt_tokens {low} is above max_prompt_tokens {high}")
        if self.tools is not None and not isinstance(self.tools, bool):
            raise SettingsError(f"{key}.tools must be true or false, got {self.tools!r}")
        if self.policy is not None and self.policy not in _POLICIES:
            raise SettingsError(f"{key}.policy must be one of {_POLICIES}, got {self.policy!r}")
        try:
            Weights().overridden(dict(self.weights))
        except ScoringError as exc:
            raise SettingsError(f"{key}.weights: {exc}") from None
        if self.policy is None and not self.weights:
            raise SettingsError(f"{key}: the rule chooses neither a policy nor weights")

    def matches(self, seen: RuleInput) -> bool:
        if self.model and seen.model not in self.model:
            return False
        if self.workload and seen.workload not in self.workload:
            return False
        if self.user and seen.user not in self.user:
            return False
        if self.tools is not None and seen.has_tools != self.tools:
            return False
        if self.min_prompt_tokens is not None and seen.num_tokens < self.min_prompt_tokens:
            return False
        if self.max_prompt_tokens is not None and seen.num_tokens > self.max_prompt_tokens:
            return False
        return all(seen.headers.get(name) in accepted for name, accepted in self.headers)

    def weight_overrides(self) -> dict[str, float]:
        return dict(self.weights)

    def as_table(self) -> dict[str, Any]:
        """The rule as its ``[[rules]]`` table, which :func:`rule_from_table` reads back equal."""
        table: dict[str, Any] = {"name": self.name}
        for condition in ("model", "workload", "user"):
            if values := getattr(self, condition):
                table[condition] = list(values)
        if self.headers:
            table["headers"] = {name: list(values) for name, values in self.headers}
        for key in ("min_prompt_tokens", "max_prompt_tokens", "tools", "policy"):
            if (value := getattr(self, key)) is not None:
                table[key] = value
        if self.weights:
            table["weights"] = dict(self.weights)
        return table


def first_match(rules: Sequence[RoutingRule], seen: RuleInput) -> RoutingRule | None:
    return next((rule for rule in rules if rule.matches(seen)), None)


_POLICIES = [p.value for p in Policy]
_KNOWN_KEYS = sorted(f.name for f in fields(RoutingRule))


def _check_values(key: str, value: object) -> None:
    # A bare string would match by substring ("lla" in "llama"): only a tuple is accepted.
    if not isinstance(value, tuple) or not all(isinstance(v, str) for v in value):
        raise SettingsError(f"{key} must be a tuple of strings, got {value!r}")


def _check_count(key: str, value: object) -> None:
    # bool is an int: reject it explicitly, it is never a token count.
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise SettingsError(f"{key} must be an integer >= 0, got {value!r}")


def rule_from_table(table: Mapping[str, Any], position: int) -> RoutingRule:
    """The ``position``-th (from 1) ``[[rules]]`` table as a rule."""
    if not isinstance(table, Mapping):
        raise SettingsError(f"[[rules]] #{position}: a rule is a table, got {table!r}")
    name = table.get("name")
    if not isinstance(name, str) or not name:
        raise SettingsError(f"[[rules]] #{position}: every rule needs a name, got {name!r}")
    key = f"rules.{name}"
    unknown = sorted(set(table) - set(_KNOWN_KEYS))
    if unknown:
        raise SettingsError(f"{key}: unknown keys {unknown} (known: {_KNOWN_KEYS})")
    values = dict(table)
    for condition in ("model", "workload", "user"):
        if condition in values:
            values[condition] = _values(f"{key}.{condition}", values[condition])
    if "headers" in values:
        values["headers"] = _headers(f"{key}.headers", values["headers"])
    if "weights" in values:
        values["weights"] = _weights(f"{key}.weights", values["weights"])
    return RoutingRule(**values)


def _values(key: str, value: object) -> Values:
    if isinstance(value, str):
        return (value,)
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise SettingsError(f"{key} must be a string or a non-empty list of strings, got {value!r}")


def _headers(key: str, value: object) -> tuple[tuple[str, Values], ...]:
    if not isinstance(value, Mapping) or not value:
        raise SettingsError(
            f'{key} must be a table of header = value(s) (e.g. {{ "x-tenant" = "acme" }}),'
            f" got {value!r}"
        )
    return tuple((str(name).lower(), _values(f"{key}.{name}", v)) for name, v in value.items())


def _weights(key: str, value: object) -> tuple[tuple[str, float], ...]:
    if not isinstance(value, Mapping):
        raise SettingsError(f"{key} must be a table of weight = number, got {value!r}")
    return tuple((str(name), v) for name, v in value.items())

"""Fixtures of the indexer's unit tests."""

from __future__ import annotations

from types import SimpleNamespace

import fakeredis.commands_mixins.server_mixin
import pytest

from tests.support.clock import Clock


@pytest.fixture
def server_clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """A hand-set clock that is also every fake Redis server's (scripts reading TIME)."""
    clock = Clock()
    fake_time = SimpleNamespace(time=clock)
    monkeypatch.setattr(fakeredis.commands_mixins.server_mixin, "time", fake_time)
    return clock

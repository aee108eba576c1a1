"""kvindex.api.http.allocator: glibc's thresholds pinned, or left to the operator."""

from __future__ import annotations

import platform

import pytest

from kvindex.api.http.allocator import pin_allocator

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")


@glibc_only
def test_the_thresholds_are_pinned_on_glibc(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_", raising=False)
    assert pin_allocator()


@pytest.mark.parametrize("name", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_"])
def test_the_operators_variables_win(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(name, "65536")
    assert not pin_allocator()


def test_without_glibc_nothing_is_done(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "libc_ver", lambda: ("", ""))
    assert not pin_allocator()

"""A clock tests set by hand, for anything that takes ``clock: Callable[[], float]``."""

from __future__ import annotations


class Clock:
    """Returns :attr:`now` (1000.0 at first) until a test moves it."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now

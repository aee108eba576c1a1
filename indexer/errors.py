"""The root of kvindex's exceptions. Each concrete error is defined beside its raiser."""


class KvIndexError(Exception):
    """Base class of every error kvindex raises on purpose."""

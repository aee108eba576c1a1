"""The root of kvindex's exceptions. Each concrete error is defined beside its raiser, except
:class:`SettingsError`: the indexer's and the API's settings and every replica spec raise it,
so it sits here, below all of them."""


class KvIndexError(Exception):
    """Base class of every error kvindex raises on purpose."""


class SettingsError(KvIndexError):
    """A setting with a bad value; the message names the key and the value."""

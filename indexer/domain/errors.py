"""The root of kvindex's exceptions and :class:`SettingsError`; others live beside their raiser."""


class KvIndexError(Exception):
    """Every error kvindex raises on purpose."""


class SettingsError(KvIndexError):
    """A setting with a bad value; the message names the key and the value."""

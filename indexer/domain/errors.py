"""The root of kvindex's exceptions, and :class:`SettingsError`, raised by every settings
object and replica spec. Other errors are defined beside their raisers."""


class KvIndexError(Exception):
    """Base class of every error kvindex raises on purpose."""


class SettingsError(KvIndexError):
    """A setting with a bad value; the message names the key and the value."""

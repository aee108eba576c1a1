"""Redis Lua scripts: each in its own ``.lua`` file beside the module that runs it."""

from __future__ import annotations

from importlib import resources


def lua_script(module: str, name: str, *, after: tuple[str, ...] = ()) -> str:
    """The file ``name`` beside ``module`` (``__name__``), after the shared files ``after``."""
    files = resources.files(module.rpartition(".")[0])
    return "\n".join(files.joinpath(part).read_text("utf-8") for part in (*after, name))

"""What ``kvindex serve`` loads on the memory store: not the libraries only other commands
or other settings use (their memory is most of a served process's), nor, until a request
needs it, FastAPI (its import and routes were most of a start-up)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numpy", "tokenizers", "jinja2", "transformers", "httpcore", "rich", "pygments")
"""numpy: ``analyze``; tokenizers and jinja2: a model with a local tokenizer only;
httpcore (and a TLS context): the first outgoing request (no replica here gives a URL);
rich and pygments: httpx's command line, which a server refuses."""
DEFERRED = ("fastapi", "pydantic", "redis")
"""fastapi (and pydantic): built on the first request the hot routes leave to the app;
redis: the Redis store only."""

_SERVE_PATH = """
import json, sys
from kvindex.clients.cli.main import main  # the console script's import
from kvindex.api.http.server import Service, served_app
from kvindex.api.config.settings import load_api_settings
from kvindex.indexer.config.settings import load_settings

settings = load_settings(None, env={}, overrides={"store": "memory"})
service = Service.build(settings, load_api_settings(None, None, env={}))
app, hot = served_app(service.deps)
served = sorted({name.partition(".")[0] for name in sys.modules})
app.build()
built = sorted({name.partition(".")[0] for name in sys.modules})
service.stop()
print(json.dumps([served, built]))
"""


def _loaded() -> tuple[set[str], set[str]]:
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_PATH], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    served, built = json.loads(done.stdout.splitlines()[-1])
    return set(served), set(built)


def test_serve_on_the_memory_store_loads_no_tokenizer_nor_numpy() -> None:
    _served, built = _loaded()
    assert "fastapi" in built  # the app was built
    assert built.isdisjoint(HEAVY), sorted(built & set(HEAVY))


def test_serve_is_ready_without_fastapi_nor_redis() -> None:
    served, built = _loaded()
    assert served.isdisjoint(DEFERRED), sorted(served & set(DEFERRED))
    assert "redis" not in built

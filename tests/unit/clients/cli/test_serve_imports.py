"""What ``kvindex serve`` loads on the memory store: not the libraries only other commands
or other settings use (their memory is most of a served process's)."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("numpy", "tokenizers", "jinja2", "transformers", "httpcore")
"""numpy: ``analyze``; tokenizers and jinja2: a model with a local tokenizer only;
httpcore (and a TLS context): the first outgoing request (no replica here gives a URL)."""

_SERVE_PATH = """
import json, sys
from kvindex.clients.cli.main import main  # the console script's import
from kvindex.api.http.app import create_app
from kvindex.api.http.server import Service
from kvindex.api.config.settings import load_api_settings
from kvindex.indexer.config.settings import load_settings

settings = load_settings(None, env={}, overrides={"store": "memory"})
service = Service.build(settings, load_api_settings(None, None, env={}))
create_app(service.deps)
service.stop()
print(json.dumps(sorted({name.partition(".")[0] for name in sys.modules})))
"""


def test_serve_on_the_memory_store_loads_no_tokenizer_nor_numpy() -> None:
    done = subprocess.run(
        [sys.executable, "-c", _SERVE_PATH], check=False, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.splitlines()[-1]))
    assert "fastapi" in loaded  # the app was built
    assert loaded.isdisjoint(HEAVY), sorted(loaded & set(HEAVY))

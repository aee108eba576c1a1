"""The tokenizer every analysis test uses: trained once per session (a few ms), no download."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.request_logs import make_tokenizer


@pytest.fixture(scope="session")
def tokenizer_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tokenizer(tmp_path_factory.mktemp("tokenizer") / "tokenizer.json")

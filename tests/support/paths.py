"""Where the tests find the checkout's files, whatever folder a test module sits in."""

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests/fixtures"
MOONCAKE_TRACE = ROOT / "bench/traces/mooncake_fast25_synthetic_trace.jsonl.gz"

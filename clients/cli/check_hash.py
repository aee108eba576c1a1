"""``kvindex check-hash``: the command; what it runs (:mod:`kvindex.clients.cli.key_check`)
loads when it runs."""

from __future__ import annotations

from typing import Any

import click


@click.command("check-hash")
@click.option("--url", required=True, help="Replica's OpenAI server, e.g. http://host:8000.")
@click.option("--events", required=True, help="Replica's KV-event endpoint, tcp://host:5557.")
@click.option("--model", required=True, help="Base model name (as the indexer keys it).")
@click.option("--block-size", default=16, show_default=True, help="Block size kvindex expects.")
@click.option("--lora-name", help="LoRA adapter of the request (sent as the request's model).")
@click.option("--cache-salt", help="cache_salt of the request.")
@click.option("--replay", help="Replica's replay endpoint, used if live events were missed.")
@click.option("--topic", default="", help="SUB topic prefix (default: everything).")
@click.option("--request-model", help="model sent in the request (default: LoRA or --model).")
@click.option("--text", "text_mode", is_flag=True, help="Send text and learn tokens by /tokenize.")
@click.option("--num-blocks", default=4, show_default=True, help="Full blocks in the prompt.")
@click.option("--timeout", "timeout_s", default=5.0, show_default=True, help="Seconds to wait.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def check_hash_command(text_mode: bool, as_json: bool, **kw: Any) -> None:
    """Check that kvindex's block keys agree with a live vLLM or SGLang replica's events."""
    from kvindex.clients.cli.key_check import CheckHashError, CheckSettings, run_check

    try:
        settings = CheckSettings(mode="text" if text_mode else "tokens", **kw)
        report = run_check(settings)
    except CheckHashError as exc:
        raise click.ClickException(str(exc)) from exc
    click.echo(report.to_json() if as_json else report.render())
    if not report.ok:
        raise SystemExit(1)

"""``kvindex why <id>``: a route explained from the proxy's journal; ``--export``: its receipts."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import click

if TYPE_CHECKING:
    import httpx

DEFAULT_PROXY = "http://127.0.0.1:8080"


@click.command()
@click.argument("request_id", required=False)
@click.option(
    "--proxy",
    "proxy_url",
    envvar="KVINDEX_PROXY_URL",
    default=DEFAULT_PROXY,
    show_default=True,
    help="Base URL of the kvindex proxy (env KVINDEX_PROXY_URL).",
)
@click.option(
    "--token",
    envvar="KVINDEX_PROXY_TOKEN",
    help="The proxy's bearer token (env KVINDEX_PROXY_TOKEN).",
)
@click.option("--json", "as_json", is_flag=True, help="Print the receipt's JSON.")
@click.option(
    "--export",
    "export_path",
    type=click.Path(path_type=Path, dir_okay=False),
    help="Write the newest receipts to this file, one JSON object a line, oldest first.",
)
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=1000,
    show_default=True,
    help="With --export: how many receipts.",
)
def why(
    request_id: str | None,
    proxy_url: str,
    token: str | None,
    as_json: bool,
    export_path: Path | None,
    limit: int,
) -> None:
    """Why the proxy sent a request where it did: the candidates, each term of the policy's
    formula, the choice, and the prediction against the engine's answer.

    REQUEST_ID is the request's x-request-id (the proxy keeps the client's or makes one, and
    sends it back). The proxy keeps its newest receipts (proxy.journal_entries); on the
    Redis store every proxy also shares them (proxy.journal_stream_maxlen)."""
    if (request_id is None) == (export_path is None):
        raise click.UsageError("give a request id, or --export FILE")
    with _client(proxy_url, token) as http:
        if export_path is not None:
            _export(http, export_path, limit)
            return
        assert request_id is not None
        answer = _get(http, f"/decisions/{quote(request_id, safe='')}")
    _show(answer.content, as_json)


def _client(url: str, token: str | None) -> httpx.Client:
    import httpx

    headers = {} if token is None else {"authorization": f"Bearer {token}"}
    return httpx.Client(base_url=url, headers=headers, timeout=30, trust_env=False)


def _get(http: httpx.Client, path: str) -> httpx.Response:
    import httpx

    try:
        answer = http.get(path)
    except httpx.HTTPError as exc:
        raise click.ClickException(f"cannot reach the proxy at {http.base_url}: {exc}") from exc
    if answer.status_code != 200:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text[:200]
        raise click.ClickException(f"{answer.status_code} from the proxy: {message}")
    return answer


def _export(http: httpx.Client, path: Path, limit: int) -> None:
    import msgspec

    receipts = msgspec.json.decode(_get(http, f"/decisions?limit={limit}").content)
    with path.open("wb") as out:
        for receipt in receipts:
            out.write(msgspec.json.encode(receipt) + b"\n")
    click.echo(f"{len(receipts)} receipts written to {path}")


def _show(body: bytes, as_json: bool) -> None:
    import msgspec

    from kvindex.clients.cli.render import render_receipt
    from kvindex.clients.console import make_console
    from kvindex.clients.proxy.receipt import decode_receipt

    if as_json:
        click.echo(msgspec.json.format(body, indent=2))
        return
    try:
        receipt = decode_receipt(body)
    except msgspec.DecodeError as exc:
        raise click.ClickException(f"the proxy's receipt cannot be read: {exc}") from exc
    console = make_console()
    console.print(*render_receipt(receipt))

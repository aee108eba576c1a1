"""What ``kvindex proxy`` adds to a request: latency through the proxy minus latency of the
same request sent straight to a replica-sim, at concurrency 1 and 16, streaming and not.

Three ``kvindex replica-sim``s (time compressed a millionfold, so a replica answers at
once) and one ``kvindex proxy`` in front of them (memory store, its own subscriber) run as
subprocesses on free loopback ports. Each worker thread keeps one keep-alive connection
(``http.client``: a blocking call releases the GIL) and sends chat requests whose prompts
cycle through a fixed set (after the first round the proxy's tokenizer cache answers, as
for a fleet's recurring system prompts); a request's latency runs from the first byte sent
to the last byte read (``[DONE]`` for a stream), and the proxy's CPU time per request is
read from ``/proc`` (steadier than latency on a busy machine). Direct runs spread the
workers over the three replicas, as the proxy does. One JSON line per (stream,
concurrency), then one with the machine's load; quote them with the load beside them.
``--prompt-tokens`` sizes the chat prompts (the sims' toy tokenizer: a word a token; with
``--tokenizer local`` the text is fitted to that many ids of the local tokenizer, and
``prompt_ids`` says how many one prompt has). ``--unique`` gives every request a user turn
never sent before after the shared system prompt, as production traffic is (the proxy's
tokenizer cache cannot answer it: it is tokenized by a replica, or locally);
``--unique-prefix`` makes the whole prompt new, system prompt included (nothing of it was
seen). ``--completions`` sends the same text as one completions ``prompt``. ``--tokenizer
local`` writes a byte-level BPE ``tokenizer.json`` and a ChatML template into the run's
directory, starts the sims with ``--tokenizer`` and gives the proxy ``[[models]] tokenizer``
(``--no-prefix-reuse``: ``tokenizer_prefix_cache_bytes = 0``, every text encoded whole;
``--bos``: the tokenizer adds a BOS before a prompt). ``--workers`` runs ``kvindex proxy
--workers N``, ``--store redis`` puts the index and the load on a private redis-server that
a ``kvindex indexer`` fills; ``proxy_rps`` and ``direct_rps`` are the throughputs (the load
generator shares the machine's cores). ``--profile PATH`` runs the proxy's loop under
cProfile on CPU time (its CPU figures then count the profiler's cost) and writes its stats
to ``PATH`` when it stops. ``--against KVINDEX`` starts a second proxy from another build's
``kvindex`` before the same sims and measures both in ``--windows`` alternating windows of
``--requests`` (the order flipped each window; CPU from each thread's ``schedstat``): an A/B
in the same seconds, whatever the host's drift (``paired_ratio``: the other's CPU over this
one's).

    python bench/proxy.py [--requests 400] [--prompt-tokens 2000] [--unique] [--workers 2]
        [--tokenizer local] [--unique-prefix] [--no-prefix-reuse] [--profile PATH]
        [--completions] [--bos]
        [--against OTHER_KVINDEX] [--windows 10]
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import itertools
import json
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from machine import calibration_ms, host_load
from score_http import process_cpu_s

from kvindex.api.tokenize.local import LocalTokenizer
from tests.support.processes import Child, http_ok, kvindex_child
from tests.support.redis_server import free_port, running_redis
from tests.support.tokenizer_kinds import write_model

MODEL = "demo-model"
NUM_PROMPTS = 64
_SYSTEM_WORDS = 20 * 5
"""Words (the sims' tokens) of the default system prompt; the user turn adds 60."""


def _sim(rid: str, workdir: Path, tokenizer: Path | None) -> tuple[Child, int, str]:
    port, events = free_port(), f"tcp://127.0.0.1:{free_port()}"
    args = [
        "replica-sim", "--id", rid, "--model", MODEL, "--port", str(port), "--events", events,
        "--bind-events", "--replay", "", "--speed", "1000000", "--max-running", "64",
        "--capacity-blocks", "8192",
    ]  # fmt: skip
    if tokenizer is not None:
        args += ["--tokenizer", str(tokenizer)]
    child = kvindex_child(rid, args, workdir / f"{rid}.log", http_ok(port, "/health"))
    return child, port, f"id={rid},model={MODEL},url=http://127.0.0.1:{port},events={events}"


@dataclass(frozen=True)
class Prompts:
    """The chat bodies a run sends: ``num_tokens`` words a prompt (about: the template adds
    a few), all different with ``unique`` (else cycling through NUM_PROMPTS); with
    ``unique_prefix`` the system prompt is new too. ``filler_words`` overrides the words
    that size the system prompt (fitted to a tokenizer)."""

    num_tokens: int = _SYSTEM_WORDS + 60
    unique: bool = False
    unique_prefix: bool = False
    filler_words: int | None = None
    completions: bool = False
    """Completions bodies: the same text as one ``prompt`` (system, a blank line, user)."""
    chinese: bool = False
    """Chinese prose (no spaces, full-width punctuation) instead of English words."""

    @property
    def path(self) -> str:
        return "/v1/completions" if self.completions else "/v1/chat/completions"

    def bodies(self, stream: bool) -> Bodies:
        if not self.unique and not self.unique_prefix:
            return _Cycled(self.path, [self.body(stream, i) for i in range(NUM_PROMPTS)])
        return _Fresh(self, stream)

    def body(self, stream: bool, number: int | str) -> bytes:
        """A shared system prompt (with ``unique_prefix``: one of its own) and user turn
        ``number`` (60 words)."""
        words = _CHINESE if self.chinese else _ENGLISH
        system = words["session"].format(number) if self.unique_prefix else ""
        system += words["system"] * 20
        filler = max(0, self.num_tokens - _SYSTEM_WORDS - 60)
        if self.filler_words is not None:
            filler = self.filler_words
        system += words["filler"] * (filler // 2) + words["odd"] * (filler % 2)
        user = words["user"].format(number) * 30
        if self.completions:
            prompt = {"model": MODEL, "prompt": f"{system}\n\n{user}", "max_tokens": 4}
            return json.dumps({**prompt, "stream": stream}).encode()
        chat = {
            "model": MODEL,
            "messages": [
                {"role": "system", "content": system},
                {"role": "user", "content": user},
            ],
            "max_tokens": 4,
            "stream": stream,
        }
        return json.dumps(chat).encode()


_ENGLISH = {
    "session": "Session {}. ",
    "system": "You are a terse assistant. ",
    "filler": "Context word. ",
    "odd": "more ",
    "user": "question {} ",
}
_CHINESE = {
    "session": "第{}次会话\uff0c",
    "system": "你是一个简洁的助手。",
    "filler": "上下文词语\uff0c",
    "odd": "更多",
    "user": "问题{}\uff1f",
}


class Bodies(Sequence[bytes]):
    """The bodies a run sends, all to ``path``."""

    path: str


class _Cycled(Bodies):
    def __init__(self, path: str, bodies: list[bytes]) -> None:
        self.path, self._bodies = path, bodies

    def __len__(self) -> int:
        return len(self._bodies)

    def __getitem__(self, index: Any) -> Any:
        return self._bodies[index]


class _Fresh(Bodies):
    """Bodies never sent before: each read makes a new one (its own user turn)."""

    _serial = itertools.count()

    def __init__(self, prompts: Prompts, stream: bool) -> None:
        self._prompts, self._stream = prompts, stream
        self.path = prompts.path

    def __len__(self) -> int:
        return NUM_PROMPTS

    def __getitem__(self, _: Any) -> Any:
        return self._prompts.body(self._stream, f"u{next(self._serial)}")


_PROFILED = """
import cProfile, runpy, sys, time
out, sys.argv = sys.argv[1], sys.argv[2:]
profile = cProfile.Profile(time.thread_time)
try:
    profile.runcall(runpy.run_path, sys.argv[0], run_name="__main__")
finally:
    profile.dump_stats(out)
"""
"""``python -c`` this, the stats' path and a command: the command's main thread under
cProfile on its own CPU time (a wait for a write's reader is not counted)."""


def _worker(port: int, bodies: Bodies, count: int, start: int, out: list[float]) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"content-type": "application/json"}
    try:
        for i in range(count):
            started = time.perf_counter()
            conn.request("POST", bodies.path, bodies[(start + i) % len(bodies)], headers)
            response = conn.getresponse()
            body = response.read()
            elapsed = time.perf_counter() - started
            if response.status != 200:
                raise RuntimeError(f"status {response.status}: {body[:200]!r}")
            out.append(elapsed)
    finally:
        conn.close()


def _run(
    ports: list[int], bodies: Bodies, concurrency: int, num_requests: int
) -> tuple[list[float], float]:
    """Latencies (s) of ``num_requests`` requests by ``concurrency`` workers, and the run's
    wall time (s); worker ``i`` talks to ``ports[i % len(ports)]``."""
    per_worker = max(1, num_requests // concurrency)
    results: list[list[float]] = [[] for _ in range(concurrency)]
    threads = [
        threading.Thread(
            target=_worker,
            args=(ports[i % len(ports)], bodies, per_worker, i * 7, results[i]),
        )
        for i in range(concurrency)
    ]
    started = time.perf_counter()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return [x for r in results for x in r], time.perf_counter() - started


def _quantile_ms(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return 1000 * ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _tree_cpu_s(pid: int | None) -> float | None:
    """CPU seconds of ``pid`` and its children (a proxy's workers) as they run now."""
    if pid is None:
        return None
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    own = process_cpu_s(pid)
    return None if own is None else own + sum(process_cpu_s(int(c)) or 0.0 for c in children)


def _measure(
    proxy: tuple[int, int | None],
    sim_ports: list[int],
    bodies: Bodies,
    concurrency: int,
    num_requests: int,
) -> dict[str, object]:
    """One JSON line's figures; ``proxy`` is the proxy's (port, pid)."""
    proxy_port, pid = proxy
    _run([proxy_port], bodies, concurrency, NUM_PROMPTS * 2)  # warm: tokenizer cache, pools
    _run(sim_ports, bodies, concurrency, NUM_PROMPTS)
    direct, direct_s = _run(sim_ports, bodies, concurrency, num_requests)
    cpu_before = _tree_cpu_s(pid)
    proxied, proxied_s = _run([proxy_port], bodies, concurrency, num_requests)
    cpu_after = _tree_cpu_s(pid)
    figures: dict[str, object] = {
        "bench": "proxy",
        "concurrency": concurrency,
        "num_requests": len(proxied),
    }
    for name, q in (("p50", 0.5), ("p99", 0.99)):
        d, p = _quantile_ms(direct, q), _quantile_ms(proxied, q)
        figures |= {f"direct_{name}_ms": round(d, 3), f"proxy_{name}_ms": round(p, 3)}
        figures[f"added_{name}_ms"] = round(p - d, 3)
    figures["direct_mean_ms"] = round(1000 * statistics.fmean(direct), 3)
    figures["proxy_mean_ms"] = round(1000 * statistics.fmean(proxied), 3)
    figures["direct_rps"] = round(len(direct) / direct_s, 1)
    figures["proxy_rps"] = round(len(proxied) / proxied_s, 1)
    if cpu_before is not None and cpu_after is not None:  # the proxy's own work per request
        cpu_ms = 1000 * (cpu_after - cpu_before) / len(proxied)
        figures["proxy_cpu_ms_per_request"] = round(cpu_ms, 3)
    return figures


def _threads_cpu_s(pid: int) -> float:
    """CPU seconds of ``pid``'s threads and its children's (a proxy's workers), from each
    thread's ``schedstat`` (nanoseconds: no ticks)."""
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        children = []
    total = 0
    for process in (pid, *map(int, children)):
        for task in Path(f"/proc/{process}/task").glob("*/schedstat"):
            try:
                total += int(task.read_text().split()[0])
            except (OSError, ValueError, IndexError):  # a thread gone meanwhile
                continue
    return total / 1e9


def _paired(
    proxies: dict[str, tuple[int, int]],
    bodies: Bodies,
    concurrency: int,
    windows: int,
    per_window: int,
) -> dict[str, object]:
    """Each proxy's CPU ms a request (``proxies``: label → (port, pid)) in ``windows``
    alternating windows of ``per_window`` requests; medians, the paired ratio's median
    (``against`` over ``this``) and in how many windows ``this`` used less."""
    for port, _ in proxies.values():  # warm: tokenizer caches, pools
        _run([port], bodies, concurrency, NUM_PROMPTS * 2)
    labels = list(proxies)
    got: dict[str, list[float]] = {label: [] for label in labels}
    for window in range(windows):
        for label in labels if window % 2 == 0 else labels[::-1]:
            port, pid = proxies[label]
            before = _threads_cpu_s(pid)
            done, _ = _run([port], bodies, concurrency, per_window)
            got[label].append(1000 * (_threads_cpu_s(pid) - before) / len(done))
    ratios = [a / t for t, a in zip(got["this"], got["against"], strict=True)]
    figures: dict[str, object] = {"bench": "proxy", "concurrency": concurrency}
    for label in labels:
        figures[f"{label}_cpu_ms_per_request"] = [round(x, 3) for x in got[label]]
        figures[f"{label}_median_ms"] = round(statistics.median(got[label]), 4)
    figures["paired_ratio"] = round(statistics.median(ratios), 4)
    figures["this_lower_in"] = f"{sum(r > 1 for r in ratios)} of {windows}"
    return figures


def _sims(workdir: Path, tokenizer: Path | None, stack: ExitStack) -> list[tuple[Child, int, str]]:
    """Three replica-sims, ready (stopped with ``stack``)."""
    sims = [_sim(f"r{i}", workdir, tokenizer) for i in (1, 2, 3)]
    for child, _, _ in sims:
        stack.callback(child.stop)
        child.spawn()
    for child, _, _ in sims:
        child.wait_ready(60)
    return sims


def _fixed(workdir: Path, stack: ExitStack) -> list[tuple[Child, int, str]]:
    """Three replicas of ``bench/fixed_upstream.py`` in one process (stopped with
    ``stack``): each spec's events endpoint a publisher that sends nothing (the streams
    connected: each replica healthy, routed on load alone)."""
    ports = [(free_port(), free_port()) for _ in range(3)]
    script = Path(__file__).with_name("fixed_upstream.py")
    args = [sys.executable, str(script), MODEL, *(f"{port},{events}" for port, events in ports)]
    child = Child("fixed", args, workdir / "fixed.log", http_ok(ports[-1][0], "/health"))
    stack.callback(child.stop)
    child.start(30)
    return [
        (child, port, f"id=r{i},model={MODEL},url=http://127.0.0.1:{port},"
         f"events=tcp://127.0.0.1:{events}")
        for i, (port, events) in enumerate(ports, start=1)
    ]  # fmt: skip


def _local_model(workdir: Path, reuse: bool, bos: bool) -> tuple[Path, Path]:
    """A byte-level BPE model directory (``bos``: its post-processor adds a BOS before a
    prompt, as Llama 3's does), and the proxy's config naming it."""
    tokenizer = write_model(workdir / "model", "byte_level_bpe", bos=bos)
    config = workdir / "kvindex.toml"
    api = "" if reuse else "[api]\ntokenizer_prefix_cache_bytes = 0\n\n"
    config.write_text(f'{api}[[models]]\nname = "{MODEL}"\ntokenizer = "{tokenizer}"\n')
    return tokenizer, config


def _fitted(prompts: Prompts, tokenizer: Path) -> tuple[Prompts, int]:
    """``prompts`` with its system prompt sized so one prompt has about ``num_tokens`` ids
    of ``tokenizer`` (its template included), and that number of ids."""
    local = LocalTokenizer.from_files(tokenizer, prefix_cache_bytes=0)

    def ids(filler: int) -> int:
        body = json.loads(replace(prompts, filler_words=filler).body(False, "u0"))
        if prompts.completions:
            return len(asyncio.run(local.encode_prompt(body["prompt"])))
        return len(asyncio.run(local.encode_messages(body["messages"])))

    base, per_100 = ids(0), ids(100) - ids(0)  # ids grow linearly with the filler's words
    filler = max(0, round((prompts.num_tokens - base) * 100 / max(1, per_100)))
    return replace(prompts, filler_words=filler), ids(filler)


def _store(store: str, specs: list[str], stack: ExitStack, workdir: Path) -> list[str]:
    """The proxy's options for ``store``: the replicas its own subscriber reads (memory), or
    a private redis-server that an indexer of the replicas fills (redis)."""
    if store == "memory":
        return [arg for spec in specs for arg in ("--replica", spec)]
    redis = stack.enter_context(running_redis())
    args = ["indexer", "--store", "redis", "--redis-url", redis.url, "--status-port", "-1"]
    args += [arg for spec in specs for arg in ("--replica", spec)]
    indexer = kvindex_child("indexer", args, workdir / "indexer.log", lambda: True)
    stack.callback(indexer.stop)
    indexer.spawn()
    return ["--store", "redis", "--redis-url", redis.url]


def _against(kvindex: Path, command: list[str], stack: ExitStack, workdir: Path) -> tuple[int, int]:
    """The same proxy ``command`` run by another build's ``kvindex`` on its own port (stopped
    with ``stack``): its (port, pid)."""
    port = free_port()
    args = [str(kvindex), *command[:2], str(port), *command[3:]]  # "proxy", "--port", port
    other = Child("against", args, workdir / "against.log", http_ok(port, "/readyz"))
    stack.callback(other.stop)
    other.start(60)
    assert other.process is not None
    return port, other.process.pid


def _figures(
    args: argparse.Namespace,
    proxies: dict[str, tuple[int, int]],
    sim_ports: list[int],
    bodies: Bodies,
    concurrency: int,
) -> dict[str, object]:
    """One JSON line's figures: paired with ``--against``, else against the sims direct."""
    if "against" in proxies:
        return _paired(proxies, bodies, concurrency, args.windows, args.requests)
    return _measure(proxies["this"], sim_ports, bodies, concurrency, args.requests)


def _options() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=400, help="Requests per measurement.")
    parser.add_argument(
        "--prompt-tokens", type=int, default=Prompts.num_tokens, help="Tokens of a prompt."
    )
    parser.add_argument(
        "--unique", action="store_true", help="A new user turn every request (shared system)."
    )
    parser.add_argument(
        "--unique-prefix", action="store_true", help="A wholly new prompt every request."
    )
    parser.add_argument(
        "--tokenizer",
        choices=("replica", "local"),
        default="replica",
        help="The proxy's tokenizer: a replica's /tokenize, or a local tokenizer.json.",
    )
    parser.add_argument(
        "--no-prefix-reuse",
        action="store_true",
        help="With --tokenizer local: encode every text whole (tokenizer_prefix_cache_bytes = 0).",
    )
    parser.add_argument("--workers", type=int, default=1, help="The proxy's --workers.")
    parser.add_argument(
        "--completions", action="store_true", help="Completions prompts instead of chats."
    )
    parser.add_argument(
        "--bos", action="store_true", help="With --tokenizer local: it adds a BOS (Llama 3)."
    )
    parser.add_argument(
        "--chinese", action="store_true", help="Chinese prose (no spaces) instead of English."
    )
    parser.add_argument(
        "--upstream",
        choices=("sims", "fixed"),
        default="sims",
        help="Three replica-sims, or three fixed answers from one cheap process (no KV"
        " events; needs --tokenizer local).",
    )
    parser.add_argument(
        "--store", choices=("memory", "redis"), default="memory", help="The proxy's store."
    )
    parser.add_argument(
        "--concurrency", type=int, nargs="+", default=[1, 16], help="Client threads."
    )
    parser.add_argument(
        "--stream", choices=("both", "yes", "no"), default="both", help="Streamed answers."
    )
    parser.add_argument(
        "--profile", type=Path, help="Run the proxy under cProfile; its stats written here."
    )
    parser.add_argument(
        "--against", type=Path, help="Another build's kvindex: a second proxy, measured paired."
    )
    parser.add_argument(
        "--windows", type=int, default=10, help="With --against: windows of --requests each."
    )
    args = parser.parse_args()
    if args.upstream == "fixed" and args.tokenizer != "local":
        parser.error("--upstream fixed answers no /tokenize: give --tokenizer local")
    if args.bos and args.tokenizer != "local":
        parser.error("--bos is a local tokenizer's: give --tokenizer local")
    return args


def _shape(args: argparse.Namespace, prompts: Prompts) -> dict[str, object]:
    """What a run's lines say of its prompts and proxy."""
    shape: dict[str, object] = {"prompt_tokens": prompts.num_tokens, "unique": prompts.unique}
    shape |= {"workers": args.workers, "store": args.store, "tokenizer": args.tokenizer}
    shape["upstream"] = args.upstream
    if prompts.unique_prefix:
        shape["unique_prefix"] = True
    if prompts.completions or args.bos:
        shape |= {"completions": prompts.completions, "bos": args.bos}
    if prompts.chinese:
        shape["chinese"] = True
    return shape


def main() -> None:
    args = _options()
    prompts = Prompts(args.prompt_tokens, args.unique, args.unique_prefix)
    prompts = replace(prompts, completions=args.completions, chinese=args.chinese)
    streams = {"both": (False, True), "yes": (True,), "no": (False,)}[args.stream]
    with tempfile.TemporaryDirectory() as tmp, ExitStack() as stack:
        workdir = Path(tmp)
        tokenizer = config = None
        shape: dict[str, object] = {}
        if args.tokenizer == "local":
            tokenizer, config = _local_model(workdir, not args.no_prefix_reuse, args.bos)
            prompts, num_ids = _fitted(prompts, tokenizer)
            shape |= {"prompt_ids": num_ids, "prefix_reuse": not args.no_prefix_reuse}
        sims = (
            _fixed(workdir, stack) if args.upstream == "fixed" else _sims(workdir, tokenizer, stack)
        )
        port = free_port()
        specs = [spec for _, _, spec in sims]
        command = ["proxy", "--port", str(port), *_store(args.store, specs, stack, workdir)]
        if args.workers != 1:
            command += ["--workers", str(args.workers)]
        if config is not None:
            command += ["--config", str(config)]
        proxy = kvindex_child("proxy", command, workdir / "proxy.log", http_ok(port, "/readyz"))
        if args.profile is not None:  # the whole run's calls, written when the proxy stops
            profiled = [sys.executable, "-c", _PROFILED, str(args.profile.resolve())]
            proxy.args = [*profiled, *proxy.args]
        stack.callback(proxy.stop)
        proxy.start(60)
        sim_ports = [p for _, p, _ in sims]
        shape |= _shape(args, prompts)
        assert proxy.process is not None
        proxies = {"this": (port, proxy.process.pid)}
        if args.against is not None:
            proxies["against"] = _against(args.against, command, stack, workdir)
        for stream in streams:
            for concurrency in args.concurrency:
                bodies = prompts.bodies(stream)
                figures = _figures(args, proxies, sim_ports, bodies, concurrency)
                print(json.dumps({**figures, "stream": stream, **shape}), flush=True)
    machine = {"load_1m": round(host_load(), 2), "calibration_ms": round(calibration_ms(), 2)}
    print(json.dumps({"bench": "proxy", "machine": machine}), flush=True)


if __name__ == "__main__":
    main()

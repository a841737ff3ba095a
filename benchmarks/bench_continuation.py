"""Benchmark: what an engine's death costs a batch of long rollouts, continuation vs restart-from-scratch.

Setup: two real SGLang CPU engines (the tiny model) behind the real sglang-router; a batch of long
greedy requests (default 24 of 240 new tokens: the tiny model's context is 256) goes through
`RolloutClient`, streamed, in both modes, one after the other in this run:
- continuation: `continuation=True`, a broken generation goes on from the tokens it had;
- restart (the baseline): `continuation=False`, a broken generation starts again from its prompt.
When each request in flight has half its budget (counted client-side), the engine holding the most of
them is SIGKILLed and removed from the router (what the fleet monitor does on a
death); a fresh engine replaces it before the next mode starts, and every engine's prefix cache is
flushed first and each mode has prompts of its own (same lengths' distribution), so both start alike.

Counted client-side, from the streamed chunks of every attempt (thrown-away ones included), never from
the engines' own counters (those only grow when a request finishes):
- tokens generated in total, and wall time to finish the batch (and after the death);
- tokens regenerated after the death: tokens at output positions a request already had when the engine
  died that an attempt after the death generated again. Goal: continuation's <= 5% of restart's.

Streamed bytes: the engines run as rlfleet's launch builder starts them (`--incremental-streaming-output`:
a chunk carries only its new tokens); one more engine without that flag (SGLang's default: every chunk
repeats all tokens so far) streams one request of the same length beside one of them, bytes counted on
the wire, and both must return the same tokens.

Timing figures include whatever else runs on the machine (two CPU engines share its cores).

Run: python benchmarks/bench_continuation.py [--requests 24] [--new-tokens 240] [--json]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the engine and router starters the tests use

from helpers.engines import (  # noqa: E402
    EngineProcess,
    LocalProcesses,
    add_workers,
    remove_worker,
    start_engine,
)
from rlfleet.crds.managed import EngineFlags  # noqa: E402
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, generate_all  # noqa: E402
from rlfleet.orchestrator.rollout.continuation import Progress  # noqa: E402
from rlfleet.orchestrator.rollout.stream import ChunkSink, parse_event, stream_generate  # noqa: E402

HTTP_TIMEOUT = aiohttp.ClientTimeout(total=10)
GOAL = 0.05


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randrange(4, 12))] for _ in range(count)]


@dataclass
class Attempt:
    """One streamed attempt of one request: where in the output it started, what it has received."""

    rid: str
    start: int
    tokens: Progress
    after_death: bool
    bytes: int = 0

    @property
    def position(self) -> int:
        return self.start + self.tokens.generated


@dataclass
class Ledger:
    """Every attempt of a batch, as the client saw it."""

    prompts: dict[str, list[int]]
    attempts: list[Attempt] = field(default_factory=list)
    live: dict[str, Attempt] = field(default_factory=dict)
    died_at: float | None = None
    had_at_death: dict[str, int] = field(default_factory=dict)  # rid -> output tokens it had at the death
    kill_when: tuple[int, int] = (1 << 30, 0)  # (requests started, output tokens of each in flight): kill
    half_way: asyncio.Event = field(default_factory=asyncio.Event)

    def begin(self, payload: Mapping) -> Attempt:
        rid = str(payload["rid"])
        start = len(payload["input_ids"]) - len(self.prompts[rid])  # a continuation sends prompt + prefix
        attempt = Attempt(rid, start, Progress(max_new_tokens=1 << 30), after_death=self.died_at is not None)
        self.attempts.append(attempt)
        self.live[rid] = attempt
        return attempt

    def mark_death(self) -> None:
        self.died_at = time.monotonic()
        self.had_at_death = {rid: a.position for rid, a in self.live.items()}

    def note_progress(self) -> None:
        """Time to kill once every request started and each one in flight has `tokens`. The engines do not
        keep pace with each other on shared cores: the slowest in-flight request stands for the victim's."""
        requests, tokens = self.kill_when
        if self.died_at is None and len({a.rid for a in self.attempts}) >= requests and self.live and \
                min(a.position for a in self.live.values()) >= tokens:
            self.half_way.set()

    def mean_progress(self) -> float:
        return sum(a.position for a in self.live.values()) / max(len(self.live), 1)

    def figures(self) -> dict:
        regenerated = 0
        for a in self.attempts:
            if a.after_death:
                had = self.had_at_death.get(a.rid, 0)
                regenerated += max(0, min(a.position, had) - a.start)
        broken = {a.rid for a in self.attempts if a.after_death}
        return {"tokens_total": sum(a.tokens.generated for a in self.attempts),
                "tokens_before_death": sum(self.had_at_death.values()),
                "tokens_regenerated": regenerated,
                "attempts": len(self.attempts),
                "requests_broken": len(broken),
                "victim_mean_tokens_at_death": (sum(self.had_at_death[r] for r in broken) / len(broken)
                                                if broken else 0.0),
                "stream_bytes": sum(a.bytes for a in self.attempts)}


def counting_stream(session: aiohttp.ClientSession, url: str, ledger: Ledger):
    """The client's stream transport, noting every chunk's tokens (and bytes) of every attempt."""

    async def stream(payload: Mapping, timeout_s: float, on_chunk: ChunkSink) -> dict:
        attempt = ledger.begin(payload)

        def chunk(data: dict) -> None:
            attempt.tokens.apply_chunk(data)
            attempt.bytes += len(json.dumps(data))
            on_chunk(data)
            ledger.note_progress()

        try:
            return await stream_generate(session, url, payload, timeout_s, chunk, connect_timeout_s=10)
        finally:
            attempt.tokens.end_attempt()
            if ledger.live.get(attempt.rid) is attempt:
                del ledger.live[attempt.rid]

    return stream


async def running_requests(session: aiohttp.ClientSession, engine: EngineProcess) -> float:
    async with session.get(engine.url + "/metrics", timeout=HTTP_TIMEOUT) as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith("sglang:num_running_reqs"))


async def kill_half_way(session: aiohttp.ClientSession, router_url: str, engines: list[EngineProcess],
                        ledger: Ledger, requests: int, half: int) -> EngineProcess:
    """When each request in flight has `half` tokens: SIGKILL the engine holding most of them."""
    ledger.kill_when = (requests, half)
    await asyncio.wait_for(ledger.half_way.wait(), 600)
    held = [await running_requests(session, e) for e in engines]
    victim = engines[held.index(max(held))]
    victim.process.signal_group(signal.SIGKILL)
    ledger.mark_death()
    await remove_worker(session, router_url, victim.url)
    print(f"  killed {victim.name} holding {held[engines.index(victim)]:.0f} of {requests} requests, "
          f"mean progress {ledger.mean_progress():.0f} tokens", flush=True)
    return victim


async def one_mode(mode: str, session: aiohttp.ClientSession, router_url: str, engines: list[EngineProcess],
                   batch: list[list[int]], new_tokens: int) -> tuple[dict, EngineProcess]:
    for engine in engines:  # both modes start from cold prefix caches
        async with session.post(engine.url + "/flush_cache", timeout=HTTP_TIMEOUT) as resp:
            assert resp.status == 200, await resp.text()
    ids = [f"{mode}-{i}" for i in range(len(batch))]
    ledger = Ledger(prompts=dict(zip(ids, batch, strict=True)))
    client = RolloutClient(router_url, None, fleet=f"bench-{mode}", rng=random.Random(0),
                           continuation=mode == "continuation",
                           stream=counting_stream(session, router_url + "/generate", ledger),
                           policy=RetryPolicy(max_attempts=8, backoff_base_s=0.2, backoff_max_s=2, deadline_s=900))
    payloads = {rid: {"input_ids": prompt, "return_logprob": True,
                      "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
                for rid, prompt in ledger.prompts.items()}
    print(f"{mode}: {len(batch)} requests of {new_tokens} new tokens", flush=True)
    started = time.monotonic()
    rollout = asyncio.create_task(generate_all(client, payloads, concurrency=len(batch)))
    killer = asyncio.create_task(kill_half_way(session, router_url, engines, ledger, len(batch), new_tokens // 2))
    try:
        await asyncio.wait([killer, rollout], return_when=asyncio.FIRST_COMPLETED)
        if not killer.done():
            raise RuntimeError(f"{mode}: the batch ended before the kill: {rollout.result().failed}")
        victim = killer.result()
        done = await rollout
    finally:
        killer.cancel()
        rollout.cancel()
    finished = time.monotonic()
    assert not done.failed, f"{mode}: {len(done.failed)} requests failed: {next(iter(done.failed.values()))}"
    lengths = {len(a["output_ids"]) for a in done.delivered.values()}
    assert lengths == {new_tokens}, f"{mode}: output lengths {lengths}"
    assert ledger.died_at is not None
    figures = {"mode": mode, **ledger.figures(), "wall_s": finished - started,
               "after_death_s": finished - ledger.died_at, "continued": client.continued.as_dict()}
    return figures, victim


async def start_cumulative_engine(model: Path, log_dir: Path) -> EngineProcess:
    """An engine as the launch builder starts it, less `--incremental-streaming-output`."""
    flag = EngineFlags.INCREMENTAL_STREAMING_OUTPUT.flag
    return await start_engine(model, log_dir=log_dir, name="cumulative", drop_args=(flag,))


async def wire_bytes(session: aiohttp.ClientSession, engine: EngineProcess, prompt: list[int],
                     new_tokens: int) -> tuple[int, list[int]]:
    """One streamed greedy request straight to `engine`: the bytes on the wire and its output tokens."""
    progress = Progress(max_new_tokens=new_tokens)
    payload = {"input_ids": prompt, "return_logprob": True, "stream": True,
               "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}
    total = 0
    buffer = b""
    async with session.post(engine.url + "/generate", json=payload,
                            timeout=aiohttp.ClientTimeout(total=600)) as resp:
        async for data in resp.content.iter_any():
            total += len(data)
            buffer += data
            *events, buffer = buffer.split(b"\n\n")
            for event in events:
                if (chunk := parse_event(event)) is not None:
                    progress.apply_chunk(chunk)
    return total, progress.token_ids


def report(rows: list[dict], requests: int, new_tokens: int) -> None:
    useful = requests * new_tokens
    for r in rows:
        print(f"  {r['mode']:12s} tokens total {r['tokens_total']:6d} ({r['tokens_total'] / useful:.3f}x the "
              f"{useful} delivered)  had at the death {r['tokens_before_death']:5d}  regenerated after it "
              f"{r['tokens_regenerated']:5d}  requests broken {r['requests_broken']:2d} (at "
              f"{r['victim_mean_tokens_at_death']:.0f} tokens on average)  attempts {r['attempts']:3d}  "
              f"wall {r['wall_s']:6.1f} s (after the death {r['after_death_s']:5.1f} s)  "
              f"streamed {r['stream_bytes'] / requests / 1024:.0f} KiB/request")
    by = {r["mode"]: r for r in rows}
    ours, base = by["continuation"], by["restart"]
    ratio = ours["tokens_regenerated"] / base["tokens_regenerated"] if base["tokens_regenerated"] else float("nan")
    print(f"continuation vs restart: tokens regenerated after the death {ours['tokens_regenerated']} vs "
          f"{base['tokens_regenerated']}, ratio {ratio:.3f} (goal <= {GOAL:.2f}); tokens total "
          f"{ours['tokens_total'] / base['tokens_total']:.3f}x; wall time {ours['wall_s'] / base['wall_s']:.2f}x, "
          f"after the death {ours['after_death_s'] / base['after_death_s']:.2f}x")


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=24)
    parser.add_argument("--new-tokens", type=int, default=240)
    parser.add_argument("--json", action="store_true", help="also print the figures as JSON")
    args = parser.parse_args()
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    model = ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0", seed=0)
    rows: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-continuation-") as tmp:
        async with LocalProcesses(Path(tmp)) as processes, aiohttp.ClientSession() as session:
            router = await processes.router()
            engines = await processes.engines_many(model, 2)
            await add_workers(session, router.url, [e.url for e in engines])
            cumulative = None
            for mode in ("continuation", "restart"):
                # Prompts of its own per mode: the router's cache-aware policy remembers where it sent the
                # last mode's, and would put them all on one engine.
                batch = prompts(args.requests, seed=len(rows))
                figures, victim = await one_mode(mode, session, router.url, engines, batch, args.new_tokens)
                rows.append(figures)
                engines.remove(victim)
                if mode != "restart":
                    replacement, cumulative = await asyncio.gather(processes.engine(model),
                                                                   start_cumulative_engine(model, Path(tmp)))
                    processes.engines.append(cumulative)
                    engines.append(replacement)
                    await add_workers(session, router.url, [replacement.url])
            assert cumulative is not None
            (inc_bytes, inc_ids), (cum_bytes, cum_ids) = await asyncio.gather(
                wire_bytes(session, engines[0], batch[0], args.new_tokens),
                wire_bytes(session, cumulative, batch[0], args.new_tokens))
    report(rows, args.requests, args.new_tokens)
    print(f"streamed bytes of one request of {args.new_tokens} tokens (logprobs on): incremental "
          f"{inc_bytes / 1024:.1f} KiB vs cumulative {cum_bytes / 1024:.1f} KiB, ratio {inc_bytes / cum_bytes:.3f}; "
          f"same tokens: {inc_ids == cum_ids} ({len(inc_ids)} vs {len(cum_ids)})")
    rows.append({"mode": "wire_bytes", "incremental": inc_bytes, "cumulative": cum_bytes,
                 "same_tokens": inc_ids == cum_ids})
    if args.json:
        print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))

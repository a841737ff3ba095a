"""Benchmark: what one engine's death costs a batch of long rollouts, continued vs restarted from scratch.

Setup: two real SGLang CPU engines behind a real sglang-router, `--requests` greedy requests of
`--tokens` new tokens each (ignore_eos, so every one needs exactly that many). First an unbroken batch
(which also warms the engines up). Then, in one run, for each mode: the batch again, and once the
engines have generated half its tokens the engine that holds the most requests is SIGKILLed and leaves
the router (as the fleet monitor does on a death); a fresh engine replaces it before the next mode.
- restart: the rollout client with continuation off (today's path: a broken request starts again
  from its prompt, on the surviving engine);
- continuation: the client streams and continues each broken request from the tokens it had.

Figures per mode: tokens the engines generated in total (their `sglang:generation_tokens_total`, the
killed engine's read just before the kill), tokens regenerated = total - requests x tokens, wall time
from submission to the last answer. Goal: continuation regenerates <= 5% of what restart regenerates.

Run: python benchmarks/bench_continuation.py [--requests 32] [--tokens 200] [--model DIR]
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
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

from helpers.engines import EngineProcess, LocalProcesses  # noqa: E402
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, generate_all  # noqa: E402
from rlfleet.trainer.tiny import ensure_tiny_model  # noqa: E402
from rlfleet.util.binaries import CACHE_DIR  # noqa: E402

TIMEOUT = aiohttp.ClientTimeout(total=10)


async def scrape(session: aiohttp.ClientSession, url: str, metric: str) -> float:
    async with session.get(url + "/metrics", timeout=TIMEOUT) as resp:
        text = await resp.text()
    return sum(float(line.split()[-1]) for line in text.splitlines() if line.startswith(metric))


async def generated_since(session: aiohttp.ClientSession, engines: list[EngineProcess],
                          before: dict[str, float]) -> float:
    return sum([await scrape(session, e.url, "sglang:generation_tokens_total") - before[e.url] for e in engines])


async def set_workers(session: aiohttp.ClientSession, router_url: str, urls: list[str]) -> None:
    """Make the router's workers exactly `urls`, all healthy."""
    async with session.get(router_url + "/workers", timeout=TIMEOUT) as resp:
        workers = (await resp.json())["workers"]
    for worker in workers:
        if worker["url"].rstrip("/") not in urls:
            async with session.delete(f"{router_url}/workers/{worker['id']}", timeout=TIMEOUT):
                pass
    have = {w["url"].rstrip("/") for w in workers}
    for url in urls:
        if url not in have:
            async with session.post(router_url + "/workers", json={"url": url}, timeout=TIMEOUT):
                pass
    deadline = time.monotonic() + 60
    while True:
        async with session.get(router_url + "/workers", timeout=TIMEOUT) as resp:
            workers = (await resp.json())["workers"]
        if {w["url"].rstrip("/") for w in workers if w["is_healthy"]} == set(urls):
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"router workers {workers}, wanted {urls}")
        await asyncio.sleep(0.2)


def requests(count: int, tokens: int) -> dict[str, dict]:
    rng = random.Random(0)
    return {f"r{i}": {"input_ids": [rng.randrange(10, 300) for _ in range(8)], "return_logprob": True,
                      "sampling_params": {"max_new_tokens": tokens, "temperature": 0, "ignore_eos": True}}
            for i in range(count)}


async def one_mode(mode: str, session: aiohttp.ClientSession, router_url: str, engines: list[EngineProcess],
                   batch: dict[str, dict], kill_half_way: bool) -> dict:
    client = RolloutClient(router_url, session, fleet=f"bench-{mode}", continuation=mode == "continuation",
                           rng=random.Random(0),
                           policy=RetryPolicy(max_attempts=8, backoff_base_s=0.2, backoff_max_s=2, deadline_s=900))
    before = {e.url: await scrape(session, e.url, "sglang:generation_tokens_total") for e in engines}
    started = time.monotonic()
    rollout = asyncio.create_task(generate_all(client, {f"{mode}-{k}": v for k, v in batch.items()},
                                               concurrency=len(batch)))
    killed: EngineProcess | None = None
    at_kill = 0.0
    if kill_half_way:  # half the batch's tokens generated (the engines' own count, either mode)
        needed = sum(p["sampling_params"]["max_new_tokens"] for p in batch.values())
        while await generated_since(session, engines, before) < needed / 2:  # noqa: ASYNC110 - polls HTTP
            await asyncio.sleep(0.05)
        held = [await scrape(session, e.url, "sglang:num_running_reqs") for e in engines]
        killed = engines[held.index(max(held))]
        at_kill = await scrape(session, killed.url, "sglang:generation_tokens_total") - before[killed.url]
        killed.process.signal_group(signal.SIGKILL)
        await set_workers(session, router_url, [e.url for e in engines if e is not killed])
    ledger = await rollout
    wall = time.monotonic() - started
    total = at_kill
    for engine in engines:
        if engine is not killed:
            total += await scrape(session, engine.url, "sglang:generation_tokens_total") - before[engine.url]
    needed = sum(p["sampling_params"]["max_new_tokens"] for p in batch.values())
    return {"mode": mode, "delivered": len(ledger.delivered), "failed": len(ledger.failed),
            "tokens_generated": int(total), "tokens_needed": needed, "tokens_regenerated": int(total - needed),
            "wall_s": round(wall, 2), "continued": client.continued.as_dict(),
            "killed": None if killed is None else killed.name}


async def main(args: argparse.Namespace) -> int:
    model = Path(args.model) if args.model else ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0", seed=0)
    batch = requests(args.requests, args.tokens)
    with tempfile.TemporaryDirectory(prefix="bench-continuation-") as logs:
        async with LocalProcesses(Path(logs)) as processes, aiohttp.ClientSession() as session:
            router = await processes.router()
            engines = await processes.engines_many(model, 2)
            await set_workers(session, router.url, [e.url for e in engines])
            unbroken = await one_mode("unbroken", session, router.url, engines, batch, False)
            print(json.dumps(unbroken))
            results = []
            for mode in ("restart", "continuation"):
                result = await one_mode(mode, session, router.url, engines, batch, True)
                print(json.dumps(result))
                results.append(result)
                dead = [e for e in engines if e.name == result["killed"]]
                for engine in dead:
                    await engine.stop()
                engines = [e for e in engines if e not in dead] + [await processes.engine(model)]
                await set_workers(session, router.url, [e.url for e in engines])
    restart, continued = results
    ratio = continued["tokens_regenerated"] / max(restart["tokens_regenerated"], 1)
    print(f"\nrestart: {restart['tokens_generated']} tokens generated ({restart['tokens_regenerated']} again), "
          f"{restart['wall_s']} s; continuation: {continued['tokens_generated']} tokens "
          f"({continued['tokens_regenerated']} again, {continued['continued']['tokens_saved']} kept), "
          f"{continued['wall_s']} s; unbroken {unbroken['wall_s']} s")
    print(f"regenerated tokens, continuation / restart: {ratio:.3f} (goal <= 0.05); "
          f"wall time ratio {continued['wall_s'] / max(restart['wall_s'], 1e-9):.2f}")
    return 0 if ratio <= 0.05 and restart["failed"] == continued["failed"] == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--model", default=None, help="an HF model directory (default: the tiny model)")
    sys.exit(asyncio.run(main(parser.parse_args())))

"""Rollout continuation through a real sglang-router and real SGLang engines: a generation whose engine
dies, or whose weights change under it, goes on from the tokens it had instead of starting again."""
from __future__ import annotations

import asyncio
import io
import json
import random
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from prometheus_client import REGISTRY

from helpers.engines import EngineProcess, add_workers, remove_worker
from rlfleet.crds.loader import load_training_run
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, generate_all
from rlfleet.orchestrator.run.local import LocalRun, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter
from rlfleet.sglang.engine import CACHE_NOT_FLUSHED_MARKER, EngineClient
from rlfleet.trainer import grpo
from rlfleet.trainer.base import build_trainer
from rlfleet.trainer.grpo import StalenessPolicy, sample_from_generate

pytestmark = pytest.mark.engines

TIMEOUT = aiohttp.ClientTimeout(total=10)
NEW_TOKENS = 200
REQUESTS = 32


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 300) for _ in range(rng.randrange(4, 12))] for _ in range(count)]


def greedy(prompt: list[int], new_tokens: int = NEW_TOKENS) -> dict:
    return {"input_ids": prompt, "return_logprob": True,
            "sampling_params": {"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True}}


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
LOGPROB_TOLERANCE = 1e-3  # SGLang's float32 CPU path vs the trainer, per token (as for an unbroken sample)


def logprob_error(trainer, prompt, response, reported) -> float:
    """The largest per-token gap between the engine-reported logprobs and the trainer's recomputation."""
    import torch

    ids = torch.tensor([list(prompt) + list(response)])
    with torch.no_grad():
        ours = grpo.token_logprobs(trainer.logits(ids), ids)[0, len(prompt) - 1:].tolist()
    assert len(ours) == len(reported)
    return max(abs(a - b) for a, b in zip(ours, reported, strict=True))


def counter(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def running_requests(session: aiohttp.ClientSession, engine_url: str, api_key: str | None = None) -> int:
    """Requests in the engine scheduler's running batch (`/v1/loads`, published at every prefill, every 15
    decode steps and when it goes idle; the `/metrics` gauge is refreshed only every 40 decode steps and may
    still count finished ones). Queued requests are left out: they have streamed nothing a kill could cut."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    async with session.get(engine_url + "/v1/loads", headers=headers, timeout=TIMEOUT) as resp:
        resp.raise_for_status()
        loads = (await resp.json())["loads"]
    return sum(load.get("num_running_reqs", 0) for load in loads)


async def wait_progress(client: RolloutClient, ids: list[str], tokens: int, timeout_s: float = 120, *,
                        each: bool = False) -> None:
    """Until the samples in flight have, on average (or `each` of them), `tokens` tokens."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        held = [client.progress[i].generated for i in ids if i in client.progress]
        if each and len(held) == len(ids) and min(held) >= tokens:
            return
        if not each and held and sum(held) / len(ids) >= tokens:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"the samples never reached {tokens} tokens {'each' if each else 'on average'}")


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def engine_pair(session_sglang_engines) -> AsyncIterator[list[EngineProcess]]:
    """Two engines (tiny model, version "0") for this module's tests: the weight-sync test lends one and
    loads version "0" back; the kill test, last of the two, kills one. Both are stopped when the module
    ends, before the next module starts engines of its own."""
    engines = await session_sglang_engines.start_many(2)
    try:
        yield engines
    finally:
        await asyncio.gather(*(e.stop() for e in engines))


async def test_a_weight_sync_between_prefix_and_continuation_shows_both_versions(engine_pair, sglang_router):
    """A weight sync that aborts in-flight requests (version 0 -> 1): each continues under the new
    version; its tokens carry both, and staleness is judged by the oldest or the newest as configured."""
    router = await sglang_router.start()
    lent = engine_pair[0]
    engine = EngineClient(aiohttp.ClientSession(), lent.url)
    batch = prompts(4, seed=1)
    ids = [f"w{i}" for i in range(len(batch))]
    try:
        async with aiohttp.ClientSession() as session:
            await add_workers(session, router.url, [lent.url])
            client = RolloutClient(router.url, session, fleet="it-continuation-sync", rng=random.Random(0),
                                   continuation=True,
                                   policy=RetryPolicy(max_attempts=8, backoff_base_s=0.1, backoff_max_s=1,
                                                      deadline_s=120))
            rollout = asyncio.create_task(generate_all(client, {k: greedy(p) for k, p in zip(ids, batch,
                                                                                            strict=True)}))
            # Every sample streaming on version "0", each far from its end when the sync aborts it: one that a
            # retry started late, or that ran ahead, could otherwise finish before the abort or slip in after
            # it, whole on one version.
            await wait_progress(client, ids, 10, each=True)
            result = await engine.update_weights_from_disk(lent.model_path, "1", abort_all_requests=True)
            # The aborted requests' continuations may reach the engine before its cache flush: the weights
            # swapped all the same (SGLang's documented 400); nothing checked here reads the cache.
            assert result.success or CACHE_NOT_FLUSHED_MARKER in result.message, result.message
            ledger = await asyncio.wait_for(rollout, 120)
    finally:
        await engine.update_weights_from_disk(lent.model_path, "0")
        await engine.session.close()
    assert ledger.failed == {}
    for sample_id, prompt in zip(ids, batch, strict=True):
        sample = sample_from_generate(prompt, ledger.delivered[sample_id])
        assert len(sample.response_ids) == NEW_TOKENS
        assert sample.versions() == ("0", "1"), sample.token_versions
        cut = sample.token_versions.index("1")
        assert set(sample.token_versions[:cut]) == {"0"} and set(sample.token_versions[cut:]) == {"1"}
        # Continued where the version changed (and again if an abort of the sync caught it once more).
        assert sample.continued_at[0] == cut and min(sample.continued_at) == cut
        assert sample.weight_version == "0"  # the oldest
        assert not StalenessPolicy(0, by="oldest").is_fresh(sample, current_step=1)
        assert StalenessPolicy(0, by="newest").is_fresh(sample, current_step=1)


async def test_greedy_rollouts_continue_on_the_surviving_engine_token_for_token(engine_pair, sglang_router,
                                                                                tiny_model):
    """Two engines, 32 greedy requests of 200 tokens; the engine holding most is SIGKILLed half-way.

    Every request completes once, equal to an unbroken run token for token, and each continued one made
    its new engine generate only the tokens it still lacked."""
    router = await sglang_router.start()
    engines = engine_pair
    batch = prompts(REQUESTS)
    fleet = "it-continuation"
    async with aiohttp.ClientSession() as session:
        await add_workers(session, router.url, [e.url for e in engines])
        client = RolloutClient(router.url, session, fleet=fleet, rng=random.Random(0), continuation=True,
                               policy=RetryPolicy(max_attempts=8, backoff_base_s=0.2, backoff_max_s=2, deadline_s=300))
        unbroken = await generate_all(client, {f"u{i}": greedy(p) for i, p in enumerate(batch)}, concurrency=REQUESTS)
        assert unbroken.failed == {}

        continued_before = counter("rlfleet_rollout_continuations_total", fleet=fleet)
        saved_before = counter("rlfleet_rollout_continuation_tokens_saved_total", fleet=fleet)
        ids = [f"k{i}" for i in range(REQUESTS)]
        rollout = asyncio.create_task(generate_all(client, {k: greedy(p) for k, p in zip(ids, batch, strict=True)},
                                                   concurrency=REQUESTS))
        await wait_progress(client, ids, NEW_TOKENS // 2)
        held = [await running_requests(session, e.url) for e in engines]
        doomed = engines[held.index(max(held))]
        doomed.process.signal_group(signal.SIGKILL)
        await remove_worker(session, router.url, doomed.url)  # what the fleet monitor does on a death
        ledger = await asyncio.wait_for(rollout, 300)
    await asyncio.gather(*(e.stop() for e in engines))  # the pair is done: the next test starts engines of its own

    assert ledger.failed == {}
    assert sorted(ledger.delivered) == sorted(ids)
    continued = 0
    for i, sample_id in enumerate(ids):
        answer = ledger.delivered[sample_id]
        assert answer["output_ids"] == unbroken.delivered[f"u{i}"]["output_ids"], f"{sample_id} differs"
        assert len(answer["meta_info"]["output_token_logprobs"]) == NEW_TOKENS
        mark = answer["meta_info"].get("continuation")
        if mark is None:
            continue
        continued += 1
        segments = mark["segments"]
        assert segments[0]["start"] == 0 and segments[-1]["end"] == NEW_TOKENS
        assert all(s["start"] > 0 for s in segments[1:]), "a continuation restarted from zero"
        # Each attempt's engine generated exactly its own segment: the prefix was never generated again.
        assert [s["completion_tokens"] for s in segments] == [s["end"] - s["start"] for s in segments]
        assert sum(s["completion_tokens"] for s in segments) == NEW_TOKENS
    # The stitched samples' behaviour logprobs are the trainer's, token by token, like unbroken ones.
    trainer = build_trainer("torch", tiny_model, lr=1e-2, seed=0)
    stitched = [i for i, k in enumerate(ids) if "continuation" in ledger.delivered[k]["meta_info"]]
    errors = {kind: max(logprob_error(trainer, batch[i], answer["output_ids"],
                                      [p[0] for p in answer["meta_info"]["output_token_logprobs"]])
                        for i, answer in picked)
              for kind, picked in (("stitched", [(i, ledger.delivered[ids[i]]) for i in stitched]),
                                   ("unbroken", [(i, unbroken.delivered[f"u{i}"]) for i in stitched]))}
    assert errors["stitched"] < LOGPROB_TOLERANCE and errors["unbroken"] < LOGPROB_TOLERANCE, errors
    held_most = max(held)
    print(f"\nfigures: engines held {held} at the kill; {continued} of {REQUESTS} requests continued, "
          f"{client.continued.tokens_saved} tokens kept")
    assert continued >= held_most // 2 > 0, f"only {continued} continued; the killed engine held {held_most}"
    assert counter("rlfleet_rollout_continuations_total", fleet=fleet) - continued_before == \
        client.continued.continuations >= continued
    assert counter("rlfleet_rollout_continuation_tokens_saved_total", fleet=fleet) - saved_before == \
        client.continued.tokens_saved > 0


async def test_a_sampled_run_with_an_engine_killed_continues_its_rollouts(tmp_path, tiny_model):
    """`rlfleet run` (temperature 1) with the busier of two engines SIGKILLed while the first step rolls out: the
    run completes, its continuations are in the summary and the metrics, and every stitched sample's
    per-token logprobs are the trainer's recomputation within tolerance."""
    run = load_training_run(EXAMPLES / "quickstart.yaml")
    run.spec.eval = None
    t = run.spec.trainer
    t.steps, t.max_new_tokens, t.temperature, t.prompts_per_step, t.samples_per_prompt = 2, 96, 1.0, 4, 4
    # Two groups (8 requests) in flight: the groups the kill cuts are the first two, so they are trained in
    # step 1 or 2 (queued in the order they finish; with more groups in flight, groups started after the kill
    # could finish first, fill both steps, and leave the continued ones untrained).
    run.spec.rollout.concurrency_per_engine = 4
    log = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=tmp_path / "run", summary_path=tmp_path / "summary.json",
                                     metrics_port=0, progress=ProgressReporter(log, tty=False),
                                     record_batches=tmp_path / "batches"))
    before = counter("rlfleet_rollout_continuations_total", fleet="rollout")
    task = asyncio.create_task(local.execute())
    # The first step's rollouts are streaming: at least 6 of the 8 in flight, and every request in flight has
    # streamed 4 tokens or more, so whichever engine is killed, the requests it holds have tokens a kill cuts
    # (requests only just prefilled on one engine, while the other engine's had streamed, made a kill continue
    # nothing).
    # Sampled answers end early (~30 tokens), so waiting much longer leaves the engines little to lose.
    def streaming() -> bool:
        in_flight = [p.generated for p in local._client.progress.values()] if local._client else []
        return len(in_flight) >= 6 and min(in_flight) >= 4

    # The router may place every sample on one engine (they share their prompts' prefixes): the engine
    # killed is the one that holds the most requests, as each engine's scheduler reports them. Its report is
    # published at a prefill (before the prefilled requests join the running batch) and every 15 decode steps,
    # so right after one prefill of every request both engines may still report none running: wait for one
    # that does.
    engines: list = []
    held: list[int] = []
    async with asyncio.timeout(600), aiohttp.ClientSession() as session:
        while True:
            assert not task.done(), f"run ended early: {task.exception() if task.done() else ''}\n{log.getvalue()}"
            if streaming():
                engines = [e for e in local.backend.engines() if e.url]
                held = [await running_requests(session, e.url, local.backend.api_key) for e in engines]
                if max(held, default=0) > 0:
                    break
            await asyncio.sleep(0.05)
    assert not local.summary.steps, "the kill came after the first step"
    local.backend.process(engines[held.index(max(held))].slot).signal_group(signal.SIGKILL)
    summary = await asyncio.wait_for(task, 900)

    assert summary.failure is None and len(summary.steps) == 2, log.getvalue()
    data = json.loads((tmp_path / "summary.json").read_text())
    assert data["rollout_continuations"]["continuations"] >= 1, data["rollout_continuations"]
    assert counter("rlfleet_rollout_continuations_total", fleet="rollout") - before == \
        data["rollout_continuations"]["continuations"]
    samples = [grpo.Sample(**{k: tuple(v) if isinstance(v, list) else v for k, v in raw.items()})
               for step in (1, 2)
               for raw in json.loads((tmp_path / "batches" / f"step_{step}.json").read_text())["samples"]]
    # Samples of one version (0: no sync happened before the kill) are scored against the initial model.
    stitched = [s for s in samples if s.continued_at and s.versions() == ("0",)]
    assert stitched, "no sample of the trained batches was continued"
    trainer = build_trainer("torch", tiny_model, lr=1e-2, seed=0)
    worst = max(logprob_error(trainer, s.prompt_ids, s.response_ids, s.sampling_logprobs) for s in stitched)
    print(f"\nfigures: engines held {held} at the kill; {len(stitched)} stitched samples trained, "
          f"worst logprob gap {worst:.2e}; "
          f"{data['rollout_continuations']}")
    assert worst < LOGPROB_TOLERANCE

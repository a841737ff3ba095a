"""Broadcast weight sync on real parts: two SGLang CPU engines (local backend, gloo update group), a real
sglang-router, the real torch trainer as the source of the weights.

One fleet is shared by the tests of this module, in order: a broadcast that the engines serve (greedy
tokens equal the trainer's, checksums equal), a broadcast that ends before its snapshot is written (which
then becomes the fleet's reference, or fails on its own), different bytes caught by the checksum, a SIGSTOPped
engine during a broadcast sync (marked dead, the others finish from disk, the next sync broadcasts over
a rebuilt group), a SIGKILL between syncs (rebuilt before the next one), a broadcast that cannot start.
"""
from __future__ import annotations

import asyncio
import os
import shutil
import signal
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
import pytest_asyncio
import torch
from prometheus_client import REGISTRY

from rlfleet.crds.specs import EngineSpec, HealthSpec, RecoverySpec, WeightSyncSpec
from rlfleet.orchestrator.fleet import broadcast_plan as plan
from rlfleet.orchestrator.fleet.backend import EngineState
from rlfleet.orchestrator.fleet.errors import WeightSyncFailed
from rlfleet.orchestrator.fleet.local_backend import LocalBackend
from rlfleet.orchestrator.fleet.local_router import LocalRouter
from rlfleet.orchestrator.fleet.runtime import FleetRuntime
from rlfleet.orchestrator.fleet.update_group import UpdateGroup
from rlfleet.orchestrator.fleet.weight_sync import EngineSyncOutcome
from rlfleet.orchestrator.run.loop import export_step
from rlfleet.sglang.engine import EngineClient
from rlfleet.snapshot.format import validate_snapshot
from rlfleet.snapshot.writer import ExportState, write_hf_snapshot
from rlfleet.trainer.base import build_trainer

pytestmark = [pytest.mark.engines, pytest.mark.asyncio(loop_scope="session")]

HEALTH = HealthSpec(interval_seconds=2, timeout_seconds=5, failure_threshold=2)
RECOVERY = RecoverySpec(max_restarts_per_engine=3, max_restarts_per_run=6, backoff_base_seconds=0.5,
                        backoff_max_seconds=4, wait_all_alive_timeout_seconds=400)
# The whole transfer (begin .. end) is bounded by 10 s, and each step by its share of that (the one bucket:
# all of it, less what begin took): a stopped engine costs at most 10 s.
WEIGHT_SYNC = WeightSyncSpec(mode="broadcast", transfer_timeout_seconds=10, load_retries=1, verify_every=1)
PROMPT = "Hello"
QUICKSTART = Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml"


def metric(name: str, **labels: str) -> float:
    """A counter of this fleet as Prometheus scrapes it from the orchestrator."""
    return REGISTRY.get_sample_value(name, {"fleet": "rollout", **labels}) or 0.0


class Fleet:
    def __init__(self, runtime: FleetRuntime, backend: LocalBackend, snapshots: Path, trainer):
        self.runtime, self.backend, self.snapshots, self.trainer = runtime, backend, snapshots, trainer
        self.step = 0
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(trainer.model_dir)

    async def next_weights(self) -> tuple[Path, dict]:
        """Change the trainer's weights (as a step would) and export them: the snapshot and its tensors."""
        self.step += 1
        with torch.no_grad():
            gen = torch.Generator().manual_seed(self.step)
            for p in self.trainer.model.parameters():
                p.add_(0.3 * torch.randn(p.shape, generator=gen, dtype=p.dtype))
        return await asyncio.to_thread(export_step, self.trainer, self.snapshots / f"step_{self.step}", self.step,
                                       True)

    async def next_weights_to_write(self) -> tuple[Path, dict, Callable[[], Awaitable[Path]]]:
        """`next_weights`, the snapshot not written yet: what writes it (in a thread) when called."""
        path, _ = await self.next_weights()
        state = await asyncio.to_thread(self.trainer.state_for_export)
        state = ExportState(step=self.step, tensors=state.tensors, config=state.config, source_dir=state.source_dir)
        out = self.snapshots / f"step_{self.step}-later"
        return out, state.tensors, lambda: asyncio.to_thread(write_hf_snapshot, state, out)

    async def greedy(self, url: str) -> tuple[list[int], str]:
        payload = {"input_ids": self.prompt_ids, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        body = await self.runtime.engine_client(url).generate(payload, timeout_s=60)
        return body["output_ids"], body["meta_info"]["weight_version"]

    @property
    def prompt_ids(self) -> list[int]:
        return self.tokenizer.encode(PROMPT, add_special_tokens=False)

    def alive(self):
        return [e for e in self.backend.engines() if e.state is EngineState.ALIVE]


@pytest.fixture(scope="module")
def base_model(tmp_path_factory, tiny_model) -> Path:
    """A private copy of the tiny model (the shared cache copy may be rewritten by setup runs); a copy,
    not a generation in a fresh interpreter (importing torch alone takes seconds)."""
    out = tmp_path_factory.mktemp("model") / "tiny"
    shutil.copytree(tiny_model, out)
    return out


@pytest_asyncio.fixture(scope="module", loop_scope="session")
async def fleet(base_model, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("bcast-run")
    router = LocalRouter(run_dir)
    await router.start()
    backend = LocalBackend(engine=EngineSpec(model_path=str(base_model), device="cpu"), replicas=2,
                           recovery=RECOVERY, run_dir=run_dir, startup_timeout_s=300, min_ready=1)
    runtime = FleetRuntime(backend, router.url, health=HEALTH, weight_sync=WEIGHT_SYNC, reference=base_model)
    trainer = await asyncio.to_thread(build_trainer, "torch", base_model, 1e-3, seed=0, device="cpu")
    try:
        started = time.monotonic()
        await runtime.start()
        await runtime.bring_up("0", timeout=400)
        print(f"\n[fleet] 2 engines alive after {time.monotonic() - started:.1f} s")
        yield Fleet(runtime, backend, run_dir / "snapshots", trainer)
    finally:
        await runtime.stop()
        await router.stop()


async def test_quickstart_run_in_broadcast_mode(tmp_path: Path):
    """`rlfleet run` of the quickstart (shortened, no eval) with weightSync.mode broadcast."""
    import io

    from rlfleet.crds.loader import load_training_run
    from rlfleet.orchestrator.run.local import LocalRun, RunOptions
    from rlfleet.orchestrator.run.progress import ProgressReporter

    run = load_training_run(QUICKSTART)
    run.spec.trainer.steps = 8
    run.spec.eval = None
    run.spec.weight_sync.mode = "broadcast"
    out = io.StringIO()
    local = LocalRun(run, RunOptions(run_dir=tmp_path / "run", summary_path=tmp_path / "summary.json",
                                     metrics_port=0, progress=ProgressReporter(out, tty=False)))
    summary = await local.execute()
    print("\n" + "\n".join(line for line in out.getvalue().splitlines() if " sync " in line))
    assert len(summary.steps) == 8
    for record in summary.steps:
        assert record.sync["mode"] == "broadcast", record.sync
        assert record.engine_versions == {0: str(record.step), 1: str(record.step)}
        assert record.sync["checksums"] == {"match": 2}
        assert record.sync["seconds"] < record.seconds
        # The step's snapshot is written after the broadcast, beside the next step: no sync waits for it.
        assert "validate" not in record.sync["phases"], record.sync
    # The update group was built as the fleet came up: no sync built one.
    assert [r.step for r in summary.steps if "group" in r.sync["phases"]] == []
    data = summary.to_dict()
    assert data["weight_sync_fallbacks"] == 0
    print(f"[run] reward {data['reward_mean_first']} -> {data['reward_mean_last']}, "
          f"{summary.wall_seconds:.0f} s")
    assert data["reward_mean_last"] > data["reward_mean_first"]


async def test_broadcast_sync_serves_the_trainers_weights(fleet: Fleet):
    bytes_before = metric("rlfleet_weight_sync_bytes_total")
    matches_before = metric("rlfleet_weight_checksums_total", result="match")
    builds_before = metric("rlfleet_weight_update_group_builds_total")
    sent = 0
    for _ in range(2):
        path, tensors = await fleet.next_weights()
        result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)
        print(f"\n[broadcast] step {fleet.step}: {result.mode} {result.total_s:.2f} s phases "
              f"{ {k: round(v, 3) for k, v in result.phases.items()} }")
        assert result.mode == "broadcast" and result.fallback_reason is None
        assert "group" not in result.phases  # built when the fleet came up, for the trainer's layout
        assert result.bytes_broadcast == sum(t.numel() * t.element_size() for t in tensors.values())
        sent += result.bytes_broadcast
        assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
        assert [e.checksum for e in result.synced] == ["match", "match"]
        expected = await asyncio.to_thread(fleet.trainer.greedy_generate, fleet.prompt_ids, 8)
        for engine in result.synced:
            tokens, version = await fleet.greedy(engine.url)
            assert version == str(fleet.step)
            assert tokens == expected
    assert fleet.runtime.weights.groups_built == 1  # at bring-up; both syncs used it
    # What the dashboards show: the bytes sent once per sync (not per engine), a match per engine and sync.
    assert metric("rlfleet_weight_sync_bytes_total") - bytes_before == sent
    assert metric("rlfleet_weight_checksums_total", result="match") - matches_before == 4
    assert metric("rlfleet_weight_update_group_builds_total") == builds_before


async def test_a_broadcast_sync_ends_before_its_snapshot_is_written(fleet: Fleet):
    """The engines serve the step once the broadcast ends: the snapshot (the next fallback, what
    replacements start from) is written after it, not waited for, and becomes the fleet's reference
    once written."""
    weights = fleet.runtime.weights
    path, tensors = await fleet.next_weights()
    written = asyncio.get_running_loop().create_future()  # the snapshot's writer, held back
    calls: list[float] = []

    def write_snapshot() -> asyncio.Future:
        calls.append(time.monotonic())
        return written

    result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors, write_snapshot=write_snapshot)
    synced_at = time.monotonic()
    assert result.mode == "broadcast"
    assert len(calls) == 1 and calls[0] >= synced_at - result.total_s + result.phases["broadcast"]
    assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
    assert "validate" not in result.phases
    assert result.snapshot is not None and not result.snapshot.done()
    assert weights.reference is not None and weights.reference.source != str(path)
    written.set_result(path)
    manifest = await asyncio.wait_for(result.snapshot, 60)  # validated once written
    assert manifest.step == fleet.step
    assert weights.reference.source == str(path)

    # A snapshot that cannot be written: the engines serve the step all the same; the error is the
    # snapshot's, for the run loop to report.
    path, tensors = await fleet.next_weights()
    written = asyncio.get_running_loop().create_future()
    result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors, write_snapshot=lambda: written)
    assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
    assert result.snapshot is not None
    written.set_exception(OSError(28, "No space left on device"))
    with pytest.raises(OSError, match="No space left"):
        await asyncio.wait_for(result.snapshot, 60)
    assert weights.reference.source != str(path)


async def test_checksum_catches_bytes_the_trainer_did_not_send(fleet: Fleet):
    victim = fleet.alive()[0]
    _, tensors = await fleet.next_weights()
    name = sorted(tensors)[0]
    perturbed = dict(tensors)
    perturbed[name] = tensors[name] + 1.0
    buckets = plan.plan_buckets(plan.tensor_specs(perturbed), 1024**2)
    client = fleet.runtime.engine_client
    group = await UpdateGroup.build([victim], buckets=buckets, bounds=plan.StepBounds(10), client=client,
                                    address="127.0.0.1", backend="gloo", group_name="test-perturbed")
    try:
        await group.transfer(perturbed, "perturbed")
    finally:
        await group.destroy()
    outcome = EngineSyncOutcome(slot=victim.slot, incarnation=victim.incarnation, url=victim.url or "", ok=True)
    mismatches_before = metric("rlfleet_weight_checksums_total", result="mismatch")
    await fleet.runtime.weights.verify([outcome], tensors)
    print(f"\n[checksum] {outcome.error}")
    assert outcome.checksum == "mismatch" and not outcome.ok and outcome.marked_dead
    assert name in (outcome.error or "")
    assert metric("rlfleet_weight_checksums_total", result="mismatch") == mismatches_before + 1
    assert fleet.backend.engines()[victim.slot].state is not EngineState.ALIVE


class StopsAfterBegin(EngineClient):
    """The real client of one engine, which SIGSTOPs that engine once it has begun the weight update:
    the broadcast of the first bucket then finds it wedged."""

    def __init__(self, inner: EngineClient, pid: int):
        super().__init__(inner.session, inner.base_url, inner.timeouts)
        self.pid = pid

    async def begin_weight_update(self, timeout_s: float) -> tuple[bool, str]:
        answer = await super().begin_weight_update(timeout_s)
        os.killpg(self.pid, signal.SIGSTOP)
        return answer


async def test_sigstop_during_broadcast_marks_it_dead_and_the_others_finish_from_disk(fleet: Fleet, monkeypatch):
    path, tensors = await fleet.next_weights()
    await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)  # recreates the slot of the last test
    built = fleet.runtime.weights.groups_built
    victim = fleet.alive()[1]
    path, tensors = await fleet.next_weights()
    weights = fleet.runtime.weights
    fallbacks_before = metric("rlfleet_weight_sync_fallbacks_total", reason="transfer")
    real = weights._engine_client  # the sync's own client factory, wrapped for one engine
    monkeypatch.setattr(weights, "_engine_client",
                        lambda url: StopsAfterBegin(real(url), victim.pid) if url == victim.url else real(url))
    started = time.monotonic()
    try:
        result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)
    finally:
        monkeypatch.setattr(weights, "_engine_client", real)
        try:
            os.killpg(victim.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
    took = time.monotonic() - started
    print(f"\n[sigstop] {result.mode} in {took:.1f} s: {result.fallback_reason}")
    assert took < 60
    assert result.mode == "broadcast_fallback" and "bucket 1/1" in (result.fallback_reason or "")
    stopped = next(e for e in result.engines if e.slot == victim.slot)
    assert stopped.marked_dead and not stopped.ok
    assert [e.version for e in result.synced] == [str(fleet.step)]
    assert metric("rlfleet_weight_sync_fallbacks_total", reason="transfer") == fallbacks_before + 1
    # The next sync recreates it and broadcasts over a group rebuilt for the survivor and the replacement.
    path, tensors = await fleet.next_weights()
    result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)
    assert result.mode == "broadcast" and result.recovered_slots == [victim.slot]
    assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
    assert fleet.runtime.weights.groups_built == built + 1


async def test_sigkill_between_syncs_rebuilds_the_group(fleet: Fleet):
    built = fleet.runtime.weights.groups_built
    victim = fleet.alive()[0]
    os.killpg(victim.pid, signal.SIGKILL)
    async with asyncio.timeout(10):  # the exit is seen at once; the sync comes after it
        while fleet.backend.engines()[victim.slot].state is EngineState.ALIVE:  # noqa: ASYNC110 - a backend view
            await asyncio.sleep(0.05)
    path, tensors = await fleet.next_weights()
    result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)
    assert result.mode == "broadcast" and result.recovered_slots == [victim.slot]
    assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
    assert fleet.runtime.weights.groups_built == built + 1


async def test_broadcast_that_cannot_start_falls_back_or_fails(fleet: Fleet):
    weights = fleet.runtime.weights
    fallbacks_before = metric("rlfleet_weight_sync_fallbacks_total", reason="start")
    weights.broadcast_address = "192.0.2.1"  # not an address of this machine
    await weights.close()  # the next sync builds a group again, on the wrong address
    try:
        # The snapshot is written after the broadcast (as a run's step does): the fallback writes it first.
        path, tensors, write_snapshot = await fleet.next_weights_to_write()
        result = await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors, write_snapshot=write_snapshot)
        print(f"\n[no start] {result.mode}: {result.fallback_reason}")
        assert result.snapshot is None and validate_snapshot(path, expected_step=fleet.step).step == fleet.step
        assert result.mode == "broadcast_fallback" and "cannot start" in (result.fallback_reason or "")
        assert "snapshot_wait" in result.phases
        assert sorted(e.version for e in result.synced) == [str(fleet.step)] * 2
        assert not any(e.marked_dead for e in result.engines)
        assert metric("rlfleet_weight_sync_fallbacks_total", reason="start") == fallbacks_before + 1

        weights.spec = weights.spec.model_copy(update={"fallback_to_disk": False})
        path, tensors = await fleet.next_weights()
        with pytest.raises(WeightSyncFailed, match="cannot start"):
            await fleet.runtime.sync_weights(path, fleet.step, tensors=tensors)
    finally:
        weights.broadcast_address = "127.0.0.1"
        weights.spec = WEIGHT_SYNC

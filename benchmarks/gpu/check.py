"""The GPU check's steps (run by benchmarks/gpu/check.sh): megatron on CUDA, export, a CUDA engine, the syncs.

1. the megatron backend on the device (on CUDA: megatron's DDP + distributed optimizer), a few GRPO steps;
   a checkpoint of it (on CUDA the distributed optimizer's state gathered), restored into a new trainer:
   both train on alike;
2. the export of the trained weights as an HF snapshot;
3. an SGLang engine on the same model, started by the project's one engine command builder and run by
   the local fleet backend behind the router, as `rlfleet run` runs it; a disk weight sync of that
   snapshot through the orchestrator's WeightSync (validated, loaded, version read back, the served
   weights' checksums against the trainer's), and the engine's greedy tokens against the trainer's;
4. one more step, then a broadcast weight sync (NCCL on CUDA, gloo on CPU) into the engine, the served
   weights' checksum compared with the trainer's, greedy tokens again. NCCL needs a GPU per rank: on
   CUDA this runs only with 2 or more GPUs (the trainer and the broadcast on GPU 0, the engine on GPU 1),
   and the check says so when it cannot;
5. with 2 or more GPUs (or on CPU): the multi-rank layouts of check_ranks.py (megatron pipeline 2 and
   data parallel 2, torch data parallel 2 as FSDP replicas) against one rank of the same backend, each
   with a checkpoint across its ranks restored mid-run.

`--device cpu` runs the same steps on this machine's CPU (gloo), a check of the check itself.
`--backend torch` runs steps 1 to 4 with the torch backend instead of megatron's.
`--no-engine` leaves out steps 3 and 4, for an environment that has the trainer's packages but no SGLang
(a GPU machine with no package registry, say); the last line names every step that was not run.
Every figure is printed as `check: <what> <value>` when it is measured; the first failure stops the
check with a non-zero status and what failed.
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
sys.path.insert(0, str(REPO / "benchmarks" / "gpu"))  # check_ranks: the ranks import it by name

GREEDY_TOKENS = 6
NOT_RUN: list[str] = []  # the steps this machine or the options left out, named again on the last line


def say(what: str, value: object) -> None:
    print(f"check: {what} {value}", flush=True)


def not_run(step: str, why: str) -> None:
    NOT_RUN.append(step)
    say(step, f"NOT RUN: {why}")


def resolve(model: str) -> Path:
    from rlfleet.crds.derive import parse_tiny_model
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    tiny = parse_tiny_model(model)
    if tiny is None:
        return Path(model)
    return ensure_tiny_model(CACHE_DIR / "models" / tiny.cache_name, seed=tiny.seed, arch=tiny.arch)


def build(model_dir: Path, device: str, backend: str):
    import torch

    from rlfleet.trainer.base import build_trainer

    if device == "cuda":
        assert torch.cuda.is_available(), "torch sees no CUDA device"
        say("device", f"{torch.cuda.get_device_name(0)} ({torch.cuda.device_count()} visible)")
    started = time.perf_counter()
    trainer = build_trainer(backend, model_dir, lr=1e-4, seed=0, device=device)
    say(f"{backend} build s", f"{time.perf_counter() - started:.1f}")
    wrapper = getattr(trainer, "model", None)
    say(f"{backend} wrapper", f"{type(wrapper).__name__} (distributed optimizer: "
        f"{getattr(getattr(wrapper, 'ddp_config', None), 'use_distributed_optimizer', None)})")
    return trainer


def train(trainer, steps: int) -> None:
    from trainer_step import make_batch

    batch = make_batch(16, 8, 0)
    for _ in range(steps):
        metrics = trainer.train_step(batch)
        say(f"step {trainer.step}", f"loss {metrics['loss']:.5f} grad_norm {metrics['grad_norm']:.4f} "
            f"{metrics['step_seconds']:.3f} s {metrics['tokens'] / metrics['step_seconds']:.0f} tok/s")
        assert metrics["grad_norm"] > 0, "no gradient reached the parameters"


def checkpoint_round_trip(trainer, model_dir: Path, device: str, backend: str, work: Path) -> None:
    """A checkpoint of `trainer` written, restored into a new trainer; two more steps on each agree."""
    from trainer_step import make_batch

    from rlfleet.trainer import checkpoint as ckpt
    from rlfleet.trainer.base import build_trainer

    started = time.perf_counter()
    state = ckpt.capture_state(trainer)
    identity = ckpt.Identity(run="gpu-check", model_path=str(model_dir), backend=backend)
    info = ckpt.write_checkpoint(work / "checkpoints", identity=identity, step=trainer.step,
                                 weight_version=str(trainer.step), state=state, run_state={})
    say("checkpoint written s", f"{time.perf_counter() - started:.2f} ({ckpt.state_bytes(state) / 2**20:.1f} MiB, "
        f"optimizer {state['optimizer_format']}, sharded state gathered: {'optimizer_shards' in state})")
    started = time.perf_counter()
    resumed = build_trainer(backend, model_dir, lr=1e-4, seed=0, device=device)
    ckpt.restore_state(resumed, ckpt.load_shard(ckpt.validate(info.directory)))
    say("checkpoint restored s", f"{time.perf_counter() - started:.2f} (a new trainer built and restored)")
    assert resumed.step == trainer.step, f"restored step {resumed.step}, written at {trainer.step}"
    batch = make_batch(16, 8, 1)
    ours = [trainer.train_step(batch)["loss"] for _ in range(2)]
    theirs = [resumed.train_step(batch)["loss"] for _ in range(2)]
    worst = max(abs(a - b) / max(abs(a), 1e-6) for a, b in zip(ours, theirs, strict=True))
    say("after the restore, losses", f"{[round(x, 5) for x in theirs]} vs {[round(x, 5) for x in ours]} "
        f"(max relative difference {worst:.2e})")
    # The second step checks the optimizer's moments too. CUDA kernels may sum in another order.
    assert worst < (1e-5 if device == "cpu" else 1e-2), "the restored trainer trains differently"
    del resumed


async def compare_greedy(runtime, trainer, version: str, exact: bool) -> None:
    from rlfleet.trainer import grpo

    (engine,) = runtime.backend.engines()
    prompt = list(b"abc=")
    body = await runtime.engine_client(engine.url).generate(
        {"input_ids": prompt, "return_logprob": True,
         "sampling_params": {"temperature": 0, "max_new_tokens": GREEDY_TOKENS, "ignore_eos": True}})
    sample = grpo.sample_from_generate(prompt, body)
    ours = await asyncio.to_thread(trainer.greedy_generate, prompt, GREEDY_TOKENS)
    same = sum(a == b for a, b in zip(sample.response_ids, ours, strict=False))
    say("greedy tokens engine vs trainer", f"{list(sample.response_ids)} vs {ours} ({same}/{GREEDY_TOKENS} equal)")
    assert sample.weight_version == version, f"generation reported version {sample.weight_version}, not {version}"
    # float32 on CPU: the same tokens. bf16 on CUDA with other kernels: agreement is reported, not required.
    assert not exact or list(sample.response_ids) == ours, "the engine's greedy tokens differ from the trainer's"


def describe_sync(result) -> str:
    phases = " ".join(f"{name} {seconds:.2f}" for name, seconds in result.phases.items())
    return f"{result.total_s:.2f} s ({phases})"


async def serve_and_sync(trainer, model_dir: Path, snapshot: Path, device: str, work: Path) -> None:
    import torch

    from rlfleet.crds.specs import EngineSpec, HealthSpec, RecoverySpec, WeightSyncSpec
    from rlfleet.orchestrator.fleet.local_backend import LocalBackend
    from rlfleet.orchestrator.fleet.local_router import LocalRouter
    from rlfleet.orchestrator.fleet.runtime import FleetRuntime
    from rlfleet.sglang.launch import ServedWeights
    from rlfleet.snapshot.writer import write_hf_snapshot

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    # With two GPUs the engine gets one of its own (the trainer and the broadcast keep GPU 0), as a local
    # run places them; with one it shares GPU 0 with the trainer and NCCL cannot join the two.
    broadcast = device == "cpu" or gpus >= 2
    if device == "cuda":
        engine = EngineSpec(model_path=str(model_dir), device="cuda", mem_fraction_static=0.3,
                            extra_args=["--dtype", "bfloat16"])
    else:
        engine = EngineSpec(model_path=str(model_dir), device="cpu", max_total_tokens=2048)
    disk = WeightSyncSpec(mode="disk", transfer_timeout_seconds=300)
    router = LocalRouter(work / "fleet")
    router_url = await router.start()
    backend = LocalBackend(engine=engine, replicas=1, recovery=RecoverySpec(wait_all_alive_timeout_seconds=300),
                           run_dir=work / "fleet", startup_timeout_s=300,
                           gpu_bases=(1,) if broadcast and device == "cuda" else ())
    runtime = FleetRuntime(backend, router_url, health=HealthSpec(interval_seconds=30, timeout_seconds=60),
                           weight_sync=disk, reference=model_dir, broadcast_device=device,
                           served=ServedWeights.of(engine))
    try:
        started = time.perf_counter()
        await runtime.start()
        await runtime.bring_up("0", timeout=300)
        where = "GPU 1" if backend.gpu_bases else ("GPU 0, beside the trainer" if device == "cuda" else "CPU")
        say("engine ready s", f"{time.perf_counter() - started:.1f} (on {where})")

        # The snapshot's weights as the trainer holds them: the sync compares the engine's checksums with
        # them (on CUDA, as SGLang's own model code holds them: fused q/k/v and gate/up).
        state = await asyncio.to_thread(trainer.state_for_export)
        result = await runtime.sync_weights(snapshot, trainer.step, tensors=state.tensors)
        say("disk weight sync", describe_sync(result))
        (outcome,) = result.engines
        assert outcome.ok, f"the disk sync failed: {outcome.error}"
        say("weight version read back", outcome.version)
        assert result.verified and outcome.checksum == "match", f"the served weights' checksum: {outcome.checksum}"
        say("served checksum equals the trainer's (disk sync)", "yes")
        await compare_greedy(runtime, trainer, str(trainer.step), exact=device == "cpu")

        if not broadcast:
            not_run("broadcast weight sync", f"NCCL needs a GPU per rank and this machine has {gpus}")
            return
        weights = runtime.weights
        assert weights is not None
        weights.spec = disk.model_copy(update={"mode": "broadcast", "verify_every": 1})
        for _ in range(2):  # the first builds the update group
            train(trainer, 1)
            state = await asyncio.to_thread(trainer.state_for_export)
            out = work / f"step_{trainer.step}"
            await asyncio.to_thread(write_hf_snapshot, state, out)  # the fallback's snapshot
            result = await runtime.sync_weights(out, trainer.step, tensors=state.tensors)
            say(f"broadcast weight sync ({'nccl' if device == 'cuda' else 'gloo'})",
                f"{describe_sync(result)}, {result.bytes_broadcast / 2**20:.1f} MiB, mode {result.mode}")
            assert result.mode == "broadcast", f"the broadcast fell back to disk: {result.fallback_reason}"
            assert result.verified, "the served weights' checksum was not compared"
            (outcome,) = result.engines
            assert outcome.ok and outcome.version == str(trainer.step), outcome
            assert outcome.checksum == "match", f"the served weights' checksum: {outcome.checksum}"
        say("served checksum equals the trainer's", "yes")
        await compare_greedy(runtime, trainer, str(trainer.step), exact=device == "cpu")
    finally:
        await runtime.stop()
        await router.stop()


def ranks_check(model_dir: Path, device: str) -> None:
    import torch
    from check_ranks import check_layouts

    gpus = torch.cuda.device_count() if device == "cuda" else 0
    if device == "cuda" and gpus < 2:
        not_run("ranks: pipeline 2 and data parallel 2", f"one GPU per rank and this machine has {gpus}")
        return
    # float32 on CPU: the same sums; bf16 on CUDA: the stages' and replicas' sums round differently.
    check_layouts(model_dir, device, say, tolerance=1e-4 if device == "cpu" else 2e-2)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny://llama?seed=0")
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda",
                        help="cpu: the same steps on this machine's CPU (gloo), a check of the check")
    parser.add_argument("--backend", choices=("megatron", "torch"), default="megatron",
                        help="the trainer backend of steps 1 to 4 (step 5, the rank layouts, is megatron's)")
    parser.add_argument("--no-engine", action="store_true",
                        help="leave out the SGLang engine and the weight syncs (steps 3 and 4), where SGLang "
                             "is not installed; the check says they were not run")
    args = parser.parse_args()
    started = time.perf_counter()
    model_dir = resolve(args.model)
    say("model", model_dir)
    trainer = build(model_dir, args.device, args.backend)
    train(trainer, args.steps)
    if args.device == "cuda":
        import torch

        say("peak GPU memory GiB", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}")
    with tempfile.TemporaryDirectory() as tmp:
        checkpoint_round_trip(trainer, model_dir, args.device, args.backend, Path(tmp))
        t = time.perf_counter()
        snapshot = trainer.export_hf(Path(tmp) / f"step_{trainer.step}", trainer.step)
        say("export s", f"{time.perf_counter() - t:.2f}")
        if args.no_engine:
            not_run("SGLang engine, disk and broadcast weight syncs", "--no-engine")
        else:
            asyncio.run(serve_and_sync(trainer, model_dir, snapshot, args.device, Path(tmp)))
    if args.backend == "megatron":
        ranks_check(model_dir, args.device)
    else:
        not_run("ranks: pipeline 2 and data parallel 2", "megatron's layouts, and the trainer is --backend torch")
    say("total s", f"{time.perf_counter() - started:.1f}")
    print("check: PASSED" + (f" (not run: {'; '.join(NOT_RUN)})" if NOT_RUN else ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

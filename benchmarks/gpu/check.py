"""The GPU check's steps (run by benchmarks/gpu/check.sh): megatron on CUDA, export, a CUDA engine, a disk sync.

Every figure is printed as `check: <what> <value>` when it is measured; the first failure stops the
check with a non-zero status and what failed.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))


def say(what: str, value: object) -> None:
    print(f"check: {what} {value}", flush=True)


def resolve(model: str) -> Path:
    from rlfleet.crds.derive import parse_tiny_model
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    tiny = parse_tiny_model(model)
    if tiny is None:
        return Path(model)
    return ensure_tiny_model(CACHE_DIR / "models" / tiny.cache_name, seed=tiny.seed, arch=tiny.arch)


def train(model_dir: Path, steps: int, out: Path):
    import torch
    from trainer_step import make_batch

    from rlfleet.trainer.base import build_trainer

    assert torch.cuda.is_available(), "torch sees no CUDA device"
    say("device", torch.cuda.get_device_name(0))
    started = time.perf_counter()
    trainer = build_trainer("megatron", model_dir, lr=1e-4, seed=0, device="cuda")
    say("megatron build s", f"{time.perf_counter() - started:.1f}")
    wrapper = getattr(trainer, "model", None)
    say("megatron wrapper", f"{type(wrapper).__name__} (distributed optimizer: "
        f"{getattr(getattr(wrapper, 'ddp_config', None), 'use_distributed_optimizer', None)})")
    batch = make_batch(16, 8, 0)
    for step in range(1, steps + 1):
        metrics = trainer.train_step(batch)
        say(f"step {step}", f"loss {metrics['loss']:.5f} grad_norm {metrics['grad_norm']:.4f} "
            f"{metrics['step_seconds']:.3f} s {metrics['tokens'] / metrics['step_seconds']:.0f} tok/s")
        assert metrics["grad_norm"] > 0, "no gradient reached the parameters"
    say("peak GPU memory GiB", f"{torch.cuda.max_memory_allocated() / 2**30:.2f}")
    started = time.perf_counter()
    snapshot = trainer.export_hf(out / f"step_{trainer.step}", trainer.step)
    say("export s", f"{time.perf_counter() - started:.2f}")
    return trainer, snapshot


def start_engine(model_dir: Path, log: Path) -> tuple[subprocess.Popen, int]:
    """A CUDA SGLang engine on the model, started by the project's one engine command builder."""
    from rlfleet.crds.specs import EngineSpec
    from rlfleet.sglang.launch import build_engine_launch
    from rlfleet.util.ports import free_port

    port = free_port("127.0.0.1")
    launch = build_engine_launch(EngineSpec(model_path=str(model_dir), device="cuda", mem_fraction_static=0.3,
                                            extra_args=["--dtype", "bfloat16"]),
                                 host="127.0.0.1", port=port)
    with log.open("w") as out:
        engine = subprocess.Popen(launch.argv(sys.executable), env={**os.environ, **launch.env}, stdout=out,
                                  stderr=subprocess.STDOUT, start_new_session=True)
    return engine, port


async def serve_and_sync(engine: subprocess.Popen, port: int, snapshot: Path, version: str, trainer,
                         log: Path) -> None:
    import aiohttp

    from rlfleet.sglang.engine import EngineClient
    from rlfleet.trainer import grpo

    started = time.perf_counter()
    try:
        async with aiohttp.ClientSession() as session:
            client = EngineClient(session, f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 300
            while True:
                assert engine.poll() is None, f"the engine exited with {engine.returncode}; see {log}"
                assert time.monotonic() < deadline, f"the engine was not healthy within 300 s; see {log}"
                try:
                    await client.health_generate(timeout_s=5)
                    break
                except Exception:  # not up yet
                    await asyncio.sleep(1)
            say("CUDA engine ready s", f"{time.perf_counter() - started:.1f}")
            started = time.perf_counter()
            result = await client.update_weights_from_disk(str(snapshot), version)
            assert result.success, f"update_weights_from_disk failed: {result.message}"
            say("disk weight sync s", f"{time.perf_counter() - started:.2f}")
            served = await client.weight_version()
            say("weight version read back", served)
            assert served == version, f"the engine serves {served}, expected {version}"
            prompt = list(b"abc=")
            body = await client.generate({"input_ids": prompt, "return_logprob": True,
                                          "sampling_params": {"temperature": 0, "max_new_tokens": 6,
                                                              "ignore_eos": True}})
            sample = grpo.sample_from_generate(prompt, body)
            ours = await asyncio.to_thread(trainer.greedy_generate, prompt, 6)
            # bf16 on both sides with different kernels: report agreement rather than require it.
            same = sum(a == b for a, b in zip(sample.response_ids, ours, strict=False))
            say("greedy tokens engine vs trainer", f"{list(sample.response_ids)} vs {ours} ({same}/6 equal)")
            assert sample.weight_version == version, "generation did not report the synced version"
    finally:
        engine.terminate()
        try:
            engine.wait(timeout=30)
        except subprocess.TimeoutExpired:
            engine.kill()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny://llama?seed=0")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    started = time.perf_counter()
    model_dir = resolve(args.model)
    say("model", model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        trainer, snapshot = train(model_dir, args.steps, Path(tmp))
        log = Path(tmp) / "engine.log"
        engine, port = start_engine(model_dir, log)
        asyncio.run(serve_and_sync(engine, port, snapshot, str(trainer.step), trainer, log))
    say("total s", f"{time.perf_counter() - started:.1f}")
    print("check: PASSED")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

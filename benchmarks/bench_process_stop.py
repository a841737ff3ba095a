"""Benchmark: seconds a stop of a local SGLang CPU engine and of an sglang-router takes.

Every run ends by stopping its engines and routers, and every recreated engine's predecessor is stopped
first, so these seconds are paid by every `rlfleet run` and every test over real engines.

- engine: a CPU engine with the launch builder's environment (SGLang's crash diagnostics off: they
  sleep 5 s "to let GPU activity settle" before a py-spy dump and a CUDA coredump) against the baseline,
  the same engine with SGLang's defaults (`SGLANG_PYSPY_DUMP_BEFORE_CRASH=1`,
  `SGLANG_CUDA_COREDUMP_BEFORE_CRASH=1`), both started side by side and stopped one after the other
  the way the local backend stops them (SIGTERM to the group, SIGKILL after its grace);
- router: `LocalRouter.stop` (SIGTERM, `ROUTER_STOP_GRACE_S`, then SIGKILL) against the baseline, the
  time an idle router takes to exit on SIGTERM alone (bounded by 30 s).

Run: python benchmarks/bench_process_stop.py [--repeats 2]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import tempfile
import time
from pathlib import Path

from rlfleet.crds.specs import EngineSpec, EnvVarSpec
from rlfleet.orchestrator.fleet.local_router import ROUTER_STOP_GRACE_S, LocalRouter
from rlfleet.sglang.engine import EngineClient
from rlfleet.sglang.http import client_session
from rlfleet.sglang.launch import build_engine_launch
from rlfleet.trainer.tiny import ensure_tiny_model
from rlfleet.util.binaries import CACHE_DIR, python_executable
from rlfleet.util.ports import allocate_endpoint
from rlfleet.util.procs import ManagedProcess

ENGINE_STOP_GRACE_S = 8.0  # LocalBackend's default
DEFAULTS = [EnvVarSpec(name="SGLANG_PYSPY_DUMP_BEFORE_CRASH", value="1"),
            EnvVarSpec(name="SGLANG_CUDA_COREDUMP_BEFORE_CRASH", value="1")]


async def start_engine(model: Path, log_dir: Path, name: str, env: list[EnvVarSpec]) -> ManagedProcess:
    host, port = allocate_endpoint()
    launch = build_engine_launch(EngineSpec(model_path=str(model), device="cpu", env=env), host=host, port=port)
    process = ManagedProcess(name, launch.argv(python_executable()), log_path=log_dir / f"{name}.log",
                             env=launch.env, cwd=str(log_dir), die_with_parent=True)
    await process.start()
    async with client_session() as session:
        client = EngineClient(session, f"http://{host}:{port}")
        deadline = time.monotonic() + 900
        while True:
            try:
                await client.health_generate(timeout_s=10)
                return process
            except Exception:
                if process.returncode is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"{name} did not start; log {process.log_path}") from None
                await asyncio.sleep(0.25)


async def timed_stop(process: ManagedProcess, grace_s: float) -> float:
    started = time.monotonic()
    await process.stop(grace_s=grace_s)
    return time.monotonic() - started


async def engine_stops(model: Path, log_dir: Path, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"builder": [], "sglang_defaults": []}
    for i in range(repeats):
        ours, baseline = await asyncio.gather(start_engine(model, log_dir, f"builder-{i}", []),
                                              start_engine(model, log_dir, f"defaults-{i}", DEFAULTS))
        out["builder"].append(await timed_stop(ours, ENGINE_STOP_GRACE_S))
        out["sglang_defaults"].append(await timed_stop(baseline, ENGINE_STOP_GRACE_S))
    return out


async def router_stops(log_dir: Path, repeats: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"local_router_stop": [], "sigterm_alone": []}
    for i in range(repeats):
        router = LocalRouter(log_dir / f"router-{i}")
        await router.start()
        started = time.monotonic()
        await router.stop()
        out["local_router_stop"].append(time.monotonic() - started)

        baseline = LocalRouter(log_dir / f"router-baseline-{i}")
        await baseline.start()
        assert baseline.process is not None and baseline.process.pid is not None
        started = time.monotonic()
        os.killpg(baseline.process.pid, signal.SIGTERM)
        try:
            await asyncio.wait_for(baseline.process.wait(), 30)
        except TimeoutError:
            pass
        out["sigterm_alone"].append(time.monotonic() - started)
        await baseline.stop()
    return out


def report(kind: str, figures: dict[str, list[float]], ours: str, base: str) -> dict:
    mean_ours, mean_base = statistics.mean(figures[ours]), statistics.mean(figures[base])
    print(f"{kind}: {ours} {mean_ours:.2f} s (runs {[round(x, 2) for x in figures[ours]]}), "
          f"baseline {base} {mean_base:.2f} s (runs {[round(x, 2) for x in figures[base]]}), "
          f"ratio {mean_ours / mean_base:.2f}")
    return {"kind": kind, ours: figures[ours], base: figures[base], "ratio": mean_ours / mean_base}


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    model = ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0", seed=0)
    with tempfile.TemporaryDirectory(prefix="rlfleet-bench-stop-") as tmp:
        log_dir = Path(tmp)
        results = [report("router", await router_stops(log_dir, args.repeats), "local_router_stop", "sigterm_alone"),
                   report("engine", await engine_stops(model, log_dir, args.repeats), "builder", "sglang_defaults")]
    print(f"router stop grace {ROUTER_STOP_GRACE_S:g} s; engine stop grace {ENGINE_STOP_GRACE_S:g} s")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    asyncio.run(main())

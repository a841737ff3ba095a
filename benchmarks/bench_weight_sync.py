"""Benchmark: one weight sync, disk (before and after hashing once) and broadcast, against floors.

A generated Llama of about `--size-mb` MiB (float32, default ~1 GiB), real SGLang CPU engines (1, then 2)
behind a real router, the orchestrator's own WeightSync. Per sync the phases are printed:

- disk, before: the snapshot written with safetensors' save_file and sealed by reading every file back
  to hash it, validated with a full re-hash (`diskVerify: full`), loaded by every engine;
- disk, after: the snapshot hashed while it is written, validated from the manifest (`diskVerify:
  manifest`), loaded by every engine;
- for both, `sync` is what the weight sync itself takes once the snapshot is written (validate, pause,
  every engine's load, read-back): its overhead is measured against the bare load; `total` adds the
  trainer's export (and, before, the hashing);
- broadcast: copied into the shared buffer (each bucket after the first while the one before is on the
  wire) and broadcast over the gloo update group into every engine (the group is built by a first,
  unmeasured sync), versions read back; then once more with the checksum verification on, to give its
  cost;
- the trainer's export (a copy of its weights) and the broadcast: exported into tensors of its own, then
  copied into the broadcast's shared buffer, against exported straight into the buffer (the run loop's
  way once the group exists);
- a broadcast step's export and sync: the snapshot written, then the broadcast, against the snapshot
  written after the broadcast (what the run loop does): `held` is how long the step waits (until every
  engine serves the weights), `write_after` the write, which in a run overlaps the next step.

Floors measured in the same run: the bare `update_weights_from_disk` of an unvalidated snapshot already
in the page cache (every engine at once), and a raw gloo broadcast of the same bytes between two
processes (measured just before each fleet's syncs; with several engines also from one process to as
many others as there are engines, the update group's shape, and the sync is given against it too). Every
figure is the median of `--repeat` syncs (or floor samples), with the fastest beside it; each ratio is
given median against median and best against best. Goals: broadcast sync <= 1.5x the raw broadcast (the
run loop's sync: the weights exported into the buffer); disk sync beyond the bare load <= 25%.
The trainer's weights are in memory, as a trainer's are.

Run: python -P benchmarks/bench_weight_sync.py [--size-mb 1024] [--engines 1 2] [--bucket-mb N]
[--malloc both|jemalloc|glibc] [--repeat 3] [--json] (`--bucket-mb`: the broadcast's bucketMegabytes, default the
field's default; `--malloc`: the engines' allocator, by default every engine count is measured with
glibc's malloc, the baseline, then with jemalloc, which CPU engines run with where the machine has
it). Each broadcast row also gives rank 0's own collective seconds (`rank0`): the rest of `broadcast`
is the engines' handling of the buckets (receive buffer, loading into the model) and the HTTP calls
around them.
"""
from __future__ import annotations

import argparse
import asyncio
import functools
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RAW_BROADCAST = r"""
import os, sys, time, torch, torch.distributed as dist
rank, port, nbytes, world = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[5])
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
data = torch.ones(nbytes, dtype=torch.uint8) if rank == 0 else torch.empty(nbytes, dtype=torch.uint8)
dist.barrier()
samples = []
for _ in range(int(sys.argv[4]) + 1):  # the first touches the receiver's pages: not a sample
    dist.barrier()
    t = time.perf_counter()
    dist.broadcast(data, src=0)
    dist.barrier()
    samples.append(time.perf_counter() - t)
if rank == 1:
    print(" ".join(map(str, samples[1:])))
dist.destroy_process_group()
"""


def make_model(out: Path, size_mb: int) -> Path:
    """A Llama of about size_mb MiB (float32) with the tiny model's byte tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from rlfleet.trainer.tiny import SPECIAL_TOKENS, VOCAB_SIZE, build_tokenizer

    hidden, inter = 1024, 2816
    per_layer = 4 * hidden * hidden + 3 * hidden * inter  # q, k, v, o + gate, up, down
    layers = max(1, round(size_mb * 2**20 / 4 / per_layer))
    ids = {name: 256 + i for i, name in enumerate(SPECIAL_TOKENS)}
    config = LlamaConfig(vocab_size=VOCAB_SIZE, hidden_size=hidden, intermediate_size=inter,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=16,
                         max_position_embeddings=256, tie_word_embeddings=True, eos_token_id=ids["<|endoftext|>"],
                         bos_token_id=ids["<|bos|>"], pad_token_id=ids["<|pad|>"], torch_dtype="float32")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).to(torch.float32)
    model.save_pretrained(out, safe_serialization=True)
    build_tokenizer().save_pretrained(out)
    for path in out.iterdir():
        path.chmod(0o644)
    return out


def export_before(state, out: Path) -> dict[str, float]:
    """The export as it was: save_file, then the seal reads every file back to hash it."""
    from safetensors.torch import save_file

    from rlfleet.snapshot.format import finalize_snapshot
    from rlfleet.snapshot.writer import WEIGHTS_NAME

    out.mkdir(parents=True, exist_ok=True)
    t = time.perf_counter()
    save_file(dict(state.tensors), str(out / WEIGHTS_NAME), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(dict(state.config)))
    for path in state.source_dir.iterdir():
        if path.name.startswith("tokenizer") or path.name == "special_tokens_map.json":
            (out / path.name).write_bytes(path.read_bytes())
    written = time.perf_counter() - t
    t = time.perf_counter()
    finalize_snapshot(out, state.step)
    return {"export": written, "hash": time.perf_counter() - t}


def export_after(state, out: Path) -> dict[str, float]:
    from rlfleet.snapshot.writer import write_hf_snapshot

    t = time.perf_counter()
    write_hf_snapshot(state, out)
    return {"export": time.perf_counter() - t, "hash": 0.0}  # hashed while written


def export_copy(tensors: dict, into: dict | None) -> dict:
    """The trainer's export of weights it holds on the CPU (`Trainer.state_for_export`): a copy of each,
    into `into`'s tensor of that name where one fits."""
    out = {}
    for name, t in tensors.items():
        target = (into or {}).get(name)
        if target is not None and target.shape == t.shape and target.dtype == t.dtype:
            out[name] = target.copy_(t)
        else:
            out[name] = t.to("cpu", copy=True)
    return out


def raw_broadcast_s(nbytes: int, repeat: int, world: int = 2) -> list[float]:
    """`repeat` timed broadcasts of nbytes from one of `world` fresh processes to the others (after one
    untimed)."""
    from rlfleet.util.ports import free_port

    port = str(free_port())
    procs = [subprocess.Popen([sys.executable, "-c", RAW_BROADCAST, str(rank), port, str(nbytes), str(repeat),
                               str(world)], stdout=subprocess.PIPE, text=True) for rank in range(world)]
    out = [p.communicate(timeout=600)[0] for p in procs]
    return [float(x) for x in out[1].strip().splitlines()[-1].split()]


def summarize(samples: list[dict[str, float]], key: str = "sync") -> dict[str, float]:
    """The sample of median `key`, with the best `key` beside it (`best`): the floors are given the same
    two ways, so each ratio compares like with like."""
    ordered = sorted(samples, key=lambda row: row[key])
    return {**ordered[(len(ordered) - 1) // 2], "best": ordered[0][key]}


def median(values: list[float]) -> float:
    return sorted(values)[(len(values) - 1) // 2]


async def measure(model: Path, work: Path, engines: int, tensors: dict, nbytes: int,
                  bucket_mb: int | None = None, malloc: str = "jemalloc", repeat: int = 3) -> dict:
    import torch

    from rlfleet.crds.specs import EngineSpec, HealthSpec, RecoverySpec, WeightSyncSpec
    from rlfleet.orchestrator.fleet.local_backend import LocalBackend
    from rlfleet.orchestrator.fleet.local_router import LocalRouter
    from rlfleet.orchestrator.fleet.runtime import FleetRuntime
    from rlfleet.snapshot.writer import ExportState, config_with_dtype, write_hf_snapshot
    from rlfleet.trainer.base import read_hf_config

    run_dir = work / f"fleet-{engines}-{malloc}"
    router = LocalRouter(run_dir)
    await router.start()
    backend = LocalBackend(engine=EngineSpec(model_path=str(model), device="cpu", max_total_tokens=2048),
                           replicas=engines, recovery=RecoverySpec(wait_all_alive_timeout_seconds=900),
                           run_dir=run_dir, startup_timeout_s=900)
    if malloc == "glibc":  # what the engines ran with before (and where the machine has no jemalloc)
        backend.malloc_library = None
    elif backend.malloc_library is None:
        raise SystemExit("no libjemalloc.so.2 on this machine (scripts/setup.sh installs it): use --malloc glibc")
    spec = WeightSyncSpec(mode="broadcast", transfer_timeout_seconds=900, verify_every=0,
                          **({"bucket_megabytes": bucket_mb} if bucket_mb else {}))
    runtime = FleetRuntime(backend, router.url, health=HealthSpec(interval_seconds=30, timeout_seconds=60,
                                                                  failure_threshold=5),
                           weight_sync=spec, reference=model)
    config = config_with_dtype(read_hf_config(model), torch.float32)
    rows: dict[str, dict[str, float]] = {}
    step = 0

    def state(n: int) -> ExportState:
        return ExportState(step=n, tensors=tensors, config=config, source_dir=model)

    try:
        await runtime.start()
        await runtime.bring_up("0", timeout=900)
        weights = runtime.weights
        assert weights is not None

        # Floor: every engine loads an unvalidated snapshot already in the page cache.
        step += 1
        floor_dir = work / f"floor-{engines}"
        await asyncio.to_thread(export_after, state(step), floor_dir)
        await asyncio.to_thread(lambda: (floor_dir / "model.safetensors").read_bytes() and None)
        clients = [runtime.engine_client(e.url or "") for e in backend.engines()]
        bare_loads = []
        for _ in range(repeat):
            step += 1
            t = time.perf_counter()
            await asyncio.gather(*(c.update_weights_from_disk(str(floor_dir), str(step), timeout_s=900)
                                   for c in clients))
            bare_loads.append(time.perf_counter() - t)

        for label, exporter, verify in (("disk before", export_before, "full"), ("disk after", export_after,
                                                                                  "manifest")):
            weights.spec = spec.model_copy(update={"mode": "disk", "disk_verify": verify})
            samples = []
            for _ in range(repeat):
                step += 1
                out = work / f"{label.replace(' ', '-')}-{engines}-{step}"
                phases = await asyncio.to_thread(exporter, state(step), out)
                result = await runtime.sync_weights(out, step)
                samples.append({**phases, "validate": result.validate_s, "load": result.phases.get("load", 0.0),
                                "sync": result.total_s, "total": phases["export"] + phases["hash"] + result.total_s})
                await asyncio.to_thread(shutil.rmtree, out)
            rows[label] = summarize(samples)

        weights.spec = spec
        step += 1
        out = work / f"bcast-{engines}-{step}"
        await asyncio.to_thread(export_after, state(step), out)
        await runtime.sync_weights(out, step, tensors=tensors)  # builds the group
        await asyncio.to_thread(shutil.rmtree, out)
        for label, every in (("broadcast", 0), ("broadcast+verify", 1)):
            weights.spec = spec.model_copy(update={"verify_every": every})
            samples = []
            for _ in range(repeat):
                step += 1
                out = work / f"bcast-{engines}-{step}"
                await asyncio.to_thread(export_after, state(step), out)
                result = await runtime.sync_weights(out, step, tensors=tensors)
                assert result.mode == "broadcast", result.fallback_reason
                await asyncio.to_thread(shutil.rmtree, out)
                p = result.phases
                samples.append({"fill": p.get("fill", 0.0), "broadcast": p.get("begin", 0) + p.get("broadcast", 0) +
                                p.get("end", 0), "rank0": result.rank0_s, "read_back": p.get("read_back", 0.0),
                                "verify": p.get("verify", 0.0), "sync": result.total_s - result.validate_s})
            rows[label] = summarize(samples)

        # The trainer's export (its copy of the weights off the device) and the broadcast: into tensors of
        # its own, which the broadcast then copies into its shared buffer, against straight into the
        # buffer's views (what the run loop does once the group exists: no copy left for the broadcast).
        weights.spec = spec
        for label, into_buffer in (("export, broadcast", False), ("export into buffer", True)):
            samples = []
            for _ in range(repeat):
                step += 1
                out = work / f"bcast-{engines}-{step}"
                await asyncio.to_thread(export_after, state(step), out)
                t = time.perf_counter()
                views = weights.export_views() if into_buffer else None
                assert (views is not None) is into_buffer, "the group is built"
                exported = await asyncio.to_thread(export_copy, tensors, views)
                export_s = time.perf_counter() - t
                result = await runtime.sync_weights(out, step, tensors=exported)
                assert result.mode == "broadcast", result.fallback_reason
                del exported
                await asyncio.to_thread(shutil.rmtree, out)
                p = result.phases
                sync_s = result.total_s - result.validate_s
                samples.append({"export": export_s, "fill": p.get("fill", 0.0),
                                "broadcast": p.get("begin", 0) + p.get("broadcast", 0) + p.get("end", 0),
                                "rank0": result.rank0_s, "sync": sync_s, "total": export_s + sync_s})
            rows[label] = summarize(samples)

        # A training step's export and sync in broadcast mode: the snapshot written first, then broadcast
        # (as before), against the snapshot written after the broadcast (the run loop's way now: the
        # step is held until the engines serve it; the write overlaps the next step).
        weights.spec = spec
        samples = []
        for _ in range(repeat):
            step += 1
            out = work / f"step-seq-{engines}-{step}"
            t = time.perf_counter()
            await asyncio.to_thread(export_after, state(step), out)
            result = await runtime.sync_weights(out, step, tensors=tensors)
            samples.append({"total": time.perf_counter() - t})
            await asyncio.to_thread(shutil.rmtree, out)
        rows["step, write then sync"] = summarize(samples, "total")
        samples = []
        for _ in range(repeat):
            step += 1
            out = work / f"step-beside-{engines}-{step}"
            t = time.perf_counter()
            write = functools.partial(asyncio.to_thread, write_hf_snapshot, state(step), out)
            result = await runtime.sync_weights(out, step, tensors=tensors, write_snapshot=write)
            assert result.mode == "broadcast", result.fallback_reason
            held = time.perf_counter() - t  # what the step waits: the engines serve the step now
            assert result.snapshot is not None, "a broadcast hands over the snapshot's write"
            await result.snapshot  # in a run: beside the next step's rollouts and training
            samples.append({"held": held, "write_after": time.perf_counter() - t - held,
                            "total": time.perf_counter() - t})
            await asyncio.to_thread(shutil.rmtree, out)
        rows["step, sync then write"] = summarize(samples, "held")
    finally:
        await runtime.stop()
        await router.stop()
    return {"engines": engines, "bytes": nbytes, "bucket_mb": spec.bucket_megabytes,
            "bare_load_s": median(bare_loads), "bare_load_best_s": min(bare_loads), "rows": rows}


def report(figures: dict) -> None:
    engines = figures["engines"]
    gib = figures["bytes"] / 2**30
    raw, raw_best = median(figures["raw_broadcast_s"]), min(figures["raw_broadcast_s"])
    bare, bare_best = figures["bare_load_s"], figures["bare_load_best_s"]
    print(f"\n== {engines} engine(s), {gib:.2f} GiB float32, buckets of {figures['bucket_mb']} MiB, "
          f"engines on {figures['malloc']} malloc; each figure the median of {figures['repeat']} syncs, "
          f"`best` the fastest ==")
    print(f"floor: bare update_weights_from_disk (page cache) {bare:.2f} s (best {bare_best:.2f}); "
          f"raw gloo broadcast of the same bytes (2 processes) {raw:.2f} s (best {raw_best:.2f})")
    for label, row in figures["rows"].items():
        cells = "  ".join(f"{k} {v:.2f}" for k, v in row.items())
        if label.startswith("step"):
            before = figures["rows"]["step, write then sync"]["total"]
            ratio = f"{row.get('held', row['total']) / before:.2f}x the write-then-sync step holds the loop"
        elif label.startswith("disk"):
            overhead, overhead_best = row["sync"] / bare - 1, row["best"] / bare_best - 1
            ratio = (f"sync beyond the bare load {100 * overhead:.0f}% (best against best "
                     f"{100 * overhead_best:.0f}%; goal <= 25%); with the export and hashing "
                     f"{row['total'] / bare:.1f}x the bare load")
        else:
            ratio = (f"sync {row['sync'] / raw:.2f}x the raw broadcast (best against best "
                     f"{row['best'] / raw_best:.2f}x; goal <= 1.5x)")
        print(f"  {label:17s} {cells}  -> {ratio}")
    row = figures["rows"]["export into buffer"]
    print(f"  the run loop's broadcast sync (its weights exported into the buffer): {row['sync']:.2f} s, "
          f"{row['sync'] / raw:.2f}x the raw broadcast (best against best {row['best'] / raw_best:.2f}x; goal <= 1.5x)")
    if "raw_group_broadcast_s" in figures:  # several engines: the same collective among the group's processes
        group, group_best = median(figures["raw_group_broadcast_s"]), min(figures["raw_group_broadcast_s"])
        print(f"  against a raw gloo broadcast from one process to {engines} others (the group's shape): "
              f"{group:.2f} s (best {group_best:.2f}); the run loop's sync {row['sync'] / group:.2f}x it "
              f"(best against best {row['best'] / group_best:.2f}x)")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-mb", type=int, default=1024)
    parser.add_argument("--engines", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--bucket-mb", type=int, default=None)
    parser.add_argument("--malloc", choices=("both", "jemalloc", "glibc"), default="both",
                        help="the engines' allocator; both: glibc first (the baseline), then jemalloc")
    parser.add_argument("--repeat", type=int, default=3, help="syncs (and floor samples) per figure")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    if args.repeat < 1:
        parser.error("--repeat must be at least 1")

    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory(prefix="bench-weight-sync-") as tmp:
        work = Path(tmp)
        model = make_model(work / "model", args.size_mb)
        # A trainer holds its weights in memory: copied off the file's pages, which a sync would otherwise
        # fault in from the page cache as it copies them.
        tensors = {name: t.clone() for name, t in load_file(str(model / "model.safetensors")).items()}
        nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
        results = []
        mallocs = ("glibc", "jemalloc") if args.malloc == "both" else (args.malloc,)
        for engines in args.engines:
            for malloc in mallocs:
                raw = raw_broadcast_s(nbytes, args.repeat)  # beside the syncs it is the floor of
                group = raw_broadcast_s(nbytes, args.repeat, world=engines + 1) if engines > 1 else None
                figures = asyncio.run(measure(model, work, engines, tensors, nbytes, args.bucket_mb, malloc,
                                              args.repeat))
                figures.update(raw_broadcast_s=raw, malloc=malloc, repeat=args.repeat)
                if group is not None:
                    figures["raw_group_broadcast_s"] = group
                report(figures)
                results.append(figures)
            if len(mallocs) == 2:
                glibc, jemalloc = (r["rows"]["broadcast"]["sync"] for r in results[-2:])
                print(f"  broadcast sync with jemalloc in the engines: {jemalloc:.2f} s vs {glibc:.2f} s with "
                      f"glibc's malloc ({jemalloc / glibc:.2f}x)")
        if args.json:
            print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

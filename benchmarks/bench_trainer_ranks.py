"""Step time and tokens/s of 1, 2 and 4 CPU trainer ranks on the same global batch, and the rank plumbing's cost.

Each layout runs in real torch.distributed ranks (gloo) started by the project's rank launcher, on the
tiny model, with the quickstart's batch shape. Per step, rank 0 splits its wall time into forward,
backward, optimizer step, the gradient all-reduce and the rest. The rank plumbing (rank 0 handing the
batch to the ranks, the statistics' reductions) is timed on every rank: its cost is what it adds to
the step's critical path, from the last rank entering each call to the last rank leaving it, as a
share of the step; the time rank 0 waits in those calls for ranks still computing is shown apart
(imbalance). The baseline is one rank measured in the same run; speed-up is step time of one rank /
step time of N. The floor under the plumbing, measured in the same ranks before they train: a bare 8-byte
broadcast among them, timed the same way. On a 2-core machine expect little speed-up: N ranks share the same cores.

    python benchmarks/bench_trainer_ranks.py [--backend megatron|torch] [--steps 10] [--prompts 16 --group 16]
    python benchmarks/bench_trainer_ranks.py --layouts 1,1,1 2,1,1 1,1,2 2,1,2    # tensor,pipeline,data
    python benchmarks/bench_trainer_ranks.py --backend torch --data-parallel-mode fsdp   # sharded replicas
"""
from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))


def timed(holder: dict[str, float], key: str, fn: Any) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            holder[key] = holder.get(key, 0.0) + time.perf_counter() - started

    return wrapper


def marked(marks: dict[str, list[tuple[float, float]]], kind: str, fn: Any) -> Any:
    """fn, each call's (enter, leave) appended to marks[kind] (the machine's one monotonic clock, so the
    ranks' marks compare)."""
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            marks.setdefault(kind, []).append((started, time.perf_counter()))

    return wrapper


PLUMBING = ("command", "stats")  # rank 0 handing out the batch; the statistics' reduction
FLOOR_ROUNDS = 40


def bare_broadcasts(marks: dict[str, list[tuple[float, float]]]) -> None:
    """The floor under any rank plumbing: a bare broadcast of 8 bytes from rank 0 among the ranks, each
    after a little compute of every rank's own (as a step's calls come), timed as the plumbing calls are."""
    import torch
    import torch.distributed as dist

    flag = torch.zeros(8, dtype=torch.uint8)
    x = torch.randn(192, 192)
    broadcast = marked(marks, "floor", dist.broadcast)
    for _ in range(FLOOR_ROUNDS):
        for _ in range(3):
            x = torch.tanh(x @ x)
        broadcast(flag, 0)


def rank_entry(backend: str, model_dir: str, layout: tuple[int, int, int], steps: int, prompts: int,
               group: int, mode: str = "ddp") -> dict[str, Any]:
    """Every rank: build, warm up, train `steps` steps. Every rank returns when it entered and left each
    plumbing call; rank 0 also its per-step split of the time."""
    import torch
    from trainer_step import make_batch

    from rlfleet.trainer import ranks
    from rlfleet.trainer.base import build_trainer
    from rlfleet.trainer.parallel import ParallelLayout

    parallel = ParallelLayout(*layout)
    if parallel.world > 1:
        ranks.init_process_group("cpu")
    # FSDP shards only across several replicas: the one-rank baseline is a plain trainer.
    trainer = build_trainer(backend, model_dir, lr=1e-3, seed=0, parallel=parallel,
                            data_parallel_mode=mode if parallel.data > 1 else "ddp")
    marks: dict[str, list[tuple[float, float]]] = {}
    ranks._Commands.send = marked(marks, "command", ranks._Commands.send)  # type: ignore[method-assign]
    ranks._Commands.receive = marked(marks, "command", ranks._Commands.receive)  # type: ignore[method-assign]
    # A rank unpickles its replica's part of the batch after the command arrived: part of handing it out.
    ranks.BatchShards.part = marked(marks, "command", ranks.BatchShards.part)  # type: ignore[method-assign]
    start_stats = trainer._start_stats_reduction

    def marked_stats_reduction(sums: list[float], maxima: list[float]) -> Any:
        # Both its start and its wait are plumbing (the wait is what it adds after the backward pass).
        return marked(marks, "stats", marked(marks, "stats", start_stats)(sums, maxima))

    trainer._start_stats_reduction = marked_stats_reduction  # type: ignore[method-assign]
    if parallel.world > 1:
        bare_broadcasts(marks)
    if ranks.rank_env()[0] != 0:
        ranks.follow(trainer)
        return {"marks": marks}
    spent: dict[str, float] = {}
    trainer._forward_logits = timed(spent, "forward", trainer._forward_logits)  # type: ignore[method-assign]
    trainer._optimizer_step = timed(spent, "optimizer", trainer._optimizer_step)  # type: ignore[method-assign]
    trainer._reduce_gradients = timed(spent, "grad_allreduce", trainer._reduce_gradients)  # type: ignore[method-assign]
    torch.Tensor.backward = timed(spent, "backward", torch.Tensor.backward)  # type: ignore[method-assign]
    lead: Any = ranks.LeadingTrainer(trainer) if parallel.world > 1 else trainer
    batch = make_batch(prompts, group, 0)
    tokens = sum(len(s.response_ids) for s in batch)
    try:
        lead.train_step(batch)  # warm-up
        rows = []
        for _ in range(steps):
            spent.clear()
            started = time.perf_counter()
            lead.train_step(batch)
            rows.append({"step": time.perf_counter() - started, "at": (started, time.perf_counter()), **spent})
    finally:
        if parallel.world > 1:
            lead.close()
    return {"rows": rows, "tokens": tokens, "samples": len(batch), "marks": marks}


def plumbing_of(by_rank: dict[int, dict[str, Any]], window: tuple[float, float]) -> tuple[dict[str, float], float]:
    """(cost per kind of call, waits) of the plumbing calls inside one step's window of rank 0's clock.

    A call's cost is from the moment the last rank entered it to the moment the last rank left it (the
    time it adds to the step's critical path: pickling, the transfer, unpickling); the waits are what
    rank 0 spent in it before the last rank arrived (the other ranks still computing: imbalance, not
    plumbing)."""
    start, end = window
    costs = dict.fromkeys(PLUMBING, 0.0)
    waits = 0.0
    for kind in PLUMBING:
        ours = [i for i, (enter, _) in enumerate(by_rank[0]["marks"].get(kind, [])) if start <= enter <= end]
        for i in ours:
            calls = [r["marks"][kind][i] for r in by_rank.values()]
            arrived = max(enter for enter, _ in calls)
            costs[kind] += max(leave for _, leave in calls) - arrived
            waits += max(0.0, arrived - by_rank[0]["marks"][kind][i][0])
    return costs, waits


def floor_of(by_rank: dict[int, dict[str, Any]]) -> float:
    """The median cost of the bare broadcasts (the first few left out: connections warming up), from the
    last rank's arrival to the last rank's departure, as the plumbing's."""
    costs = []
    for i in range(5, FLOOR_ROUNDS):
        calls = [r["marks"]["floor"][i] for r in by_rank.values()]
        costs.append(max(leave for _, leave in calls) - max(enter for enter, _ in calls))
    return statistics.median(costs)


def summarise(by_rank: dict[int, dict[str, Any]]) -> dict[str, float]:
    result = by_rank[0]
    rows = result["rows"]
    for row in rows:
        costs, row["waits"] = plumbing_of(by_rank, row["at"]) if len(by_rank) > 1 else ({}, 0.0)
        row["plumbing"] = sum(costs.values())
        row.update({f"plumbing_{kind}": cost for kind, cost in costs.items()})

    def med(key: str) -> float:
        return statistics.median(r.get(key, 0.0) for r in rows)

    step = med("step")
    optimizer = med("optimizer")
    allreduce = med("grad_allreduce")
    compute = med("forward") + med("backward") + optimizer
    return {"step": step, "forward": med("forward"), "backward": med("backward"), "optimizer": optimizer,
            "grad_allreduce": allreduce, "other": step - compute - allreduce, "plumbing": med("plumbing"),
            **{f"plumbing_{kind}": med(f"plumbing_{kind}") for kind in PLUMBING},
            "waits": med("waits"), "plumbing_share": statistics.median(r["plumbing"] / r["step"] for r in rows),
            "tokens_per_s": result["tokens"] / step, "floor": floor_of(by_rank) if len(by_rank) > 1 else 0.0}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["megatron", "torch"], default="megatron")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--group", type=int, default=16)
    parser.add_argument("--data-parallel-mode", choices=["ddp", "fsdp"], default="ddp",
                        help="how the torch backend's data-parallel replicas hold the model (fsdp: sharded)")
    parser.add_argument("--layouts", nargs="+", default=["1,1,1", "1,1,2", "1,1,4"],
                        help="tensor,pipeline,data per layout; the first is the baseline (one rank)")
    args = parser.parse_args(argv)

    from rlfleet.trainer.launch import launch_ranks
    from rlfleet.trainer.tiny import ensure_tiny_model
    from rlfleet.util.binaries import CACHE_DIR

    model_dir = str(ensure_tiny_model(CACHE_DIR / "models" / "tiny-llama-seed0", seed=0))
    layouts = [tuple(int(x) for x in text.split(",")) for text in args.layouts]
    figures = {}
    with tempfile.TemporaryDirectory() as tmp:
        for layout in layouts:
            tp, pp, dp = layout
            world = tp * pp * dp
            started = time.perf_counter()
            results = launch_ranks(rank_entry, (args.backend, model_dir, layout, args.steps, args.prompts, args.group,
                                                args.data_parallel_mode),
                                   world=world, log_dir=Path(tmp) / f"logs-{tp}-{pp}-{dp}")
            figures[layout] = summarise(results)
            print(f"  tp{tp} pp{pp} dp{dp} ({world} ranks): launched and ran in {time.perf_counter() - started:.1f} s",
                  file=sys.stderr)
    base = figures[layouts[0]]
    mode = f" ({args.data_parallel_mode} replicas)" if args.backend == "torch" else ""
    print(f"{args.backend} trainer{mode}, tiny model, global batch {args.prompts} x {args.group} samples, "
          f"median of {args.steps} steps (rank 0's view)")
    print(f"{'layout':<14}{'ranks':>6}{'step s':>9}{'tok/s':>9}{'speed-up':>10}{'fwd':>8}{'bwd':>8}{'opt':>8}"
          f"{'allred':>8}{'other':>8}{'waits':>8}{'plumbing':>10}{'(cmd':>8}{'stats)':>8}{'share':>8}")
    for layout, f in figures.items():
        tp, pp, dp = layout
        print(f"{f'tp{tp} pp{pp} dp{dp}':<14}{tp * pp * dp:>6}{f['step']:>9.4f}{f['tokens_per_s']:>9.0f}"
              f"{base['step'] / f['step']:>9.2f}x{f['forward']:>8.4f}{f['backward']:>8.4f}{f['optimizer']:>8.4f}"
              f"{f['grad_allreduce']:>8.4f}{f['other']:>8.4f}{f['waits']:>8.4f}{f['plumbing']:>10.4f}"
              f"{f.get('plumbing_command', 0.0):>8.4f}{f.get('plumbing_stats', 0.0):>8.4f}"
              f"{f['plumbing_share']:>7.1%}")
    for layout, f in figures.items():
        if f["floor"]:
            tp, pp, dp = layout
            print(f"floor, tp{tp} pp{pp} dp{dp}: a bare 8-byte broadcast among its {tp * pp * dp} ranks costs "
                  f"{f['floor'] * 1000:.2f} ms; two of them (the plumbing's calls a step) "
                  f"{2 * f['floor'] / f['step']:.1%} of the step; the plumbing is "
                  f"{f['plumbing'] / (2 * f['floor']):.2f}x that")
    print("seconds, median over the steps. other = the step outside forward/backward/optimizer/gradient all-reduce "
          "(collation, loss, plumbing); plumbing = the rank plumbing on the step's critical path: rank 0 handing "
          "the batch to the ranks (cmd) and the statistics' reduction (stats, its start and its wait), each from "
          "the last rank's arrival to the last rank's departure; share = plumbing / step, goal <= 5%; "
          "waits = rank 0's time in those calls before "
          "the last rank arrived (ranks sharing cores: imbalance, not plumbing)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

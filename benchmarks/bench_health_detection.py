"""Benchmark: how fast the health prober notices crashed and hung engines, and what it costs.

Setup: the load generator (benchmarks/loadgen.py, its own process) simulates N engines'
`/health_generate` (default 1,000). The prober under test runs in a process of its own, probing every
engine every `--interval` s, so its CPU time can be read from /proc alone. After a warm-up the
benchmark measures the prober's CPU over a quiet window, then injects faults at once:
- crash: the engine's port closes (connection refused), like a process that died;
- hang: the engine accepts the probe and never answers, like a stopped scheduler;
- blip: the engine answers late for a moment (longer than one probe timeout), then recovers; a good
  prober must NOT mark it dead (a false death recreates a healthy engine).
Detection latency = time the prober reported an engine dead - time the fault took effect (one
monotonic clock; both processes run on this machine).

Probers:
- rlfleet: rlfleet.orchestrator.fleet.monitor.HealthMonitor (concurrent probes, failure threshold, a refused
  connection is a death at once) with its own probe client (one kept-alive connection per engine,
  reopened at once when it ends between probes, so a crash is refused within milliseconds);
- rlfleet-aiohttp (opt-in): the same monitor probing through aiohttp, to price the client alone;
- miles: the baseline, re-implemented from Miles' RolloutHealthMonitor behaviour: engines probed one
  at a time, each probe bounded by the timeout, the first failed probe kills the engine, then sleep
  the interval (Miles defaults are 30 s / 30 s; here both probers get the same interval and timeout).

Targets: crash <= 1 s, hang <= interval + threshold x timeout, CPU <= 5% of one core.

Run: python benchmarks/bench_health_detection.py [--engines 1000] [--interval 1] [--timeout 1] [--threshold 3]
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

HERE = Path(__file__).resolve().parent
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")

OnDead = Callable[[int, str], None]


@dataclass(frozen=True)
class ProbeSettings:
    interval_s: float
    timeout_s: float
    threshold: int


# ---------------------------------------------------------------------------------------------------
# Probers (each runs inside the prober process; `on_dead(engine_index, reason)` reports a death)
# ---------------------------------------------------------------------------------------------------

async def run_rlfleet(urls: list[str], settings: ProbeSettings, on_dead: OnDead) -> None:
    """rlfleet's HealthMonitor as FleetRuntime wires it: its own keep-alive probe client."""
    await _run_monitor(urls, settings, on_dead, probe_factory=None)


async def run_rlfleet_aiohttp(urls: list[str], settings: ProbeSettings, on_dead: OnDead) -> None:
    """The same monitor probing through aiohttp (EngineClient over one session), for comparison."""
    from rlfleet.sglang.engine import EngineClient

    def probe_factory(session: aiohttp.ClientSession, timeout_s: float):
        clients: dict[str, EngineClient] = {}

        async def probe(target) -> None:
            client = clients.get(target.url) or clients.setdefault(target.url, EngineClient(session, target.url))
            await client.health_generate(timeout_s)

        return probe

    await _run_monitor(urls, settings, on_dead, probe_factory=probe_factory)


async def _run_monitor(urls: list[str], settings: ProbeSettings, on_dead: OnDead, *, probe_factory) -> None:
    from rlfleet.crds.specs import HealthSpec
    from rlfleet.orchestrator.fleet.monitor import HealthMonitor, ProbeTarget

    spec = HealthSpec(interval_seconds=settings.interval_s, timeout_seconds=settings.timeout_s,
                      failure_threshold=settings.threshold)
    targets = [ProbeTarget(slot=index, incarnation=0, url=url) for index, url in enumerate(urls)]
    alive = {t.slot: t for t in targets}

    async def dead(target: ProbeTarget, reason: str) -> None:
        alive.pop(target.slot, None)  # a dead incarnation leaves the fleet, as the backend does
        on_dead(target.slot, reason)

    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        probe = probe_factory(session, spec.timeout_seconds) if probe_factory is not None else None
        monitor = HealthMonitor(spec, targets=lambda: alive.values(), probe=probe, on_dead=dead, fleet="bench")
        await monitor.start()
        try:
            await asyncio.Event().wait()
        finally:
            await monitor.stop()


async def run_miles(urls: list[str], settings: ProbeSettings, on_dead: OnDead) -> None:
    """Miles-style: sequential probes, one failure kills, then sleep the interval."""
    alive = list(range(len(urls)))
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while True:
            for index in list(alive):
                try:
                    async with session.get(urls[index] + "/health_generate") as resp:
                        await resp.read()
                        ok = resp.status == 200
                        reason = f"HTTP {resp.status}"
                except (aiohttp.ClientError, TimeoutError, OSError) as exc:
                    ok, reason = False, type(exc).__name__
                if not ok:
                    alive.remove(index)
                    on_dead(index, reason)
            await asyncio.sleep(settings.interval_s)


PROBERS: dict[str, Callable[[list[str], ProbeSettings, OnDead], Awaitable[None]]] = {
    "rlfleet": run_rlfleet,
    "rlfleet-aiohttp": run_rlfleet_aiohttp,
    "miles": run_miles,
}


def prober_main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.ERROR)  # deaths are reported as events, not log lines
    urls = json.loads(Path(args.urls_file).read_text())
    settings = ProbeSettings(args.interval, args.timeout, args.threshold)

    def emit(event: dict) -> None:
        sys.stdout.write(json.dumps(event) + "\n")
        sys.stdout.flush()

    def on_dead(index: int, reason: str) -> None:
        emit({"event": "dead", "engine": index, "t": time.monotonic(), "reason": reason})

    async def run() -> None:
        emit({"event": "started", "t": time.monotonic()})
        await PROBERS[args.impl](urls, settings, on_dead)

    asyncio.run(run())
    return 0


# ---------------------------------------------------------------------------------------------------
# The driver
# ---------------------------------------------------------------------------------------------------

def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    stat = Path(f"/proc/{pid}/stat").read_text()
    fields = stat[stat.rindex(")") + 2:].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


@dataclass
class Result:
    impl: str
    cpu_core_fraction: float
    loadgen_core_fraction: float
    probes_per_s: float
    crash_latencies: list[float] = field(default_factory=list)
    hang_latencies: list[float] = field(default_factory=list)
    crash_missed: int = 0
    hang_missed: int = 0
    blip_deaths: int = 0  # blipping engines marked dead (a good prober tolerates a short blip)
    healthy_deaths: int = 0  # engines that never had a fault, marked dead
    false_death_reason: str = ""


async def start_process(*argv: str) -> asyncio.subprocess.Process:
    return await asyncio.create_subprocess_exec(
        sys.executable, *argv, stdout=asyncio.subprocess.PIPE, stderr=None, start_new_session=True)


async def stop_process(proc: asyncio.subprocess.Process) -> None:
    if proc.returncode is None:
        proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), 5)
        except TimeoutError:
            proc.kill()
            await proc.wait()


async def bench_one(impl: str, args: argparse.Namespace, workdir: Path) -> Result:
    # Crashable engines are the first ones (they have ports of their own); hung and blipping ones are
    # spread over the fleet by a fixed seed, so a sequential walk meets them where chance puts them.
    crash = list(range(args.crash))
    spread = random.Random(args.seed).sample(range(args.crash, args.engines), args.hang + args.blip)
    hang, blip = sorted(spread[:args.hang]), sorted(spread[args.hang:])
    loadgen = await start_process(str(HERE / "loadgen.py"), "--engines", str(args.engines),
                                  "--crashable", str(args.crash), "--host", args.host)
    prober = None
    try:
        ready = json.loads(await asyncio.wait_for(loadgen.stdout.readline(), 60))
        control, urls = ready["control"], ready["engines"]
        # The prober sees the engines in a shuffled order, so where a fault sits in a sequential walk
        # is chance, not the load generator's port layout.
        order = random.Random(args.seed + 1).sample(range(len(urls)), len(urls))
        urls_file = workdir / "urls.json"
        urls_file.write_text(json.dumps([urls[engine] for engine in order]))
        prober = await start_process(__file__, "--role", "prober", "--impl", impl, "--urls-file", str(urls_file),
                                     "--interval", str(args.interval), "--timeout", str(args.timeout),
                                     "--threshold", str(args.threshold))
        deaths: dict[int, tuple[float, str]] = {}  # engine -> first report

        async def read_events() -> None:
            while line := await prober.stdout.readline():
                event = json.loads(line)
                if event["event"] == "dead":
                    deaths.setdefault(order[event["engine"]], (event["t"], event["reason"]))

        reader = asyncio.create_task(read_events())
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
            async def stats() -> int:
                async with session.get(control + "/_loadgen/stats") as resp:
                    return (await resp.json())["probes"]

            await asyncio.sleep(args.warmup)
            if prober.returncode is not None:
                raise RuntimeError(f"{impl} prober exited with {prober.returncode}")
            cpu0, lg0, probes0, t0 = (process_cpu_seconds(prober.pid), process_cpu_seconds(loadgen.pid),
                                      await stats(), time.monotonic())
            await asyncio.sleep(args.cpu_window)
            cpu1, lg1, probes1, t1 = (process_cpu_seconds(prober.pid), process_cpu_seconds(loadgen.pid),
                                      await stats(), time.monotonic())
            result = Result(impl, (cpu1 - cpu0) / (t1 - t0), (lg1 - lg0) / (t1 - t0), (probes1 - probes0) / (t1 - t0))

            fault_at: dict[int, float] = {}

            async def fault(engine: int, mode: str) -> None:
                async with session.post(control + "/_loadgen/fault",
                                        json={"engine": engine, "mode": mode, "seconds": args.blip_seconds}) as resp:
                    body = await resp.json()
                    if resp.status != 200:
                        raise RuntimeError(f"fault {mode} on {engine}: {body}")
                    fault_at[engine] = body["at"]

            await asyncio.gather(*(fault(e, "crash") for e in crash), *(fault(e, "hang") for e in hang),
                                 *(fault(e, "blip") for e in blip))
            deadline = time.monotonic() + args.give_up
            targets = set(crash) | set(hang)
            # The reader task fills `deaths` from the prober's event stream; polled up to the give-up time.
            while time.monotonic() < deadline and not targets <= set(deaths):  # noqa: ASYNC110 - see above
                await asyncio.sleep(0.1)
            await asyncio.sleep(args.interval * 2 + args.blip_seconds)  # let late false deaths show
        reader.cancel()
        for engine in crash:
            if engine in deaths:
                result.crash_latencies.append(deaths[engine][0] - fault_at[engine])
            else:
                result.crash_missed += 1
        for engine in hang:
            if engine in deaths:
                result.hang_latencies.append(deaths[engine][0] - fault_at[engine])
            else:
                result.hang_missed += 1
        result.blip_deaths = len(set(deaths) & set(blip))
        healthy_dead = sorted(set(deaths) - targets - set(blip))
        result.healthy_deaths = len(healthy_dead)
        if healthy_dead:
            result.false_death_reason = deaths[healthy_dead[0]][1][:200]
        return result
    finally:
        if prober is not None:
            await stop_process(prober)
        await stop_process(loadgen)


def fmt_latencies(values: list[float], missed: int) -> str:
    if not values:
        return f"none detected ({missed} missed)"
    text = f"median {statistics.median(values):.2f} s, max {max(values):.2f} s"
    return text + (f", {missed} missed" if missed else "")


def report(results: list[Result], args: argparse.Namespace) -> str:
    hang_target = args.interval + args.threshold * args.timeout
    lines = [
        f"{args.engines} simulated engines, interval {args.interval:g} s, timeout {args.timeout:g} s, "
        f"threshold {args.threshold}; faults: {args.crash} crash, {args.hang} hang, {args.blip} blip "
        f"({args.blip_seconds:g} s)",
        f"targets: crash <= 1 s, hang <= {hang_target:g} s, prober CPU <= 5% of one core",
    ]
    for r in results:
        lines += [
            f"[{r.impl}]",
            f"  prober CPU           {100 * r.cpu_core_fraction:6.1f} % of one core "
            f"(load generator {100 * r.loadgen_core_fraction:.1f} %)",
            f"  probes per second    {r.probes_per_s:8.0f}",
            f"  crash detection      {fmt_latencies(r.crash_latencies, r.crash_missed)}",
            f"  hang detection       {fmt_latencies(r.hang_latencies, r.hang_missed)}",
            f"  false deaths         {r.blip_deaths} of {args.blip} blipping, "
            f"{r.healthy_deaths} of {args.engines - args.crash - args.hang - args.blip} healthy"
            + (f" (e.g. {r.false_death_reason})" if r.false_death_reason else ""),
        ]
    by = {r.impl: r for r in results}
    if "rlfleet" in by and "miles" in by:
        ours, base = by["rlfleet"], by["miles"]

        def ratio(a: list[float], b: list[float]) -> str:
            if not a or not b:
                return "n/a"
            return f"{max(b) / max(a):.1f}x faster (max {max(a):.2f} s vs {max(b):.2f} s)"

        lines += [
            "rlfleet vs miles-style baseline:",
            f"  crash detection  {ratio(ours.crash_latencies, base.crash_latencies)}",
            f"  hang detection   {ratio(ours.hang_latencies, base.hang_latencies)}",
            f"  probes per second {ours.probes_per_s / max(base.probes_per_s, 1e-9):.1f}x",
            f"  CPU per probe    {1e6 * ours.cpu_core_fraction / max(ours.probes_per_s, 1e-9):.0f} us vs "
            f"{1e6 * base.cpu_core_fraction / max(base.probes_per_s, 1e-9):.0f} us",
        ]
    return "\n".join(lines)


async def driver_main(args: argparse.Namespace) -> int:
    import tempfile

    results = []
    with tempfile.TemporaryDirectory(prefix="bench-health-") as tmp:
        for impl in args.impls.split(","):
            print(f"running {impl} ...", file=sys.stderr, flush=True)
            results.append(await bench_one(impl, args, Path(tmp)))
    text = report(results, args)
    print(text)
    if args.json:
        print(json.dumps([r.__dict__ for r in results]))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--role", choices=["driver", "prober"], default="driver")
    parser.add_argument("--impl", default="rlfleet", help="prober role: which prober")
    parser.add_argument("--impls", default="rlfleet,miles",
                        help=f"driver: probers to compare, comma-separated, of {', '.join(PROBERS)}")
    parser.add_argument("--urls-file")
    parser.add_argument("--engines", type=int, default=1000)
    parser.add_argument("--interval", type=float, default=1.0)
    parser.add_argument("--timeout", type=float, default=1.0)
    parser.add_argument("--threshold", type=int, default=3)
    parser.add_argument("--crash", type=int, default=5)
    parser.add_argument("--hang", type=int, default=5)
    parser.add_argument("--blip", type=int, default=5)
    parser.add_argument("--blip-seconds", type=float, default=2.5,
                        help="how long a blip lasts; below threshold x timeout a good prober tolerates it")
    parser.add_argument("--seed", type=int, default=0, help="placement of hung and blipping engines")
    parser.add_argument("--warmup", type=float, default=5.0)
    parser.add_argument("--cpu-window", type=float, default=10.0)
    parser.add_argument("--give-up", type=float, default=60.0)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    if args.role == "prober":
        return prober_main(args)
    return asyncio.run(driver_main(args))


if __name__ == "__main__":
    sys.exit(main())

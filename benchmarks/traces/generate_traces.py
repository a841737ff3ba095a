"""Write the two rollout-error traces the watchdog replay is checked on (deterministic: fixed seeds).

- healthy-bursty.txt (ISO-8601 times): a busy run that finishes normally. Its router returned 503s in
  bursts of 10-60 s at up to ~37 errors/s (about 2,200 in a minute), separated by minutes of quiet;
  once, two bursts came 45 s apart. That pair is what six checks in a row mistake for a dead engine.
- dead-engine.txt (epoch seconds): the engine died at startup and every request failed from then on,
  ~53 errors/s without a break (200,533 in 63 minutes in the field report), here 8 minutes of it.

Usage: python benchmarks/traces/generate_traces.py [OUT_DIR]   (default: this folder)
"""
from __future__ import annotations

import random
import sys
from datetime import UTC, datetime
from pathlib import Path

HEALTHY_SEED = 2
DEAD_SEED = 3
HEALTHY_START = datetime(2026, 10, 22, 7, 16, 29, tzinfo=UTC).timestamp()
DEAD_START = datetime(2026, 10, 17, 21, 3, 30, 637000, tzinfo=UTC).timestamp()


def poisson_times(rng: random.Random, start: float, duration: float, rate: float) -> list[float]:
    """Arrival times of a Poisson process of `rate` per second over [start, start + duration)."""
    times, t = [], start
    while True:
        t += rng.expovariate(rate)
        if t >= start + duration:
            return times
        times.append(t)


def healthy_bursty(rng: random.Random) -> list[float]:
    times: list[float] = []
    t = HEALTHY_START
    for episode in range(16):
        if episode == 9:
            # Two bursts 45 s apart: every window from the first burst's start to the second's end
            # holds well over 100 errors.
            for _ in range(2):
                duration = rng.uniform(32.0, 36.0)
                times += poisson_times(rng, t, duration, rng.uniform(28.0, 37.0))
                t += duration + 45.0
            t -= 45.0
        else:
            duration = rng.uniform(10.0, 60.0)
            times += poisson_times(rng, t, duration, rng.uniform(15.0, 37.0))
            t += duration
        quiet = rng.uniform(150.0, 420.0)
        # A few stray errors in the quiet stretch (retries that failed once and then succeeded).
        times += poisson_times(rng, t, quiet, 0.05)
        t += quiet
    return times


def dead_engine(rng: random.Random) -> list[float]:
    return poisson_times(rng, DEAD_START, 480.0, 53.0)


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%dT%H:%M:%S.%f")[:-3] + "Z"


def write(path: Path, lines: list[str]) -> None:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")


def main(argv: list[str]) -> int:
    out = Path(argv[0]) if argv else Path(__file__).resolve().parent
    out.mkdir(parents=True, exist_ok=True)
    write(out / "healthy-bursty.txt", [iso(t) for t in healthy_bursty(random.Random(HEALTHY_SEED))])
    write(out / "dead-engine.txt", [f"{t:.3f}" for t in dead_engine(random.Random(DEAD_SEED))])
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))

"""The one builder of the SGLang engine command line.

The operator puts its output into pod specs and the local backend runs it as a process, so the two
modes can never drift. Pure: no I/O.
"""
from __future__ import annotations

from dataclasses import dataclass

from rlfleet.crds.specs import EngineSpec

CPU_DEFAULT_MAX_TOTAL_TOKENS = 8192

# Offline engines must never reach for a hub; CPU engines need the transformers implementation.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}


@dataclass(frozen=True)
class EngineLaunch:
    """Everything needed to start one engine: argv (after the interpreter) and environment."""

    args: tuple[str, ...]
    env: dict[str, str]

    def argv(self, python: str = "python3") -> list[str]:
        return [python, *self.args]


def build_engine_launch(
    engine: EngineSpec,
    *,
    host: str,
    port: int | None = None,
    model_path: str | None = None,
    weight_version: str = "0",
    enable_metrics: bool = True,
) -> EngineLaunch:
    """Build the `python -m sglang.launch_server ...` arguments for one engine slot.

    `model_path` overrides the spec's (a replacement engine starts from the current snapshot);
    `weight_version` labels the weights it starts with, so read-back is meaningful from the start.
    """
    args: list[str] = [
        "-m", "sglang.launch_server",
        "--model-path", model_path or engine.model_path,
        "--host", host,
        "--port", str(port if port is not None else engine.port),
        "--tp-size", str(engine.tensor_parallel_size),
        "--weight-version", weight_version,
    ]
    for flag, size in (("--pp-size", engine.pipeline_parallel_size), ("--dp-size", engine.data_parallel_size),
                       ("--ep-size", engine.expert_parallel_size)):
        if size != 1:
            args += [flag, str(size)]
    if engine.device == "cpu":
        args += [
            "--device", "cpu",
            "--model-impl", "transformers",
            # Without it each idle CPU engine busy-polls a full core.
            "--sleep-on-idle",
            "--max-total-tokens", str(engine.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS),
        ]
        if "--dtype" not in engine.extra_args:
            # SGLang's default halves float32 weights to float16, which on CPU is ~3.4x slower and
            # returns less exact logprobs than the trainer computes.
            args += ["--dtype", "float32"]
    elif engine.max_total_tokens is not None:
        args += ["--max-total-tokens", str(engine.max_total_tokens)]
    if engine.mem_fraction_static is not None:
        args += ["--mem-fraction-static", str(engine.mem_fraction_static)]
    if engine.attention_backend:
        args += ["--attention-backend", engine.attention_backend]
    if enable_metrics:
        args.append("--enable-metrics")
    args += list(engine.extra_args)
    env = dict(BASE_ENV)
    env.update({e.name: e.value for e in engine.env})
    return EngineLaunch(args=tuple(args), env=env)


def build_router_args(*, host: str, port: int, metrics_port: int, health_interval_s: int = 2,
                      health_failure_threshold: int = 2) -> list[str]:
    """Arguments for `python -m sglang_router.launch_router` with no workers: membership is ours."""
    return [
        "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(health_interval_s),
        "--health-failure-threshold", str(health_failure_threshold),
    ]


def served_dtype(engine: EngineSpec) -> str | None:
    """The dtype the engine serves its weights in: its --dtype (CPU engines: float32 unless told), else None
    (the snapshot's own)."""
    args = list(engine.extra_args)
    if "--dtype" in args and args.index("--dtype") + 1 < len(args):
        value = args[args.index("--dtype") + 1]
        return None if value == "auto" else {"half": "float16", "float": "float32"}.get(value, value)
    return "float32" if engine.device == "cpu" else None

"""The one builder of the SGLang engine command line.

The operator puts its output into pod specs and the local backend runs it as a process, so the two
modes can never drift. Every flag it sets is spelled through `rlfleet.crds.managed.EngineFlags`, the
table the API uses to refuse those flags in `extraArgs`. Pure: no I/O.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rlfleet.crds.managed import USER_SETTABLE_ENGINE_FLAGS, EngineFlags
from rlfleet.crds.specs import EngineSpec, literal_env

CPU_DEFAULT_MAX_TOTAL_TOKENS = 8192

# Offline engines must never reach for a hub; CPU engines need the transformers implementation.
BASE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
# On a stop (SIGTERM to the group) SGLang treats its scheduler's exit as a crash and, by default, sleeps
# 5 s "to let GPU activity settle" before a py-spy dump and a CUDA coredump. A CPU engine has no GPU
# activity and no CUDA: without these every CPU engine stop (teardown, recreation) takes 5 s longer.
CPU_ENV = {"SGLANG_PYSPY_DUMP_BEFORE_CRASH": "0", "SGLANG_CUDA_COREDUMP_BEFORE_CRASH": "0"}
# With a preloaded jemalloc (`malloc_library`): freed pages stay with the process, so the next weight
# update's buffers reuse them instead of faulting fresh pages in (rlfleet.util.allocator). Never purging
# is what holds them: with any finite decay jemalloc serves allocations over 8 MiB from an arena that
# purges at once (a 512 MiB buffer then faulted in as slowly as under glibc, measured). An engine's
# memory is bounded by its KV cache and its largest update bucket either way.
JEMALLOC_CONF = "dirty_decay_ms:-1,muzzy_decay_ms:-1"


def cpu_threads_per_engine(cpus: int, engines: int) -> int:
    """OpenMP threads for each of `engines` CPU engines sharing one machine's `cpus` cores: an equal share,
    at least one. Left alone, every engine's torch runs a thread per core, and the engines' OpenMP threads
    spin-wait against each other: two engines on 2 cores loaded a 1 GiB update from the page cache in
    1.05 s (both at once), 0.27 s with one thread each, and took a broadcast update in 1.9 s against 1.0 s."""
    return max(1, cpus // max(1, engines))


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
    api_key: str | None = None,
    malloc_library: str | None = None,
    base_gpu_id: int | None = None,
    forked_cpu_processes: bool = False,
    cpu_threads: int | None = None,
) -> EngineLaunch:
    """Build the `python -m sglang.launch_server ...` arguments for one engine slot.

    `model_path` overrides the spec's (a replacement engine starts from the current snapshot);
    `weight_version` labels the weights it starts with, so read-back is meaningful from the start;
    `api_key` (a value, or `$(RLFLEET_API_KEY)` in a pod) makes every route but /health*, /ready* and
    /metrics require `Authorization: Bearer <key>`; `malloc_library` (a CPU engine: a jemalloc the
    engine's machine has, see `rlfleet.util.allocator`) is preloaded into every engine process, unless
    the spec's `env` sets LD_PRELOAD itself; `base_gpu_id` (a CUDA engine on a machine it shares with the
    trainer and other engines) is the first of the GPUs it runs on; `forked_cpu_processes` (a CPU engine
    run as a local process, where rlfleet is installed) starts SGLang through `rlfleet.sglang.forked_server`,
    which forks its processes instead of spawning them (a faster start, the same server); `cpu_threads` (CPU
    engines sharing one machine, see `cpu_threads_per_engine`) sets OMP_NUM_THREADS, unless the spec's
    `env` does. Environment
    variables with `valueFrom` are not in `env` (only a pod can resolve them; see `EnvVarSpec.to_pod`).
    """
    f = EngineFlags
    forked = forked_cpu_processes and engine.device == "cpu"
    server = "rlfleet.sglang.forked_server" if forked else "sglang.launch_server"
    args: list[str] = [
        "-m", server,
        f.MODEL_PATH.flag, model_path or engine.model_path,
        f.HOST.flag, host,
        f.PORT.flag, str(port if port is not None else engine.port),
        f.TP_SIZE.flag, str(engine.tensor_parallel_size),
        f.WEIGHT_VERSION.flag, weight_version,
    ]
    for flag, size in ((f.PP_SIZE, engine.pipeline_parallel_size), (f.DP_SIZE, engine.data_parallel_size),
                       (f.EP_SIZE, engine.expert_parallel_size)):
        if size != 1:
            args += [flag.flag, str(size)]
    if engine.device == "cpu":
        args += [
            f.DEVICE.flag, "cpu",
            f.MODEL_IMPL.flag, "transformers",
            # Without it each idle CPU engine busy-polls a full core.
            f.SLEEP_ON_IDLE.flag,
            f.MAX_TOTAL_TOKENS.flag, str(engine.max_total_tokens or CPU_DEFAULT_MAX_TOTAL_TOKENS),
        ]
        (dtype,) = USER_SETTABLE_ENGINE_FLAGS
        if not any(a == dtype or a.startswith(dtype + "=") for a in engine.extra_args):
            # SGLang's default halves float32 weights to float16, which on CPU is ~3.4x slower and
            # returns less exact logprobs than the trainer computes.
            args += [dtype, "float32"]
    else:
        if engine.max_total_tokens is not None:
            args += [f.MAX_TOTAL_TOKENS.flag, str(engine.max_total_tokens)]
        if base_gpu_id is not None:
            args += [f.BASE_GPU_ID.flag, str(base_gpu_id)]
    if engine.mem_fraction_static is not None:
        args += [f.MEM_FRACTION_STATIC.flag, str(engine.mem_fraction_static)]
    if engine.attention_backend:
        args += [f.ATTENTION_BACKEND.flag, engine.attention_backend]
    if enable_metrics:
        args.append(f.ENABLE_METRICS.flag)
    if api_key:
        args += [f.API_KEY.flag, api_key]
    # A streamed chunk then carries only its new tokens; by default each repeats every token so far, and
    # a long rollout (which rlfleet streams to continue it after an engine death) costs bytes and JSON
    # parsing quadratic in its length. Only `stream: true` requests change.
    args.append(f.INCREMENTAL_STREAMING_OUTPUT.flag)
    args += list(engine.extra_args)
    env = dict(BASE_ENV) | (CPU_ENV if engine.device == "cpu" else {})
    if engine.device == "cpu" and malloc_library:
        env |= {"LD_PRELOAD": malloc_library, "MALLOC_CONF": JEMALLOC_CONF}
    if engine.device == "cpu" and cpu_threads:
        env["OMP_NUM_THREADS"] = str(cpu_threads)
    env.update(literal_env(engine.env))
    return EngineLaunch(args=tuple(args), env=env)


# The one control-plane key sglang-router is given: `id:name:role:key`, role admin (POST/DELETE /workers).
ROUTER_CONTROL_KEY_ID = "rlfleet"


def build_router_args(*, host: str, port: int, metrics_port: int, health_interval_s: int = 2,
                      health_failure_threshold: int = 2, api_key: str | None = None,
                      policy: str | None = None) -> list[str]:
    """Arguments for `python -m sglang_router.launch_router` with no workers: membership is ours.
    `policy`: the load-balancing policy (None: the router's default, cache_aware).

    With `api_key` one key guards both planes of sglang-router 0.3.2: `--api-key` (required on
    /generate and the other data routes, and sent to the workers as their Bearer key) and
    `--control-plane-api-keys` (required on /workers). /health, /liveness, /readiness stay open.
    """
    auth = ["--api-key", api_key, "--control-plane-api-keys",
            f"{ROUTER_CONTROL_KEY_ID}:{ROUTER_CONTROL_KEY_ID}:admin:{api_key}"] if api_key else []
    return [
        "-m", "sglang_router.launch_router",
        "--host", host,
        "--port", str(port),
        "--prometheus-host", host,
        "--prometheus-port", str(metrics_port),
        "--health-check-interval-secs", str(health_interval_s),
        "--health-failure-threshold", str(health_failure_threshold),
        *auth,
        *(["--policy", policy] if policy else []),
    ]


def _flag_value(args: Sequence[str], flag: str) -> str | None:
    """The value `args` give `flag` (`--flag value` or `--flag=value`; the last one counts, as SGLang's
    parser takes it), or None."""
    value = None
    for i, arg in enumerate(args):
        if arg == flag and i + 1 < len(args):
            value = args[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    return value


def served_dtype(engine: EngineSpec) -> str | None:
    """The dtype the engine serves its weights in: its --dtype (CPU engines: float32 unless told), else None
    (the snapshot's own)."""
    value = _flag_value(engine.extra_args, "--dtype")
    if value is not None:
        return None if value == "auto" else {"half": "float16", "float": "float32"}.get(value, value)
    return "float32" if engine.device == "cpu" else None


def served_quantization(engine: EngineSpec) -> str | None:
    """The quantization the engine serves its weights in (its --quantization, e.g. fp8), or None: the
    weights as loaded."""
    value = _flag_value(engine.extra_args, "--quantization")
    return None if value is None or value.lower() == "none" else value


@dataclass(frozen=True)
class ServedWeights:
    """How the engines of one spec hold the weights they load: what a weight sync needs to know of them
    (their update-group ranks, and how they hash what they serve)."""

    device: str = "cpu"
    tp_size: int = 1
    dtype: str | None = None  # None: the snapshot's own
    quantization: str | None = None  # None: as loaded

    @classmethod
    def of(cls, engine: EngineSpec) -> ServedWeights:
        return cls(device=engine.device, tp_size=engine.tensor_parallel_size, dtype=served_dtype(engine),
                   quantization=served_quantization(engine))

"""What rlfleet itself sets in the processes and pods it builds, so a spec can not override it.

The one SGLang command builder (`rlfleet.sglang.launch`) spells every flag it sets through
`ENGINE_FLAGS` below, and the operator's builders name every environment variable they set through
`RESERVED_ENV`: these tables are the builders' vocabulary, so what the API refuses in `extraArgs` and
`env` is exactly what the builders manage (unit tests run the builders over every branch and compare,
and compare the aliases with SGLang's own argument parser).

A user flag counts as managed when its name (before any `=`) is a managed option string or a prefix of
one: SGLang's parser accepts unambiguous abbreviations (`--po 1` is `--port 1`).
"""
from __future__ import annotations

from dataclasses import dataclass

from rlfleet.crds.conventions import API_KEY_ENV


@dataclass(frozen=True)
class ManagedFlag:
    """A flag the engine command builder sets, with the other spellings SGLang's parser takes for it."""

    flag: str
    aliases: tuple[str, ...] = ()
    field: str = ""  # the spec field that sets it ("" when rlfleet alone decides)

    @property
    def option_strings(self) -> tuple[str, ...]:
        return (self.flag, *self.aliases)


class EngineFlags:
    """The SGLang flags `build_engine_launch` sets; the builder writes them only as these attributes."""

    MODEL_PATH = ManagedFlag("--model-path", ("--model",), "modelPath")
    HOST = ManagedFlag("--host")
    PORT = ManagedFlag("--port", (), "port")
    TP_SIZE = ManagedFlag("--tp-size", ("--tensor-parallel-size",), "tensorParallelSize")
    PP_SIZE = ManagedFlag("--pp-size", ("--pipeline-parallel-size",), "pipelineParallelSize")
    DP_SIZE = ManagedFlag("--dp-size", ("--data-parallel-size",), "dataParallelSize")
    EP_SIZE = ManagedFlag("--ep-size", ("--expert-parallel-size", "--ep"), "expertParallelSize")
    WEIGHT_VERSION = ManagedFlag("--weight-version")
    DEVICE = ManagedFlag("--device", (), "device")
    MODEL_IMPL = ManagedFlag("--model-impl", (), "device")
    SLEEP_ON_IDLE = ManagedFlag("--sleep-on-idle", (), "device")
    MAX_TOTAL_TOKENS = ManagedFlag("--max-total-tokens", (), "maxTotalTokens")
    MEM_FRACTION_STATIC = ManagedFlag("--mem-fraction-static", (), "memFractionStatic")
    ATTENTION_BACKEND = ManagedFlag("--attention-backend", (), "attentionBackend")
    ENABLE_METRICS = ManagedFlag("--enable-metrics")
    API_KEY = ManagedFlag("--api-key")
    INCREMENTAL_STREAMING_OUTPUT = ManagedFlag("--incremental-streaming-output")
    # A local CUDA engine's first GPU (rlfleet places the trainer and every engine on GPUs of their own);
    # a pod's engine sees only its own GPUs and starts at 0.
    BASE_GPU_ID = ManagedFlag("--base-gpu-id")


# Set by the builder only when extraArgs do not (a CPU engine defaults to float32): the user may set it.
USER_SETTABLE_ENGINE_FLAGS = ("--dtype",)

ENGINE_FLAGS: tuple[ManagedFlag, ...] = tuple(
    value for name, value in vars(EngineFlags).items() if isinstance(value, ManagedFlag)
)
MANAGED_OPTION_STRINGS: tuple[str, ...] = tuple(s for f in ENGINE_FLAGS for s in f.option_strings)


def flag_name(arg: str) -> str | None:
    """The option name of one extraArgs item (`--port=1` -> `--port`), or None for a value."""
    if not arg.startswith("--"):
        return None
    return arg.split("=", 1)[0]


def managed_flag(arg: str) -> str | None:
    """The managed option string an extraArgs item sets (or abbreviates), or None."""
    name = flag_name(arg)
    if name is None:
        return None
    return next((s for s in MANAGED_OPTION_STRINGS if s.startswith(name)), None)


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


EXTRA_ARG_CEL = (
    "!self.startsWith('--') || !" + _cel_list(MANAGED_OPTION_STRINGS) + ".exists(m, m.startsWith(self.split('=')[0]))"
)
# Longest extraArgs item: bounds the API server's CEL cost estimate of the rule above.
EXTRA_ARG_MAX = 2048


def extra_arg_allowed(arg: str) -> bool:
    """The Python side of EXTRA_ARG_CEL."""
    return managed_flag(arg) is None


EXTRA_ARG_MESSAGE = (
    "must not set (or abbreviate) a flag rlfleet manages: " + ", ".join(f.flag for f in ENGINE_FLAGS)
    + "; use the engine's own fields (modelPath, port, tensorParallelSize, ...)"
)


class ReservedEnv:
    """Environment variables the operator's builders set in the pods they build."""

    POD_IP = "POD_IP"
    POD_NAME = "POD_NAME"
    POD_NAMESPACE = "POD_NAMESPACE"
    FLEET = "RLFLEET_FLEET"
    SLOT = "RLFLEET_SLOT"
    TRAINING_RUN = "RLFLEET_TRAINING_RUN"
    SNAPSHOT_DIR = "RLFLEET_SNAPSHOT_DIR"
    TRAINER_NODE = "RLFLEET_TRAINER_NODE"  # a trainer group's pod: its node rank (0 .. nodes-1)
    API_KEY = API_KEY_ENV  # the fleet's key, from its Secret


# Every RLFLEET_* name is reserved, the ones set today and the ones to come.
RESERVED_ENV_PREFIX = "RLFLEET_"
BUILDER_ENV: tuple[str, ...] = tuple(
    value for name, value in vars(ReservedEnv).items() if not name.startswith("_") and isinstance(value, str)
)
# torch.distributed's launcher sets these in every trainer rank (SGLang reads none of them): a pod's own
# value would make its process take itself for a rank and launch none.
TORCH_LAUNCHER_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                      "MASTER_PORT")
RESERVED_ENV: tuple[str, ...] = BUILDER_ENV + TORCH_LAUNCHER_ENV
RESERVED_ENV_EXACT: tuple[str, ...] = tuple(n for n in RESERVED_ENV if not n.startswith(RESERVED_ENV_PREFIX))


def env_name_reserved(name: str) -> bool:
    return name.startswith(RESERVED_ENV_PREFIX) or name in RESERVED_ENV_EXACT


ENV_NAME_CEL = f"!self.name.startsWith('{RESERVED_ENV_PREFIX}') && !(self.name in {_cel_list(RESERVED_ENV_EXACT)})"
ENV_NAME_MESSAGE = (
    f"is reserved: rlfleet sets {', '.join(RESERVED_ENV_EXACT)} and every {RESERVED_ENV_PREFIX}* variable itself"
)

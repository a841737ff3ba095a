"""One rank of SGLang's own model code (what a CUDA engine runs), on CPU over gloo.

    python tests/helpers/sglang_native_ranks.py RANK TP PP PORT OUT.json MODEL_DIR [MODEL_DIR ...]

For each model directory: SGLang's model class for its architecture is built in this rank's place of
TP tensor-parallel x PP pipeline ranks (rank = pipeline stage x TP + tensor-parallel rank), loads the
directory's safetensors with its own `load_weights`, and SGLang's own `WeightChecker` computes the
checksums this rank would answer on `/weights_checker`.
Rank r writes {model dir: that answer} to OUT.json.r.

Three things differ from an engine on a GPU, none of them in the weights: no forward pass runs, so the
CUDA-only rotary kernel that the rotary embedding imports is a stand-in that raises if called (it holds
no weights); the group's NCCL communicator is off (gloo only); and the rank's place is stated to
SGLang's parallel context as its scheduler states it.
"""
from __future__ import annotations

import glob
import importlib
import json
import sys
import types


def _rotary_kernel_stand_in() -> None:
    module = types.ModuleType("vllm._custom_ops")

    def rotary_embedding(*args: object, **kwargs: object) -> None:
        raise RuntimeError("no rotary kernel here: this process only loads and hashes weights")

    module.rotary_embedding = rotary_embedding
    sys.modules.setdefault("vllm", types.ModuleType("vllm"))
    sys.modules["vllm._custom_ops"] = module


ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def main(argv: list[str]) -> int:
    rank, tp, pp, port, out = int(argv[0]), int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    models = argv[5:]
    world = tp * pp
    _rotary_kernel_stand_in()
    import sglang.srt.distributed.parallel_state as parallel_state
    import sglang.srt.server_args as server_args
    from safetensors.torch import load_file
    from sglang.srt.distributed import init_distributed_environment, initialize_model_parallel
    from sglang.srt.runtime_context import get_parallel
    from sglang.srt.utils.weight_checker import WeightChecker
    from transformers import AutoConfig

    server_args.set_global_server_args_for_scheduler(
        server_args.ServerArgs(model_path=models[0], device="cpu", tp_size=tp, pp_size=pp))
    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    get_parallel().override_permanently(tp_size=tp, tp_rank=rank % tp, pp_size=pp, pp_rank=rank // tp,
                                        attn_tp_rank=rank % tp, attn_tp_size=tp, attn_dp_size=1, attn_dp_rank=0,
                                        attn_cp_rank=0, moe_ep_rank=0, dp_rank=None)
    build_group = parallel_state.init_model_parallel_group

    def gloo_only(*args: object, **kwargs: object) -> object:
        return build_group(*args, **{**kwargs, "use_pynccl": False, "use_custom_allreduce": False})

    parallel_state.init_model_parallel_group = gloo_only
    initialize_model_parallel()

    answers = {}
    for model_dir in models:
        config = AutoConfig.from_pretrained(model_dir)
        architecture = config.architectures[0]
        model_class = getattr(importlib.import_module(f"sglang.srt.models.{ARCHITECTURES[architecture]}"),
                              architecture)
        model = model_class(config)
        weights: dict = {}
        for path in sorted(glob.glob(f"{model_dir}/*.safetensors")):
            weights.update(load_file(path))
        model.load_weights(list(weights.items()))
        answers[model_dir] = WeightChecker(get_model=lambda m=model: m).handle("checksum", role="target")
    with open(f"{out}.{rank}", "w") as f:
        json.dump(answers, f)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

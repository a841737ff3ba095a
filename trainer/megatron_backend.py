"""The `megatron` backend: megatron-core GPTModel (local layer spec) initialised from HF weights.

The model is built to match the HF Llama/Qwen2/Qwen3 architecture of `model_dir` (RMSNorm, SwiGLU,
rotary embeddings, no linear biases except Qwen2's q/k/v, Qwen3's per-head q/k norms, tied
embeddings, GQA) and loaded from
its safetensors through `hf_export.hf_to_megatron`, so export back to HF is exact.

Two execution paths, chosen by `device`:
- CPU: a bare GPTModel with plain `torch.optim.AdamW`. megatron-core 0.16 hard-codes CUDA in a few
  places on this path: the attention-score buffer, the default causal mask (we pass our own), the
  rotary frequencies (moved to the current CUDA device on first use), and attention dropout forks
  a CUDA RNG tracker; see `_cpu_workarounds`.
- CUDA: megatron's own DistributedDataParallel and `get_megatron_optimizer` with the distributed
  optimizer (`_MegatronGpuStep`).
With `options.parallel` above one rank, the process is one rank of a torch.distributed group the
launcher started (trainer/launch.py, trainer/ranks.py): megatron's model-parallel state splits it into
tensor-parallel groups (each rank holds its shards, trainer/shards.py) and data-parallel replicas
(gradients summed across them); the HF export gathers the shards. With pipeline parallelism each rank
builds its stage of the model and the stages hand activations, logits and gradients to each other
(trainer/pipeline.py, over gloo on CPU and NCCL on CUDA); the export gathers the stages too.

Checkpoints: on CPU the model's and AdamW's state dicts. On CUDA the distributed optimizer keeps its
fp32 main weights and moments sharded across the data-parallel replicas; a checkpoint gathers them onto
data-parallel rank 0 (megatron's `get_parameter_state_dp_zero`, its own format) and a restore scatters
them back (`load_parameter_state_from_dp_zero`), as megatron's own non-distributed checkpoints do.
"""
from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from rlfleet.trainer import collectives
from rlfleet.trainer.base import Trainer, TrainerOptions, freeze_reference, resolve_dtype
from rlfleet.trainer.hf_export import Architecture, hf_to_megatron, megatron_to_hf
from rlfleet.trainer.parallel import ParallelLayout, check_layout
from rlfleet.trainer.pipeline import EMBEDDING, Pipeline, global_names, stage_part
from rlfleet.trainer.shards import ShardPlan, join_shards, split_for_rank


def _cpu_workarounds() -> None:
    """Make megatron-core's local attention path run without CUDA (idempotent, process-wide)."""
    import torch
    from megatron.core import tensor_parallel
    from megatron.core import utils as mcore_utils
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    def get_tensor_on_cpu(self, tensor_shape, dtype, name, mem_alloc_context=None):
        # Same contract as GlobalMemoryBuffer.get_tensor, which hard-codes the current CUDA device.
        required = 1
        for dim in tensor_shape:
            required *= dim
        buffer = self.buffer.get((name, dtype))
        if buffer is None or buffer.numel() < required:
            buffer = self.buffer[(name, dtype)] = torch.empty(required, dtype=dtype, device="cpu")
        return buffer[:required].view(*tensor_shape)

    mcore_utils.GlobalMemoryBuffer.get_tensor = get_tensor_on_cpu
    tensor_parallel.mappings._gather_along_last_dim = gather_along_last_dim_on_cpu
    RotaryEmbedding.get_emb = rotary_emb_on_cpu
    # Megatron's own no-op tracker: fork() is a nullcontext, dropout uses the CPU generator.
    tensor_parallel.random.initialize_rng_tracker(inference_rng_tracker=True, force_reset=True)


def gather_along_last_dim_on_cpu(input_, group):
    """megatron's `_gather_along_last_dim` (the vocab-parallel logits' gather under tensor parallelism)
    with its output on the input's device instead of the current CUDA device."""
    import torch
    import torch.distributed as dist

    world_size = group.size()
    if world_size == 1:
        return input_
    shards = [torch.empty_like(input_) for _ in range(world_size)]
    dist.all_gather(shards, input_.contiguous(), group=group)
    return torch.cat(shards, dim=-1).contiguous()


def rotary_emb_on_cpu(self, max_seq_len: int, offset: int = 0):
    """RotaryEmbedding.get_emb without its move of `inv_freq` to the current CUDA device.

    Same result as megatron's (non-interleaved: [freqs, freqs] on the last dim, shape
    [seq, 1, 1, dim]); the interleaved layout is not used by Llama/Qwen2.
    """
    import torch

    freqs = self.get_freqs_non_repeated(max_seq_len, offset)
    if self.rotary_interleaved:
        emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
    else:
        emb = torch.cat((freqs, freqs), dim=-1)
    return emb[:, None, None, :]


def hide_unloadable_flash_mla() -> None:
    """Let megatron see a missing flash_mla rather than crash on it.

    megatron-core imports `flash_mla` optionally but only catches ImportError; the CUDA wheel that
    SGLang pulls in raises OSError (no libcuda) on a machine without a GPU.
    """
    import sys

    if "flash_mla" in sys.modules:
        return
    try:
        import flash_mla  # noqa: F401 - imported only to see whether it loads
    except ImportError:
        pass
    except OSError:
        # A None entry makes `import flash_mla` raise ImportError.
        sys.modules["flash_mla"] = None  # type: ignore[assignment]  # typeshed has no None in sys.modules


def _init_ranks(device: str, seed: int, layout: ParallelLayout) -> None:
    """Megatron's model-parallel state over this process's torch.distributed group.

    One rank: a world-size-1 group of its own (gloo on CPU, nccl on CUDA). More: the group the
    launcher's rendezvous made (trainer/ranks.py), which must be exactly `layout.world` ranks.
    """
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    from rlfleet.util.ports import free_port

    if not dist.is_initialized():
        if layout.world != 1:
            raise RuntimeError(f"a trainer of {layout.world} ranks runs in a torch.distributed group: "
                               "start it with the rank launcher (rlfleet.trainer.launch)")
        backend = "nccl" if device.startswith("cuda") else "gloo"
        dist.init_process_group(
            backend, world_size=1, rank=0, init_method=f"tcp://127.0.0.1:{free_port('127.0.0.1')}"
        )
    if dist.get_world_size() != layout.world:
        raise RuntimeError(f"the process group has {dist.get_world_size()} ranks, the layout {layout.world} "
                           f"(tensor {layout.tensor} x pipeline {layout.pipeline} x data {layout.data})")
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=layout.tensor, pipeline_model_parallel_size=layout.pipeline
        )
    if device.startswith("cuda"):
        index = torch.device(device).index
        if index is not None:
            torch.cuda.set_device(index)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
    else:
        _cpu_workarounds()


def build_gpt_model(arch: Architecture, dtype: Any, layout: ParallelLayout | None = None) -> Any:
    """A megatron-core GPTModel with the local layer spec, shaped like the HF model (uninitialised)."""
    import torch

    hide_unloadable_flash_mla()
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=arch.num_layers,
        hidden_size=arch.hidden_size,
        num_attention_heads=arch.num_heads,
        num_query_groups=arch.num_kv_heads,
        kv_channels=arch.head_dim,
        ffn_hidden_size=arch.ffn_hidden_size,
        normalization="RMSNorm",
        layernorm_epsilon=arch.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=torch.nn.functional.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.qkv_bias,
        qk_layernorm=arch.qk_norm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        attention_softmax_in_fp32=True,
        # Fused kernels need apex / TransformerEngine / CUDA; the local spec does without.
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        persist_layer_norm=False,
        tensor_model_parallel_size=layout.tensor if layout else 1,
        pipeline_model_parallel_size=layout.pipeline if layout else 1,
        # The loss is already normalised by the step's tokens: megatron's DDP sums the replicas'
        # gradients instead of averaging them.
        calculate_per_token_loss=True,
        use_cpu_initialization=True,
        perform_initialization=False,  # every weight is loaded from the HF checkpoint
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=dtype == torch.bfloat16,
        fp16=dtype == torch.float16,
    )
    stages: dict[str, bool] = {}
    if layout is not None and layout.pipeline > 1:
        from megatron.core import parallel_state

        stages = {"pre_process": parallel_state.is_pipeline_first_stage(),
                  "post_process": parallel_state.is_pipeline_last_stage()}
    with _no_embedding_sync_at_build(bool(stages)):
        model = GPTModel(
            config,
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm", qk_layernorm=arch.qk_norm),
            vocab_size=arch.vocab_size,
            max_sequence_length=arch.max_position_embeddings,
            position_embedding_type="rope",
            rotary_percent=1.0,
            rotary_base=arch.rope_theta,
            share_embeddings_and_output_weights=arch.tied_embeddings,
            parallel_output=False,
            **stages,
        )
    mark_tensor_parallel(model)
    return model


class _no_embedding_sync_at_build:
    """With pipeline stages and tied embeddings megatron copies the first stage's embedding into the last
    stage's output weight at construction, on CUDA (`weight.data.cuda()`). Every weight is loaded from
    the HF checkpoint instead (the last stage's copy included, trainer/pipeline.py), so that copy is
    skipped while the model is built."""

    def __init__(self, active: bool):
        self.active = active
        self.saved: Any = None

    def __enter__(self) -> None:
        if self.active:
            from megatron.core.models.common.language_module.language_module import LanguageModule

            self.saved = LanguageModule._is_in_embd_group
            LanguageModule._is_in_embd_group = lambda self: False  # see the class doc

    def __exit__(self, *exc: object) -> None:
        if self.saved is not None:
            from megatron.core.models.common.language_module.language_module import LanguageModule

            LanguageModule._is_in_embd_group = self.saved


def mark_tensor_parallel(model: Any) -> None:
    """Set megatron's tensor-parallel attributes on every sharded parameter.

    Megatron sets them only while it initialises weights, and ours are loaded instead
    (perform_initialization=False); without them neither our shard plan nor megatron's own
    gradient-norm and optimizer code could tell a shard from a replicated tensor.
    """
    import torch
    from megatron.core.tensor_parallel.layers import (
        ColumnParallelLinear,
        RowParallelLinear,
        VocabParallelEmbedding,
        set_tensor_model_parallel_attributes,
    )

    for module in model.modules():
        if isinstance(module, ColumnParallelLinear | VocabParallelEmbedding):
            dims = {"weight": 0, "bias": 0}
        elif isinstance(module, RowParallelLinear):
            dims = {"weight": 1}  # its bias is added after the reduction: whole on every rank
        else:
            continue
        for name, dim in dims.items():
            param = getattr(module, name, None)
            if isinstance(param, torch.nn.Parameter):
                set_tensor_model_parallel_attributes(param, True, dim, 1)


def tensor_parallel_partial_grads(named_parameters: Any) -> list[Any]:
    """The parameters every tensor-parallel rank holds whole but whose gradient each rank computes from
    its own attention heads only: Qwen3's query and key norms (one weight shared by all heads). Their
    gradients are summed over the tensor-parallel group, as megatron's finalize_model_grads does."""
    return [p for name, p in named_parameters
            if name.endswith(("self_attention.q_layernorm.weight", "self_attention.k_layernorm.weight"))]


def load_hf_weights(model_dir: Any) -> dict[str, Any]:
    """All tensors of an HF directory's safetensors files (single file or sharded)."""
    from pathlib import Path

    from safetensors.torch import load_file

    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no safetensors weights in {model_dir}")
    state: dict[str, Any] = {}
    for path in files:
        state.update(load_file(str(path)))
    return state


def load_into(model: Any, mg_state: dict[str, Any]) -> None:
    """Copy the converted weights in; every parameter must be covered."""
    result = model.load_state_dict(mg_state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"megatron weights do not fit: missing {missing}, unexpected {result.unexpected_keys}")


class MegatronTrainer(Trainer):
    backend = "megatron"

    def __init__(self, model_dir: str | os.PathLike, options: TrainerOptions, device: str = "cpu"):
        super().__init__(model_dir, options, device)
        import torch

        self.arch = Architecture.from_hf_config(self.hf_config)
        self.layout = options.parallel
        check_layout(self.layout, "megatron", self.arch, device)
        if options.data_parallel_mode != "ddp":
            raise ValueError(f"spec.trainer.dataParallelMode {options.data_parallel_mode} is the torch backend's: "
                             "megatron's replicas run its DDP (and on GPUs its distributed optimizer)")
        self._dtype = resolve_dtype(options.dtype, device)
        # On CUDA in half precision the model runs under megatron's Float16Module, which hands the last
        # stage's logits out in float32; the pipeline's other stages receive them in that dtype.
        half = self._dtype in (torch.bfloat16, torch.float16)
        self._logits_dtype = torch.float32 if device.startswith("cuda") and half else self._dtype
        torch.manual_seed(options.seed)
        _init_ranks(device, options.seed, self.layout)
        self.pipe = Pipeline() if self.layout.pipeline > 1 else None
        self.gpt = build_gpt_model(self.arch, self._dtype, self.layout)
        self._plan = ShardPlan.of(self.gpt)
        initial = self._this_ranks_part(hf_to_megatron(load_hf_weights(model_dir), self.arch))
        load_into(self.gpt, initial)
        self.gpt.to(device)
        self.reference = self._build_reference(initial) if options.loss.uses_reference else None
        self._gpu: _MegatronGpuStep | None
        if device.startswith("cuda"):
            self._gpu = _MegatronGpuStep(self.gpt, options)
            self.model = self._gpu.model
        else:
            self._gpu = None
            self.model = self.gpt
            self.optimizer = torch.optim.AdamW(
                self.gpt.parameters(), lr=options.lr, betas=options.betas, weight_decay=options.weight_decay
            )
        self._masks: dict[int, Any] = {}

    # --- ranks -------------------------------------------------------------------------------

    def _this_ranks_part(self, full: dict[str, Any]) -> dict[str, Any]:
        from megatron.core import parallel_state

        rank = parallel_state.get_tensor_model_parallel_rank()
        if self.pipe is not None:  # this stage's layers, under megatron's local numbering
            full = stage_part(full, self.pipe.stage, self.pipe.stages, self.arch.num_layers, self.arch.tied_embeddings)
        part = split_for_rank(full, self._plan, rank, self.layout.tensor)
        # Buffers and extra state megatron keeps beside the parameters load as they are.
        return {**{k: v for k, v in full.items() if k not in self._plan.dims}, **part}

    def _start_stats_reduction(self, sums: list[float], maxima: list[float]) -> collectives.StatsReduction:
        if self.layout.data == 1:
            return super()._start_stats_reduction(sums, maxima)
        from megatron.core import parallel_state

        return collectives.start_reduce_stats(sums, maxima, parallel_state.get_data_parallel_group())

    def _full_state(self) -> dict[str, Any]:
        """Every parameter whole, under the whole model's names: the tensor-parallel shards gathered (a
        collective of the TP group), then the pipeline stages (of the pipeline group)."""
        state = self._stage_state()
        if self.pipe is None:
            return state
        arch = self.arch
        mine = {k: v.detach().cpu() for k, v in state.items() if v is not None}
        part = global_names(mine, self.pipe.stage, self.pipe.stages, arch.num_layers, arch.tied_embeddings)
        return self.pipe.gather_states(part)

    def _stage_state(self) -> dict[str, Any]:
        state = self.gpt.state_dict()
        if self.layout.tensor == 1:
            return dict(state)
        import torch
        import torch.distributed as dist
        from megatron.core import parallel_state

        group = parallel_state.get_tensor_model_parallel_group()
        out = dict(state)
        for name in sorted(self._plan.dims):
            if self._plan.dims[name] is None:
                continue
            local = state[name].detach().contiguous()
            shards = [torch.empty_like(local) for _ in range(self.layout.tensor)]
            dist.all_gather(shards, local, group=group)
            out[name] = join_shards(name, shards, self._plan)
        return out

    @property
    def param_dtype(self) -> Any:
        return self._dtype

    def _causal_mask(self, length: int) -> Any:
        # Megatron's default causal mask is built on CUDA; pass one (True = masked out).
        import torch

        mask = self._masks.get(length)
        if mask is None:
            mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=self.device), diagonal=1)
            mask = self._masks[length] = mask.view(1, 1, length, length)
        return mask

    def _build_reference(self, initial: dict[str, Any]) -> Any:
        """The KL reference: a second GPTModel holding the initial weights, frozen, on the same device.

        Not wrapped in DDP (it never takes a gradient); on CUDA in half precision it gets the same
        Float16Module wrapper as the policy, so both compute their logits the same way.
        """
        reference = build_gpt_model(self.arch, self._dtype, self.layout)
        load_into(reference, initial)
        reference.to(self.device)
        if self.device.startswith("cuda") and (reference.config.bf16 or reference.config.fp16):
            from megatron.core.transformer.module import Float16Module

            reference = Float16Module(reference.config, reference)
        return freeze_reference(reference)

    def _logits_of(self, model: Any, input_ids: Any) -> Any:
        import torch

        batch, length = input_ids.shape
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0).expand(batch, length)
        pipe = self.pipe
        if pipe is None:
            return model(input_ids=input_ids, position_ids=positions, attention_mask=self._causal_mask(length))
        if not pipe.first:  # megatron's activations are sequence-first
            from megatron.core.utils import get_attr_wrapped_model

            # Through megatron's wrappers (DDP has no set_input_tensor of its own).
            set_input_tensor = get_attr_wrapped_model(model, "set_input_tensor")
            set_input_tensor(pipe.receive_input((length, batch, self.arch.hidden_size), self._dtype,
                                                input_ids.device))
        out = model(input_ids=input_ids, position_ids=positions, attention_mask=self._causal_mask(length))
        if pipe.last:
            return pipe.share_logits(out)
        return pipe.hand_on(out, (batch, length, self.arch.vocab_size), self._logits_dtype)

    def _forward_logits(self, input_ids: Any) -> Any:
        return self._logits_of(self.model, input_ids)

    def _reference_logits(self, input_ids: Any) -> Any:
        if self.reference is None:
            raise RuntimeError("this trainer keeps no reference model (kl_coef is 0)")
        return self._logits_of(self.reference, input_ids)

    def _zero_grad(self) -> None:
        if self._gpu is not None:
            self._gpu.zero_grad()
        else:
            self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        if self._gpu is not None:
            return self._gpu.step()
        import torch

        max_norm = self.options.max_grad_norm or float("inf")
        if self.layout.world == 1:
            norm = float(torch.nn.utils.clip_grad_norm_(self.gpt.parameters(), max_norm))
        else:
            norm = self._clip_across_ranks(max_norm)
        self.optimizer.step()
        return norm

    def _reduce_gradients(self) -> None:
        # On CUDA megatron reduces them in its optimizer step (finalize_model_grads), these included.
        if self._gpu is not None:
            return
        from megatron.core import parallel_state

        from rlfleet.trainer.collectives import sum_gradients

        if self.layout.tensor > 1:
            partial = tensor_parallel_partial_grads(self.gpt.named_parameters())
            if partial:
                sum_gradients(partial, parallel_state.get_tensor_model_parallel_group())
        if self.layout.data > 1:
            sum_gradients(list(self.gpt.parameters()), parallel_state.get_data_parallel_group())

    def _clip_across_ranks(self, max_norm: float) -> float:
        """Clip by the norm over every tensor-parallel shard and pipeline stage (the replicas' gradients
        are summed already)."""
        from megatron.core import parallel_state

        from rlfleet.trainer.collectives import clip_grad_norm

        params = list(self.gpt.parameters())
        tied_copy = None
        if self.pipe is not None and self.arch.tied_embeddings:
            # The first stage's embedding and the last stage's copy of it take the same (summed) gradient.
            weight = self.gpt.state_dict(keep_vars=True)[EMBEDDING if self.pipe.first else "output_layer.weight"]
            self.pipe.sum_tied_gradient(weight)
            tied_copy = None if self.pipe.first else weight
        tp_rank = parallel_state.get_tensor_model_parallel_rank()
        group = parallel_state.get_model_parallel_group() if self.layout.tensor * self.layout.pipeline > 1 else None
        # A replicated tensor (a norm) has the same gradient on every tensor-parallel rank: count it once;
        # the tied embedding once too, on the first stage.
        return clip_grad_norm(params, max_norm, group,
                              counts=lambda p: p is not tied_copy and (
                                  tp_rank == 0 or bool(getattr(p, "tensor_model_parallel", False))))

    def _set_train(self, training: bool) -> None:
        self.model.train(training)

    def hf_state_dict(self) -> dict[str, Any]:
        return megatron_to_hf(self._full_state(), self.arch)

    def checkpoint_objects(self) -> tuple[Any, Any]:
        return self.gpt, (self._gpu.optimizer if self._gpu is not None else self.optimizer)

    @property
    def optimizer_format(self) -> str:
        return "megatron-distributed" if self._gpu is not None else super().optimizer_format

    def gather_optimizer_shards(self) -> Any:
        return self._gpu.gather_shards() if self._gpu is not None else None

    def scatter_optimizer_shards(self, shards: Any) -> None:
        if self._gpu is not None:
            self._gpu.scatter_shards(shards)


class _MegatronGpuStep:
    """Megatron's DDP wrapper and optimizer (CUDA only: both allocate on the current CUDA device).

    Gradients accumulate in DDP's contiguous buffers (`main_grad`), so zeroing and stepping go
    through the wrapper and the megatron optimizer instead of torch's.
    """

    def __init__(self, gpt: Any, options: TrainerOptions):
        from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
        from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
        from megatron.core.transformer.module import Float16Module

        config = gpt.config
        module = Float16Module(config, gpt) if (config.bf16 or config.fp16) else gpt
        self.model = DistributedDataParallel(
            config,
            DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                          use_distributed_optimizer=True),
            module=module,
        )
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(
                optimizer="adam",
                lr=options.lr,
                weight_decay=options.weight_decay,
                adam_beta1=options.betas[0],
                adam_beta2=options.betas[1],
                clip_grad=options.max_grad_norm,
                bf16=config.bf16,
                fp16=config.fp16,
                params_dtype=config.params_dtype,
                # The optimizer state is sharded across the data-parallel replicas (ZeRO-1).
                use_distributed_optimizer=True,
            ),
            [self.model],
        )

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()

    def step(self) -> float:
        from megatron.core.distributed import finalize_model_grads

        # The replicas' gradients, and with pipeline stages the tied embedding's two copies (first stage,
        # last stage) summed; the loss is already normalised per token (no num_tokens).
        finalize_model_grads([self.model])
        success, grad_norm, _ = self.optimizer.step()
        if not success:
            raise FloatingPointError("megatron optimizer step skipped (non-finite gradients)")
        return float(grad_norm or 0.0)

    def _distributed_optimizers(self) -> list[Any]:
        # get_megatron_optimizer returns one DistributedOptimizer, or a ChainedOptimizer of several.
        return list(getattr(self.optimizer, "chained_optimizers", [self.optimizer]))

    def gather_shards(self) -> list[Any] | None:
        """Every sub-optimizer's sharded state (fp32 main weights, moments) gathered onto data-parallel
        rank 0, on the CPU; None on the other replicas. A collective of the data-parallel group."""
        from megatron.core import parallel_state

        states = [opt.get_parameter_state_dp_zero() for opt in self._distributed_optimizers()]
        return states if parallel_state.get_data_parallel_rank() == 0 else None

    def scatter_shards(self, shards: list[Any] | None) -> None:
        """The reverse: data-parallel rank 0's `shards` scattered back to every replica (the others'
        argument is not read). A collective of the data-parallel group."""
        from megatron.core import parallel_state

        optimizers = self._distributed_optimizers()
        first = parallel_state.get_data_parallel_rank() == 0
        if first and (shards is None or len(shards) != len(optimizers)):
            raise ValueError(f"the checkpoint holds {0 if shards is None else len(shards)} sharded optimizer "
                             f"states, this trainer's optimizer has {len(optimizers)}")
        for index, opt in enumerate(optimizers):
            with step_counts_set_aside(opt.optimizer.state):
                opt.load_parameter_state_from_dp_zero(shards[index] if first and shards is not None else None)


@contextlib.contextmanager
def step_counts_set_aside(state: dict[Any, dict[str, Any]]) -> Iterator[None]:
    """Torch Adam's per-parameter `step` counts, out of `state` while megatron loads the sharded state.

    Without Apex or TransformerEngine, megatron's distributed optimizer runs torch's AdamW, whose state
    holds a `step` beside the moments; `load_parameter_state_from_dp_zero` copies every key of that state
    from the shards, which hold only the main weights and the moments (KeyError: 'step'). The counts
    were already restored from the param groups by `load_state_dict`, as one tensor shared by every
    parameter, which torch's foreach step would advance once per parameter: each gets its own copy back.
    """
    steps = {param: entry.pop("step") for param, entry in state.items() if "step" in entry}
    try:
        yield
    finally:
        for param, step in steps.items():
            state[param]["step"] = step.clone() if hasattr(step, "clone") else step


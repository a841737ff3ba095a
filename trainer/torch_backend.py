"""The `torch` backend: a Hugging Face transformers causal LM with AdamW (CPU or GPUs).

Data parallel (`options.parallel.data` > 1): the process is one replica of a torch.distributed group
the launcher started (trainer/ranks.py), its model wrapped in torch's DistributedDataParallel: the
backward pass of a step's last micro-batch all-reduces the gradients bucket by bucket while it runs
(the earlier ones accumulate under `no_sync`). The hook sums instead of DDP's mean: the loss is
normalised by the step's tokens over every replica, so the sum is the gradient of the whole batch
and every replica takes the same step.

With `dataParallelMode: fsdp` the replicas shard the weights, gradients and AdamW moments instead
(PyTorch FSDP2, trainer/fsdp.py): every forward and backward pass gathers a layer's weights from all
of them, so the replicas run the same passes in a step and every rank joins each export, logits call
and checkpoint (trainer/ranks.py sends them all). Exports and checkpoints hold whole tensors, as one
rank's do.
"""
from __future__ import annotations

import contextlib
import copy
import os
from collections.abc import Mapping
from typing import Any

from rlfleet.trainer import collectives, fsdp
from rlfleet.trainer.base import Trainer, TrainerOptions, freeze_reference, resolve_dtype
from rlfleet.trainer.parallel import check_layout


def sum_gradients_hook(state, bucket):  # unannotated: DDP refuses any `bucket` annotation but its own class
    """A DDP communication hook: the bucket's gradients summed over the replicas (DDP's own divides by
    the world size)."""
    import torch.distributed as dist

    return dist.all_reduce(bucket.buffer(), group=state, async_op=True).get_future().then(lambda f: f.value()[0])


class TorchTrainer(Trainer):
    backend = "torch"

    def __init__(self, model_dir: str | os.PathLike, options: TrainerOptions, device: str = "cpu"):
        super().__init__(model_dir, options, device)
        import torch
        from transformers import AutoModelForCausalLM

        self.layout = options.parallel
        check_layout(self.layout, "torch", device=device)
        self.fsdp = options.data_parallel_mode == "fsdp"
        if self.fsdp and self.layout.data < 2:
            raise ValueError("spec.trainer.dataParallelMode fsdp shards the model across data-parallel replicas: "
                             f"it needs dataParallelSize above 1 (got {self.layout.data})")
        if self.layout.world > 1:
            import torch.distributed as dist

            if not dist.is_initialized() or dist.get_world_size() != self.layout.world:
                raise RuntimeError(f"a trainer of {self.layout.world} data-parallel ranks runs in a torch.distributed "
                                   "group of that size: start it with the rank launcher (rlfleet.trainer.launch)")
        torch.manual_seed(options.seed)
        self._dtype = resolve_dtype(options.dtype, device)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self._dtype)
        # transformers wraps `to` with functools.wraps(torch.nn.Module.to), which mypy reads as unbound.
        self.model = model.to(device)  # type: ignore[arg-type]  # the wrapped method's self is taken for `device`
        self.model.config.use_cache = False
        # The KL reference: the initial weights, frozen, beside the policy on the same device.
        self.reference = freeze_reference(copy.deepcopy(self.model)) if options.loss.uses_reference else None
        if self.fsdp:
            fsdp.shard_model(self.model, device, self.layout.data)  # before the optimizer: it holds the shards
            if self.reference is not None:  # sharded too: the replicas run its forward passes in lockstep as well
                fsdp.shard_model(self.reference, device, self.layout.data)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=options.lr, betas=options.betas, weight_decay=options.weight_decay
        )
        # The training forward runs through DDP; everything else (logits, export, checkpoints) uses the
        # model itself, whose parameters DDP shares.
        self._ddp: Any = None
        if self.layout.data > 1 and not self.fsdp:
            from torch.nn.parallel import DistributedDataParallel

            self._ddp = DistributedDataParallel(self.model, device_ids=[torch.device(device).index or 0]
                                                if device.startswith("cuda") else None, forward_sync_buffers=False)
            self._ddp.register_comm_hook(None, sum_gradients_hook)

    @property
    def param_dtype(self) -> Any:
        return self._dtype

    @property
    def passes_in_lockstep(self) -> bool:
        return self.fsdp

    @property
    def _gradient_scale(self) -> float:
        return float(self.layout.data) if self.fsdp else 1.0

    def _forward_logits(self, input_ids: Any) -> Any:
        import torch

        # Right padding under a causal mask: pads only follow the tokens that are scored.
        module = self._ddp if self._ddp is not None and torch.is_grad_enabled() else self.model
        return module(input_ids=input_ids, use_cache=False).logits

    def _reference_logits(self, input_ids: Any) -> Any:
        if self.reference is None:
            raise RuntimeError("this trainer keeps no reference model (kl_coef is 0)")
        return self.reference(input_ids=input_ids, use_cache=False).logits

    def _zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def _optimizer_step(self) -> float:
        import torch

        max_norm = self.options.max_grad_norm or float("inf")
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        self.optimizer.step()
        # FSDP: a DTensor, the norm over every replica's shards
        return float(norm.full_tensor() if self.fsdp else norm)  # type: ignore[attr-defined]

    def _micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        if self.fsdp:
            return fsdp.gradient_sync(self.model, last)  # accumulate; the last pass reduce-scatters the sum
        if self._ddp is None or last:
            return contextlib.nullcontext()
        return self._ddp.no_sync()  # accumulate: the last micro-batch's backward pass reduces the sum

    def _start_stats_reduction(self, sums: list[float], maxima: list[float]) -> collectives.StatsReduction:
        if self.layout.data == 1:
            return super()._start_stats_reduction(sums, maxima)
        return collectives.start_reduce_stats(sums, maxima, None)

    def _set_train(self, training: bool) -> None:
        self.model.train(training)

    def hf_state_dict(self) -> dict[str, Any]:
        if self.fsdp:
            return fsdp.full_model_state(self.model)  # every rank gathers; rank 0 gets the weights
        return dict(self.model.state_dict())

    def checkpoint_objects(self) -> tuple[Any, Any]:
        return self.model, self.optimizer

    def checkpoint_state(self, *, keep: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
        if not self.fsdp:
            return super().checkpoint_state(keep=keep)
        weights = fsdp.full_model_state(self.model)
        optim = fsdp.full_optimizer_state(self.model, self.optimizer)
        if not keep:
            return None
        return weights, fsdp.optimizer_state_by_index(optim, fsdp.parameter_names(self.model))

    def load_checkpoint_state(self, weights: Mapping[str, Any],
                              optim: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        if not self.fsdp:
            return super().load_checkpoint_state(weights, optim)
        names = set(self.model.state_dict())
        missing, unexpected = sorted(names - set(weights)), sorted(set(weights) - names)
        if missing or unexpected:
            return missing, unexpected
        fsdp.load_full_state(self.model, self.optimizer, weights,
                             fsdp.optimizer_state_by_name(optim, fsdp.parameter_names(self.model)))
        return [], []

    def hf_generate(self, input_ids: Any, **kwargs: Any) -> Any:
        """transformers' own generate (KV cache), for fast local rollouts in measurements."""
        import torch

        if self.fsdp:
            raise RuntimeError("hf_generate runs on one rank; under FSDP every rank's shards take part")
        self._set_train(False)
        with torch.no_grad():
            return self.model.generate(input_ids=input_ids, use_cache=True, **kwargs)

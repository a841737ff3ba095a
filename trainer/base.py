"""The trainer interface the RL loop drives, and the step logic both backends share.

A backend supplies a forward pass (logits [B, L, V]), an optimizer step and its weights under
Hugging Face names; everything else (collation, the clipped policy-gradient loss, micro-batches,
export) lives here so the two backends cannot drift.

    trainer = build_trainer("torch", model_dir, lr=1e-3, seed=0, device="cpu",
                            loss=grpo.LossConfig(kl_coef=0.01))  # kl_coef > 0: KL to the initial weights
    metrics = trainer.train_step(samples)        # one optimizer step; trainer.step += 1
    state = trainer.state_for_export()           # weights copied off the device (fast)
    write_hf_snapshot(state, out_dir)            # may run in a thread beside the next step
"""
from __future__ import annotations

import abc
import contextlib
import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rlfleet.snapshot.writer import ExportState, config_with_dtype, write_hf_snapshot
from rlfleet.trainer import collectives, grpo
from rlfleet.trainer.hf_export import hf_state_for_save
from rlfleet.trainer.parallel import ParallelLayout

BACKENDS = ("torch", "megatron")
DATA_PARALLEL_MODES = ("ddp", "fsdp")


@dataclass(frozen=True)
class TrainerOptions:
    """Optimizer and loss settings shared by both backends."""

    lr: float = 1e-5
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.999)
    max_grad_norm: float = 1.0  # 0 disables clipping
    micro_batch_size: int | None = None  # samples per forward/backward; None: the whole batch at once
    loss: grpo.LossConfig = field(default_factory=grpo.LossConfig)
    seed: int = 0
    dtype: str | None = None  # parameter dtype; None: float32 on CPU, bfloat16 on CUDA
    # tensor x pipeline x data parallel ranks; above 1 the process runs in a torch.distributed group
    # (trainer/ranks.py) and `train_step` takes this data-parallel replica's part of the step's batch.
    parallel: ParallelLayout = field(default_factory=ParallelLayout)
    # How the torch backend's data-parallel replicas hold the model: "ddp" (whole on each) or "fsdp"
    # (FSDP2: weights, gradients and optimizer state sharded across them).
    data_parallel_mode: str = "ddp"

    def __post_init__(self) -> None:
        if self.lr <= 0:
            raise ValueError(f"lr must be > 0, got {self.lr}")
        if self.micro_batch_size is not None and self.micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {self.micro_batch_size}")
        if self.dtype not in (None, "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be float32, bfloat16 or float16, got {self.dtype!r}")
        if self.data_parallel_mode not in DATA_PARALLEL_MODES:
            raise ValueError(f"data_parallel_mode must be one of {', '.join(DATA_PARALLEL_MODES)}, "
                             f"got {self.data_parallel_mode!r}")


def resolve_dtype(name: str | None, device: str) -> Any:
    import torch

    if name is None:
        name = "bfloat16" if str(device).startswith("cuda") else "float32"
    return getattr(torch, name)


def read_hf_config(model_dir: str | os.PathLike) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{model_dir} is not a Hugging Face model directory (no config.json)")
    return json.loads(path.read_text())


class Trainer(abc.ABC):
    """One policy model with its optimizer. `step` counts optimizer steps taken."""

    backend: str = ""

    def __init__(self, model_dir: str | os.PathLike, options: TrainerOptions, device: str):
        self.model_dir = Path(model_dir)
        self.options = options
        self.device = device
        self.hf_config = read_hf_config(model_dir)
        self.pad_id = int(self.hf_config.get("pad_token_id") or self.hf_config.get("eos_token_id") or 0)
        self.step = 0

    # --- what a backend provides -------------------------------------------------------------

    @abc.abstractmethod
    def _forward_logits(self, input_ids: Any) -> Any:
        """Logits [B, L, V] for right-padded input_ids [B, L] under a causal mask."""

    @abc.abstractmethod
    def _reference_logits(self, input_ids: Any) -> Any:
        """Logits [B, L, V] of the frozen initial weights, as `_forward_logits` computes them.

        Called (under no_grad) only when the loss has a KL penalty (`options.loss.kl_coef` > 0); a
        backend keeps that frozen copy only then (see `freeze_reference`).
        """

    @abc.abstractmethod
    def _zero_grad(self) -> None: ...

    @abc.abstractmethod
    def _optimizer_step(self) -> float:
        """Clip, step, and return the gradient norm before clipping."""

    def _micro_batch(self, *, last: bool) -> contextlib.AbstractContextManager[Any]:
        """The context of one micro-batch's forward and backward pass; `last`: the step's last one. A
        backend whose backward pass reduces the gradients (torch DDP) reduces them in the last only."""
        return contextlib.nullcontext()

    def _reduce_gradients(self) -> None:
        """Sum the data-parallel replicas' gradients (the step's first collective after the forward
        passes, so the replicas meet here). One replica, or a backend whose backward pass or optimizer
        step reduces them itself, does nothing."""
        return None

    @abc.abstractmethod
    def _set_train(self, training: bool) -> None: ...

    @abc.abstractmethod
    def hf_state_dict(self) -> dict[str, Any]:
        """The weights under Hugging Face names (may be device tensors or views)."""

    @property
    @abc.abstractmethod
    def param_dtype(self) -> Any: ...

    def checkpoint_objects(self) -> tuple[Any, Any]:
        """(the module whose state dict is this rank's model, its optimizer), for trainer/checkpoint.py."""
        raise NotImplementedError(f"the {self.backend} backend writes no checkpoints")

    def checkpoint_state(self, *, keep: bool) -> tuple[dict[str, Any], dict[str, Any]] | None:
        """(weights, optimizer state) as a checkpoint holds them: the model's state dict tensors under the
        backend's names and torch's `Optimizer.state_dict()` (may be device tensors); None without `keep`
        (a rank whose shard holds no weights). Every rank calls it, in the same order: where a backend
        shards them over the replicas it is a gather."""
        if not keep:
            return None
        import torch

        model, optimizer = self.checkpoint_objects()
        tensors = {k: v for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}
        return tensors, optimizer.state_dict()

    def load_checkpoint_state(self, weights: Mapping[str, Any],
                              optim: Mapping[str, Any]) -> tuple[list[str], list[str]]:
        """Load what `checkpoint_state` made; (missing, unexpected) weight names, and nothing loaded when
        either is not empty. Every rank calls it, with the same state where the backend shards it."""
        model, optimizer = self.checkpoint_objects()
        result = model.load_state_dict(weights, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            return missing, list(result.unexpected_keys)
        optimizer.load_state_dict(optim)
        return [], []

    @property
    def optimizer_format(self) -> str:
        """What a checkpoint's optimizer state is: a shard resumes only into the same format."""
        return "torch"

    def gather_optimizer_shards(self) -> Any:
        """Optimizer state kept sharded across the data-parallel replicas (outside its state dict),
        gathered onto data-parallel rank 0; None on the other replicas, and None where the state dict
        holds everything. Every rank calls it, in the same order: it may be a collective."""
        return None

    def scatter_optimizer_shards(self, shards: Any) -> None:
        """The reverse of gather_optimizer_shards (`shards` is read on data-parallel rank 0 only).
        Every rank calls it, in the same order."""
        return None  # nothing kept outside the state dict

    # --- the interface the RL loop uses --------------------------------------------------------

    @property
    def passes_in_lockstep(self) -> bool:
        """Whether every data-parallel replica must run the same number of forward and backward passes in a
        step (a backend that gathers the weights in them: FSDP)."""
        return False

    @property
    def _gradient_scale(self) -> float:
        """What the loss is multiplied by for its backward pass: a backend whose reduction averages the
        replicas' gradients (FSDP) scales by their number, so the average is the sum."""
        return 1.0

    def train_step(self, batch: Sequence[grpo.Sample], *, step_tokens: int | None = None,
                   largest_part: int | None = None) -> dict[str, float]:
        """One optimizer step on the clipped policy-gradient loss of `batch`; returns metrics.

        `step_tokens`: the response tokens of the whole step over every data-parallel replica (the caller
        that split the batch knows them, so the replicas need no collective before the forward pass);
        None: `batch` is the whole step (one replica). `largest_part`: the samples of the step's largest
        replica part; where `passes_in_lockstep`, a replica with fewer micro-batches than that part
        makes as many passes, the extra ones contributing nothing.
        """
        if not batch:
            raise ValueError("train_step needs at least one sample")
        started = time.perf_counter()
        size = self.options.micro_batch_size or max(len(batch), largest_part or 0)
        chunks = [batch[i : i + size] for i in range(0, len(batch), size)]
        passes = len(chunks)
        if self.passes_in_lockstep and largest_part is not None:
            passes = max(passes, -(-largest_part // size))
        collated = [grpo.collate(c, pad_id=self.pad_id, device=self.device) for c in chunks]
        # The loss is normalised by the step's tokens over every data-parallel replica, so the replicas'
        # summed gradients are the gradient of the whole batch.
        if step_tokens is None:
            if self.options.parallel.data > 1:
                raise ValueError(f"a replica of dataParallelSize {self.options.parallel.data} needs the step's "
                                 "step_tokens (train_part passes them)")
            total_tokens = float(sum(c.num_tokens for c in collated))
        else:
            total_tokens = float(step_tokens)
        if total_tokens == 0:
            raise ValueError("batch has no response tokens")
        self._set_train(True)
        self._zero_grad()
        loss_sum = 0.0
        sums: dict[str, float] = {}
        for index in range(passes):
            last = index == passes - 1
            # A pass beyond this replica's micro-batches repeats its last one with the loss zeroed: the
            # other replicas' passes need its part in their gathers and reductions.
            c, padding = collated[min(index, len(collated) - 1)], index >= len(collated)
            ref_logprobs = self._reference_logprobs(c.input_ids)
            with self._micro_batch(last=last):
                logits = self._forward_logits(c.input_ids)
                new_logprobs = grpo.token_logprobs(logits, c.input_ids, self.options.loss.temperature)
                loss, stats = grpo.policy_loss(
                    new_logprobs, c.old_logprobs, c.advantages, c.response_mask, self.options.loss,
                    normaliser=total_tokens, ref_logprobs=ref_logprobs,
                )
                if padding:
                    loss, stats = loss * 0.0, {}
                loss_sum += float(loss.item())
                for key, value in stats.items():
                    if key == "ratio_max":
                        sums[key] = max(sums.get(key, 0.0), value)
                    elif key != "tokens":
                        sums[key] = sums.get(key, 0.0) + value * stats["tokens"] / total_tokens
                if last:
                    # The statistics are complete before the last backward pass: their reduction over the
                    # replicas travels beside it (and the gradients' own) instead of after them.
                    keys = sorted(k for k in sums if k != "ratio_max")
                    maxima = ["ratio_max"] if "ratio_max" in sums else []
                    reduced_stats = self._start_stats_reduction([loss_sum, *(sums[k] for k in keys)],
                                                                [sums[k] for k in maxima])
                (loss * self._gradient_scale if self._gradient_scale != 1 else loss).backward()
        self._reduce_gradients()
        (loss_sum, *summed), peaks = reduced_stats()
        sums.update(zip(keys, summed, strict=True))
        sums.update(zip(maxima, peaks, strict=True))
        if not math.isfinite(loss_sum):
            # Stepping on a non-finite loss would poison the weights; leave them as they were.
            self._zero_grad()
            raise FloatingPointError(f"loss is {loss_sum} at step {self.step + 1}; no update was made")
        grad_norm = self._optimizer_step()
        self.step += 1
        return {
            "loss": loss_sum,
            "grad_norm": grad_norm,
            "tokens": total_tokens,
            "samples": float(len(batch)),
            "reward_mean": sum(s.reward for s in batch) / len(batch),
            "step_seconds": time.perf_counter() - started,
            **sums,
        }

    def _start_stats_reduction(self, sums: list[float], maxima: list[float]) -> collectives.StatsReduction:
        """Start summing `sums` and maximising `maxima` over the data-parallel replicas (one collective,
        in flight while the caller goes on); calling the result waits for it. A single replica's are
        its own. Backends that run data parallel override it."""
        return lambda: (sums, maxima)

    def _reference_logprobs(self, input_ids: Any) -> Any:
        """Per-token log-probs of the initial weights (no grad), or None when the KL penalty is off."""
        if not self.options.loss.uses_reference:
            return None
        import torch

        with torch.no_grad():
            logits = self._reference_logits(input_ids)
            return grpo.token_logprobs(logits, input_ids, self.options.loss.temperature)

    def logits(self, input_ids: Any) -> Any:
        """The model's own forward pass (no grad), float32 on CPU: [B, L, V]."""
        import torch

        self._set_train(False)
        with torch.no_grad():
            ids = torch.as_tensor(input_ids, dtype=torch.long, device=self.device)
            if ids.dim() == 1:
                ids = ids.unsqueeze(0)
            return self._forward_logits(ids).float().cpu()

    def greedy_generate(self, prompt_ids: Sequence[int], max_new_tokens: int,
                        stop_ids: Sequence[int] = ()) -> list[int]:
        """Greedy continuation with the trainer's own forward (no KV cache: for checks, not speed)."""
        ids = list(prompt_ids)
        out: list[int] = []
        for _ in range(max_new_tokens):
            token = int(self.logits([ids])[0, -1].argmax())
            out.append(token)
            ids.append(token)
            if token in stop_ids:
                break
        return out

    def state_for_export(self, into: Mapping[str, Any] | None = None) -> ExportState:
        """Copy the weights off the device under HF names; the copy is the trainer's no longer.

        `into`: CPU tensors to copy into, by HF name (a broadcast weight sync's shared buffer, so the
        weights need no second copy into it); a name not there, or there with another shape or dtype,
        gets a tensor of its own."""
        import torch

        tied = bool(self.hf_config.get("tie_word_embeddings", False))
        into = into or {}
        tensors: dict[str, Any] = {}
        with torch.no_grad():
            for name, t in hf_state_for_save(self.hf_state_dict(), tied).items():
                target = into.get(name)
                if target is not None and target.shape == t.shape and target.dtype == t.dtype:
                    tensors[name] = target.copy_(t.detach())
                else:
                    tensors[name] = t.detach().to("cpu", copy=True).contiguous()
        return ExportState(
            step=self.step,
            tensors=tensors,
            config=config_with_dtype(self.hf_config, self.param_dtype),
            source_dir=self.model_dir,
        )

    def export_hf(self, out_dir: str | os.PathLike, step: int | None = None) -> Path:
        """Write an HF snapshot of the current weights to out_dir and finalise it; returns out_dir."""
        state = self.state_for_export()
        if step is not None and step != state.step:
            state = ExportState(step=step, tensors=state.tensors, config=state.config, source_dir=state.source_dir)
        return write_hf_snapshot(state, out_dir)


def freeze_reference(module: Any) -> Any:
    """`module` as a reference policy: eval mode, no parameter takes a gradient."""
    module.eval()
    module.requires_grad_(False)
    return module


def build_trainer(
    backend: str,
    model_dir: str | os.PathLike,
    lr: float,
    seed: int = 0,
    device: str = "cpu",
    **options: Any,
) -> Trainer:
    """A trainer of `backend` ('torch' or 'megatron') initialised from the HF model in model_dir.

    Extra keyword arguments are TrainerOptions fields (weight_decay, max_grad_norm, micro_batch_size,
    loss, dtype, betas). With `loss.kl_coef` > 0 the trainer also keeps a frozen copy of the initial
    weights on `device` (the KL reference): one more model's worth of memory.
    """
    opts = TrainerOptions(lr=lr, seed=seed, **options)
    if backend == "torch":
        from rlfleet.trainer.torch_backend import TorchTrainer

        return TorchTrainer(model_dir, opts, device)
    if backend == "megatron":
        from rlfleet.trainer.megatron_backend import MegatronTrainer

        return MegatronTrainer(model_dir, opts, device)
    raise ValueError(f"unknown trainer backend {backend!r}: expected one of {BACKENDS}")

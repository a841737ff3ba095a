"""FSDP2 for the torch backend (`dataParallelMode: fsdp`): the model's weights, gradients and AdamW
moments sharded across the data-parallel replicas.

Each decoder layer is one FSDP unit (its weights gathered for its forward and backward passes, and
freed after), the embeddings, final norm and head the root's. The backward pass of a step's last
micro-batch reduce-scatters the gradients (FSDP averages them over the replicas, so the trainer scales
the loss by their number: the loss is normalised by the whole step's tokens, and the gradient of the
step is the replicas' sum; gloo has no pre-multiplied sum to ask FSDP for); the earlier ones accumulate
without communicating.

Exports and checkpoints see whole tensors: `full_model_state` gathers the weights onto rank 0, and
the optimizer state travels between its FSDP form (keyed by parameter name) and torch's own (keyed
by the parameter's index), so a checkpoint holds the same as a single rank's or a DDP replica's and
resumes into any of them.

    shard_model(model, device, replicas)            # before the optimizer is built
    full = full_model_state(model)                  # every rank calls; rank 0 gets the tensors
    optim = optimizer_state_by_index(full_optimizer_state(model, opt), parameter_names(model))
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any


def shard_model(model: Any, device: str, replicas: int) -> None:
    """Shard a Hugging Face causal LM in place over `replicas` ranks (the default process group)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cuda" if device.startswith("cuda") else "cpu", (replicas,))
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"dataParallelMode fsdp shards a model by its decoder layers (model.model.layers); "
                         f"{type(model).__name__} has none")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def gradient_sync(model: Any, enabled: bool) -> Iterator[None]:
    """A micro-batch whose backward pass reduce-scatters the gradients (`enabled`) or accumulates them."""
    model.set_requires_gradient_sync(enabled)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def full_model_state(model: Any) -> dict[str, Any]:
    """The whole weights on CPU under the model's own names, on rank 0; {} on the other ranks. Every rank
    calls it (a gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return dict(get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def full_optimizer_state(model: Any, optimizer: Any) -> dict[str, Any]:
    """The whole optimizer state on CPU keyed by parameter name, on rank 0; {} on the other ranks. Every
    rank calls it (a gather)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return dict(get_optimizer_state_dict(model, optimizer,
                                         options=StateDictOptions(full_state_dict=True, cpu_offload=True)))


def load_full_state(model: Any, optimizer: Any, weights: Mapping[str, Any], optim: Mapping[str, Any]) -> None:
    """Shard whole weights and a whole optimizer state (keyed by parameter name) into this rank's model
    and optimizer. Every rank calls it with the same state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_optimizer_state_dict

    options = StateDictOptions(full_state_dict=True, strict=True)
    set_model_state_dict(model, dict(weights), options=options)
    set_optimizer_state_dict(model, optimizer, dict(optim), options=options)


def parameter_names(model: Any) -> list[str]:
    """The parameters' names in the order the optimizer holds them (it was built from `parameters()`)."""
    return [name for name, _ in model.named_parameters()]


def optimizer_state_by_index(by_name: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """An optimizer state keyed by parameter name as torch's `Optimizer.state_dict()` keys it: by the
    parameter's index in `names`."""
    index = {name: i for i, name in enumerate(names)}
    unknown = sorted(set(by_name["state"]) - set(index))
    if unknown:
        raise ValueError(f"optimizer state for parameters the model does not have: {unknown[:5]}")
    return {
        "state": {index[name]: state for name, state in by_name["state"].items()},
        "param_groups": [{**group, "params": [index[name] for name in group["params"]]}
                         for group in by_name["param_groups"]],
    }


def optimizer_state_by_name(by_index: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The reverse of `optimizer_state_by_index`."""
    out_of_range = sorted(i for i in by_index["state"] if not 0 <= int(i) < len(names))
    if out_of_range:
        raise ValueError(f"optimizer state for parameter indices {out_of_range[:5]} of a model of "
                         f"{len(names)} parameters")
    return {
        "state": {names[int(i)]: state for i, state in by_index["state"].items()},
        "param_groups": [{**group, "params": [names[int(i)] for i in group["params"]]}
                         for group in by_index["param_groups"]],
    }

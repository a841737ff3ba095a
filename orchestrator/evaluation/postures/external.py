"""Posture external: a user's CheckpointEvalFn gets each snapshot directory and returns results."""
from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Callable, Mapping
from typing import Any

from rlfleet.orchestrator.evaluation.api import CheckpointEvalFn, EvalOutcome, EvalRequest
from rlfleet.orchestrator.evaluation.policy import mapping_scores

log = logging.getLogger(__name__)


class ExternalEvaluator:
    posture = "external"
    uses_snapshots = True

    def __init__(self, fn: CheckpointEvalFn):
        self.fn = fn
        self.concurrency = int(getattr(fn, "max_concurrent_points", 1))

    async def evaluate(self, request: EvalRequest) -> EvalOutcome:
        assert request.checkpoint_dir is not None, "posture external evaluates snapshots"
        # Declared async, but a plain function is accepted too (it runs in a thread).
        method: Callable[..., Any] = self.fn.evaluate_checkpoint
        if inspect.iscoroutinefunction(method):
            result = await method(str(request.checkpoint_dir), request)
        else:  # a plain function: keep it off the event loop
            result = await asyncio.to_thread(method, str(request.checkpoint_dir), request)
            if inspect.isawaitable(result):
                result = await result
        if isinstance(result, EvalOutcome):
            return result
        if isinstance(result, Mapping):
            return EvalOutcome(weight_version=request.weight_version, datasets=mapping_scores(result))
        raise TypeError(f"{type(self.fn).__name__}.evaluate_checkpoint returned {type(result).__name__}; "
                        "expected an EvalOutcome or a {dataset: score} mapping")

    async def close(self) -> None:
        try:
            result = self.fn.dispose()
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("%s.dispose() failed", type(self.fn).__name__)

"""The W&B client's own process (`python -m rlfleet.observability.tracking.wandb_worker`): every W&B call
happens here, never in the training process, so a W&B client that blocks (a `finish` waiting on an
unreachable server) is ended by its parent's bound, not waited for.

Requests come one JSON object a line on stdin, each answered on stdout by `{"id": n, "ok": true}` or
`{"id": n, "error": "..."}`: `open` (wandb.init with the flattened spec as config), `log` (one record),
`finish` (wandb.finish, then the process ends). W&B's own output goes to stderr (the parent's log file).
stdin closing (the parent is gone) finishes the run as failed, within W&B's finish timeout.
"""
from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping
from typing import Any, TextIO

TRAIN_STEP = "step"  # the x-axis of every series but the eval ones: the training step
EVAL_STEP = "eval/step"  # eval points settle after later training steps: a step series of their own


def history_rows(step: int, scalars: Mapping[str, float]) -> list[dict[str, float]]:
    """One record as W&B history rows (pure): the training series with `step`, the eval series
    (`eval/...`) in a row of their own with `eval/step`, as TensorBoard keeps them in a directory apart.
    Rows carry their step as a value, never as W&B's own step, which may not go backwards."""
    rows = []
    for is_eval, step_key in ((False, TRAIN_STEP), (True, EVAL_STEP)):
        chosen = {tag: float(v) for tag, v in sorted(scalars.items()) if tag.startswith("eval/") == is_eval}
        if chosen:
            rows.append({step_key: float(step), **chosen})
    return rows


def step_metric_of(tag: str) -> str:
    return EVAL_STEP if tag.startswith("eval/") else TRAIN_STEP


class WandbSession:
    def __init__(self) -> None:
        self.run: Any = None
        self.defined: set[str] = set()

    def open(self, request: Mapping[str, Any]) -> None:
        import wandb

        if self.run is not None:
            return
        chosen = {"base_url": request["base_url"]} if request.get("base_url") else {}  # unset: W&B's cloud
        settings = wandb.Settings(
            mode=request["mode"], init_timeout=request["timeout_s"], finish_timeout=request["timeout_s"],
            console="off", silent=True, x_disable_stats=True, save_code=False, disable_git=True,
            disable_job_creation=True, **chosen,
        )
        self.run = wandb.init(project=request["project"], entity=request.get("entity") or None,
                              name=request["run_name"], dir=request["dir"], config=dict(request["config"]),
                              settings=settings)
        for step_key in (TRAIN_STEP, EVAL_STEP):
            self.run.define_metric(step_key)
            self.defined.add(step_key)

    def log(self, step: int, scalars: Mapping[str, float]) -> None:
        assert self.run is not None, "open first"
        for row in history_rows(step, scalars):
            for tag in row:
                if tag not in self.defined:
                    self.run.define_metric(tag, step_metric=step_metric_of(tag))
                    self.defined.add(tag)
            self.run.log(row)

    def finish(self, exit_code: int) -> None:
        if self.run is not None:
            run, self.run = self.run, None
            run.finish(exit_code=exit_code)


def serve(requests: TextIO, replies: TextIO) -> None:
    session = WandbSession()
    for line in requests:
        request = json.loads(line)
        op = request["op"]
        try:
            if op == "open":
                session.open(request)
            elif op == "log":
                session.log(int(request["step"]), request["scalars"])
            elif op == "finish":
                session.finish(int(request["exit_code"]))
            else:
                raise ValueError(f"unknown request {op!r}")
            answer: dict[str, Any] = {"id": request["id"], "ok": True}
        except Exception as exc:  # answered, the parent decides (warn once, drop the record)
            answer = {"id": request["id"], "error": f"{type(exc).__name__}: {exc}"[:1000]}
        replies.write(json.dumps(answer) + "\n")
        replies.flush()
        if op == "finish":
            return
    session.finish(1)  # the parent is gone


def main() -> None:
    replies = os.fdopen(os.dup(1), "w")  # the answers' own channel ...
    os.dup2(2, 1)  # ... and whatever W&B prints goes to the log
    sys.stdout = sys.stderr
    serve(sys.stdin, replies)


if __name__ == "__main__":
    main()

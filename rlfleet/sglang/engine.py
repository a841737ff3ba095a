"""Client of one SGLang engine's HTTP API (sglang 0.5.x): bounded calls, classified failures.

Facts it relies on: control routes (pause/continue/abort) need a JSON body, a bodyless POST is a
400; `/update_weights_from_disk` answers 400 with `success:false` for a refused load, and an
`in_place` pause makes a successful load answer 400 "Weights were updated, but the cache was not
flushed"; an aborted generation is an HTTP 200 whose `finish_reason.type` is "abort".

`pin_weights` is the one "pause -> load -> flush -> read back -> continue" routine: the weight sync,
the eval fleet and external evaluators load a snapshot through it.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import aiohttp

from rlfleet.sglang.errors import BadResponse, CallError, FailureKind, RequestAborted
from rlfleet.sglang.http import Reply, call, expect_dict

log = logging.getLogger(__name__)

PauseMode = Literal["abort", "retract", "in_place"]
PAUSE_MODES: tuple[str, ...] = ("abort", "retract", "in_place")

# The marker SGLang puts in the 400 of an update that did swap the weights but could not flush.
CACHE_NOT_FLUSHED_MARKER = "cache was not flushed"
# How long `gone_for_good` waits for an engine whose connection closed to answer on a new one.
CONFIRM_TIMEOUT_S = 5.0


@dataclass(frozen=True)
class EngineTimeouts:
    """Bounds (seconds) on each kind of engine call."""

    control: float = 10.0  # model_info, pause, continue, flush
    health: float = 5.0
    generate: float = 120.0
    load: float = 600.0  # update_weights_from_disk


@dataclass(frozen=True)
class ModelInfo:
    weight_version: str
    model_path: str
    raw: dict[str, Any] = field(repr=False, default_factory=dict)


@dataclass(frozen=True)
class UpdateWeightsResult:
    """What `/update_weights_from_disk` said (200 or a 400 that carries `success`)."""

    success: bool
    message: str
    status: int
    elapsed_s: float

    @property
    def swapped_but_not_flushed(self) -> bool:
        """The in_place-pause outcome: new weights are live but the prefix cache still holds old KV."""
        return not self.success and CACHE_NOT_FLUSHED_MARKER in self.message


def finish_reason_type(body: dict[str, Any]) -> str | None:
    reason = (body.get("meta_info") or {}).get("finish_reason")
    return reason.get("type") if isinstance(reason, dict) else None


def raise_if_aborted(reply: Reply, body: dict[str, Any]) -> dict[str, Any]:
    """The body of a `/generate` answer, or RequestAborted when it is an abort answered with HTTP 200
    (`finish_reason.type` "abort": the engine or router dropped the request, no text was generated)."""
    if finish_reason_type(body) == "abort":
        message = (body.get("meta_info") or {}).get("finish_reason", {}).get("message") or "aborted"
        raise RequestAborted(message, method=reply.method or "POST", url=reply.url, status=reply.status,
                             body=reply.text, elapsed_s=reply.elapsed_s)
    return body


class EngineClient:
    """Calls one engine at `base_url` over a shared aiohttp session."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, timeouts: EngineTimeouts | None = None):
        self.session = session
        self.base_url = base_url.rstrip("/")
        self.timeouts = timeouts or EngineTimeouts()

    def __repr__(self) -> str:
        return f"EngineClient({self.base_url})"

    async def _call(self, method: str, path: str, timeout_s: float, **kwargs) -> Reply:
        return await call(self.session, method, self.base_url + path, timeout_s=timeout_s, **kwargs)

    async def health_generate(self, timeout_s: float | None = None) -> float:
        """One-token generation health check; returns its latency. 503 / timeout raise."""
        reply = await self._call("GET", "/health_generate", timeout_s or self.timeouts.health)
        return reply.elapsed_s

    async def generate(self, payload: dict[str, Any], timeout_s: float | None = None, *,
                       raise_on_abort: bool = True) -> dict[str, Any]:
        """POST /generate (non-streaming, single prompt). An abort-in-200 raises RequestAborted."""
        reply = await self._call("POST", "/generate", timeout_s or self.timeouts.generate, json_body=payload)
        body = expect_dict(reply, "generate")
        return raise_if_aborted(reply, body) if raise_on_abort else body

    async def model_info(self, timeout_s: float | None = None) -> ModelInfo:
        reply = await self._call("GET", "/model_info", timeout_s or self.timeouts.control)
        body = expect_dict(reply, "model_info")
        version = body.get("weight_version")
        if not isinstance(version, str):
            raise BadResponse(f"model_info has no weight_version: {reply.text[:300]!r}",
                              url=self.base_url + "/model_info", status=reply.status)
        return ModelInfo(weight_version=version, model_path=str(body.get("model_path", "")), raw=body)

    async def weight_version(self, timeout_s: float | None = None) -> str:
        return (await self.model_info(timeout_s)).weight_version

    async def update_weights_from_disk(self, model_path: str, weight_version: str, *,
                                       timeout_s: float | None = None, flush_cache: bool = True,
                                       abort_all_requests: bool = False) -> UpdateWeightsResult:
        """Load weights from a directory. A 400 with `success:false` is returned, not raised."""
        payload = {
            "model_path": model_path,
            "weight_version": weight_version,
            "flush_cache": flush_cache,
            "abort_all_requests": abort_all_requests,
        }
        reply = await self._call("POST", "/update_weights_from_disk", timeout_s or self.timeouts.load,
                                 json_body=payload, accept=(400,))
        body = expect_dict(reply, "update_weights_from_disk")
        if "success" not in body:
            # A schema 400 has no `success`; that is our bug, not a load outcome.
            raise BadResponse(f"update_weights_from_disk answered {reply.status}: {reply.text[:500]}",
                              url=self.base_url + "/update_weights_from_disk", status=reply.status)
        return UpdateWeightsResult(success=bool(body["success"]), message=str(body.get("message", "")),
                                   status=reply.status, elapsed_s=reply.elapsed_s)

    async def pause_generation(self, mode: PauseMode = "retract", timeout_s: float | None = None) -> None:
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        await self._call("POST", "/pause_generation", timeout_s or self.timeouts.control, json_body={"mode": mode})

    async def continue_generation(self, *, torch_empty_cache: bool = False, timeout_s: float | None = None) -> None:
        await self._call("POST", "/continue_generation", timeout_s or self.timeouts.control,
                         json_body={"torch_empty_cache": torch_empty_cache})

    async def flush_cache(self, timeout_s: float | None = None) -> str:
        """Flush the prefix cache; a 400 (requests still running) raises ClientErrorStatus."""
        reply = await self._call("POST", "/flush_cache", timeout_s or self.timeouts.control)
        return reply.text

    # --- broadcast weight update (update group; SGLang 0.5.x) ----------------------------------------

    async def _control(self, path: str, body: dict[str, Any], timeout_s: float) -> tuple[bool, str]:
        """POST a weight-update control call; a 400 with `success` is returned as (False, message)."""
        reply = await self._call("POST", path, timeout_s, json_body=body, accept=(400,))
        answer = expect_dict(reply, path.lstrip("/"))
        if "success" not in answer:
            raise BadResponse(f"{path} answered {reply.status}: {reply.text[:500]}", url=self.base_url + path,
                              status=reply.status)
        return bool(answer["success"]), str(answer.get("message", ""))

    async def init_weights_update_group(self, *, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str,
                                        timeout_s: float) -> tuple[bool, str]:
        """Join the update group (returns once every rank has joined)."""
        return await self._control("/init_weights_update_group", {
            "master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
            "world_size": world_size, "group_name": group_name, "backend": backend}, timeout_s)

    async def destroy_weights_update_group(self, group_name: str, timeout_s: float) -> tuple[bool, str]:
        return await self._control("/destroy_weights_update_group", {"group_name": group_name}, timeout_s)

    async def begin_weight_update(self, timeout_s: float) -> tuple[bool, str]:
        return await self._control("/begin_weight_update", {}, timeout_s)

    async def end_weight_update(self, timeout_s: float) -> tuple[bool, str]:
        return await self._control("/end_weight_update", {}, timeout_s)

    async def update_weights_from_distributed(self, *, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str, timeout_s: float,
                                              weight_version: str | None = None, flush_cache: bool = False,
                                              load_format: str | None = None) -> tuple[bool, str]:
        """Receive (and load) one broadcast of these tensors; returns once it arrived."""
        body: dict[str, Any] = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name,
                                "flush_cache": flush_cache}
        if weight_version is not None:
            body["weight_version"] = weight_version
        if load_format is not None:
            body["load_format"] = load_format
        return await self._control("/update_weights_from_distributed", body, timeout_s)

    async def weights_checksums(self, timeout_s: float) -> list[RankChecksums]:
        """The served weights' checksums, one `RankChecksums` per engine rank (/weights_checker)."""
        reply = await self._call("POST", "/weights_checker", timeout_s, json_body={"action": "checksum"})
        body = expect_dict(reply, "weights_checker")
        ranks = body.get("ranks")
        if not isinstance(ranks, list) or not all(isinstance(r, dict) and isinstance(r.get("checksums"), dict)
                                                  for r in ranks):
            raise BadResponse(f"weights_checker has no per-rank checksums: {reply.text[:300]!r}",
                              url=self.base_url + "/weights_checker", status=reply.status)
        return [RankChecksums.from_reply(r, len(ranks)) for r in ranks]


@dataclass(frozen=True)
class RankChecksums:
    """One engine rank's `/weights_checker` checksums and its place in the engine (its parallelism_info;
    an answer without one is a single rank's, or of an unknown place: tp_rank None)."""

    checksums: dict[str, str]
    tp_rank: int | None = 0
    tp_size: int = 1
    pp_size: int = 1
    dp_size: int = 1

    @classmethod
    def from_reply(cls, rank: Mapping[str, Any], ranks: int) -> RankChecksums:
        checksums = {str(k): str(v) for k, v in rank["checksums"].items()}
        info = rank.get("parallelism_info")
        if not isinstance(info, dict):
            return cls(checksums, tp_rank=0 if ranks == 1 else None)

        def number(key: str, default: int) -> int:
            value = info.get(key, default)
            return value if isinstance(value, int) and not isinstance(value, bool) else default

        tp_rank = info.get("tp_rank")
        return cls(checksums, tp_rank=tp_rank if isinstance(tp_rank, int) and not isinstance(tp_rank, bool) else None,
                   tp_size=number("tp_size", 1), pp_size=number("pp_size", 1), dp_size=number("dp_size", 1))


class CacheNotFlushed(Exception):
    """A load swapped the weights but the prefix cache could not be flushed (the engine kept refusing)."""

    def __init__(self, last: CallError | None):
        super().__init__(f"weights swapped but the cache could not be flushed: {last}")
        self.last = last


@dataclass(frozen=True)
class PinResult:
    """What a pin ended with: the last load's answer and the version read back afterwards."""

    load: UpdateWeightsResult
    served: str | None  # from /model_info; None when it was not read (a refused load, read_back_refused=False)

    def serves(self, version: str) -> bool:
        """The load succeeded and the engine reports `version`."""
        return self.load.success and self.served == version


async def gone_for_good(client: EngineClient, error: CallError, timeout_s: float = CONFIRM_TIMEOUT_S) -> bool:
    """Did `error` show that the engine is gone? A refused connection does. A connection closed without
    an answer may be a kept-alive connection the engine's server closed just as it was reused (uvicorn
    closes idle ones after a few seconds), so the engine is asked again, on a new connection, what it
    serves (GET /model_info answers while generation is paused): gone only if that fails too."""
    if error.kind is not FailureKind.CONNECTION_CLOSED:
        return error.engine_gone
    try:
        await client.model_info(timeout_s)
    except CallError:
        return True
    log.warning("%s: connection closed without an answer, but the engine answers again: not dead (%s)",
                client.base_url, error)
    return False


async def pin_weights(client: EngineClient, model_path: str, version: str, *, load_timeout_s: float | None = None,
                      pause: PauseMode | None = None, keep_paused: Callable[[], bool] | None = None,
                      flush_attempts: int = 1, flush_retry_s: float = 0.5,
                      read_back_refused: bool = True) -> PinResult:
    """Pause -> load -> flush -> read back -> continue, on one engine.

    - `pause`: pause generation in this mode first and continue it at the end (also on failure),
      unless `keep_paused()` says otherwise then; a failing continue is logged, not raised. None: no pause.
    - A load that swapped the weights but could not flush the prefix cache (the engine was paused
      in_place) flushes and loads again: up to `flush_attempts` flushes, `flush_retry_s` apart; a flush
      that found the engine gone raises its CallError, one that kept being refused CacheNotFlushed.
      0: no flush, the refused answer is returned.
    - The version is read back from `/model_info`; after a refused load only if `read_back_refused`.

    A refused load is returned (check `PinResult.serves`), not raised; failed calls raise CallError.
    """
    if pause is not None:
        await client.pause_generation(pause)
    try:
        result = await client.update_weights_from_disk(model_path, version, timeout_s=load_timeout_s)
        if result.swapped_but_not_flushed and flush_attempts > 0:
            await _flush(client, flush_attempts, flush_retry_s)
            result = await client.update_weights_from_disk(model_path, version, timeout_s=load_timeout_s)
        served = await client.weight_version() if result.success or read_back_refused else None
        return PinResult(result, served)
    finally:
        if pause is not None and not (keep_paused is not None and keep_paused()):
            try:
                await client.continue_generation()
            except CallError as exc:
                log.warning("continue_generation on %s failed: %s", client.base_url, exc)


async def _flush(client: EngineClient, attempts: int, retry_s: float) -> None:
    last: CallError | None = None
    for attempt in range(attempts):
        if attempt:
            await asyncio.sleep(retry_s)
        try:
            await client.flush_cache()
            return
        except CallError as exc:
            if exc.engine_gone:
                raise
            last = exc
    raise CacheNotFlushed(last)

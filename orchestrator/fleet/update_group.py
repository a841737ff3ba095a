"""One weight-update group: the trainer's broadcasting rank 0 (a `Broadcaster` process) and every
member engine's ranks, and the broadcast protocol over it.

Protocol of one transfer (generation already paused by the caller): copy the weights into the shared
buffer, `begin_weight_update` on every engine, then per bucket the broadcast and every engine's
`update_weights_from_distributed` concurrently (the call returns once the bytes arrived; the last one
carries the weight version and flushes the cache), `end_weight_update`. Every step is bounded
(`StepBounds`), and the whole transfer (begin .. end) by the transfer timeout: each step gets at most
what is left of it. A failure names the engines that did not answer in time (wedged) or are gone, and
leaves the group abandoned (its broadcasting process killed): the caller marks those engines dead and
finishes from disk.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.orchestrator.fleet.backend import EngineSlot
from rlfleet.orchestrator.fleet.broadcast_plan import LOAD_FORMAT, Bucket, StepBounds, buffer_bytes, rank_offsets
from rlfleet.orchestrator.fleet.broadcaster import Broadcaster, BroadcastError, check_listen_address
from rlfleet.sglang.engine import EngineClient
from rlfleet.sglang.errors import CallError, FailureKind
from rlfleet.util.aio import settle
from rlfleet.util.ports import free_port

log = logging.getLogger(__name__)


class TransferFailed(Exception):
    """A step of the protocol failed; `wedged` engines did not answer in time, `gone` ones are dead."""

    def __init__(self, message: str, *, wedged: Sequence[int] = (), gone: Sequence[int] = ()):
        super().__init__(message)
        self.wedged = tuple(wedged)
        self.gone = tuple(gone)


@dataclass(frozen=True)
class Member:
    slot: int
    incarnation: int
    url: str
    rank_offset: int


def membership_key(engines: Sequence[EngineSlot]) -> tuple[tuple[int, int, str], ...]:
    """What the group was built for: a change (death, recreation, scale) means a rebuild."""
    return tuple(sorted((e.slot, e.incarnation, e.url or "") for e in engines))


@dataclass
class TransferTimes:
    fill_s: float = 0.0
    begin_s: float = 0.0
    broadcast_s: float = 0.0
    end_s: float = 0.0
    bytes: int = 0
    buckets: int = 0
    per_bucket_s: list[float] = field(default_factory=list)
    # Rank 0's own collective per bucket: the rest of a bucket's time is the engines' handling of it
    # (receive buffer, load into the model) and the HTTP call around it.
    rank0_s: list[float] = field(default_factory=list)


class UpdateGroup:
    def __init__(self, members: Sequence[Member], key: tuple, broadcaster: Broadcaster, *, group_name: str,
                 backend: str, buckets: Sequence[Bucket], bounds: StepBounds,
                 client: Callable[[str], EngineClient]):
        self.members = list(members)
        self.key = key
        self.broadcaster = broadcaster
        self.group_name = group_name
        self.backend = backend
        self.buckets = list(buckets)
        self.bounds = bounds
        self._client = client
        self.broken = False

    @classmethod
    async def build(cls, engines: Sequence[EngineSlot], *, buckets: Sequence[Bucket], bounds: StepBounds,
                    client: Callable[[str], EngineClient], address: str, backend: str, group_name: str,
                    device: str = "cpu", tp_size: int = 1, port: int | None = None) -> UpdateGroup:
        """Start rank 0 on address:port (None: a free port) and have every engine join; TransferFailed
        names the engines that did not."""
        offsets, world_size = rank_offsets([tp_size] * len(engines))
        members = [Member(e.slot, e.incarnation, e.url or "", off) for e, off in zip(engines, offsets, strict=True)]
        try:
            if port is None:
                port = free_port(address)  # OSError at once when this machine has no such address
            check_listen_address(address, port)
        except (BroadcastError, OSError) as exc:
            raise TransferFailed(f"broadcast cannot start: cannot listen on {address}: {exc}") from exc
        broadcaster = Broadcaster(buffer_bytes(buckets), device=device)
        group = cls(members, membership_key(engines), broadcaster, group_name=group_name, backend=backend,
                    buckets=buckets, bounds=bounds, client=client)

        async def engine_joins(m: Member) -> tuple[bool, str]:
            return await client(m.url).init_weights_update_group(
                master_address=address, master_port=port, rank_offset=m.rank_offset, world_size=world_size,
                group_name=group_name, backend=backend, timeout_s=bounds.join_s)

        try:
            try:
                await broadcaster.start()
            except (BroadcastError, OSError) as exc:
                raise TransferFailed(f"broadcast cannot start: {exc}") from exc
            await group._together(lambda: broadcaster.join(address=address, port=port, world_size=world_size,
                                                           group_name=group_name, backend=backend,
                                                           timeout_s=bounds.join_s),
                                  engine_joins, "init_weights_update_group", bounds.join_s)
        except BaseException:
            # Whatever ended the build (a failure, a cancel, a buffer torch could not map) leaves neither
            # the broadcasting process nor its model-sized buffer behind.
            await group.abandon()
            raise
        log.info("update group %s: rank 0 at %s:%d, %d engine(s), world size %d, %s, %d bucket(s) of %.1f MiB",
                 group_name, address, port, len(members), world_size, backend, len(buckets),
                 buffer_bytes(buckets) / 2**20)
        return group

    async def _all(self, call: Callable[[Member], Awaitable[tuple[bool, str]]], what: str, timeout_s: float) -> None:
        """`call` on every member within timeout_s; TransferFailed names who did not answer."""
        await self._together(None, call, what, timeout_s)

    async def _together(self, rank0: Callable[[], Awaitable[Any]] | None,
                        call: Callable[[Member], Awaitable[tuple[bool, str]]], what: str, timeout_s: float) -> None:
        async def one(m: Member) -> str | None:
            try:
                async with asyncio.timeout(timeout_s):
                    ok, message = await call(m)
            except TimeoutError:
                return "wedged"
            except CallError as exc:
                if exc.kind is FailureKind.TIMEOUT:
                    return "wedged"
                return "gone" if exc.engine_gone else f"error: {exc}"
            return None if ok else f"refused: {message}"

        async def zero() -> str | None:
            if rank0 is None:
                return None
            try:
                await rank0()
            except BroadcastError as exc:
                return str(exc)
            return None

        async with asyncio.TaskGroup() as tg:
            rank0_task = tg.create_task(zero())
            tasks = [(m, tg.create_task(one(m))) for m in self.members]
        problems = {m.slot: t.result() for m, t in tasks if t.result() is not None}
        rank0_problem = rank0_task.result()
        if not problems and rank0_problem is None:
            return
        self.broken = True
        wedged = [slot for slot, p in problems.items() if p == "wedged"]
        gone = [slot for slot, p in problems.items() if p == "gone"]
        if rank0_problem is not None and len(wedged) == len(self.members) and what == "init_weights_update_group":
            wedged = []  # nobody joined a rank 0 that failed: the trainer's side is at fault, not the engines
        detail = "; ".join(f"slot {slot}: {p}" for slot, p in sorted(problems.items()))
        if rank0_problem is not None:
            detail = f"rank 0: {rank0_problem}" + (f"; {detail}" if detail else "")
        raise TransferFailed(f"{what} (bound {timeout_s:.1f} s): {detail}", wedged=wedged, gone=gone)

    async def _fill(self, buckets: Sequence[Bucket], tensors: Mapping[str, Any]) -> None:
        try:
            await asyncio.to_thread(self.broadcaster.fill, buckets, tensors)
        except Exception as exc:
            self.broken = True
            raise TransferFailed(f"copying the weights for the broadcast failed: {exc}") from exc

    def views(self) -> dict[str, Any]:
        """Every tensor's place in the shared buffer (name -> view), for the trainer to export into."""
        return self.broadcaster.views(self.buckets)

    def fill_first(self, tensors: Mapping[str, Any]) -> asyncio.Future[None]:
        """Start copying the first bucket into the shared buffer. The copy touches no engine, so the
        caller starts it before pausing the engines and `transfer(first_filled=...)` waits for it after
        `begin_weight_update`: pause and begin hide (part of) it."""
        return asyncio.ensure_future(self._fill(self.buckets[:1], tensors))

    async def transfer(self, tensors: Mapping[str, Any], version: str,
                       first_filled: asyncio.Future[None] | None = None) -> TransferTimes:
        """Broadcast every bucket into every member; the engines serve `version` afterwards.

        The first bucket is copied into the shared buffer beside `begin_weight_update` (and, started by
        the caller with `fill_first`, beside the pause); each later one is copied while the one before it
        is on the wire (disjoint parts of the buffer). `fill_s`: the copying not hidden that way."""
        times = TransferTimes(bytes=sum(b.nbytes for b in self.buckets), buckets=len(self.buckets))
        first = first_filled if first_filled is not None else self.fill_first(tensors)
        loop = asyncio.get_running_loop()
        began = loop.time()

        def within(step_s: float, what: str) -> float:
            """The step's bound, cut to what is left of the transfer's; TransferFailed when nothing is left
            (every engine answered each step before, so none is to blame: no engine is named)."""
            bound = self.bounds.within_transfer(step_s, loop.time() - began)
            if bound <= 0:
                self.broken = True
                raise TransferFailed(f"{what}: the transfer took its whole bound of "
                                     f"{self.bounds.transfer_s:.1f} s before this step")
            return bound

        t = time.monotonic()
        try:
            control = within(self.bounds.control_s, "begin_weight_update")
            await self._all(lambda m: self._client(m.url).begin_weight_update(control), "begin_weight_update",
                            control)
        except BaseException:
            await settle(first)  # the begin's failure is the one that counts
            raise
        times.begin_s = time.monotonic() - t
        t = time.monotonic()
        await first
        times.fill_s = time.monotonic() - t
        t = time.monotonic()
        last = len(self.buckets) - 1
        for bucket in self.buckets:
            what = f"bucket {bucket.index + 1}/{len(self.buckets)}"
            bound = within(self.bounds.bucket_s(bucket.nbytes, times.bytes), what)
            b0 = time.monotonic()

            def receive(m: Member, bucket: Bucket = bucket, bound: float = bound) -> Awaitable[tuple[bool, str]]:
                final = bucket.index == last
                return self._client(m.url).update_weights_from_distributed(
                    names=bucket.names, dtypes=bucket.dtypes, shapes=bucket.shapes, group_name=self.group_name,
                    timeout_s=bound, weight_version=version if final else None, flush_cache=final,
                    load_format=LOAD_FORMAT)

            following = self.buckets[bucket.index + 1:bucket.index + 2]
            fill_next = asyncio.ensure_future(self._fill(following, tensors)) if following else None
            async def send(bucket: Bucket = bucket, bound: float = bound) -> None:
                times.rank0_s.append(await self.broadcaster.broadcast(bucket.start, bucket.end, bound))

            try:
                await self._together(send, receive, what, bound)
            finally:
                if fill_next is not None:
                    if not fill_next.done():  # its thread ends by itself, soon; the wait is the copy's share
                        w = time.monotonic()
                        await asyncio.wait([fill_next])
                        times.fill_s += time.monotonic() - w
                    copy_failed = fill_next.exception()  # retrieved even when the bucket failed first
            if fill_next is not None and copy_failed is not None:
                raise copy_failed
            times.per_bucket_s.append(time.monotonic() - b0)
        times.broadcast_s = time.monotonic() - t
        t = time.monotonic()
        control = within(self.bounds.control_s, "end_weight_update")
        await self._all(lambda m: self._client(m.url).end_weight_update(control), "end_weight_update", control)
        times.end_s = time.monotonic() - t
        return times

    async def abandon(self) -> None:
        """Kill rank 0 (every collective in the group ends with it); tell no engine anything."""
        self.broken = True
        self.broadcaster.kill()
        await self.broadcaster.close()

    async def destroy(self, alive_urls: set[str] | None = None) -> None:
        """Leave the group on every member still alive (bounded, best effort), then stop rank 0."""
        self.broken = True
        self.broadcaster.kill()  # first: an engine's destroy must not wait on a collective with rank 0

        async def leave(m: Member) -> None:
            try:
                async with asyncio.timeout(self.bounds.control_s):
                    await self._client(m.url).destroy_weights_update_group(self.group_name, self.bounds.control_s)
            except (TimeoutError, CallError) as exc:
                log.info("update group %s: slot %d did not leave cleanly: %s", self.group_name, m.slot, exc)

        try:
            async with asyncio.TaskGroup() as tg:
                for m in self.members:
                    if alive_urls is None or m.url in alive_urls:
                        tg.create_task(leave(m))
        finally:  # also when cancelled: the model-sized shared buffer goes with rank 0
            await self.broadcaster.close()

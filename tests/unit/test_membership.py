"""Router membership and router-client deadlines on a virtual clock (looptime).

Fakes, named as such: `ListingRouter` is a RouterClient whose worker API (`GET/POST/DELETE /workers`)
answers from an in-memory list instead of HTTP, and `engine_client` returns an object that reports a
fixed weight version instead of calling `/model_info`. What is under test is the timing of the
membership's registration window and of `RouterClient.wait_listed`, not the router or the engine.
"""
from __future__ import annotations

import asyncio

import pytest

from rlfleet.orchestrator.fleet.membership import RouterMembership, plan_membership
from rlfleet.sglang.errors import CallTimeout
from rlfleet.sglang.router import RouterClient, RouterWorker

pytestmark = pytest.mark.looptime

ENGINE = "http://127.0.0.2:30000"


class ListingRouter(RouterClient):
    """A RouterClient whose worker API is an in-memory list (a fake: no HTTP, no router process).

    `listed_after_s`: a worker added at loop time t is listed from t + listed_after_s on (None: never,
    as a router that drops the registration)."""

    def __init__(self, listed_after_s: float | None = 0.0):
        super().__init__(None, "http://router.invalid")  # type: ignore[arg-type]  # a fake: no session is ever used
        self.listed_after_s = listed_after_s
        self.added: list[tuple[float, str]] = []  # (loop time, url) of every POST /workers
        self._listed_at: dict[str, float] = {}

    async def add_worker(self, url: str) -> str:
        now = asyncio.get_running_loop().time()
        self.added.append((now, url))
        if self.listed_after_s is not None:
            self._listed_at.setdefault(url, now + self.listed_after_s)
        return f"id-{url}"

    async def list_workers(self) -> list[RouterWorker]:
        now = asyncio.get_running_loop().time()
        return [RouterWorker(id=f"id-{url}", url=url, is_healthy=True)
                for url, at in self._listed_at.items() if at <= now]

    async def remove_worker(self, worker_id: str) -> bool:
        url = worker_id.removeprefix("id-")
        return self._listed_at.pop(url, None) is not None


class FixedVersion:
    """Stands for an EngineClient: reports one weight version (a fake: no /model_info call)."""

    def __init__(self, version: str):
        self.version = version

    async def weight_version(self) -> str:
        return self.version


def membership(router: ListingRouter, *, registration_timeout_s: float = 30.0) -> RouterMembership:
    return RouterMembership(router, engine_client=lambda url: FixedVersion("3"),  # type: ignore[arg-type,return-value]  # fakes
                            alive_urls=lambda: [ENGINE], registration_timeout_s=registration_timeout_s)


async def test_wait_listed_returns_the_virtual_seconds_waited():
    router = ListingRouter(listed_after_s=7.0)
    await router.add_worker(ENGINE)
    waited = await router.wait_listed(ENGINE, timeout_s=30.0, poll_s=0.5)
    assert waited == pytest.approx(7.0)
    assert asyncio.get_running_loop().time() == pytest.approx(7.0)


async def test_wait_listed_gives_up_at_its_deadline_on_the_loop_clock():
    router = ListingRouter(listed_after_s=None)
    await router.add_worker(ENGINE)
    with pytest.raises(CallTimeout, match="not listed after 30 s"):
        await router.wait_listed(ENGINE, timeout_s=30.0, poll_s=1.0)
    assert asyncio.get_running_loop().time() == pytest.approx(30.0)


async def test_admit_waits_for_the_listing_within_the_registration_timeout():
    router = ListingRouter(listed_after_s=None)
    members = membership(router, registration_timeout_s=12.0)
    with pytest.raises(CallTimeout):
        await members.admit(ENGINE, "3")
    assert asyncio.get_running_loop().time() == pytest.approx(12.0, abs=0.3)


async def test_reconcile_leaves_a_registration_in_progress_alone_until_its_window_ends():
    router = ListingRouter(listed_after_s=None)  # the router never lists it: the registration was lost
    members = membership(router, registration_timeout_s=30.0)
    await members.admit(ENGINE, "3", wait_listed=False)
    assert [url for _, url in router.added] == [ENGINE]

    await asyncio.sleep(29.0)
    plan = await members.reconcile()
    assert plan.add == (ENGINE,)  # missing from the listing...
    assert len(router.added) == 1  # ...but still registering: not added again

    await asyncio.sleep(2.0)  # 31 s after the registration was queued
    await members.reconcile()
    assert [(round(at), url) for at, url in router.added] == [(0, ENGINE), (31, ENGINE)]


def test_plan_membership_is_pure():
    listed = [RouterWorker("a", "http://x:1", True), RouterWorker("b", "http://y:1", True)]
    plan = plan_membership(listed, ["http://x:1/", "http://z:1"])
    assert plan.add == ("http://z:1",)
    assert [w.id for w in plan.remove] == ["b"]

"""A real Prometheus server on loopback, for tests that query what it scraped."""
from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path

import aiohttp
import yaml

from rlfleet.util.binaries import tool_path
from rlfleet.util.ports import allocate_endpoint
from rlfleet.util.procs import ManagedProcess

HTTP = aiohttp.ClientTimeout(total=10)


class LocalPrometheus:
    """A Prometheus server on loopback that scrapes one target every second and evaluates rule files."""

    def __init__(self, work_dir: Path, target: str, rule_files: list[Path], *, job: str = "rlfleet",
                 target_labels: dict[str, str] | None = None):
        """`target_labels`: labels of the scrape target, as service discovery would set them (a target's own
        `pod` makes Prometheus keep a scraped sample's `pod` as `exported_pod`)."""
        self.work_dir = work_dir
        self.host, self.port = allocate_endpoint()
        self.url = f"http://{self.host}:{self.port}"
        static: dict = {"targets": [target]}
        if target_labels:
            static["labels"] = dict(target_labels)
        config = {
            "global": {"scrape_interval": "1s", "scrape_timeout": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(p) for p in rule_files],
            "scrape_configs": [{"job_name": job, "static_configs": [static]}],
        }
        (work_dir / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.process = ManagedProcess("prometheus", [
            str(tool_path("prometheus")), f"--config.file={work_dir / 'prometheus.yml'}",
            f"--storage.tsdb.path={work_dir / 'data'}", f"--web.listen-address={self.host}:{self.port}",
            "--log.level=warn"], log_path=work_dir / "prometheus.log", die_with_parent=True)

    async def start(self, session: aiohttp.ClientSession, timeout_s: float = 30) -> None:
        await self.process.start()
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.process.returncode is None, "prometheus exited:\n" + "\n".join(self.process.tail(20))
            with contextlib.suppress(aiohttp.ClientError, OSError):
                async with session.get(self.url + "/-/ready", timeout=HTTP) as resp:
                    if resp.status == 200:
                        return
            assert time.monotonic() < deadline, "prometheus not ready:\n" + "\n".join(self.process.tail(20))
            await asyncio.sleep(0.1)

    async def stop(self) -> None:
        await self.process.stop(grace_s=5)

    async def query(self, session: aiohttp.ClientSession, expr: str) -> list[dict]:
        async with session.get(self.url + "/api/v1/query", params={"query": expr}, timeout=HTTP) as resp:
            body = await resp.json()
        assert body["status"] == "success", f"{expr}: {body.get('errorType')}: {body.get('error')}"
        return body["data"]["result"]

    async def wait_for(self, session: aiohttp.ClientSession, expr: str, ok, timeout_s: float = 15) -> list[dict]:
        """Query until `ok(result)`; the last result otherwise (the caller's assert says what was missing)."""
        deadline = time.monotonic() + timeout_s
        while True:
            result = await self.query(session, expr)
            if ok(result) or time.monotonic() >= deadline:
                return result
            await asyncio.sleep(0.25)

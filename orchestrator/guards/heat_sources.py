"""Where the heat guard reads GPU temperatures: a file, a DCGM exporter, or NVML on the node.

Every source answers `await read()` with {engine slot: celsius}. Slots without a reading are left out;
a source that cannot be read raises, and the guard counts that round as one without readings.
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.crds.specs import HeatSourceSpec

DCGM_TEMP_METRIC = "DCGM_FI_DEV_GPU_TEMP"


class TemperatureReadError(RuntimeError):
    pass


class TemperatureSource(Protocol):
    name: str

    async def read(self) -> dict[str, float]: ...


def parse_temperature_lines(text: str, *, origin: str = "temperature file") -> dict[str, float]:
    """Lines `<slot> <celsius>`; blank lines and `#` comments are skipped."""
    temps: dict[str, float] = {}
    for number, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        parts = line.split()
        if len(parts) != 2:
            raise TemperatureReadError(f"{origin}, line {number}: expected `<slot> <celsius>`, got {line!r}")
        try:
            temps[parts[0]] = float(parts[1])
        except ValueError:
            raise TemperatureReadError(f"{origin}, line {number}: {parts[1]!r} is not a temperature") from None
    return temps


class FileSource:
    """A text file of `<slot> <celsius>` lines, rewritten by whatever measures the GPUs."""

    name = "file"

    def __init__(self, path: str | Path):
        self.path = Path(path)

    async def read(self) -> dict[str, float]:
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except OSError as exc:
            raise TemperatureReadError(f"cannot read {self.path}: {exc}") from exc
        return parse_temperature_lines(text, origin=str(self.path))


def parse_dcgm_metrics(text: str, *, key_label: str = "gpu",
                       slot_by_key: Mapping[str, str] | None = None) -> dict[str, float]:
    """Temperatures from a DCGM exporter's metrics text.

    Each `DCGM_FI_DEV_GPU_TEMP{gpu="0", pod="...", ...} 71` sample is keyed by its `key_label`
    (`gpu` index, or `pod` when the exporter maps GPUs to pods) and mapped to a slot through
    `slot_by_key`; without a map the key is the slot. Samples of keys outside the map are ignored.
    """
    temps: dict[str, float] = {}
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise TemperatureReadError(f"DCGM metrics do not parse: {exc}") from exc
    for family in families:
        for sample in family.samples:
            if sample.name != DCGM_TEMP_METRIC:
                continue
            key = sample.labels.get(key_label)
            if key is None:
                continue
            slot = slot_by_key.get(key) if slot_by_key is not None else key
            if slot is not None:
                temps[slot] = float(sample.value)
    return temps


class DcgmSource:
    """A DCGM exporter's /metrics URL."""

    name = "dcgm"

    def __init__(self, url: str, session: aiohttp.ClientSession, *, key_label: str = "gpu",
                 slot_by_key: Mapping[str, str] | None = None, timeout_s: float = 5.0):
        self.url = url
        self.session = session
        self.key_label = key_label
        self.slot_by_key = slot_by_key
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)

    async def read(self) -> dict[str, float]:
        try:
            async with self.session.get(self.url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise TemperatureReadError(f"DCGM exporter {self.url} answered {resp.status}")
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TemperatureReadError(f"DCGM exporter {self.url}: {exc or type(exc).__name__}") from exc
        return parse_dcgm_metrics(text, key_label=self.key_label, slot_by_key=self.slot_by_key)


class NvmlSource:
    """NVML on this node (pynvml): GPU index -> slot."""

    name = "nvml"

    def __init__(self, slot_by_index: Mapping[int, str]):
        try:
            import pynvml
        except ImportError as exc:
            raise TemperatureReadError("heat guard source nvml needs pynvml (nvidia-ml-py)") from exc
        self._nvml = pynvml
        self.slot_by_index = dict(slot_by_index)
        self._initialised = False

    def _read_blocking(self) -> dict[str, float]:
        nvml = self._nvml
        if not self._initialised:
            nvml.nvmlInit()
            self._initialised = True
        temps: dict[str, float] = {}
        for index, slot in self.slot_by_index.items():
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            temps[slot] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        return temps

    async def read(self) -> dict[str, float]:
        try:
            return await asyncio.to_thread(self._read_blocking)
        except self._nvml.NVMLError as exc:
            raise TemperatureReadError(f"NVML: {exc}") from exc


def build_source(spec: HeatSourceSpec, *, session: aiohttp.ClientSession | None = None,
                 slot_by_key: Mapping[str, str] | None = None,
                 slot_by_gpu_index: Mapping[int, str] | None = None) -> TemperatureSource | None:
    """The source a HeatGuardSpec names (None for type `none`)."""
    if spec.type == "none":
        return None
    if spec.type == "file":
        if not spec.path:
            raise ValueError("heat guard source file needs `path`")
        return FileSource(spec.path)
    if spec.type == "dcgm":
        if not spec.url:
            raise ValueError("heat guard source dcgm needs `url`")
        if session is None:
            raise ValueError("heat guard source dcgm needs an HTTP session")
        return DcgmSource(spec.url, session, slot_by_key=slot_by_key)
    if spec.type == "nvml":
        return NvmlSource(slot_by_gpu_index or {})
    raise ValueError(f"unknown heat guard source {spec.type!r}")

"""Where the heat guard reads GPU temperatures: a file, a DCGM exporter, a Prometheus that scrapes the DCGM
exporters of every node, or NVML on this machine.

Every source answers `await read()` with {engine slot: celsius}. Slots without a reading are left out;
a source that cannot be read raises, and the guard counts that round as one without readings. A source
also keeps `unmapped_keys`: what its last read found that is no engine's (named when nothing matched).

GPU numbering: a local run places engines on GPUs counted among those CUDA_VISIBLE_DEVICES shows
(`--base-gpu-id`), while NVML and DCGM number the machine's GPUs physically. `visible_gpu_entries` turns
each slot's visible index into the physical index or UUID CUDA_VISIBLE_DEVICES names for it. (This
assumes CUDA counts GPUs as NVML does, in PCI bus order: CUDA_DEVICE_ORDER=PCI_BUS_ID, or identical GPUs.)
On Kubernetes a DCGM exporter with its pod mapping labels each GPU's samples with its pod: the engine
pods' names are the keys there. One exporter runs per node, so a fleet across nodes is read through the
Prometheus that scrapes them all (it keeps the exporter's pod label as `exported_pod` when the scrape
target has its own `pod`).
"""
from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from rlfleet.crds.reasons import INVALID_SPEC
from rlfleet.crds.specs import HeatSourceSpec
from rlfleet.errors import RunError

DCGM_TEMP_METRIC = "DCGM_FI_DEV_GPU_TEMP"
CUDA_VISIBLE_DEVICES = "CUDA_VISIBLE_DEVICES"
# dcgm-exporter's pod mapping labels; the second of each with --use-old-namespace.
DCGM_POD_LABELS = ("pod", "pod_name")
DCGM_NAMESPACE_LABELS = ("namespace", "pod_namespace")
# The same, as a Prometheus stores them: the scrape target's own pod and namespace labels win the plain
# names, and the exporter's are kept with an `exported_` prefix (honor_labels false, the default).
PROMETHEUS_POD_LABELS = ("exported_pod", *DCGM_POD_LABELS)
PROMETHEUS_NAMESPACE_LABELS = ("exported_namespace", *DCGM_NAMESPACE_LABELS)


class TemperatureReadError(RuntimeError):
    pass


class HeatGuardSetupError(RunError):
    """The heat guard cannot read the engines' GPUs as configured, here: the run fails rather than run
    with a guard that never acts."""

    reason = INVALID_SPEC


class TemperatureSource(Protocol):
    name: str
    unmapped_keys: tuple[str, ...]  # keys the last read found that map to no engine slot

    async def read(self) -> dict[str, float]: ...


# --- GPU numbering (pure) -----------------------------------------------------------------------------

def parse_visible_devices(value: str | None) -> tuple[str, ...] | None:
    """CUDA_VISIBLE_DEVICES as its entries; None when unset (CUDA then shows every GPU)."""
    if value is None:
        return None
    return tuple(entry.strip() for entry in value.split(",") if entry.strip())


def _visible_entry(visible: Sequence[str], index: int, slot: str) -> str:
    if index >= len(visible):
        raise HeatGuardSetupError(f"heat guard: engine {slot} runs on visible GPU {index}, but "
                                  f"{CUDA_VISIBLE_DEVICES}={','.join(visible)!r} shows {len(visible)} GPUs")
    entry = visible[index]
    if entry.isdigit() or entry.startswith("GPU-"):
        return entry
    if entry.startswith("MIG-"):
        raise HeatGuardSetupError(f"heat guard: {CUDA_VISIBLE_DEVICES} entry {entry} is a MIG instance; the heat "
                                  f"guard reads whole GPUs: name GPUs by index or GPU-UUID, or use source type file")
    raise HeatGuardSetupError(f"heat guard: {CUDA_VISIBLE_DEVICES} entry {entry!r} (engine {slot}) is neither a GPU "
                              f"index nor a GPU UUID (GPU-...)")


def visible_gpu_entries(slot_by_visible: Mapping[int, str], visible: Sequence[str] | None) -> dict[str, str]:
    """Each slot's GPU as NVML and DCGM know it: {slot: physical index (digits) or UUID (prefix) `GPU-...`}.

    `slot_by_visible`: each slot's first GPU, counted among the visible GPUs; `visible`: the entries of
    CUDA_VISIBLE_DEVICES (None: unset, visible index = physical index). Raises HeatGuardSetupError for an
    index past the list, a MIG instance, or an entry that is neither."""
    if visible is None:
        return {slot: str(index) for index, slot in slot_by_visible.items()}
    return {slot: _visible_entry(visible, index, slot) for index, slot in slot_by_visible.items()}


def uuid_matches(entry: str, uuid: str) -> bool:
    """CUDA takes a GPU's UUID or a unique prefix of it."""
    return entry.startswith("GPU-") and uuid.startswith(entry)


def physical_gpu_index(entry: str, uuid_by_index: Mapping[int, str]) -> int:
    """The NVML index of a `visible_gpu_entries` entry; a UUID must match exactly one of `uuid_by_index`."""
    if entry.isdigit():
        return int(entry)
    matches = [index for index, uuid in uuid_by_index.items() if uuid_matches(entry, uuid)]
    if len(matches) != 1:
        found = "no GPU" if not matches else f"{len(matches)} GPUs"
        raise HeatGuardSetupError(f"heat guard: {CUDA_VISIBLE_DEVICES} entry {entry} matches {found} of this "
                                  f"machine ({', '.join(uuid_by_index.values()) or 'none'})")
    return matches[0]


# --- file ---------------------------------------------------------------------------------------------

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
    unmapped_keys: tuple[str, ...] = ()  # its keys are slots already: the guard sees them all

    def __init__(self, path: str | Path):
        self.path = Path(path)

    async def read(self) -> dict[str, float]:
        try:
            text = await asyncio.to_thread(self.path.read_text, encoding="utf-8")
        except OSError as exc:
            raise TemperatureReadError(f"cannot read {self.path}: {exc}") from exc
        return parse_temperature_lines(text, origin=str(self.path))


# --- DCGM ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class DcgmSample:
    labels: Mapping[str, str]
    celsius: float


def parse_dcgm_samples(text: str) -> list[DcgmSample]:
    """The `DCGM_FI_DEV_GPU_TEMP{gpu="0", UUID="GPU-...", pod="...", ...} 71` samples of an exporter's text."""
    try:
        families = list(text_string_to_metric_families(text))
    except ValueError as exc:
        raise TemperatureReadError(f"DCGM metrics do not parse: {exc}") from exc
    return [DcgmSample(sample.labels, float(sample.value))
            for family in families for sample in family.samples if sample.name == DCGM_TEMP_METRIC]


def _first_label(labels: Mapping[str, str], names: Sequence[str]) -> str | None:
    return next((labels[name] for name in names if name in labels), None)


@dataclass(frozen=True)
class Assigned:
    """Samples sorted out: the slots' temperatures, and the keys of the samples that are no slot's."""

    temps: dict[str, float]
    unmapped: tuple[str, ...]


class DcgmKeys(Protocol):
    def assign(self, samples: Sequence[DcgmSample]) -> Assigned: ...


def _assign(keyed: Sequence[tuple[str, str | None, float]]) -> Assigned:
    """(key, slot or None, celsius) -> Assigned; a slot with several GPUs gets its hottest."""
    temps: dict[str, float] = {}
    unmapped: list[str] = []
    for key, slot, celsius in keyed:
        if slot is None:
            unmapped.append(key)
        else:
            temps[slot] = max(celsius, temps.get(slot, celsius))
    return Assigned(temps, tuple(sorted(set(unmapped))))


@dataclass(frozen=True)
class SlotsByGpu:
    """A local run: each slot's GPU by `visible_gpu_entries` (physical index, matched to the `gpu` label,
    or UUID, matched to the `UUID` label)."""

    gpu_by_slot: Mapping[str, str]

    def slot_of(self, labels: Mapping[str, str]) -> str | None:
        gpu, uuid = labels.get("gpu"), labels.get("UUID", "")
        return next((slot for slot, entry in self.gpu_by_slot.items()
                     if entry == gpu or uuid_matches(entry, uuid)), None)

    def assign(self, samples: Sequence[DcgmSample]) -> Assigned:
        return _assign([(f"gpu {s.labels.get('gpu', '?')}", self.slot_of(s.labels), s.celsius) for s in samples])


class PodSlots(Protocol):
    """Which slot a pod is (None: not an engine of the fleet): a mapping, or a rule over pod names."""

    def get(self, pod: str, /) -> str | None: ...


@dataclass(frozen=True)
class SlotsByPod:
    """Kubernetes: each sample's pod (dcgm-exporter's pod mapping) -> slot; samples of another namespace,
    when the exporter names one, are not ours."""

    slot_by_pod: PodSlots
    namespace: str | None = None
    pod_labels: tuple[str, ...] = DCGM_POD_LABELS  # the labels naming a sample's pod, first found wins
    namespace_labels: tuple[str, ...] = DCGM_NAMESPACE_LABELS

    def key_and_slot(self, labels: Mapping[str, str]) -> tuple[str, str | None]:
        pod = _first_label(labels, self.pod_labels)
        if pod is None:  # the exporter maps no pod to this GPU (or runs without its pod mapping)
            return f"gpu {labels.get('gpu', '?')} (no pod label)", None
        namespace = _first_label(labels, self.namespace_labels)
        if self.namespace is not None and namespace is not None and namespace != self.namespace:
            return f"{namespace}/{pod}", None
        return pod, self.slot_by_pod.get(pod)

    def assign(self, samples: Sequence[DcgmSample]) -> Assigned:
        return _assign([(*self.key_and_slot(s.labels), s.celsius) for s in samples])


class SampledSource:
    """A source of DCGM samples read over HTTP (`_samples`); `keys` says which samples are which slot's."""

    name = "samples"

    def __init__(self, session: aiohttp.ClientSession, keys: DcgmKeys, *, timeout_s: float = 5.0):
        self.session = session
        self.keys = keys
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.unmapped_keys: tuple[str, ...] = ()

    async def _samples(self) -> list[DcgmSample]:
        raise NotImplementedError

    async def read(self) -> dict[str, float]:
        self.unmapped_keys = ()
        assigned = self.keys.assign(await self._samples())
        self.unmapped_keys = assigned.unmapped
        return assigned.temps


class DcgmSource(SampledSource):
    """A DCGM exporter's /metrics URL (one node's GPUs)."""

    name = "dcgm"

    def __init__(self, url: str, session: aiohttp.ClientSession, keys: DcgmKeys, *, timeout_s: float = 5.0):
        super().__init__(session, keys, timeout_s=timeout_s)
        self.url = url

    async def _samples(self) -> list[DcgmSample]:
        try:
            async with self.session.get(self.url, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise TemperatureReadError(f"DCGM exporter {self.url} answered {resp.status}")
                text = await resp.text()
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise TemperatureReadError(f"DCGM exporter {self.url}: {exc or type(exc).__name__}") from exc
        return parse_dcgm_samples(text)


# --- Prometheus ---------------------------------------------------------------------------------------

def engine_temperature_query(pod_pattern: str) -> str:
    """PromQL for the GPU temperatures of the pods matching `pod_pattern` (a regular expression), whichever
    label the exporter's pod name is stored under."""
    return " or ".join(f'{DCGM_TEMP_METRIC}{{{label}=~"{pod_pattern}"}}' for label in PROMETHEUS_POD_LABELS)


def parse_query_samples(body: object) -> list[DcgmSample]:
    """The samples of a Prometheus instant-query answer (`/api/v1/query`, result type vector)."""
    if not isinstance(body, dict) or body.get("status") != "success":
        error = body.get("error") if isinstance(body, dict) else None
        raise TemperatureReadError(f"Prometheus query failed: {error or body!r}"[:500])
    data = body.get("data") or {}
    if data.get("resultType") != "vector":
        raise TemperatureReadError(f"Prometheus answered a {data.get('resultType')!r}, not an instant vector")
    samples = []
    for item in data.get("result") or []:
        try:
            samples.append(DcgmSample(dict(item["metric"]), float(item["value"][1])))
        except (KeyError, IndexError, TypeError, ValueError) as exc:
            raise TemperatureReadError(f"Prometheus sample does not parse: {item!r}"[:500]) from exc
    return samples


class PrometheusSource(SampledSource):
    """The DCGM exporters' GPU temperatures as a Prometheus has scraped them (`url`: its base URL), one
    instant query per read: every node's engines through one address."""

    name = "prometheus"

    def __init__(self, url: str, session: aiohttp.ClientSession, keys: DcgmKeys, *, query: str,
                 timeout_s: float = 5.0):
        super().__init__(session, keys, timeout_s=timeout_s)
        self.endpoint = url.rstrip("/") + "/api/v1/query"
        self.query = query

    async def _samples(self) -> list[DcgmSample]:
        try:
            async with self.session.get(self.endpoint, params={"query": self.query}, timeout=self.timeout) as resp:
                if resp.status != 200:
                    raise TemperatureReadError(f"Prometheus {self.endpoint} answered {resp.status}: "
                                               f"{(await resp.text())[:300]}")
                body = await resp.json(content_type=None)
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
            raise TemperatureReadError(f"Prometheus {self.endpoint}: {exc or type(exc).__name__}") from exc
        return parse_query_samples(body)


# --- NVML ---------------------------------------------------------------------------------------------

class NvmlSource:
    """NVML on this machine (pynvml): each slot's GPU by `visible_gpu_entries`, resolved to NVML's index
    on the first read (a UUID needs NVML's list of GPUs)."""

    name = "nvml"
    unmapped_keys: tuple[str, ...] = ()  # reads only the slots' GPUs

    def __init__(self, gpu_by_slot: Mapping[str, str]):
        try:
            import pynvml
        except ImportError as exc:
            raise TemperatureReadError("heat guard source nvml needs pynvml (nvidia-ml-py)") from exc
        self._nvml = pynvml
        self.gpu_by_slot = dict(gpu_by_slot)
        self._index_by_slot: dict[str, int] | None = None

    def _uuid_by_index(self) -> dict[int, str]:
        nvml = self._nvml
        uuids = {}
        for index in range(nvml.nvmlDeviceGetCount()):
            uuid = nvml.nvmlDeviceGetUUID(nvml.nvmlDeviceGetHandleByIndex(index))
            uuids[index] = uuid.decode() if isinstance(uuid, bytes) else uuid  # bytes in older pynvml
        return uuids

    def _resolve(self) -> dict[str, int]:
        self._nvml.nvmlInit()
        needs_uuids = any(not entry.isdigit() for entry in self.gpu_by_slot.values())
        uuids = self._uuid_by_index() if needs_uuids else {}
        return {slot: physical_gpu_index(entry, uuids) for slot, entry in self.gpu_by_slot.items()}

    def _read_blocking(self) -> dict[str, float]:
        nvml = self._nvml
        if self._index_by_slot is None:
            self._index_by_slot = self._resolve()
        temps: dict[str, float] = {}
        for slot, index in self._index_by_slot.items():
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
            temps[slot] = float(nvml.nvmlDeviceGetTemperature(handle, nvml.NVML_TEMPERATURE_GPU))
        return temps

    async def read(self) -> dict[str, float]:
        try:
            return await asyncio.to_thread(self._read_blocking)
        except self._nvml.NVMLError as exc:
            raise TemperatureReadError(f"NVML: {exc}") from exc


def build_source(spec: HeatSourceSpec, *, session: aiohttp.ClientSession | None = None,
                 dcgm_keys: DcgmKeys | None = None,
                 gpu_by_slot: Mapping[str, str] | None = None, query: str | None = None) -> TemperatureSource | None:
    """The source a HeatGuardSpec names (None for type `none`). `dcgm_keys`: which DCGM samples are
    which slot's; `gpu_by_slot`: each slot's GPU for NVML (`visible_gpu_entries`); `query`: the PromQL
    of the engines' temperatures (type prometheus)."""
    if spec.type == "none":
        return None
    if spec.type == "file":
        if not spec.path:
            raise ValueError("heat guard source file needs `path`")
        return FileSource(spec.path)
    if spec.type == "dcgm":
        if not spec.url:
            raise ValueError("heat guard source dcgm needs `url`")
        if session is None or dcgm_keys is None:
            raise ValueError("heat guard source dcgm needs an HTTP session and the engines' GPUs or pods")
        return DcgmSource(spec.url, session, dcgm_keys)
    if spec.type == "prometheus":
        if not spec.url:
            raise ValueError("heat guard source prometheus needs `url`")
        if session is None or dcgm_keys is None or query is None:
            raise ValueError("heat guard source prometheus needs an HTTP session, the engine pods and a query")
        return PrometheusSource(spec.url, session, dcgm_keys, query=query)
    if spec.type == "nvml":
        if not gpu_by_slot:
            raise ValueError("heat guard source nvml needs the engines' GPUs")
        return NvmlSource(gpu_by_slot)
    raise ValueError(f"unknown heat guard source {spec.type!r}")

"""Heat guard: which GPU (or pod) is each engine slot's, wherever the engines run, and what is refused.

Local runs count GPUs among those CUDA_VISIBLE_DEVICES shows, NVML and DCGM count them physically; on
Kubernetes a DCGM exporter labels GPUs with their pods, and NVML would read the trainer pod's node.
"""
from __future__ import annotations

import asyncio
import json
import logging
import re
import sys
import types
from pathlib import Path

import pytest

from rlfleet.crds.loader import load_training_run
from rlfleet.crds.specs import HeatGuardSpec
from rlfleet.orchestrator.guards.heat_guard import (
    EnginePods,
    EnginePodSlots,
    HeatGuardTask,
    LocalEngines,
    check_heat_guard,
    dcgm_keys,
    engine_pods_pattern,
    engine_visible_devices,
    gpu_by_slot,
    listed,
    unmatched_readings,
)
from rlfleet.orchestrator.guards.heat_sources import (
    DcgmSample,
    HeatGuardSetupError,
    NvmlSource,
    SlotsByPod,
    TemperatureReadError,
    engine_temperature_query,
    parse_dcgm_samples,
    parse_query_samples,
    parse_visible_devices,
    physical_gpu_index,
    visible_gpu_entries,
)
from rlfleet.orchestrator.run.kubernetes import KubernetesRun
from rlfleet.orchestrator.run.local import LocalRun
from rlfleet.orchestrator.run.loop import RunFailed, RunOptions
from rlfleet.orchestrator.run.progress import ProgressReporter
from rlfleet.util.procs import OUTER_ENV

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def guard_spec(kind: str, **source) -> HeatGuardSpec:
    return HeatGuardSpec.model_validate({"enabled": True, "source": {"type": kind, **source}})


NVML = guard_spec("nvml")
DCGM = guard_spec("dcgm", url="http://dcgm:9400/metrics")
FILE = guard_spec("file", path="temps")


# --- CUDA_VISIBLE_DEVICES -> the GPUs NVML and DCGM number --------------------------------------------

def test_visible_devices_entries():
    assert parse_visible_devices(None) is None  # unset: every GPU, numbered as NVML does
    assert parse_visible_devices("") == ()
    assert parse_visible_devices(" 2, 3 ,") == ("2", "3")


def test_visible_indices_become_physical_ones():
    slots = {0: "rollout-0", 1: "rollout-1"}
    assert visible_gpu_entries(slots, None) == {"rollout-0": "0", "rollout-1": "1"}
    assert visible_gpu_entries(slots, ("6", "4")) == {"rollout-0": "6", "rollout-1": "4"}
    assert visible_gpu_entries({1: "rollout-0"}, ("GPU-aaa", "GPU-bbb")) == {"rollout-0": "GPU-bbb"}


@pytest.mark.parametrize(("visible", "message"), [
    (("0",), "engine rollout-1 runs on visible GPU 1, but CUDA_VISIBLE_DEVICES='0' shows 1 GPUs"),
    (("0", "MIG-1234"), "CUDA_VISIBLE_DEVICES entry MIG-1234 is a MIG instance"),
    (("0", "gpu1"), "CUDA_VISIBLE_DEVICES entry 'gpu1' (engine rollout-1) is neither a GPU index nor a GPU UUID"),
])
def test_visible_devices_that_name_no_gpu_of_a_slot_are_refused(visible, message):
    with pytest.raises(HeatGuardSetupError, match=re.escape(message)) as refused:
        visible_gpu_entries({0: "rollout-0", 1: "rollout-1"}, visible)
    assert refused.value.reason == "InvalidSpec"


def test_a_uuid_is_matched_whole_or_by_unique_prefix():
    uuids = {0: "GPU-aaa-1", 1: "GPU-aab-2", 2: "GPU-bbb-3"}
    assert physical_gpu_index("5", uuids) == 5
    assert physical_gpu_index("GPU-bbb-3", uuids) == 2
    assert physical_gpu_index("GPU-aab", uuids) == 1
    with pytest.raises(HeatGuardSetupError, match="matches 2 GPUs"):
        physical_gpu_index("GPU-aa", uuids)
    with pytest.raises(HeatGuardSetupError, match="matches no GPU of this machine"):
        physical_gpu_index("GPU-ccc", uuids)


def test_the_engines_own_cuda_visible_devices_counts():
    assert engine_visible_devices({}, {}) is None
    assert engine_visible_devices({"CUDA_VISIBLE_DEVICES": "4,5"}, {}) == ("4", "5")
    assert engine_visible_devices({"CUDA_VISIBLE_DEVICES": "4,5"}, {"CUDA_VISIBLE_DEVICES": "1"}) == ("1",)


def test_local_slots_read_their_planned_gpu_through_cuda_visible_devices():
    placement = LocalEngines(gpu_bases=(2, 4), visible_devices=("7", "6", "5", "4", "3", "2", "1", "0"))
    assert gpu_by_slot("rollout", 2, placement) == {"rollout-0": "5", "rollout-1": "3"}
    assert gpu_by_slot("rollout", 2, LocalEngines(gpu_bases=(2, 4))) == {"rollout-0": "2", "rollout-1": "4"}


# --- DCGM ---------------------------------------------------------------------------------------------

def sample(celsius: float, **labels: str) -> DcgmSample:
    return DcgmSample(labels, celsius)


def test_dcgm_locally_keys_samples_by_physical_gpu_or_uuid():
    samples = [sample(50, gpu="0", UUID="GPU-aaa"), sample(91, gpu="1", UUID="GPU-bbb"),
               sample(70, gpu="2", UUID="GPU-ccc")]
    # CUDA_VISIBLE_DEVICES=2,1: visible GPU 0 (rollout-0) is physical 2, visible 1 (rollout-1) physical 1.
    keys = dcgm_keys("rollout", 2, LocalEngines(gpu_bases=(0, 1), visible_devices=("2", "1")))
    assert keys.assign(samples).temps == {"rollout-0": 70.0, "rollout-1": 91.0}
    assert keys.assign(samples).unmapped == ("gpu 0",)
    by_uuid = dcgm_keys("rollout", 1, LocalEngines(gpu_bases=(0,), visible_devices=("GPU-bb",)))
    assert by_uuid.assign(samples).temps == {"rollout-0": 91.0}


def test_dcgm_on_kubernetes_keys_samples_by_the_engine_pods():
    keys = dcgm_keys("run-rollout", 2, EnginePods("rl"))
    assert keys == SlotsByPod(EnginePodSlots("run-rollout"), namespace="rl")
    assigned = keys.assign([
        sample(80, gpu="0", pod="run-rollout-engine-0", namespace="rl"),
        sample(88, gpu="1", pod="run-rollout-engine-0", namespace="rl"),  # a pod of two GPUs: its hottest
        sample(60, gpu="2", pod_name="run-rollout-engine-1", pod_namespace="rl"),  # --use-old-namespace
        sample(99, gpu="3", pod="run-rollout-engine-1", namespace="other"),  # the same name elsewhere
        sample(40, gpu="4", pod="someone-else", namespace="rl"),
        sample(30, gpu="5"),  # a GPU no pod holds
        sample(77, gpu="6", pod="run-rollout-engine-12", namespace="rl"),  # a slot added by a scale-up
        sample(50, gpu="7", pod="run-rollout-engine-01", namespace="rl"),  # no slot's pod is named so
        sample(51, gpu="8", pod="run-rollout-engine-1x", namespace="rl"),
    ])
    assert assigned.temps == {"run-rollout-0": 88.0, "run-rollout-1": 60.0, "run-rollout-12": 77.0}
    assert assigned.unmapped == ("gpu 5 (no pod label)", "other/run-rollout-engine-1", "run-rollout-engine-01",
                                 "run-rollout-engine-1x", "someone-else")


def test_dcgm_exporter_text_of_engine_pods():
    text = ('DCGM_FI_DEV_GPU_TEMP{gpu="0",UUID="GPU-a",container="engine",namespace="rl",'
            'pod="run-rollout-engine-1"} 86\n')
    assert dcgm_keys("run-rollout", 2, EnginePods("rl")).assign(parse_dcgm_samples(text)).temps == {
        "run-rollout-1": 86.0}


# --- NVML (a stand-in pynvml: no driver here) ---------------------------------------------------------

class FakeNvml(types.ModuleType):
    NVML_TEMPERATURE_GPU = 0

    class NVMLError(Exception):
        pass

    def __init__(self, uuids: list[str], temps: list[float]):
        super().__init__("pynvml")
        self.uuids, self.temps, self.uuid_calls = uuids, temps, 0

    def nvmlInit(self) -> None:  # pynvml's names
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.uuids)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> int:
        return index

    def nvmlDeviceGetUUID(self, handle: int) -> bytes:
        self.uuid_calls += 1
        return self.uuids[handle].encode()  # older pynvml answers bytes

    def nvmlDeviceGetTemperature(self, handle: int, sensor: int) -> float:
        return self.temps[handle]


@pytest.fixture
def nvml(monkeypatch) -> FakeNvml:
    fake = FakeNvml(["GPU-aaa", "GPU-bbb", "GPU-ccc"], [40.0, 90.0, 60.0])
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    return fake


async def test_nvml_reads_each_slots_physical_gpu(nvml):
    assert await NvmlSource({"rollout-0": "2", "rollout-1": "0"}).read() == {"rollout-0": 60.0, "rollout-1": 40.0}
    assert nvml.uuid_calls == 0  # indices need no UUIDs
    assert await NvmlSource({"rollout-0": "GPU-bbb"}).read() == {"rollout-0": 90.0}
    with pytest.raises(HeatGuardSetupError, match="GPU-ddd matches no GPU"):
        await NvmlSource({"rollout-0": "GPU-ddd"}).read()


# --- what is refused, and where -----------------------------------------------------------------------

def test_nvml_on_kubernetes_is_refused_naming_the_field_and_the_alternatives():
    with pytest.raises(HeatGuardSetupError) as refused:
        check_heat_guard(NVML, EnginePods("rl"))
    message = str(refused.value)
    assert message.startswith("spec.heatGuard.source.type: nvml reads the GPUs of the node the orchestrator runs on")
    assert "use prometheus" in message and "dcgm (one node" in message and "or file" in message
    assert refused.value.reason == "InvalidSpec"
    check_heat_guard(guard_spec("prometheus", url="http://prometheus:9090"), EnginePods("rl"))
    for spec in (DCGM, FILE, HeatGuardSpec(enabled=False)):
        check_heat_guard(spec, EnginePods("rl"))


def test_locally_gpu_sources_need_engines_on_gpus_that_cuda_visible_devices_shows():
    for spec in (NVML, DCGM):
        with pytest.raises(HeatGuardSetupError, match=f"source.type: {spec.source.type} reads the engines' GPUs, "
                                                      "but the rollout engines run on no GPU"):
            check_heat_guard(spec, LocalEngines())
        with pytest.raises(HeatGuardSetupError, match="engine slot 1 runs on visible GPU 4"):
            check_heat_guard(spec, LocalEngines(gpu_bases=(2, 4), visible_devices=("0", "1", "2", "3")))
        check_heat_guard(spec, LocalEngines(gpu_bases=(2, 4), visible_devices=None))
    check_heat_guard(FILE, LocalEngines())  # a file names slots, wherever they run


async def test_a_kubernetes_run_with_nvml_fails_at_its_start(tmp_path):
    run = load_training_run(EXAMPLES / "gpu-megatron.yaml")
    run.spec.heat_guard = NVML
    options = RunOptions(run_dir=tmp_path / "run", progress=ProgressReporter(tty=False))
    k8s = KubernetesRun(run, options, kube=None, namespace="rl", snapshots=tmp_path / "snapshots", run_uid="uid")
    with pytest.raises(RunFailed) as failed:
        await k8s.execute()
    assert failed.value.reason == "InvalidSpec" and "spec.heatGuard.source.type: nvml" in failed.value.message
    assert not (tmp_path / "run").exists()  # nothing started


def test_a_local_run_places_the_heat_guard_on_its_planned_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "7,6,5,4,3,2,1,0")
    run = load_training_run(EXAMPLES / "gpu-megatron.yaml")
    placement = LocalRun(run, RunOptions(run_dir=tmp_path / "run"))._engine_placement()
    assert placement == LocalEngines(gpu_bases=(2, 4), visible_devices=("7", "6", "5", "4", "3", "2", "1", "0"))
    # The trainer's own variables (spec.trainer.env, set in this process) are not the engines'.
    monkeypatch.setenv(OUTER_ENV, json.dumps({"CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7"}))
    placement = LocalRun(run, RunOptions(run_dir=tmp_path / "run"))._engine_placement()
    assert placement.visible_devices == ("0", "1", "2", "3", "4", "5", "6", "7")


# --- readings that match no engine ---------------------------------------------------------------------

def test_unmatched_readings():
    assert unmatched_readings(["gpu 0", "gpu 1"], ["rollout-0"]).seen == ("gpu 0", "gpu 1")
    assert unmatched_readings(["rollout-0", "gpu 1"], ["rollout-0", "rollout-1"]) is None  # one matches
    assert unmatched_readings([], ["rollout-0"]) is None  # nothing read: the read error says why
    assert unmatched_readings(["gpu 0"], []) is None  # no engine to match
    assert listed(["a", "b", "c"], most=2) == "a, b and 1 more"


class Keys:
    """A source whose keys can be changed."""

    name = "test"

    def __init__(self, temps: dict[str, float], unmapped: tuple[str, ...] = ()):
        self.temps, self.unmapped_keys = temps, unmapped

    async def read(self) -> dict[str, float]:
        return dict(self.temps)


async def noop(url, action) -> None:
    pass


@pytest.mark.looptime
async def test_readings_for_no_engine_are_warned_once_until_they_change(caplog):
    source = Keys({}, unmapped=("other-pod",))
    guard = HeatGuardTask(HeatGuardSpec(enabled=True), source, engines=lambda: {"r0": "http://r0"},
                          call_engine=noop, fleet="heat-test", poll_interval_s=5)
    caplog.set_level(logging.WARNING, logger="rlfleet.orchestrator.guards.heat_guard")
    runner = asyncio.create_task(guard.run())
    await asyncio.sleep(12)  # three polls, one warning
    warnings = [r.getMessage() for r in caplog.records if "but none for the engines" in r.getMessage()]
    assert warnings == ["heat guard: test read temperatures for other-pod, but none for the engines r0: none of "
                        "them can be paused until the source names them"]
    source.temps = {"rollout-0": 90.0}  # keys changed: warned again
    await asyncio.sleep(5)
    source.temps = {"r0": 70.0}  # matched: nothing to say
    await asyncio.sleep(5)
    warnings = [r.getMessage() for r in caplog.records if "but none for the engines" in r.getMessage()]
    assert len(warnings) == 2 and "for other-pod, rollout-0," in warnings[1]
    runner.cancel()


@pytest.mark.looptime
async def test_a_source_that_cannot_be_set_up_ends_the_guard_and_resumes_what_it_paused():
    calls: list[tuple[str, str]] = []

    class Breaks(Keys):
        async def read(self) -> dict[str, float]:
            if calls:
                raise HeatGuardSetupError("no such GPU")
            return {"r0": 95.0}

    async def call(url, action) -> None:
        calls.append((url, action.value))

    guard = HeatGuardTask(HeatGuardSpec(enabled=True), Breaks({}), engines=lambda: {"r0": "http://r0"},
                          call_engine=call, fleet="heat-test", poll_interval_s=5)
    with pytest.raises(HeatGuardSetupError):
        await guard.run()
    assert calls == [("http://r0", "pause"), ("http://r0", "resume")]


# --- prometheus: every node's DCGM exporter through the Prometheus that scrapes them ------------------

def test_prometheus_is_refused_in_a_local_run():
    with pytest.raises(HeatGuardSetupError, match="prometheus reads the DCGM exporters of a cluster"):
        check_heat_guard(guard_spec("prometheus", url="http://prometheus:9090"), LocalEngines(gpu_bases=(0,)))


def test_prometheus_query_asks_for_the_fleets_engine_pods_under_either_pod_label():
    query = engine_temperature_query(engine_pods_pattern("run-rollout"))
    assert query == ('DCGM_FI_DEV_GPU_TEMP{exported_pod=~"run-rollout-engine-[0-9]+"} or '
                     'DCGM_FI_DEV_GPU_TEMP{pod=~"run-rollout-engine-[0-9]+"} or '
                     'DCGM_FI_DEV_GPU_TEMP{pod_name=~"run-rollout-engine-[0-9]+"}')
    assert re.fullmatch(engine_pods_pattern("run-rollout"), "run-rollout-engine-12")
    assert not re.fullmatch(engine_pods_pattern("run-rollout"), "run-rollout-engine-1x")


def test_prometheus_answers_are_read_and_keyed_by_the_exported_pod_first():
    body = {"status": "success", "data": {"resultType": "vector", "result": [
        {"metric": {"exported_pod": "run-rollout-engine-0", "exported_namespace": "rl", "pod": "dcgm-exporter-1",
                    "namespace": "gpu-operator", "gpu": "0"}, "value": [1.0, "83.5"]},
        {"metric": {"pod": "run-rollout-engine-1", "namespace": "rl", "gpu": "1"}, "value": [1.0, "70"]}]}}
    samples = parse_query_samples(body)
    assert [s.celsius for s in samples] == [83.5, 70.0]
    keys = dcgm_keys("run-rollout", 2, EnginePods("rl"), prometheus=True)
    assert keys.assign(samples).temps == {"run-rollout-0": 83.5, "run-rollout-1": 70.0}
    for bad, says in (({"status": "error", "error": "parse error"}, "parse error"),
                      ({"status": "success", "data": {"resultType": "matrix", "result": []}}, "not an instant vector"),
                      ({"status": "success", "data": {"resultType": "vector", "result": [{"metric": {}}]}},
                       "does not parse")):
        with pytest.raises(TemperatureReadError, match=says):
            parse_query_samples(bad)

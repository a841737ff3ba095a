"""Pure decisions of the broadcast weight sync: buckets, ranks, bounds, checksums as SGLang computes them."""
from __future__ import annotations

import hashlib

import pytest
import torch

from rlfleet.orchestrator.fleet import broadcast_plan as plan


def spec(name: str, dtype: str, nbytes: int) -> plan.TensorSpec:
    return plan.TensorSpec(name, dtype, (nbytes,), nbytes)


def test_buckets_hold_one_dtype_at_most_max_bytes_back_to_back_aligned():
    specs = [spec("a", "float32", 40), spec("b", "bfloat16", 30), spec("c", "float32", 70), spec("d", "float32", 10),
             spec("e", "float32", 500)]
    buckets = plan.plan_buckets(specs, 100)
    assert [b.names for b in buckets] == [["a"], ["c", "d"], ["e"], ["b"]]
    assert all(len(set(b.dtypes)) == 1 for b in buckets)
    assert buckets[2].nbytes == 500  # a tensor larger than a bucket is a bucket of its own
    for before, after in zip(buckets, buckets[1:], strict=False):
        assert after.start >= before.end and after.start % plan.BUCKET_ALIGN == 0
    assert plan.buffer_bytes(buckets) == buckets[-1].end
    assert sorted(plan.names_of(buckets)) == ["a", "b", "c", "d", "e"]
    with pytest.raises(ValueError):
        plan.plan_buckets(specs, 0)


def test_tensor_specs_name_dtype_shape_bytes():
    specs = plan.tensor_specs({"w": torch.zeros(2, 3), "b": torch.zeros(4, dtype=torch.bfloat16)})
    assert specs == [plan.TensorSpec("b", "bfloat16", (4,), 8), plan.TensorSpec("w", "float32", (2, 3), 24)]


def test_rank_offsets_follow_rank_zero_and_each_engines_ranks():
    assert plan.rank_offsets([1, 1]) == ([1, 2], 3)
    assert plan.rank_offsets([2, 4, 1]) == ([1, 3, 7], 8)
    with pytest.raises(ValueError):
        plan.rank_offsets([0])


def test_control_and_join_bounds_are_short_shares_of_the_transfer_timeout():
    bounds = plan.StepBounds(600)
    assert bounds.control_s == plan.CONTROL_TIMEOUT_S and bounds.join_s == plan.JOIN_TIMEOUT_S
    assert bounds.transfer_s == 600
    tight = plan.StepBounds(5)
    assert tight.control_s == tight.join_s == tight.bucket_s(1, 1) == tight.transfer_s == 5


def test_a_bucket_gets_its_share_of_the_transfer_timeout_by_bytes():
    gib = 1024**3
    bounds = plan.StepBounds(600)
    assert bounds.bucket_s(gib // 2, gib) == pytest.approx(300)  # two 512 MiB buckets of 1 GiB: T/2 each
    assert bounds.bucket_s(gib // 4, gib) == pytest.approx(150)
    assert bounds.bucket_s(10**7, 10**7) == 600  # one bucket: the whole transfer timeout
    # Raising T gives a slow link more time (a fixed rate would give 512 MiB 20.24 s whatever T is).
    assert plan.StepBounds(3600).bucket_s(gib // 2, gib) == pytest.approx(1800)


def test_a_bucket_never_gets_less_than_a_healthy_peer_always_meets_nor_more_than_t():
    gib = 1024**3
    bounds = plan.StepBounds(600)
    tiny = bounds.bucket_s(1024, gib)  # share 0.6 ms: the floor instead
    assert tiny == pytest.approx(plan.bucket_floor_s(1024)) and tiny >= plan.BUCKET_FLOOR_S
    assert plan.bucket_floor_s(10 * plan.SLOWEST_BYTES_PER_S) == pytest.approx(plan.BUCKET_FLOOR_S + 10)
    # 100 GiB in 1 GiB buckets at T=600: a share of 6 s is below the floor of 30.48 s.
    assert bounds.bucket_s(gib, 100 * gib) == pytest.approx(plan.BUCKET_FLOOR_S + gib / plan.SLOWEST_BYTES_PER_S)
    assert bounds.bucket_s(10**15, 10**15) == 600  # never beyond the transfer timeout
    assert plan.StepBounds(60).bucket_s(gib, gib) == 60  # even when the floor is larger
    assert bounds.bucket_s(0, 10**6) == plan.BUCKET_FLOOR_S  # empty tensors only: the floor
    assert bounds.bucket_s(0, 0) == 600  # a transfer of nothing: all of it is the one bucket's share


def test_a_step_gets_at_most_what_is_left_of_the_transfer():
    bounds = plan.StepBounds(60)
    assert bounds.within_transfer(30, 0) == 30  # its own bound while there is time
    assert bounds.within_transfer(30, 45) == 15  # cut to what is left
    assert bounds.within_transfer(bounds.bucket_s(10**7, 10**7), 2) == 58
    assert bounds.within_transfer(30, 60) <= 0  # nothing left: the transfer has overrun
    assert bounds.within_transfer(30, 75) <= 0


def test_checksum_is_sglangs():
    from sglang.srt.managers.mm_utils import tensor_hash

    for t in (torch.randn(3, 5), torch.randn(7).to(torch.bfloat16), torch.arange(6).reshape(2, 3).t()):
        assert plan.tensor_checksum(t) == f"{tensor_hash(t):016x}"
    t = torch.randn(4)
    assert plan.tensor_checksum(t) == hashlib.sha256(t.numpy().tobytes()).digest()[:8].hex()


def test_compare_checksums_matches_prefixed_names_and_reports_differences():
    expected = {"model.embed_tokens.weight": "aa", "model.norm.weight": "bb", "lm_head.weight": "cc"}
    served = {"model.model.embed_tokens.weight": "aa", "model.model.norm.weight": "00"}
    verdict = plan.compare_checksums(expected, served)
    assert verdict.compared == 2 and verdict.mismatched == ("model.norm.weight",)
    assert verdict.unmatched == ("lm_head.weight",)  # tied: the engine does not list it
    assert not verdict.ok and "model.norm.weight" in verdict.describe()
    same = plan.compare_checksums(expected, {"model.embed_tokens.weight": "aa", "model.norm.weight": "bb"})
    assert same.ok and same.compared == 2
    nothing = plan.compare_checksums(expected, {"other": "aa"})
    assert nothing.compared == 0 and not nothing.ok and "no served tensor" in nothing.describe()


def test_compare_checksums_never_guesses_between_two_candidates():
    verdict = plan.compare_checksums({"norm.weight": "aa"}, {"a.norm.weight": "aa", "b.norm.weight": "bb"})
    assert verdict.compared == 0 and verdict.unmatched == ("norm.weight",)


def test_verification_rate():
    assert [plan.verification_due(i, 1) for i in range(1, 4)] == [True, True, True]
    assert [plan.verification_due(i, 3) for i in range(1, 7)] == [False, False, True, False, False, True]
    assert not any(plan.verification_due(i, 0) for i in range(1, 10))


def test_only_syncs_that_carry_tensors_count_toward_the_verification_rate():
    """A recovery or launch re-sync (no tensors) between steps does not shift which steps are verified."""
    def verified_steps(carries: list[bool], every: int) -> list[int]:
        count, verified = 0, []
        for i, carries_tensors in enumerate(carries):
            count = plan.count_verifiable(count, carries_tensors)
            if carries_tensors and plan.verification_due(count, every):
                verified.append(i)
        return verified

    assert plan.count_verifiable(4, True) == 5 and plan.count_verifiable(4, False) == 4
    steps = [True] * 6
    with_resyncs = [False, True, True, False, True, True, False, True, True]  # the same 6 steps, 3 re-syncs
    assert verified_steps(steps, 2) == [1, 3, 5]  # the 2nd, 4th and 6th step
    assert [with_resyncs[:i + 1].count(True) for i in verified_steps(with_resyncs, 2)] == [2, 4, 6]
    assert verified_steps(with_resyncs, 1) == [i for i, c in enumerate(with_resyncs) if c]
    assert verified_steps(with_resyncs, 0) == []


def test_served_dtype_is_what_the_engine_launch_asks_for():
    from rlfleet.crds.specs import EngineSpec
    from rlfleet.sglang.launch import served_dtype

    assert served_dtype(EngineSpec(model_path="m", device="cpu")) == "float32"
    assert served_dtype(EngineSpec(model_path="m", device="cuda")) is None  # the snapshot's own
    assert served_dtype(EngineSpec(model_path="m", device="cpu", extra_args=["--dtype", "bfloat16"])) == "bfloat16"
    assert served_dtype(EngineSpec(model_path="m", device="cuda", extra_args=["--dtype", "half"])) == "float16"
    assert served_dtype(EngineSpec(model_path="m", device="cuda", extra_args=["--dtype=bfloat16"])) == "bfloat16"


def test_how_an_engine_spec_serves_its_weights():
    from rlfleet.crds.specs import EngineSpec
    from rlfleet.orchestrator.fleet.served_weights import EngineLayout
    from rlfleet.sglang.launch import ServedWeights

    plain = ServedWeights.of(EngineSpec(model_path="m", tensor_parallel_size=4, gpus_per_engine=4))
    assert plain == ServedWeights(device="cuda", tp_size=4, dtype=None, quantization=None)
    fp8 = ServedWeights.of(EngineSpec(model_path="m", extra_args=["--quantization", "fp8", "--dtype", "bfloat16"]))
    assert (fp8.quantization, fp8.dtype) == ("fp8", "bfloat16")
    assert ServedWeights.of(EngineSpec(model_path="m", extra_args=["--quantization=none"])).quantization is None
    # Quantized weights hash to other values than the trainer's: unverifiable, never a mismatch.
    why = EngineLayout.of(device="cuda", tp_size=1, config={}, quantization="fp8")
    assert isinstance(why, str) and "quantized (fp8)" in why


def test_checksums_in_the_engines_dtype():
    t = {"w": torch.randn(4, 4)}
    assert plan.checksums(t) == {"w": plan.tensor_checksum(t["w"])}
    assert plan.checksums(t, dtype="bfloat16") == {"w": plan.tensor_checksum(t["w"].to(torch.bfloat16))}


def test_a_snapshots_tensor_table_plans_the_buckets_its_tensors_do(tmp_path):
    """The group built at bring-up from the launch snapshot's table is the one the trainer's tensors need."""
    from rlfleet.snapshot.format import SnapshotReference
    from rlfleet.snapshot.writer import ExportState, write_hf_snapshot

    tensors = {"model.embed_tokens.weight": torch.zeros(64, 16), "model.norm.weight": torch.ones(16),
               "lm_head.weight": torch.zeros(64, 16, dtype=torch.bfloat16)}
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "float32"}
    (tmp_path / "source").mkdir()
    write_hf_snapshot(ExportState(step=0, tensors=tensors, config=config, source_dir=tmp_path / "source"),
                      tmp_path / "step_0")
    table = SnapshotReference.from_dir(tmp_path / "step_0").tensors
    assert plan.table_specs(table) == plan.tensor_specs(tensors)
    assert plan.plan_buckets(plan.table_specs(table), 4096) == plan.plan_buckets(plan.tensor_specs(tensors), 4096)


def test_a_table_with_a_dtype_torch_has_no_name_for_plans_nothing():
    from rlfleet.snapshot.format import TensorInfo

    assert plan.table_specs({"w": TensorInfo(dtype="F8_E8M0", shape=(4,), file="model.safetensors")}) is None


def test_a_broadcast_goes_again_over_the_staying_engines_only_when_a_scale_down_broke_it():
    # Slot 2 scaled away under way (replicas now 2), it or no one blamed: again over slots 0 and 1.
    assert plan.staying_after_scale_down([0, 1, 2], 2, blamed={2}) == [0, 1]
    assert plan.staying_after_scale_down([0, 1, 2], 2, blamed=set()) == [0, 1]
    # A staying engine timed out or went away itself: the failure is its, not the scale-down's.
    assert plan.staying_after_scale_down([0, 1, 2], 2, blamed={1, 2}) is None
    # Nothing scaled away, or nothing left to broadcast to.
    assert plan.staying_after_scale_down([0, 1], 2, blamed={1}) is None
    assert plan.staying_after_scale_down([1, 2], 1, blamed=set()) is None

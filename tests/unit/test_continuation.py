"""Rollout continuation: the progress kept from a stream, the request that continues it, the stitched
answer, the client's loop around broken streams (looptime), per-token versions and staleness."""
from __future__ import annotations

import asyncio
import json
import random

import pytest
from prometheus_client import REGISTRY

from helpers.manifests import RUN, errors
from rlfleet.crds.loader import load_text
from rlfleet.orchestrator.rollout.client import RetryPolicy, RolloutClient, RolloutLedger, generate_all
from rlfleet.orchestrator.rollout.continuation import Progress, continuation_request, stitched_answer
from rlfleet.orchestrator.rollout.stream import error_of_chunk, parse_event
from rlfleet.sglang.errors import CallError, FailureKind, RequestAborted, error_for
from rlfleet.trainer.grpo import Sample, StalenessPolicy, assemble_batch, sample_from_generate

K = FailureKind
PROMPT = [5, 6, 7]


def chunk(pairs: list[tuple[float, int]], version: str = "0", finish: str | None = None) -> dict:
    """A cumulative SGLang stream chunk of one attempt."""
    return {"text": "", "output_ids": [t for _, t in pairs],
            "meta_info": {"weight_version": version, "completion_tokens": len(pairs),
                          "finish_reason": None if finish is None else {"type": finish},
                          "output_token_logprobs": [[lp, t, None] for lp, t in pairs]}}


def test_progress_keeps_the_tokens_of_every_attempt_with_their_logprobs_and_versions():
    progress = Progress(max_new_tokens=6)
    assert progress.apply_chunk(chunk([(-0.1, 11)])) == 1
    assert progress.apply_chunk(chunk([(-0.1, 11), (-0.2, 12)])) == 1  # cumulative: only the new one counts
    assert progress.end_attempt() == 2
    progress.apply_chunk(chunk([(-0.3, 13)], version="1"))
    progress.apply_chunk(chunk([(-0.3, 13), (-0.4, 14)], version="1"))
    assert (progress.token_ids, progress.logprobs, progress.versions) == (
        [11, 12, 13, 14], [-0.1, -0.2, -0.3, -0.4], ["0", "0", "1", "1"])
    assert progress.remaining == 2 and progress.finished_without_engine() is None
    assert progress.end_attempt() == 2
    assert progress.end_attempt() == 0 and len(progress.segments) == 2  # an empty attempt leaves no segment


def delta(pairs: list[tuple[float, int]], total: int, text: str = "", version: str = "0",
          finish: str | None = None) -> dict:
    """An incremental (`--incremental-streaming-output`) chunk: only the new tokens, the count so far."""
    return {"text": text, "output_ids": [t for _, t in pairs],
            "meta_info": {"weight_version": version, "completion_tokens": total,
                          "finish_reason": None if finish is None else {"type": finish},
                          "output_token_logprobs": [[lp, t, None] for lp, t in pairs]}}


def test_incremental_chunks_are_accumulated_with_their_text():
    progress = Progress(max_new_tokens=8)
    assert progress.apply_chunk(delta([(-0.1, 11)], 1, "a")) == 1
    assert progress.apply_chunk(delta([(-0.2, 12), (-0.3, 13)], 3, "bc")) == 2  # two deltas coalesced
    assert progress.apply_chunk(delta([], 3, "")) == 0
    assert (progress.token_ids, progress.logprobs, progress.all_text) == ([11, 12, 13], [-0.1, -0.2, -0.3], "abc")
    # An abort answers with the whole output (and only its last output id), not a delta.
    assert progress.apply_chunk(delta([(-0.1, 11), (-0.2, 12), (-0.3, 13), (-0.4, 14)], 4, "abcd",
                                      finish="abort")) == 1
    assert progress.end_attempt() == 4 and progress.text == "abcd"
    assert progress.apply_chunk(delta([(-0.5, 15)], 1, "e", version="1")) == 1  # the continuation's first
    assert progress.apply_chunk(delta([(-0.6, 16)], 2, "f", version="1")) == 1
    assert progress.token_ids == [11, 12, 13, 14, 15, 16] and progress.versions == ["0"] * 4 + ["1"] * 2
    assert progress.all_text == "abcdef"


def test_an_abort_joined_to_queued_deltas_keeps_each_token_once():
    progress = Progress(max_new_tokens=8)
    progress.apply_chunk(delta([(-0.1, 11), (-0.2, 12)], 2, "ab"))
    # Queued deltas (13, 14) and the abort's whole output (11-14), concatenated by the engine.
    joined = delta([(-0.3, 13), (-0.4, 14), (-0.1, 11), (-0.2, 12), (-0.3, 13), (-0.4, 14)], 4, "cd" + "abcd",
                   finish="abort")
    assert progress.apply_chunk(joined) == 2
    assert progress.token_ids == [11, 12, 13, 14] and progress.logprobs == [-0.1, -0.2, -0.3, -0.4]
    assert progress.all_text == "abcd"


def test_a_cumulative_list_running_ahead_of_its_count_is_not_taken_for_a_delta():
    progress = Progress(max_new_tokens=8)
    progress.apply_chunk(chunk([(-0.1, 11)]))
    ahead = chunk([(-0.1, 11), (-0.2, 12), (-0.3, 13)])
    ahead["meta_info"]["completion_tokens"] = 2  # the engine appended a token after counting
    assert progress.apply_chunk(ahead) == 2 and progress.token_ids == [11, 12, 13]


def test_the_continuation_request_is_prompt_plus_prefix_with_the_remaining_budget_and_the_same_sampling():
    payload = {"input_ids": PROMPT, "return_logprob": True, "rid": "s1",
               "sampling_params": {"max_new_tokens": 10, "temperature": 0.7, "top_p": 0.9, "stop_token_ids": [2]}}
    progress = Progress.for_request(payload)
    progress.apply_chunk(chunk([(-0.1, 11), (-0.2, 12), (-0.3, 13)]))
    progress.end_attempt()
    request = continuation_request(payload, PROMPT, progress)
    assert request == {"input_ids": [5, 6, 7, 11, 12, 13], "return_logprob": True, "rid": "s1",
                       "sampling_params": {"max_new_tokens": 7, "temperature": 0.7, "top_p": 0.9,
                                           "stop_token_ids": [2]}}
    assert payload["input_ids"] == PROMPT and payload["sampling_params"]["max_new_tokens"] == 10  # untouched
    progress.apply_chunk(chunk([(-0.5, 2)]))  # a stop token last: done, whatever the budget says
    assert progress.finished_without_engine() == "stop"


def test_the_stitched_answer_has_every_token_the_oldest_version_and_the_continuation_mark():
    progress = Progress(max_new_tokens=4)
    progress.apply_chunk(chunk([(-0.1, 11), (-0.2, 12)], version="3"))
    progress.end_attempt()
    last = chunk([(-0.3, 13), (-0.4, 14)], version="4", finish="length")
    progress.apply_chunk(last)
    progress.end_attempt()
    answer = stitched_answer(last, progress)
    sample = sample_from_generate(PROMPT, answer)
    assert sample.response_ids == (11, 12, 13, 14) and sample.sampling_logprobs == (-0.1, -0.2, -0.3, -0.4)
    assert sample.token_versions == ("3", "3", "4", "4") and sample.weight_version == "3"
    assert sample.continued_at == (2,) and sample.versions() == ("3", "4")
    assert answer["meta_info"]["continuation"] == {
        "continued": 1, "tokens_saved": 2,
        "segments": [{"start": 0, "end": 2, "weight_version": "3", "completion_tokens": 2},
                     {"start": 2, "end": 4, "weight_version": "4", "completion_tokens": 2}]}


def test_staleness_is_judged_by_the_oldest_or_the_newest_token():
    mixed = Sample((1,), (2, 3), (-1.0, -1.0), "3", reward=1.0, token_versions=("3", "4"))
    plain = Sample((1,), (2,), (-1.0,), "4", reward=0.0)
    assert StalenessPolicy(0).staleness(mixed, 4) == 1
    assert StalenessPolicy(0, by="newest").staleness(mixed, 4) == 0
    assert assemble_batch([[mixed, plain]], current_step=4, policy=StalenessPolicy(0)).stale_groups_rejected == 1
    assert assemble_batch([[mixed, plain]], current_step=4, policy=StalenessPolicy(0, by="newest")).groups == 1
    with pytest.raises(ValueError, match="judged by"):
        StalenessPolicy(0, by="median")
    with pytest.raises(ValueError, match="token versions"):
        Sample((1,), (2, 3), (-1.0, -1.0), "3", token_versions=("3",))


def test_stream_events_and_mid_stream_errors_are_parsed_and_classified():
    assert parse_event(b'data: {"text": "a"}') == {"text": "a"}
    assert parse_event(b"data: [DONE]") is None
    failed = error_of_chunk({"error": {"message": "bad", "code": 400}})
    assert failed is not None and failed.kind is K.CLIENT_ERROR and failed.status == 400
    failed = error_of_chunk({"error": "engine gone"})
    assert failed is not None and failed.kind is K.SERVER_ERROR
    assert error_of_chunk({"text": "a"}) is None


class Engines:
    """A stream transport playing a deterministic greedy model (token at output position i is 100 + i):
    each attempt streams until its planned break (a CallError after that many tokens), and records what
    it was sent."""

    def __init__(self, *breaks: tuple[int, CallError], version: str = "0", incremental: bool = False):
        self.breaks = list(breaks)
        self.incremental = incremental
        self.sent: list[dict] = []
        self.generated = 0
        self.version = version

    async def __call__(self, payload, timeout_s, on_chunk):
        self.sent.append(json.loads(json.dumps(payload)))
        offset = len(payload["input_ids"]) - len(PROMPT)
        budget = payload["sampling_params"]["max_new_tokens"]
        cut, failure = self.breaks.pop(0) if self.breaks else (budget, None)
        pairs: list[tuple[float, int]] = []
        for i in range(min(cut, budget)):
            await asyncio.sleep(0.01)
            pairs.append((-0.01 * (offset + i), 100 + offset + i))
            self.generated += 1
            finish = "length" if failure is None and len(pairs) == budget else None
            last = (delta(pairs[-1:], len(pairs), f"<{pairs[-1][1]}>", self.version, finish) if self.incremental
                    else chunk(pairs, self.version, finish))
            on_chunk(last)
        if failure is not None:
            raise failure
        return last


def greedy(max_new_tokens: int = 10) -> dict:
    return {"input_ids": PROMPT, "return_logprob": True,
            "sampling_params": {"max_new_tokens": max_new_tokens, "temperature": 0}}


def counter(name: str, fleet: str) -> float:
    return REGISTRY.get_sample_value(name, {"fleet": fleet}) or 0.0


@pytest.mark.looptime
async def test_a_broken_stream_continues_from_its_tokens_and_only_the_rest_is_generated():
    engines = Engines((4, error_for(K.CONNECTION_CLOSED, "engine died")))
    client = RolloutClient("http://router", None, stream=engines, continuation=True, rng=random.Random(0),
                           fleet="cont-unit-1")
    answer = await client.generate("s1", greedy(10))
    assert answer["output_ids"] == list(range(100, 110))
    assert [p[0] for p in answer["meta_info"]["output_token_logprobs"]] == [-0.01 * i for i in range(10)]
    assert engines.generated == 10  # nothing generated twice
    assert engines.sent[1]["input_ids"] == PROMPT + [100, 101, 102, 103]
    assert engines.sent[1]["sampling_params"] == {"max_new_tokens": 6, "temperature": 0}
    assert {s["rid"] for s in engines.sent} == {"s1"}
    assert client.continued.as_dict() == {"requests": 1, "continuations": 1, "tokens_saved": 4}
    assert counter("rlfleet_rollout_continuations_total", "cont-unit-1") == 1
    assert counter("rlfleet_rollout_continuation_tokens_saved_total", "cont-unit-1") == 4
    assert client.progress == {}


@pytest.mark.looptime
async def test_incremental_streams_continue_and_join_into_the_whole_answer():
    engines = Engines((4, error_for(K.CONNECTION_CLOSED, "engine died")), incremental=True)
    client = RolloutClient("http://router", None, stream=engines, continuation=True, rng=random.Random(0),
                           fleet="cont-unit-inc")
    answer = await client.generate("s1", greedy(10))
    assert answer["output_ids"] == list(range(100, 110)) and engines.generated == 10
    assert engines.sent[1]["input_ids"] == PROMPT + [100, 101, 102, 103]
    assert answer["text"] == "".join(f"<{t}>" for t in range(100, 110))
    # Continuation off: one stream per attempt, its deltas joined into the answer.
    plain = RolloutClient("http://router", None, stream=Engines(incremental=True), fleet="cont-unit-inc-off")
    answer = await plain.generate("s2", greedy(5))
    assert answer["output_ids"] == list(range(100, 105)) and len(answer["meta_info"]["output_token_logprobs"]) == 5


@pytest.mark.looptime
async def test_a_continuation_that_breaks_again_is_continued_again_beyond_max_attempts():
    closed = error_for(K.CONNECTION_CLOSED, "engine died")
    aborted = RequestAborted("weights changed")
    engines = Engines((3, closed), (0, error_for(K.UNAVAILABLE, "no workers", status=503)), (2, aborted), (2, closed))
    client = RolloutClient("http://router", None, stream=engines, continuation=True, rng=random.Random(0),
                           policy=RetryPolicy(max_attempts=2), fleet="cont-unit-2")
    answer = await client.generate("s1", greedy(10))
    assert answer["output_ids"] == list(range(100, 110)) and engines.generated == 10
    assert [len(s["input_ids"]) - len(PROMPT) for s in engines.sent] == [0, 3, 3, 5, 7]
    assert answer["meta_info"]["continuation"]["continued"] == 3
    assert answer["meta_info"]["continuation"]["tokens_saved"] == 3 + 5 + 7


@pytest.mark.looptime
async def test_failures_without_progress_still_use_up_the_attempts():
    refused = error_for(K.CONNECTION_REFUSED, "refused")
    engines = Engines((3, error_for(K.CONNECTION_CLOSED, "died")), (0, refused), (0, refused))
    client = RolloutClient("http://router", None, stream=engines, continuation=True, rng=random.Random(0),
                           policy=RetryPolicy(max_attempts=2), fleet="cont-unit-3")
    ledger = await generate_all(client, {"s1": greedy(10)})
    assert set(ledger.failed) == {"s1"} and ledger.delivered == {}
    assert len(engines.sent) == 3


@pytest.mark.looptime
async def test_a_stream_broken_after_its_last_token_is_complete():
    engines = Engines((10, error_for(K.CONNECTION_CLOSED, "died before the final chunk")))
    client = RolloutClient("http://router", None, stream=engines, continuation=True, fleet="cont-unit-4")
    answer = await client.generate("s1", greedy(10))
    assert answer["output_ids"] == list(range(100, 110)) and len(engines.sent) == 1
    assert answer["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.looptime
async def test_continuation_off_restarts_from_scratch_and_every_sample_is_delivered_once():
    sent: list[dict] = []
    fails = {"s1": 1}

    async def transport(payload, timeout_s):
        sent.append(dict(payload))
        if fails.get(payload["rid"]):
            fails[payload["rid"]] -= 1
            raise error_for(K.CONNECTION_CLOSED, "died")
        return {"output_ids": [1], "meta_info": {"id": payload["rid"]}}

    engines = Engines()
    client = RolloutClient("http://router", None, transport=transport, stream=engines, continuation=False,
                           fleet="cont-unit-5")
    ledger = await generate_all(client, {"s1": greedy(10), "s2": greedy(10)})
    assert set(ledger.delivered) == {"s1", "s2"} and engines.sent == []
    assert [p["input_ids"] for p in sent] == [PROMPT] * 3  # the retry starts from the prompt alone
    with pytest.raises(Exception, match="delivered twice"):
        RolloutLedger(delivered=dict(ledger.delivered)).deliver("s1", {})


@pytest.mark.looptime
async def test_a_client_error_is_not_continued():
    engines = Engines((2, error_for(K.CLIENT_ERROR, "bad", status=400)))
    client = RolloutClient("http://router", None, stream=engines, continuation=True, fleet="cont-unit-6")
    ledger = await generate_all(client, {"s1": greedy(10)})
    assert set(ledger.failed) == {"s1"} and len(engines.sent) == 1
    assert isinstance(ledger.failed["s1"].last, CallError)


def test_the_api_takes_continuation_and_staleness_by_and_names_a_bad_value():
    (doc,) = load_text(RUN + "  rollout: {continuation: false}\n  trainer: {stalenessBy: newest}\n")
    assert doc.errors == [] and doc.obj.spec.rollout.continuation is False
    assert doc.obj.spec.trainer.staleness_by == "newest"
    (doc,) = load_text(RUN)
    assert doc.obj.spec.rollout.continuation is True and doc.obj.spec.trainer.staleness_by == "oldest"
    assert [path for path, _ in errors(RUN + "  trainer: {stalenessBy: median}\n")] == ["spec.trainer.stalenessBy"]
    assert [path for path, _ in errors(RUN + "  rollout: {continuation: 1}\n")] == ["spec.rollout.continuation"]

"""Continuation of a broken generation: what was generated so far, the request that continues it, and
the stitched answer. Pure: no I/O.

A streamed `/generate` chunk carries output tokens of this attempt (`meta_info.output_token_logprobs`:
`[[logprob, token_id, text|null], ...]`), the attempt's token count so far (`meta_info.completion_tokens`)
and the weight version serving it (`meta_info.weight_version`). By default every chunk repeats all the
attempt's tokens so far (cumulative: bytes grow with the square of the length); engines started with
`--incremental-streaming-output` (rlfleet's launch builder) send only the new ones (`new_output`
tells the two apart). `Progress` keeps, at any moment, the tokens and text of the finished attempts
(the kept prefix) and of the one streaming now, each token with its behaviour logprob and the weight
version of the chunk that brought it. When an attempt breaks, its tokens join the prefix and
`continuation_request` resubmits the prompt plus the prefix as `input_ids`, with the remaining token
budget and the same sampling settings; `stitched_answer` is the one answer the caller gets.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from rlfleet.trainer.grpo import CONTINUATION_KEY, TOKEN_VERSIONS_KEY, version_order

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default of sampling_params.max_new_tokens


DELTA, WHOLE, JOINED = "delta", "whole", "joined"  # what a chunk's tokens and text are (new_output)


def new_output(meta: Mapping[str, Any], have: int) -> tuple[list, str]:
    """The tokens (logprob pairs) of one chunk that are new to an attempt holding `have`, and what the
    chunk's lists are: DELTA (only new tokens and text), WHOLE (all so far) or JOINED (see below).

    A cumulative chunk holds all tokens so far (its list may run ahead of `completion_tokens`); an
    incremental one exactly `completion_tokens - have` new ones. SGLang answers an abort with the whole
    output even when incremental, and when that joins deltas still queued for the client it sends them
    concatenated (deltas, then the whole output): the whole output is the tail.
    """
    pairs = list(meta.get("output_token_logprobs") or [])
    total = meta.get("completion_tokens")
    if isinstance(total, int) and have > 0 and len(pairs) == total - have:
        return pairs, DELTA
    reason = meta.get("finish_reason")
    if isinstance(total, int) and 0 < total < len(pairs) and isinstance(reason, dict) and \
            reason.get("type") == "abort":
        return pairs[-total:][have:], JOINED
    return pairs[have:], WHOLE


def attempt_text(held: str, text: str, kind: str) -> str:
    """The attempt's text after a chunk with `text` of that kind (new_output). JOINED is the queued
    deltas D then the whole text (held + D): D + held + D."""
    if kind == DELTA:
        return held + text
    if kind == JOINED:
        return text[(len(text) - len(held)) // 2:]
    return text


@dataclass(frozen=True)
class Segment:
    """What one attempt generated: tokens [start, end) of the output, the engine's own count of them."""

    start: int
    end: int
    weight_version: str  # the version of its last chunk
    completion_tokens: int  # meta_info.completion_tokens as the engine reported it


@dataclass
class Progress:
    """The output of one sample so far, across attempts."""

    max_new_tokens: int
    stop_token_ids: frozenset[int] = frozenset()
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[str] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    kept: int = 0  # tokens of finished (broken) attempts: the prefix the current attempt continues
    text: str = ""  # the text of the finished attempts
    _attempt_text: str = ""
    _completion_tokens: int = 0

    @classmethod
    def for_request(cls, payload: Mapping[str, Any]) -> Progress:
        """The empty progress of a request (its token budget and stop tokens)."""
        sampling = payload.get("sampling_params") or {}
        return cls(max_new_tokens=int(sampling.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)),
                   stop_token_ids=frozenset(int(t) for t in sampling.get("stop_token_ids") or ()))

    @property
    def generated(self) -> int:
        return len(self.token_ids)

    @property
    def all_text(self) -> str:
        """The text of every attempt so far (at a cut the engine's detokenizer starts afresh)."""
        return self.text + self._attempt_text

    @property
    def remaining(self) -> int:
        return self.max_new_tokens - self.generated

    def apply_chunk(self, chunk: Mapping[str, Any]) -> int:
        """Take one chunk (cumulative or incremental) of the attempt streaming now; returns how many
        tokens it added."""
        meta = chunk.get("meta_info") or {}
        version = str(meta.get("weight_version", ""))
        pairs, kind = new_output(meta, len(self.token_ids) - self.kept)
        if isinstance(text := chunk.get("text"), str):
            self._attempt_text = attempt_text(self._attempt_text, text, kind)
        added = 0
        for pair in pairs:
            self.logprobs.append(float(pair[0]))
            self.token_ids.append(int(pair[1]))
            self.versions.append(version)
            added += 1
        tokens = meta.get("completion_tokens")
        if isinstance(tokens, int):
            self._completion_tokens = tokens
        return added

    def end_attempt(self) -> int:
        """The attempt streaming now is over (finished or broken); returns the tokens it generated."""
        made = len(self.token_ids) - self.kept
        if made:  # an attempt that generated nothing leaves no segment
            self.segments.append(Segment(self.kept, len(self.token_ids), self.versions[-1], self._completion_tokens))
        self.kept = len(self.token_ids)
        self.text += self._attempt_text
        self._attempt_text = ""
        self._completion_tokens = 0
        return made

    def finished_without_engine(self) -> str | None:
        """The finish reason when the prefix is already complete (budget used up, or a stop token last):
        the stream broke after the last token but before its final chunk. None: continue."""
        if self.remaining <= 0:
            return "length"
        if self.token_ids and self.token_ids[-1] in self.stop_token_ids:
            return "stop"
        return None


def prompt_ids_of(payload: Mapping[str, Any]) -> list[int] | None:
    """The prompt's token ids when the request gives them (`input_ids`, one prompt); None otherwise."""
    ids = payload.get("input_ids")
    if isinstance(ids, list) and ids and all(isinstance(t, int) for t in ids):
        return list(ids)
    return None


def continuation_request(payload: Mapping[str, Any], prompt_ids: Sequence[int], progress: Progress) -> dict:
    """The request that continues `progress`: prompt + prefix as input_ids, the remaining budget, the
    same sampling settings (and everything else) as the original request."""
    if progress.remaining <= 0:
        raise ValueError("nothing left to generate")
    request = {k: v for k, v in payload.items() if k != "text"}
    request["input_ids"] = list(prompt_ids) + list(progress.token_ids)
    sampling = dict(payload.get("sampling_params") or {})
    sampling["max_new_tokens"] = progress.remaining
    request["sampling_params"] = sampling
    return request


def stitched_answer(last: Mapping[str, Any] | None, progress: Progress, *, finish: str | None = None) -> dict:
    """One answer for the whole sample: every token, its behaviour logprob and weight version.

    `last` is the final chunk of the last attempt (None when the prefix finished by itself, `finish`
    then says how). `meta_info.weight_version` is the oldest token's version; `token_weight_versions`
    has one per token; a continued sample has `continuation` with what was kept and regenerated.
    """
    answer: dict[str, Any] = {k: v for k, v in (last or {}).items() if k not in ("output_ids", "meta_info")}
    meta: dict[str, Any] = dict((last or {}).get("meta_info") or {})
    if finish is not None:
        meta["finish_reason"] = {"type": finish, **({"length": progress.generated} if finish == "length" else {})}
    meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(progress.logprobs, progress.token_ids,
                                                                         strict=True)]
    meta["output_token_logprobs_length"] = progress.generated
    meta["completion_tokens"] = progress.generated
    meta[TOKEN_VERSIONS_KEY] = list(progress.versions)
    if progress.versions:
        meta["weight_version"] = min(progress.versions, key=version_order)
    continued = [s for s in progress.segments if s.start > 0]
    if continued:
        meta[CONTINUATION_KEY] = {
            "continued": len(continued),
            "tokens_saved": sum(s.start for s in continued),
            "segments": [{"start": s.start, "end": s.end, "weight_version": s.weight_version,
                          "completion_tokens": s.completion_tokens} for s in progress.segments],
        }
    answer["text"] = progress.all_text
    answer["output_ids"] = list(progress.token_ids)
    answer["meta_info"] = meta
    return answer


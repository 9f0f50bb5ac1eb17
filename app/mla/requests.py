"""What an engine is asked for (``Request``) and what it hands back (``RequestOutput``, each
step's ``StepOutput``, its ``EngineStats``), and the error of a request that can never fit
(``RequestTooLargeError``)."""

from __future__ import annotations

import enum
import reprlib
from collections.abc import Iterable

import attrs
import torch

from app._validation import check_int_at_least, is_int

__all__ = ["EngineStats", "FinishReason", "Request", "RequestMetrics", "RequestOutput",
           "RequestTooLargeError", "RowKind", "StepOutput"]


def _tokens(field: str, value: object) -> tuple[int, ...]:
    """``value`` as a tuple of ints; ``TypeError`` naming ``field`` otherwise."""
    if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
        raise TypeError(f"Request.{field}: token ids must be an iterable of ints, got "
                        f"{reprlib.repr(value)} ({type(value).__name__})")
    tokens = tuple(value)
    for t in tokens:
        if not is_int(t):
            raise TypeError(f"Request.{field}: token ids must be ints, got {t!r} "
                            f"({type(t).__name__})")
    return tokens


def _token_tuple(value: Iterable[int]) -> tuple[int, ...]:
    return _tokens("prompt_token_ids", value)


def _token_set(value: Iterable[int] | None) -> frozenset[int]:
    return frozenset(_tokens("stop_token_ids", () if value is None else value))


def _request_id(instance: object, attribute: attrs.Attribute[str], value: object) -> None:
    if not isinstance(value, str) or not value:
        raise TypeError(f"Request.request_id must be a non-empty str, got {value!r}")


def _positive(instance: object, attribute: attrs.Attribute[int], value: object) -> None:
    check_int_at_least(f"Request.{attribute.name}", value, 1)


@attrs.frozen
class Request:
    """A generation request: ``prompt_token_ids`` (non-empty), at most ``max_new_tokens``
    generated tokens, and ``stop_token_ids`` (generation ends after emitting one of them)."""

    request_id: str = attrs.field(validator=_request_id)
    prompt_token_ids: tuple[int, ...] = attrs.field(converter=_token_tuple)
    max_new_tokens: int = attrs.field(default=16, validator=_positive)
    stop_token_ids: frozenset[int] = attrs.field(default=frozenset(), converter=_token_set)

    def __attrs_post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError(f"request {self.request_id!r} has no prompt tokens")


class FinishReason(str, enum.Enum):
    """Why a request ended: ``max_new_tokens`` reached, a stop token emitted, aborted, or an
    error (the model's logits for it were not finite: ``RequestOutput.error`` says where)."""

    LENGTH = "length"
    STOP = "stop"
    ABORT = "abort"
    ERROR = "error"


class RowKind(enum.IntEnum):
    """How a row (token position) of a request's output was computed, if at all."""

    NOT_COMPUTED = 0   # a prefix-cache hit (computed by another request), or never computed
    PREFILL = 1        # the non-absorbed prefill path
    DECODE = 2         # the absorbed decode path (plain or speculative verification)


@attrs.frozen
class RequestMetrics:
    """Timestamps (``time.perf_counter`` seconds) and engine steps of a request's life, and its
    speculative-decoding counts (drafts proposed / accepted)."""

    arrival_time: float
    arrival_step: int
    first_token_time: float | None
    first_token_step: int | None
    finish_time: float
    finish_step: int
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first generated token."""
        return None if self.first_token_time is None else \
            self.first_token_time - self.arrival_time

    @property
    def ttft_steps(self) -> int | None:
        """Steps from arrival to the first generated token (1: in the first step it ran)."""
        return None if self.first_token_step is None else \
            self.first_token_step - self.arrival_step


@attrs.frozen(eq=False)
class RequestOutput:
    """A finished (or aborted) request.

    ``output_token_ids`` are the generated tokens; ``logit_margins[i]`` the top-1 minus top-2
    logit of the row that chose token ``i`` (a near-tie when within rounding) and
    ``logprobs[i]`` token ``i``'s log-probability under that row's softmax. When the engine
    keeps outputs, ``hidden [S, hidden]`` (model dtype; ``S = len(prompt) + len(outputs)``)
    holds the final normed hidden state (the LM head's input) of every row the request
    computed and ``row_kinds [S]`` (int8, ``RowKind``) says how; rows it did not compute are
    zero. ``error`` says why a request ended with ``FinishReason.ERROR`` (None otherwise).
    A sparse model's engine built with ``keep_selections=True`` also gives ``selections
    [indexer layers, S, ceil(S / 8)]`` uint8: the positions each row attended to in each layer
    with its own indexer as a bitmask (bit ``b`` of byte ``j``: position ``8 j + b``; an
    all-zero row where ``row_kinds`` says not computed; ``app.model.sparse.selections``), for
    the float64 check to attend alike (``app.mla.checks``).
    """

    request_id: str
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]
    finish_reason: FinishReason
    num_cached_tokens: int
    num_preemptions: int
    logit_margins: tuple[float, ...]
    metrics: RequestMetrics
    logprobs: tuple[float, ...] = ()
    hidden: torch.Tensor | None = None
    row_kinds: torch.Tensor | None = None
    error: str | None = None
    selections: torch.Tensor | None = None

    @property
    def token_ids(self) -> tuple[int, ...]:
        """The final sequence: prompt then generated tokens."""
        return self.prompt_token_ids + self.output_token_ids

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first (None with fewer than two)."""
        m = self.metrics
        if m.first_token_time is None or len(self.output_token_ids) < 2:
            return None
        return (m.finish_time - m.first_token_time) / (len(self.output_token_ids) - 1)

    @property
    def tpot_steps(self) -> float | None:
        """Steps per output token after the first (below 1 when speculation accepts drafts)."""
        m = self.metrics
        if m.first_token_step is None or len(self.output_token_ids) < 2:
            return None
        return (m.finish_step - m.first_token_step) / (len(self.output_token_ids) - 1)


class RequestTooLargeError(ValueError):
    """A request needs more KV-cache blocks than the whole pool has: it can never run."""


@attrs.frozen
class StepOutput:
    """One step: the tokens each request emitted, the requests that finished, the ids
    preempted, the prefill / decode query tokens computed and the step's wall seconds."""

    step: int
    new_tokens: dict[str, tuple[int, ...]]
    finished: tuple[RequestOutput, ...]
    preempted: tuple[str, ...]
    num_prefill_tokens: int
    num_decode_tokens: int
    seconds: float


@attrs.define
class EngineStats:
    """Counters since the engine started (seconds are wall time inside ``step``)."""

    steps: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    decode_emitted_tokens: int = 0
    emitted_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finished_requests: int = 0
    aborted_requests: int = 0
    preemptions: int = 0
    peak_used_blocks: int = 0
    draft_tokens: int = 0
    accepted_tokens: int = 0
    step_seconds: float = 0.0
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    #: Latent values an ``fp8`` cache's per-layer scale saturated (0 by construction).
    fp8_overflows: int = 0

    @property
    def prefix_cache_hit_rate(self) -> float:
        """Prompt tokens served from the prefix cache / prompt tokens (finished requests)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def prefill_tokens_per_second(self) -> float:
        """Prefill tokens per second of prefill compute."""
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0

    @property
    def decode_tokens_per_second(self) -> float:
        """Tokens emitted by decode steps per second of decode compute."""
        return self.decode_emitted_tokens / self.decode_seconds if self.decode_seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts / proposed drafts (0.0 without speculation)."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

"""Per-phase wall-clock accounting of engine steps (off unless asked for).

``PhaseTimer`` adds the time spent in each named phase of a step (``gather``, ``up_projection``,
``attention_new``, ...). On an asynchronous device it synchronises around every phase, which
costs time: enable it for benchmarks, not in production. ``NULL_TIMER`` does nothing.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

__all__ = ["NULL_TIMER", "PHASES", "PhaseTimer"]

#: The phases of a step, in the order they run (prefill, then decode, then the LM head).
PHASES: tuple[str, ...] = (
    "schedule",          # engine: queue, allocate_slots, prefix-cache lookups, drafting,
                         # token bookkeeping, cache_blocks, frees
    "metadata",          # slot indices, positions, MLAPrefillMetadata.build + prepare_metadata
    "projection",        # W_q, W_kv_a, RMSNorm, RoPE (new tokens) and W_o
    "cache_write",       # latent of the new tokens into their slots
    "up_projection",     # W_kv_b of new tokens and of each gathered context chunk
    "gather",            # cached context out of the paged cache
    "attention_new",     # backend: causal attention of the new tokens
    "attention_context",  # backend: one call per context chunk
    "merge",             # LSE merges
    "decode_metadata",   # decode: block tables, slots, positions, prepare_metadata, inputs
    "absorption",        # decode: q_nope x W_UK, and W_UV over the latent output
    "attention_decode",  # decode backend: run_decode over the latent cache
    "indexer",           # sparse layers: index q / k / weights, key-cache writes, scores, top-k
    "attention_sparse",  # sparse layers: run_sparse_prefill / run_sparse_decode
    "mlp",               # RMSNorms around attention and MLP, the SwiGLU MLP or the MoE (router,
                         # grouped experts, shared experts), the final norm
    "lm_head",           # LM head (hidden x lm_head^T)
    "sample",            # greedy argmax, float32 rescoring, top-2 margins, log-probabilities
)

_NULL = nullcontext()


class PhaseTimer:
    """Accumulates seconds per phase; ``sync`` (e.g. ``torch.cuda.synchronize``) runs at each
    phase boundary so that asynchronous work is charged to the phase that launched it."""

    def __init__(self, enabled: bool = True, sync: Callable[[], None] | None = None) -> None:
        self.enabled = enabled
        self.sync = sync
        self.seconds: dict[str, float] = dict.fromkeys(PHASES, 0.0)

    def phase(self, name: str) -> AbstractContextManager[None]:
        """A context manager charging its body to ``name`` (a no-op when disabled)."""
        if not self.enabled:
            return _NULL
        return self._timed(name)

    @contextmanager
    def _timed(self, name: str) -> Iterator[None]:
        if self.sync is not None:
            self.sync()
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.sync is not None:
                self.sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - start

    def reset(self) -> None:
        """Zero every phase."""
        self.seconds = dict.fromkeys(PHASES, 0.0)

    @property
    def total(self) -> float:
        """Seconds over all phases."""
        return sum(self.seconds.values())


#: A disabled timer, shared.
NULL_TIMER = PhaseTimer(enabled=False)

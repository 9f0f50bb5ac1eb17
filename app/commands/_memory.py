"""Whether what a command builds fits in memory, checked before it is built: the model's
weights, a request's blocks, and (``check_cache_fits``, from ``app.model.cache``, where
``MLAEngine`` runs it too) the KV-cache pool.

A pool of ``num_blocks`` blocks is a Python list of block objects plus one latent-cache tensor:
with an absurd ``num_blocks`` (int32 allows 2**31 - 1) building it would take minutes and then
fail; these say up front how much memory it needs, how much there is, and how many blocks fit.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from app._cpu import available_host_bytes
from app.config import EngineConfig
from app.model.cache import available_memory_bytes, check_cache_fits

if TYPE_CHECKING:
    from app.model.config import DeepseekConfig

__all__ = ["available_host_bytes", "available_memory_bytes", "check_cache_fits",
           "check_host_memory", "check_request_fits", "check_weights_fit", "weights_bytes"]


def check_host_memory(what: str, needed: int) -> None:
    """``ValueError`` naming ``what`` (a flag and its value) when ``needed`` bytes of host
    memory are more than the host has available now: said up front, instead of an
    allocation failing (or the OOM killer coming) minutes later."""
    have = available_host_bytes()
    if have is not None and needed > have:
        raise ValueError(f"{what} needs {needed / 2**30:.1f} GiB of host memory; this machine "
                         f"has {have / 2**30:.1f} GiB available now")


def weights_bytes(arch: DeepseekConfig, dtype: torch.dtype) -> int:
    """Host bytes the model's weights take: every tensor of ``weight_specs`` in ``dtype`` (the
    router in float32), and the float64 copies the reference check keeps (at most
    ``REFERENCE_CACHE_BYTES``)."""
    from app.model.reference import REFERENCE_CACHE_BYTES
    from app.model.weights import weight_specs

    total = elements = 0
    for spec in weight_specs(arch).values():
        n = math.prod(spec.shape)
        elements += n
        total += n * (4 if spec.float32 else dtype.itemsize)
    return total + min(8 * elements, int(REFERENCE_CACHE_BYTES))


def check_weights_fit(arch: DeepseekConfig, dtype: torch.dtype) -> None:
    """``ValueError`` when the model's weights cannot fit in host memory (a deployment's
    ``hidden_size = 262144, num_heads = 1024`` is nearly 1 TiB of weights): said before they are
    drawn or loaded, instead of an allocation failing or the OOM killer coming."""
    check_host_memory(f"a model of {arch.num_hidden_layers} layer(s) with num_heads "
                      f"{arch.num_attention_heads}, hidden_size {arch.hidden_size}, "
                      f"kv_lora_rank {arch.kv_lora_rank} (its weights)",
                      weights_bytes(arch, dtype))


def check_request_fits(config: EngineConfig, max_len: int) -> None:
    """``ValueError`` when a request of ``max_len`` tokens needs more blocks than the pool has
    (block 0 is the null block): it could never run, so say so before generating it."""
    cache = config.cache
    needed = -(-max_len // cache.block_size)
    if needed > cache.num_blocks - 1:
        raise ValueError(
            f"--max-len {max_len}: a request that long can never run: it needs {needed} blocks of "
            f"{cache.block_size} tokens; the pool has {cache.num_blocks - 1} usable "
            f"(cache.num_blocks = {cache.num_blocks}, block 0 reserved): raise --num-blocks to "
            f"at least {needed + 1} or lower --max-len to at most "
            f"{(cache.num_blocks - 1) * cache.block_size}")

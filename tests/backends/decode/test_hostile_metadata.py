"""Hostile step metadata for every decode backend the base feeds (issue 21).

- A caller that rewrites its block table or ``seq_lens`` tensor between two layers of one step
  (an engine reusing its buffers) must not change what the kernels read: the metadata is a
  snapshot taken and checked at ``prepare_metadata``. Before, CPU_MLA read the caller's own
  tensor (SIGSEGV on an out-of-range id) and TORCH_SDPA raised a bare ``IndexError``; the test
  runs in a subprocess so that such a crash fails the test, not the suite.
- int64 block ids and ``seq_lens`` outside int32 are refused, never narrowed (``2**32 + 3``
  read block 3 of an 8-block cache, ``seq_len 2**32 + 7`` became 7).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from app.backends.decode.base import MLADecodeBackend
from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend
from tests.backends.decode._cpu_support import BACKENDS, BS, HEADS, NUM_BLOCKS, RANK, ROPE

ROOT = Path(__file__).resolve().parents[3]


def _backend(cls: type[MLADecodeBackend]) -> MLADecodeBackend:
    return cls(num_heads=HEADS, scale=0.1, kv_lora_rank=RANK, qk_rope_head_dim=ROPE,
               kv_cache_dtype=torch.float32)


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return (torch.randn(2, 1, HEADS, RANK + ROPE, generator=gen),
            torch.randn(NUM_BLOCKS, BS, RANK + ROPE, generator=gen))


_REWRITE_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    from app.backends.decode.cpu_mla import CpuMLADecodeBackend
    from app.backends.decode.torch_sdpa import TorchSDPADecodeBackend

    cls = {"CPU_MLA": CpuMLADecodeBackend, "TORCH_SDPA": TorchSDPADecodeBackend}[sys.argv[1]]
    be = cls(num_heads=4, scale=0.1, kv_lora_rank=64, qk_rope_head_dim=32,
             kv_cache_dtype=torch.float32)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 1, 4, 96, generator=gen)
    cache = torch.randn(8, 16, 96, generator=gen)
    table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=torch.int32)   # the engine's buffer
    seq_lens = torch.tensor([40, 20], dtype=torch.int32)
    be.prepare_metadata(table, seq_lens, 1)
    first = be.run_decode(q, cache)                                   # layer 0
    table.fill_(2**31 - 1)                                            # buffer reused ...
    seq_lens.fill_(2**31 - 1)
    second = be.run_decode(q, cache)                                  # ... before layer 1
    table[:] = torch.tensor([[7, 6, 5], [4, 3, 2]])                   # valid, but another step's
    seq_lens[:] = torch.tensor([48, 1])
    third = be.run_decode(q, cache)
    assert torch.equal(first, second) and torch.equal(first, third), "the step changed"
    print("same result")
""")


@pytest.mark.slow
@pytest.mark.parametrize("cls", BACKENDS)
def test_rewriting_the_step_buffers_between_layers_changes_nothing(
        cls: type[MLADecodeBackend]) -> None:
    # In a subprocess: the old code crashed the interpreter here (SIGSEGV in CPU_MLA).
    proc = subprocess.run([sys.executable, "-c", _REWRITE_SCRIPT, cls.get_name()],
                          capture_output=True, text=True, timeout=300, check=False, cwd=ROOT)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-2000:])
    assert proc.stdout.strip() == "same result"


@pytest.mark.parametrize("cls", BACKENDS)
def test_the_metadata_never_aliases_the_callers_tensors(cls: type[MLADecodeBackend]) -> None:
    be = _backend(cls)
    for dtype in (torch.int32, torch.int64):
        table = torch.tensor([[0, 1, 2], [3, 4, 5]], dtype=dtype)
        seq_lens = torch.tensor([40, 20], dtype=dtype)
        be.prepare_metadata(table, seq_lens, 1)
        meta = be.metadata
        for snapshot in (meta.block_table_cpu, meta.seq_lens_cpu, *meta.on_device(
                torch.device("cpu"))):
            assert snapshot.dtype == torch.int32 and snapshot.is_contiguous()
            assert snapshot.untyped_storage().data_ptr() not in (
                table.untyped_storage().data_ptr(), seq_lens.untyped_storage().data_ptr())


@pytest.mark.parametrize("cls", BACKENDS)
def test_int64_metadata_that_fits_int32_gives_the_int32_result(
        cls: type[MLADecodeBackend]) -> None:
    q, cache = _inputs()
    be = _backend(cls)
    results = []
    for dtype in (torch.int32, torch.int64):
        be.prepare_metadata(torch.tensor([[5, 1, 7], [3, 0, 0]], dtype=dtype),
                            torch.tensor([35, 9], dtype=dtype), 1)
        results.append(be.run_decode(q, cache))
    assert torch.equal(results[0], results[1])


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("table, seq_lens, message", [
    ([[0, 2**32 + 3, 0], [1, 2, 3]], [20, 20],
     "block_table[0, 1] = 4294967299 does not fit int32"),
    ([[0, 1, 2], [1, 2, 3]], [20, 2**32 + 7], "seq_lens[1] = 4294967303 does not fit int32"),
    ([[0, 1, 2], [1, 2, 3]], [-2**32 + 20, 20], "seq_lens[0] = -4294967276 does not fit int32"),
    ([[0, 1, 2], [-2**40, 2, 3]], [20, 20], "block_table[1, 0] = -1099511627776 does not fit"),
])
def test_int64_values_beyond_int32_are_refused_not_narrowed(
        cls: type[MLADecodeBackend], table: list[list[int]], seq_lens: list[int],
        message: str) -> None:
    be = _backend(cls)
    with pytest.raises(ValueError, match=r"prepare_metadata: ") as info:
        be.prepare_metadata(torch.tensor(table, dtype=torch.int64),
                            torch.tensor(seq_lens, dtype=torch.int64), 1)
    assert message in str(info.value) and "refused, not narrowed" in str(info.value)


def test_a_meta_tensor_is_refused() -> None:
    be = _backend(TorchSDPADecodeBackend)
    with pytest.raises(ValueError, match="block_table: expected a tensor with data, got one "
                                         "on the meta device"):
        be.prepare_metadata(torch.zeros(1, 2, dtype=torch.int32, device="meta"),
                            torch.tensor([3], dtype=torch.int32), 1)


@pytest.mark.parametrize("cls", BACKENDS)
@pytest.mark.parametrize("shared", ["q", "kv_cache"])
def test_an_out_sharing_memory_with_an_input_gets_the_right_result(
        cls: type[MLADecodeBackend], shared: str) -> None:
    be = _backend(cls)
    be.prepare_metadata(torch.tensor([[1, 2], [0, 3]], dtype=torch.int32),
                        torch.tensor([20, 20], dtype=torch.int32), 1)
    q, cache = _inputs()
    expected = be.run_decode(q.clone(), cache.clone())
    n = expected.numel()
    if shared == "q":   # out starts inside request 1's query: written before it is read
        buf = torch.cat([q.reshape(-1), torch.zeros(n)])
        q_in, cache_in = buf[:q.numel()].view(q.shape), cache
        out = buf[q[0].numel():q[0].numel() + n].view(expected.shape)
    else:               # out is block 0 of the cache, which request 1 reads
        cache_in, q_in = cache.clone(), q
        out = cache_in[0].reshape(-1)[:n].view(expected.shape)
    result = be.run_decode(q_in, cache_in, out=out)
    assert result is out
    torch.testing.assert_close(result, expected)

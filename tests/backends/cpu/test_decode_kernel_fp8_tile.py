"""The bf16 tile an FP8 cache is converted into on the decode kernel's dot path
(``csrc/mla_decode_cpu_fp8.h``): every one of the 256 e4m3fn bytes, under powers of two out to
the extremes the table path takes and past them, and under other scales, through both
conversions (through fp16 and float32; by VBMI table look-ups), bit for bit against each other
and against torch's float8_e4m3fn -> float32 x scale -> bf16; and the kernel's own tile
(fp8_tile_bf16, which picks the table path on a CPU with AVX512-VBMI) read back through a
decode whose output is exactly the one key's values."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Callable

import pytest
import torch

from app.backends.cpu.decode_kernel import (
    SPEC,
    NativeMLADecodeKernel,
    decode_kernel_status,
    load_decode_kernel,
    plan_decode,
)
from app.backends.cpu.loader import cpu_flags
from app.kvcache.cache_dtypes import ds_mla_row_bytes
from tests._support import native_compiler_or_skip

HAS_VBMI = "avx512vbmi" in cpu_flags()

#: Powers of two the table path takes (2^-117 .. 2^119: every e4m3 product a normal bf16).
TABLE_EXPONENTS = (-117, -116, -100, -33, -9, -1, 0, 1, 2, 7, 8, 31, 64, 118, 119)
#: Powers of two it leaves to the fp16 path (products below bf16's normal range, or past
#: float32's with 2^8 x scale: the fp16 path's two-step multiply).
FALLBACK_EXPONENTS = (-149, -130, -126, -118, 120, 121, 127)
#: Scales that are not positive powers of two (vLLM's amax / 448 and its like, negative,
#: zero, subnormal, not finite).
OTHER_SCALES = (0.07, 3.0, 1 / 448, 17.3 / 448, 1.5, -1.0, -0.25, 0.0, -0.0, 1e-40, 3e38,
                math.inf, -math.inf, math.nan)
ALL_BYTES = torch.arange(256, dtype=torch.int32).to(torch.uint8)


def _kernel() -> NativeMLADecodeKernel:
    """The decode kernel; skips where its dot path cannot run here, fails where it should but
    did not load (a failed self-test: a wrong tile would show there first)."""
    if not {"avx512_bf16", "avx512bw"} <= cpu_flags():
        pytest.skip("the decode kernel's bf16 dot path needs AVX512-BF16 and AVX512BW")
    native_compiler_or_skip()
    if SPEC.requirements is not None and (why := SPEC.requirements()):
        pytest.skip(f"the decode kernel cannot run here: {'; '.join(why)}")
    kernel = load_decode_kernel()
    if kernel is None:
        pytest.fail(f"the decode kernel did not load: {decode_kernel_status()[0].reasons}")
    return kernel


@functools.cache
def _hook_of(kernel: NativeMLADecodeKernel) -> Callable[..., int]:
    hook: Callable[..., int] = kernel.library.function(
        "mla_decode_cpu_e4m3_to_bf16", ctypes.c_int32, ctypes.c_void_p, ctypes.c_int64,
        ctypes.c_float, ctypes.c_int32, ctypes.c_void_p)
    return hook


def _hook() -> Callable[..., int]:
    return _hook_of(_kernel())


def _convert(data: torch.Tensor, scale: float, method: int) -> tuple[int, torch.Tensor]:
    """(the hook's return code, the bf16 bits as int32 ``[n]``: 0xFFFF where nothing was
    written)."""
    dst = torch.full((data.numel(),), -1, dtype=torch.int16)
    rc = _hook()(data.data_ptr(), data.numel(), scale, method, dst.data_ptr())
    return int(rc), dst.to(torch.int32) & 0xFFFF


def _torch_bits(data: torch.Tensor, scale: float) -> torch.Tensor:
    """torch's float8_e4m3fn -> float32 x scale -> bf16, as int32 bits."""
    values = data.view(torch.float8_e4m3fn).float() * torch.tensor(scale, dtype=torch.float32)
    return values.bfloat16().view(torch.int16).to(torch.int32) & 0xFFFF


def _is_nan(bits: torch.Tensor) -> torch.Tensor:
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)


def _assert_same(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    """Bit for bit, NaN for NaN (a NaN's sign and payload aside)."""
    nan = _is_nan(want)
    assert torch.equal(_is_nan(got), nan), f"{where}: NaNs differ"
    bad = (got != want) & ~nan
    assert not bad.any(), (f"{where}: elements {bad.nonzero().flatten().tolist()[:8]} -> "
                           f"{[hex(x) for x in got[bad].tolist()[:8]]}, expected "
                           f"{[hex(x) for x in want[bad].tolist()[:8]]}")


@pytest.mark.parametrize("scale", [*(2.0 ** k for k in TABLE_EXPONENTS),
                                   *(2.0 ** k for k in FALLBACK_EXPONENTS), *OTHER_SCALES])
def test_every_e4m3_byte_converts_to_the_same_bf16_on_both_paths_and_as_torch(
        scale: float) -> None:
    rc, fp16_path = _convert(ALL_BYTES, scale, 0)
    assert rc == 0
    # torch keeps bf16 subnormals; vcvtne2ps2bf16 flushes them (and any float32 subnormal) to
    # zero: compare where the float32 product is zero or normal
    product = ALL_BYTES.view(torch.float8_e4m3fn).float() * torch.tensor(scale)
    normal = ~((product != 0) & (product.abs() < 2.0 ** -126))
    _assert_same(fp16_path[normal], _torch_bits(ALL_BYTES, scale)[normal], f"fp16 path x {scale}")
    assert (fp16_path[~normal] & 0x7FFF == 0).all()
    takes = scale > 0 and math.isfinite(scale) and math.frexp(scale)[0] == 0.5 and (
        -117 <= math.frexp(scale)[1] - 1 <= 119)
    rc, table_path = _convert(ALL_BYTES, scale, 1)
    if not HAS_VBMI or not takes:   # refused, nothing written: the fp16 path does it
        assert rc == 1 and (table_path == 0xFFFF).all()
        return
    assert rc == 0
    _assert_same(table_path, fp16_path, f"table path x {scale}")
    assert normal.all()    # no product of a table-path scale needs flushing


def test_the_hook_refuses_counts_it_cannot_convert() -> None:
    data = ALL_BYTES[:64].clone()
    for method in (0, 1):
        assert _convert(data[:48], 1.0, method)[0] == 1
        assert _convert(data[:0], 1.0, method)[0] == 0
    assert _hook()(data.data_ptr(), 32, 1.0, 2, data.data_ptr()) == 1


@pytest.mark.parametrize("tail", [False, True])
def test_runs_of_any_multiple_of_32_convert_whole_and_stop_at_their_end(tail: bool) -> None:
    count = 96 if tail else 128     # the table path takes 64 bytes a step: a half step last
    data = ALL_BYTES.roll(37)[:count].contiguous()
    dst = torch.full((count + 32,), -1, dtype=torch.int16)
    for method in (0, 1) if HAS_VBMI else (0,):
        assert _hook()(data.data_ptr(), count, 0.5, method, dst.data_ptr()) == 0
        _assert_same(dst[:count].to(torch.int32) & 0xFFFF, _torch_bits(data, 0.5), "run")
        assert (dst[count:] == -1).all()


def _kernel_tile(rows: torch.Tensor, rank: int, rope: int) -> torch.Tensor:
    """The dot path's tile of ``fp8_ds_mla`` rows ``[n, row_bytes]`` as bits ``[n, rank]``:
    one request per row, of that one key, with q = 0, so p = 1 and the output is the key's
    values as the tile holds them (bf16, written back exactly), but for -0, which p.v's sum
    from +0 makes +0."""
    kernel = _kernel()
    n = rows.shape[0]
    cache = rows.view(n, 1, -1)
    table = torch.arange(n, dtype=torch.int32).view(n, 1)
    q = torch.zeros(n, 1, 1, rank + rope, dtype=torch.bfloat16)
    out = torch.empty(n, 1, 1, rank, dtype=torch.bfloat16)
    kernel.run(plan_decode([1] * n, 1), q, cache, table, torch.ones(n, dtype=torch.int32),
               rank, out, None, 0.1, 1.0, bf16_dot=True, kv_cache_format="fp8_ds_mla")
    return out.view(n, rank).view(torch.int16).to(torch.int32) & 0xFFFF


def test_the_kernels_tile_holds_each_blocks_bytes_times_its_scale_exactly() -> None:
    rank, rope = 512, 64
    finite = ALL_BYTES[(ALL_BYTES & 0x7F) != 0x7F]      # a NaN would make the output NaN
    nope = torch.cat([finite, finite, finite[:rank - 2 * finite.numel()]])
    # per row, four blocks: table-path powers of two (repeated: the tables are kept), ones it
    # leaves to the fp16 path (products below the normal range), and amax / 448-like scales,
    # mixed inside rows (every product finite: q = 0 times an infinity would be NaN)
    scales = [2.0 ** k for k in (-117, 0, 0, 119, 5, -3, -3, 7)] + [
        2.0 ** -118, 0.07, 2.0 ** -130, 1 / 448, 2.0 ** -20, 3.0, 2.0 ** 100, 0.5]
    blocks = torch.tensor(scales, dtype=torch.float32).view(-1, 4)
    n = blocks.shape[0]
    rows = torch.zeros(n, ds_mla_row_bytes(rank, rope), dtype=torch.uint8)
    rows[:, :rank] = nope.roll(11)
    rows[:, rank:rank + 16] = blocks.view(torch.uint8)
    rows[:, rank + 16:] = torch.randn(n, rope).bfloat16().view(torch.uint8)
    got = _kernel_tile(rows, rank, rope)
    for r in range(n):
        for t in range(4):
            block = rows[r, 128 * t:128 * (t + 1)].contiguous()
            want = _convert(block, float(blocks[r, t]), 0)[1]
            want[want == 0x8000] = 0        # p.v sums from +0: -0 comes out +0
            _assert_same(got[r, 128 * t:128 * (t + 1)], want, f"row {r} block {t}")

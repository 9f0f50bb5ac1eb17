"""Argument types for the CLI's options: each refuses a bad value when the command line is
parsed (one line, exit 2), before any work starts."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path

import torch

from app._cpu import available_host_bytes
from app._files import check_writable_file
from app._validation import INT32_MAX
from app.platforms.detect import default_device

__all__ = ["add_kv_cache_dtype_argument", "bench_device", "buffer_gib", "int_in",
           "output_file", "positive_float", "positive_int", "resolve_device"]


def int_in(minimum: int, maximum: int = INT32_MAX) -> Callable[[str], int]:
    """An argparse ``type``: an ASCII decimal int in ``[minimum, maximum]``."""

    def parse(text: str) -> int:
        stripped = text.strip()
        digits = stripped.removeprefix("-")
        # int() also takes "1_000", "+5" and non-ASCII digits: a flag takes plain digits only.
        if not (digits.isascii() and digits.isdigit()) or len(digits) > 19:
            raise argparse.ArgumentTypeError(
                f"expected an int in [{minimum}, {maximum}], got {text!r}")
        value = int(stripped)
        if not minimum <= value <= maximum:
            raise argparse.ArgumentTypeError(
                f"expected an int in [{minimum}, {maximum}], got {value}")
        return value

    parse.__name__ = "int"  # argparse names the type in some messages
    return parse


#: An argparse ``type``: an int in ``[1, 2**31 - 1]``.
positive_int = int_in(1)


def add_kv_cache_dtype_argument(parser: argparse.ArgumentParser, default: str | None = None,
                                help_default: str = "auto, or the --deployment file's "
                                                    "[cache] kv_cache_dtype") -> None:
    """``--kv-cache-dtype auto|fp8|fp8_e4m3|fp8_ds_mla`` (the latent cache's dtype, named as
    vLLM names them; ``app.kvcache.cache_dtypes``)."""
    from app.config import KV_CACHE_DTYPES

    parser.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default=default,
                        help="the latent cache's dtype: auto (the model's), fp8 / fp8_e4m3 "
                             "(e4m3, one scale per layer: 576 B per token at 512 + 64), "
                             "fp8_ds_mla (DeepSeek's FlashMLA row: e4m3 with a float32 scale "
                             f"per 128 values, rope in bf16: 656 B) (default: {help_default})")


def positive_float(text: str) -> float:
    """An argparse ``type``: a finite float > 0 (seconds, sizes)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"expected a positive, finite number, got {text!r}")
    return value


#: The smallest measurement buffer a benchmark takes (smaller ones time nothing but overhead).
MIN_BUFFER_GIB = 2.0**-10


def buffer_gib(text: str) -> float:
    """An argparse ``type``: the size in GiB of a host buffer a benchmark allocates, a finite
    number of at least 1 MiB and at most half the host memory available now (the benchmark
    needs the rest): ``1e3`` would try to allocate 1 TiB."""
    value = positive_float(text)
    if value < MIN_BUFFER_GIB:
        raise argparse.ArgumentTypeError(f"expected at least {MIN_BUFFER_GIB} GiB (1 MiB), got "
                                         f"{text!r}")
    have = available_host_bytes()
    if have is not None and value * 2**30 > have / 2:
        raise argparse.ArgumentTypeError(
            f"{text!r} GiB is more than half the host memory available now "
            f"({have / 2**30:.1f} GiB); use at most {have / 2**31:.2f}")
    return value


def bench_device(text: str) -> str:
    """An argparse ``type``: ``cpu``, ``cuda`` or ``cuda:N`` (whether that device exists is
    checked when the benchmark starts)."""
    name = text.strip().lower()
    kind, sep, index = name.partition(":")
    if (kind == "cpu" and not sep) or (kind == "cuda" and (
            not sep or (index.isascii() and index.isdigit() and len(index) < 4))):
        return name
    raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")


def resolve_device(name: str | None) -> torch.device:
    """The device a benchmark runs on: ``name`` (from ``bench_device``), else the device of the
    platform ``APP_PLATFORM`` pins, else CUDA when present, else the CPU. ``ValueError`` when
    CUDA (or that CUDA device) is not here."""
    device = torch.device(name) if name else default_device()
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name}: CUDA is not available on this machine "
                         f"(torch {torch.__version__}); use --device cpu")
    if device.type == "cuda" and (device.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"--device {name}: this machine has {torch.cuda.device_count()} "
                         f"CUDA device(s)")
    return device


def output_file(text: str) -> Path:
    """An argparse ``type``: a file path the result can be written to (a regular file, or a new
    file in an existing, writable folder; never a directory, FIFO or device), checked before
    the command runs."""
    try:
        return check_writable_file(text, "")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).strip()) from None

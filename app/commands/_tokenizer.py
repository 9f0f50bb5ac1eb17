"""A checkpoint's ``tokenizer.json``, read and run so that nothing in it reaches the user as a
traceback or hangs the command.

The file is read as every file a user names is (``app._files.read_regular_file``: a regular
file of at most ``MAX_TOKENIZER_BYTES``, never a FIFO or a device) and parsed from that text,
so it is opened once. The ``tokenizers`` package is Rust: an invalid file raises a plain
``Exception``, and a pre-tokenizer regex that backtracks past Oniguruma's limit *panics*
(``pyo3_runtime.PanicException``, a ``BaseException`` that passes ``except Exception``), after
Rust has printed the panic and a backtrace on file descriptor 2. Every call into it here runs
with that descriptor captured (replayed when the call succeeds) and any failure becomes one
``ValueError`` naming the file and what failed.
"""

from __future__ import annotations

import contextlib
import os
import sys
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from app._files import read_regular_file

#: The largest ``tokenizer.json`` read (DeepSeek-V3's is ~7.5 MB; the largest vocabularies'
#: are some tens of MB).
MAX_TOKENIZER_BYTES = 128 << 20

_T = TypeVar("_T")


@contextlib.contextmanager
def _native_stderr() -> Iterator[list[bytes]]:
    """File descriptor 2 sent to a temporary file for the block; what was written there is
    appended to the yielded list when the block ends (the caller replays or drops it)."""
    sys.stderr.flush()
    saved = os.dup(2)
    captured: list[bytes] = []
    with tempfile.TemporaryFile() as sink:
        os.dup2(sink.fileno(), 2)
        try:
            yield captured
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            sink.seek(0)
            captured.append(sink.read(1 << 16))


class CheckpointTokenizer:
    """``tokenizer.json`` at ``path`` (see the module docstring): ``encode(text)`` and
    ``decode(ids)``; ``ValueError`` naming the file for anything the file or the package
    refuses, ``ImportError`` when ``tokenizers`` is not installed."""

    def __init__(self, path: Path) -> None:
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise ImportError("--prompt needs the tokenizers package: pip install "
                              "'app[tokenizer]' (or pip install tokenizers)") from None
        self.path = path
        raw = read_regular_file(path, "tokenizer.json", expected="a JSON tokenizer file",
                                limit=MAX_TOKENIZER_BYTES)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise ValueError(f"{path}: tokenizer.json is not UTF-8 text (byte "
                             f"0x{raw[exc.start]:02x} at offset {exc.start})") from None
        self._tokenizer: Any = self._call("reading it", lambda: Tokenizer.from_str(text))

    def _call(self, what: str, call: Callable[[], _T]) -> _T:
        failure: BaseException | None = None
        with _native_stderr() as captured:
            try:
                result = call()
            except (KeyboardInterrupt, SystemExit, GeneratorExit):
                raise
            except BaseException as exc:  # a Rust panic (PanicException) is a BaseException
                failure = exc
        if failure is None:
            if captured and captured[0]:   # what the package printed on a success, shown
                os.write(2, captured[0])
            return result
        message = " ".join(str(failure).split()) or type(failure).__name__
        kind = "panicked" if type(failure).__name__ == "PanicException" else "failed"
        raise ValueError(f"{self.path}: the tokenizer {kind} {what} ({type(failure).__name__}: "
                         f"{message})")

    def encode(self, text: str) -> list[int]:
        """The token ids of ``text``."""
        ids: list[int] = self._call("encoding a prompt", lambda: self._tokenizer.encode(text).ids)
        return ids

    def decode(self, ids: Sequence[int]) -> str:
        """The text of ``ids``, special tokens skipped."""
        text: str = self._call("decoding the output", lambda: self._tokenizer.decode(
            list(ids), skip_special_tokens=True))
        return text

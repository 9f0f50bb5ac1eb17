"""The catalog of MLA backends, one per kind: every backend's name, written once, and where the
built-in ones live.

This module is data and imports nothing from the package: a leaf at the bottom of the house, so
the config (which checks a forced backend's name when it is built), the platforms (which list
names in their priorities) and the registry all read it from below (``app.backends.catalog``,
its old place, re-exports it). Adding a built-in backend is one new module and one line here
(``"NAME": "app.backends.<kind>.<module>.<Class>"``): the container gives it a provider, the
kind's enum a member, and the class takes its name from this line (``get_name()``).

A catalog also holds the names registered at run time (``register_mla_prefill_backend("MY_NAME",
...)``): the enum's members and the names a config may force are the built-ins, then ``CUSTOM``,
then those, for the whole process. Which class a name resolves to lives in each container. A
name whose registration is undone (``app._container_state.rollback_on_error``) and that nothing
else holds is taken back (``remove``).
"""

from __future__ import annotations

import contextlib
import contextvars
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping

__all__ = ["CATALOGS", "CUSTOM", "DECODE_BACKENDS", "PREFILL_BACKENDS", "BackendCatalog"]

#: The third-party placeholder every kind has (no default class; register one before use).
CUSTOM = "CUSTOM"


class BackendCatalog:
    """The backend names of one kind: the built-ins with their class paths, ``CUSTOM``, then the
    names registered at run time, in that order. Thread-safe."""

    def __init__(self, kind: str, label: str, builtins: Mapping[str, str]) -> None:
        #: ``"prefill"`` or ``"decode"``.
        self.kind = kind
        #: How messages name the kind: ``"MLA prefill"``.
        self.label = label
        #: ``{name: class path}`` of every built-in, in declaration order.
        self.builtins: dict[str, str] = dict(builtins)
        self._names: tuple[str, ...] = (*self.builtins, CUSTOM)
        self._lock = threading.RLock()
        self._listeners: list[Callable[[str], None]] = []
        self._remove_listeners: list[Callable[[str], None]] = []
        self._declared: contextvars.ContextVar[frozenset[str]] = contextvars.ContextVar(
            f"app_declared_{kind}_backends", default=frozenset())

    # -- reading -------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[str]:
        return iter(self._names)

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def name_of(self, class_path: str) -> str | None:
        """The built-in name whose class lives at ``class_path`` (None for any other class)."""
        for name, path in self.builtins.items():
            if path == class_path:
                return name
        return None

    def unknown_message(self, name: object) -> str:
        """vLLM's wording for a name that is not a backend of this kind."""
        return (f"Unknown {self.label} backend: '{name}'. "
                f"Valid options are: {', '.join(self._names)}")

    def resolve(self, name: str) -> str:
        """The backend ``name`` means: exact first (names registered at run time may be lower
        case), then upper case; names being ``declared`` count too. ``ValueError`` listing the
        valid names otherwise."""
        if not isinstance(name, str):
            raise ValueError(self.unknown_message(name))
        known = (self._names, self._declared.get())
        for candidate in (name, name.upper()):
            if any(candidate in names for names in known):
                return candidate
        raise ValueError(self.unknown_message(name))

    @contextlib.contextmanager
    def declared(self, names: Iterable[str]) -> Iterator[None]:
        """Inside the block (this thread or task only), ``resolve`` also accepts ``names``:
        a deployment declares the names it will register while it builds its config, and
        adds them only when it builds its container."""
        token = self._declared.set(self._declared.get() | frozenset(names))
        try:
            yield
        finally:
            self._declared.reset(token)

    def check(self, *names: str) -> list[str]:
        """``names`` as a list, each checked against the catalog (``ValueError`` naming a
        typo): how platforms write their priority lists."""
        unknown = [name for name in names if name not in self._names]
        if unknown:
            raise ValueError(f"the {self.label} backend catalog has no {unknown}; "
                             f"known: {list(self._names)}")
        return list(names)

    # -- adding names at run time -------------------------------------------------------------

    @property
    def lock(self) -> threading.RLock:
        """Held while a name is added (a registration holds it across its own checks)."""
        return self._lock

    def add(self, name: str) -> None:
        """Append ``name`` (the caller has checked it) and tell every listener."""
        with self._lock:
            if name in self._names:
                return
            self._names = (*self._names, name)
            for listener in self._listeners:
                listener(name)

    def on_add(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` for every name added from now on (the seed API's enum adds
        its member this way)."""
        with self._lock:
            self._listeners.append(listener)

    def remove(self, name: str) -> None:
        """Take back a name added at run time (its registration was undone: nothing holds it)
        and tell every removal listener; a built-in, ``CUSTOM`` or an unknown name is left
        alone."""
        with self._lock:
            if name not in self._names or name in self.builtins or name == CUSTOM:
                return
            self._names = tuple(n for n in self._names if n != name)
            for listener in self._remove_listeners:
                listener(name)

    def on_remove(self, listener: Callable[[str], None]) -> None:
        """Call ``listener(name)`` for every name removed from now on (the seed API's enum
        drops its member this way)."""
        with self._lock:
            self._remove_listeners.append(listener)

    def __repr__(self) -> str:
        return f"BackendCatalog({self.kind!r}, {list(self._names)})"


#: MLA prefill backends.
PREFILL_BACKENDS = BackendCatalog("prefill", "MLA prefill", {
    "TORCH_SDPA": "app.backends.prefill.torch_sdpa.TorchSDPAPrefillBackend",
    "FLASH_ATTN": "app.backends.prefill.flash_attn.FlashAttnPrefillBackend",
    "FLASHINFER": "app.backends.prefill.flashinfer.FlashInferPrefillBackend",
    "TRTLLM_RAGGED": "app.backends.prefill.trtllm_ragged.TrtllmRaggedPrefillBackend",
    "TOKENSPEED_MLA": "app.backends.prefill.tokenspeed_mla.TokenSpeedMLAPrefillBackend",
    "TORCH_SPARSE": "app.backends.prefill.torch_sparse.TorchSparsePrefillBackend",
    "CPU_MLA_SPARSE": "app.backends.prefill.cpu_sparse.CpuSparsePrefillBackend",
})

#: MLA decode backends.
DECODE_BACKENDS = BackendCatalog("decode", "MLA decode", {
    "CPU_MLA": "app.backends.decode.cpu_mla.CpuMLADecodeBackend",
    "TORCH_SDPA": "app.backends.decode.torch_sdpa.TorchSDPADecodeBackend",
    "FLASHINFER_MLA": "app.backends.decode.flashinfer_mla.FlashInferMLADecodeBackend",
    "TOKENSPEED_MLA": "app.backends.decode.tokenspeed_mla.TokenSpeedMLADecodeBackend",
    "TORCH_SPARSE": "app.backends.decode.torch_sparse.TorchSparseDecodeBackend",
    "CPU_MLA_SPARSE": "app.backends.decode.cpu_sparse.CpuSparseDecodeBackend",
})

#: Every catalog, by kind.
CATALOGS: dict[str, BackendCatalog] = {PREFILL_BACKENDS.kind: PREFILL_BACKENDS,
                                       DECODE_BACKENDS.kind: DECODE_BACKENDS}

"""The built-in backends, one table per kind: what drives the container's providers, the enum
members and the names platform priorities use.

This module imports nothing from the package: it is data. Adding a built-in backend is one new
module and one line here (``BackendEntry("NAME", "app.backends.module.Class")``); the
container gives it a provider, the kind's enum gets a member, and a platform may list it in its
priorities (``PREFILL_BACKENDS.names(...)`` refuses a name that is not in the table).
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs

__all__ = ["CUSTOM", "DECODE_BACKENDS", "PREFILL_BACKENDS", "BackendEntry", "BackendTable"]

#: The third-party placeholder every kind has (no default class; register one before use).
CUSTOM = "CUSTOM"


@attrs.frozen
class BackendEntry:
    """One built-in backend: its name (the enum member, the provider) and its class path."""

    name: str
    class_path: str


@attrs.define(eq=False)
class BackendTable:
    """The built-in backends of one kind, in declaration order (``CUSTOM`` is implicit)."""

    kind: str
    entries: list[BackendEntry]

    def __iter__(self) -> Iterator[BackendEntry]:
        return iter(self.entries)

    def __contains__(self, name: object) -> bool:
        return any(entry.name == name for entry in self.entries)

    def as_dict(self) -> dict[str, str]:
        """``{name: class path}`` of every built-in."""
        return {entry.name: entry.class_path for entry in self.entries}

    def names(self, *names: str) -> list[str]:
        """``names`` as a list, each checked against the table (``ValueError`` naming a typo):
        how platforms write their priority lists."""
        unknown = [name for name in names if name not in self and name != CUSTOM]
        if unknown:
            raise ValueError(f"{self.kind} backend table has no {unknown}; "
                             f"known: {[entry.name for entry in self.entries]}")
        return list(names)


#: MLA prefill backends.
PREFILL_BACKENDS = BackendTable("prefill", [
    BackendEntry("TORCH_SDPA", "app.backends.prefill.torch_sdpa.TorchSDPABackend"),
    BackendEntry("FLASH_ATTN", "app.backends.prefill.flash_attn.FlashAttnBackend"),
    BackendEntry("FLASHINFER", "app.backends.prefill.flashinfer.FlashInferBackend"),
    BackendEntry("TRTLLM_RAGGED", "app.backends.prefill.trtllm_ragged.TrtllmRaggedBackend"),
    BackendEntry("TOKENSPEED_MLA", "app.backends.prefill.tokenspeed_mla.TokenSpeedMLABackend"),
])

#: MLA decode backends (the modules of the decode contract).
DECODE_BACKENDS = BackendTable("decode", [
    BackendEntry("CPU_MLA", "app.backends.decode.cpu_mla.CpuMLADecodeBackend"),
    BackendEntry("TORCH_SDPA", "app.backends.decode.torch_sdpa.TorchSDPADecodeBackend"),
    BackendEntry("FLASHINFER_MLA", "app.backends.decode.flashinfer_mla.FlashInferMLADecodeBackend"),
    BackendEntry("TOKENSPEED_MLA", "app.backends.decode.tokenspeed_mla.TokenSpeedMLADecodeBackend"),
])

"""Small value types shared by the platform, backend and config layers.

They live here, below everything else, so that ``app.platforms`` and ``app.backends`` can both
use them without importing each other.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs

__all__ = ["ANY_GPU", "NO_GPU", "ComputeCapabilities", "DeviceCapability", "MLADimensions"]

from app._validation import is_int


def _non_negative_int(instance: object, attribute: attrs.Attribute[int], value: int) -> None:
    if not is_int(value):
        raise TypeError(
            f"{type(instance).__name__}.{attribute.name} must be an int, "
            f"got {value!r} ({type(value).__name__})"
        )
    if value < 0:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be >= 0, got {value!r}"
        )


@attrs.frozen(order=True)
class DeviceCapability:
    """A GPU's compute capability, e.g. ``DeviceCapability(9, 0)`` for an H100 (SM90).

    Ordered and hashable; ``cap.to_int()`` gives vLLM's integer form (``90``, ``100``).
    """

    major: int = attrs.field(validator=_non_negative_int)
    minor: int = attrs.field(validator=_non_negative_int)

    def to_int(self) -> int:
        """The capability as one integer: ``major * 10 + minor``."""
        return self.major * 10 + self.minor

    def is_family(self, major: int) -> bool:
        """Whether this device belongs to the ``major`` family (SM100, SM103 and SM107 are 10)."""
        return self.major == major

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"


@attrs.frozen
class MLADimensions:
    """The head dimensions of an MLA model, as each kind of attention reads them.

    Prefill attention (after the latent up-projection) reads ``qk_nope_head_dim``,
    ``qk_rope_head_dim`` and ``v_head_dim``: its q/k head dim is ``qk_nope + qk_rope``
    (DeepSeek: 128 + 64 = 192) and its value head dim ``v_head_dim`` (DeepSeek: 128). Decode
    attention (absorbed, over the latent cache) reads ``kv_lora_rank`` and ``qk_rope_head_dim``
    (DeepSeek: 512 and 64). A field the shape at hand does not use is 0, so the prefill
    dimensions are ``MLADimensions(qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)``
    and the decode ones ``MLADimensions(kv_lora_rank=512, qk_rope_head_dim=64)``; both kinds'
    ``supports_mla_dimensions(dims)`` take this type.
    """

    qk_nope_head_dim: int = attrs.field(default=0, validator=_non_negative_int)
    qk_rope_head_dim: int = attrs.field(default=0, validator=_non_negative_int)
    v_head_dim: int = attrs.field(default=0, validator=_non_negative_int)
    kv_lora_rank: int = attrs.field(default=0, validator=_non_negative_int)

    @property
    def qk_head_dim(self) -> int:
        """The prefill q/k head dim: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_head_dims(self) -> tuple[int, int]:
        """``(kv_lora_rank, qk_rope_head_dim)``: what decode attention reads."""
        return self.kv_lora_rank, self.qk_rope_head_dim

    def __str__(self) -> str:
        prefill = f"{self.qk_nope_head_dim}, {self.qk_rope_head_dim}, {self.v_head_dim}"
        return f"({prefill}, kv_lora_rank={self.kv_lora_rank})" if self.kv_lora_rank \
            else f"({prefill})"


def _capability_set(values: Iterable[DeviceCapability]) -> frozenset[DeviceCapability]:
    return frozenset(values)


@attrs.frozen
class ComputeCapabilities:
    """Which GPUs a backend's kernels run on, as a backend declares it.

    ``minimum`` (inclusive) and ``below`` (exclusive) bound the capability; ``only``, when not
    empty, lists the exact capabilities. ``ComputeCapabilities()`` is any GPU,
    ``ComputeCapabilities(minimum=DeviceCapability(8, 0))`` SM80 and newer,
    ``ComputeCapabilities(minimum=DeviceCapability(10, 0), below=DeviceCapability(11, 0))`` the
    SM100 family and ``NO_GPU`` none (a CPU backend).
    """

    minimum: DeviceCapability | None = DeviceCapability(0, 0)
    below: DeviceCapability | None = None
    only: frozenset[DeviceCapability] = attrs.field(default=frozenset(),
                                                    converter=_capability_set)

    def __contains__(self, capability: object) -> bool:
        # Compared as (major, minor) tuples: selection asks this for every backend it checks.
        if not isinstance(capability, DeviceCapability) or self.minimum is None:
            return False
        if self.only:
            return capability in self.only
        key, low, high = (capability.major, capability.minor), self.minimum, self.below
        return (low.major, low.minor) <= key and (high is None or key < (high.major, high.minor))

    def __str__(self) -> str:
        if self.minimum is None:
            return "no GPU"
        if self.only:
            return ", ".join(f"SM{c.to_int()}" for c in sorted(self.only))
        upper = "" if self.below is None else f" below SM{self.below.to_int()}"
        return f"SM{self.minimum.to_int()} and newer{upper}"


#: Any GPU.
ANY_GPU = ComputeCapabilities()
#: No GPU at all (a backend whose kernels run on the CPU only).
NO_GPU = ComputeCapabilities(minimum=None)

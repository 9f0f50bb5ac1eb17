"""Small value types shared by the platform, backend and config layers.

They live here, below everything else, so that ``app.platforms`` and ``app.backends`` can both
use them without importing each other.
"""

from __future__ import annotations

import attrs

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
    """The head dimensions of an MLA model's prefill attention.

    ``qk_nope_head_dim + qk_rope_head_dim`` is the q/k head dim (DeepSeek: 128 + 64 = 192);
    ``v_head_dim`` is the value head dim (DeepSeek: 128).
    """

    qk_nope_head_dim: int = attrs.field(validator=_non_negative_int)
    qk_rope_head_dim: int = attrs.field(validator=_non_negative_int)
    v_head_dim: int = attrs.field(validator=_non_negative_int)

    @property
    def qk_head_dim(self) -> int:
        """The q/k head dim: ``qk_nope_head_dim + qk_rope_head_dim``."""
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    def __str__(self) -> str:
        return f"({self.qk_nope_head_dim}, {self.qk_rope_head_dim}, {self.v_head_dim})"

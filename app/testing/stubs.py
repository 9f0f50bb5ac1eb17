"""Stand-in backends for tests of registration, overrides and selection."""

from __future__ import annotations

import torch

from app.backends.prefill.base import MLAPrefillBackend

__all__ = ["SelectionOnlyBackend"]


class SelectionOnlyBackend(MLAPrefillBackend):
    """A backend that can be registered, overridden, validated and selected, but runs nothing.

    Subclass it in tests of the registry and the selector (override ``get_name`` and the
    ``supports_*`` hooks as the test needs); calling either run method raises
    ``NotImplementedError``. Use the conformance kit for backends that compute attention.
    """

    @staticmethod
    def get_name() -> str:
        """``"SELECTION_ONLY"``."""
        return "SELECTION_ONLY"

    def run_prefill_new_tokens(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                               return_softmax_lse: bool, out: torch.Tensor | None = None
                               ) -> torch.Tensor:
        """Raises ``NotImplementedError``: a selection-only backend runs no attention."""
        raise NotImplementedError(f"{type(self).__name__} is a selection-only test backend")

    def run_prefill_context_chunk(self, chunk: int, q: torch.Tensor, k: torch.Tensor,
                                  v: torch.Tensor, out: torch.Tensor | None = None
                                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Raises ``NotImplementedError``: a selection-only backend runs no attention."""
        raise NotImplementedError(f"{type(self).__name__} is a selection-only test backend")

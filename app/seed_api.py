"""vLLM's documented API (the seeds) over the *active* container, in one place.

- The backend enums ``MLAPrefillBackendEnum`` / ``MLADecodeBackendEnum`` (``get_path``,
  ``get_class``, ``is_overridden``, ``clear_override``, and ``is_registered``), and
  ``register_mla_prefill_backend`` / ``override_mla_prefill_backend`` (decode alike).
- The selectors ``get_mla_prefill_backend`` / ``get_mla_decode_backend`` and their
  ``explain_*`` forms; each takes ``container=`` (default: the active container).
- ``KVCacheSpecRegistry`` and ``register_kv_cache_spec``, and the bindings that
  ``KVCacheSpec.is_uniform_with_collection(specs)`` uses when it is given none.

They are defined beside what they wrap, in ``app.backends.seed_api`` and
``app.kvcache.seed_api`` (which ``app.backends`` and ``app.kvcache`` re-export), and gathered
here: the same objects, under the import path this API has always had.
"""

from app.backends.seed_api import (
    BackendEnum,
    ClassDecorator,
    MLADecodeBackendEnum,
    MLAPrefillBackendEnum,
    explain_mla_decode_selection,
    explain_mla_prefill_selection,
    get_mla_decode_backend,
    get_mla_prefill_backend,
    override_mla_decode_backend,
    override_mla_prefill_backend,
    register_mla_decode_backend,
    register_mla_prefill_backend,
)
from app.kvcache.seed_api import KVCacheSpecRegistry, register_kv_cache_spec

__all__ = [
    "BackendEnum",
    "ClassDecorator",
    "KVCacheSpecRegistry",
    "MLADecodeBackendEnum",
    "MLAPrefillBackendEnum",
    "explain_mla_decode_selection",
    "explain_mla_prefill_selection",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "override_mla_decode_backend",
    "override_mla_prefill_backend",
    "register_kv_cache_spec",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
]

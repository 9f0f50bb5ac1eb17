"""MLA attention backends, prefill and decode.

Where to look:

- ``app/catalog.py`` (a leaf below the config; ``catalog.py`` here re-exports it): every
  backend's name, and where the built-in ones live (one line each).
- ``declarations.py``: what a backend declares (name, dtypes, GPUs, probe, install hint);
  ``prefill/base.py`` and ``decode/base.py``: the two contracts built on it.
- ``prefill/``, ``decode/``: one module per kernel backend (``prefill/kernel_base.py`` is the
  public base kernel backends build on); ``cpu/``: our native CPU kernels, their loader and pool.
- ``registry.py``: the kinds and the backend providers inside one container (register,
  override, resolve); ``selection.py``: choosing one (``decide``, ``select_backend``,
  ``explain_selection``).
- ``lse.py``, ``merge.py``: the log-sum-exp layout and the merge of partial results.
- ``sparse/``: DeepSeek Sparse Attention's shared pieces: the index checks, the torch
  reference of sparse attention over selected latent rows, the lightning indexer
  (``SparseIndexer``, ``TorchSparseIndexer``, ``SparseIndexerMetadata``; the native CPU one,
  ``CpuSparseIndexer``, in ``sparse.cpu_indexer``).

The kernel backends are not imported here: the container's providers import each one the first
time it is asked for, and a backend whose kernel package is missing says so through
``validate_configuration``. vLLM's API over the active container (``MLAPrefillBackendEnum``,
``register_mla_prefill_backend``, ``get_mla_prefill_backend`` ...) lives in ``seed_api.py``
(gathered with the KV-cache one in ``app.seed_api``) and is re-exported here.
"""

from app._types import DeviceCapability, MLADimensions
from app.backends.decode.base import (
    MLADecodeBackend,
    MLADecodeSelectorConfig,
    MLASparseDecodeBackend,
)
from app.backends.decode.metadata import MLADecodeMetadata
from app.backends.prefill.base import (
    ContextChunkMetadata,
    MLAPrefillBackend,
    MLAPrefillMetadata,
    MLAPrefillSelectorConfig,
    MLASparsePrefillBackend,
)
from app.backends.seed_api import (
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
from app.backends.selection import check_decode_block_size
from app.backends.sparse.cpu_indexer import CpuSparseIndexer
from app.backends.sparse.indexer import SparseIndexer, SparseIndexerMetadata, TorchSparseIndexer

__all__ = [
    "ContextChunkMetadata",
    "CpuSparseIndexer",
    "DeviceCapability",
    "MLADecodeBackend",
    "MLADecodeBackendEnum",
    "MLADecodeMetadata",
    "MLADecodeSelectorConfig",
    "MLADimensions",
    "MLAPrefillBackend",
    "MLAPrefillBackendEnum",
    "MLAPrefillMetadata",
    "MLAPrefillSelectorConfig",
    "MLASparseDecodeBackend",
    "MLASparsePrefillBackend",
    "SparseIndexer",
    "SparseIndexerMetadata",
    "TorchSparseIndexer",
    "check_decode_block_size",
    "explain_mla_decode_selection",
    "explain_mla_prefill_selection",
    "get_mla_decode_backend",
    "get_mla_prefill_backend",
    "override_mla_decode_backend",
    "override_mla_prefill_backend",
    "register_mla_decode_backend",
    "register_mla_prefill_backend",
]

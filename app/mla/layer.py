"""An MLA attention layer in DeepSeek form, with weights drawn from a seed.

Per token ``x [hidden]``:

- ``q = W_q x`` split per head into ``q_nope [H, P]`` and ``q_pe [H, R]`` (RoPE on ``q_pe``);
- ``c = W_kv_a x`` split into the latent ``kv_c = RMSNorm(c[:L])`` and ``k_pe = RoPE(c[L:])``
  (one rope key shared by every head); ``[kv_c, k_pe]`` is what the paged cache stores;
- ``W_kv_b kv_c`` up-projects the latent to ``k_nope [H, P]`` and ``v [H, V]``; the attention key
  is ``[k_nope, k_pe]`` (``P + R``) and the value ``v``;
- the attention output ``[H, V]`` goes through ``W_o`` back to ``hidden``.

``H, L, P, R, V`` are ``num_heads, kv_lora_rank, qk_nope_head_dim, qk_rope_head_dim,
v_head_dim`` of a ``ModelConfig``. RoPE is the rotate-half (NeoX) form with base 10000.

``MLALayerWeights.generate`` draws every weight from a seed in float64 and rounds it once to the
model dtype, so the engine (``MLALayer``) and the float64 reference (``app.mla.reference``) use
bit-identical weight values. ``MLALayer`` runs its projections in a *compute dtype*: the model
dtype, or float32 where the device has no fast bf16/fp16 matmul (these CPUs); results are rounded
to the model dtype where a real engine holds them in it (the latent cache, q/k/v handed to the
attention kernel, the layer output).
"""

from __future__ import annotations

import math

import attrs
import torch

from app._cpu import detect_cpu_features
from app._validation import MAX_GENERATOR_SEED, check_int_at_least, check_seed
from app.config import ModelConfig

__all__ = [
    "MLALayer",
    "MLALayerWeights",
    "RotaryEmbedding",
    "TokenEmbedding",
    "apply_rope",
    "default_compute_dtype",
    "rms_norm",
    "rope_inv_freq",
]

#: RMSNorm epsilon of the latent norm.
RMS_NORM_EPS = 1e-6
#: RoPE base.
ROPE_THETA = 10000.0
#: Gain of ``W_q`` over a unit-variance init: attention logits with a spread of about 2 (std),
#: sharper than uniform, as trained models are.
Q_GAIN = 2.0


def _check_model(model: ModelConfig) -> None:
    if not isinstance(model, ModelConfig):
        raise TypeError(f"expected a ModelConfig, got {type(model).__name__}")
    if model.qk_rope_head_dim % 2:
        raise ValueError(f"ModelConfig.qk_rope_head_dim must be even for RoPE, "
                         f"got {model.qk_rope_head_dim}")


@attrs.frozen(eq=False)
class MLALayerWeights:
    """The layer's weights, float64 tensors holding values exactly representable in ``dtype``.

    Shapes (``H, L, P, R, V`` as in the module docstring, ``D = hidden_size``):
    ``w_q [H*(P+R), D]``, ``w_kv_a [L+R, D]``, ``kv_a_norm [L]``, ``w_kv_b [H*(P+V), L]``,
    ``w_o [D, H*V]``.
    """

    model: ModelConfig
    seed: int
    w_q: torch.Tensor
    w_kv_a: torch.Tensor
    kv_a_norm: torch.Tensor
    w_kv_b: torch.Tensor
    w_o: torch.Tensor

    @classmethod
    def generate(cls, model: ModelConfig, seed: int = 0) -> MLALayerWeights:
        """Draw the weights for ``model``'s dims from ``seed`` (on the CPU; deterministic)."""
        _check_model(model)
        check_seed("MLALayerWeights.generate: seed", seed, MAX_GENERATOR_SEED)
        gen = torch.Generator(device="cpu").manual_seed(seed)
        h, d = model.num_heads, model.hidden_size
        lr, p, r, v = (model.kv_lora_rank, model.qk_nope_head_dim, model.qk_rope_head_dim,
                       model.v_head_dim)

        def draw(rows: int, cols: int, gain: float = 1.0) -> torch.Tensor:
            w = torch.randn(rows, cols, generator=gen, dtype=torch.float64)
            return (w * (gain / math.sqrt(cols))).to(model.dtype).double()

        w_q = draw(h * (p + r), d, Q_GAIN)
        w_kv_a = draw(lr + r, d)
        norm = (1.0 + 0.1 * torch.randn(lr, generator=gen, dtype=torch.float64))
        kv_a_norm = norm.to(model.dtype).double()
        w_kv_b = draw(h * (p + v), lr)
        w_o = draw(d, h * v)
        return cls(model=model, seed=seed, w_q=w_q, w_kv_a=w_kv_a, kv_a_norm=kv_a_norm,
                   w_kv_b=w_kv_b, w_o=w_o)


@attrs.frozen(eq=False)
class TokenEmbedding:
    """A seeded token embedding ``[vocab_size, hidden]``: the input hidden states of the layer.

    ``table`` is float64 with values exactly representable in ``dtype``; ``lookup`` returns rows
    in any dtype and device.
    """

    table: torch.Tensor
    dtype: torch.dtype

    @classmethod
    def generate(cls, vocab_size: int, hidden_size: int, dtype: torch.dtype,
                 seed: int = 0) -> TokenEmbedding:
        """Draw a ``[vocab_size, hidden_size]`` unit-variance table from ``seed``."""
        check_int_at_least("vocab_size", vocab_size, 1)
        check_seed("TokenEmbedding.generate: seed", seed, MAX_GENERATOR_SEED - 0x5EED)
        gen = torch.Generator(device="cpu").manual_seed(seed + 0x5EED)
        table = torch.randn(vocab_size, hidden_size, generator=gen, dtype=torch.float64)
        return cls(table=table.to(dtype).double(), dtype=dtype)

    @property
    def vocab_size(self) -> int:
        """Number of rows."""
        return int(self.table.shape[0])

    def lookup(self, token_ids: torch.Tensor, dtype: torch.dtype | None = None,
               device: torch.device | str | None = None) -> torch.Tensor:
        """Rows for ``token_ids`` (int64 ``[T]``), in ``dtype`` (default float64)."""
        rows = self.table.index_select(0, token_ids.to(device="cpu", dtype=torch.long))
        return rows.to(device=device or "cpu", dtype=dtype or torch.float64)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = RMS_NORM_EPS) -> torch.Tensor:
    """RMSNorm over the last dim, computed in ``x``'s dtype."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rope_inv_freq(rope_dim: int, theta: float = ROPE_THETA) -> torch.Tensor:
    """float64 inverse frequencies ``[rope_dim // 2]``."""
    return 1.0 / theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE. ``x [T, ..., R]``, ``cos``/``sin`` ``[T, R/2]`` (broadcast over the middle
    dims). Returns a new tensor in ``x``'s dtype."""
    half = x.shape[-1] // 2
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    c, s = cos.reshape(shape), sin.reshape(shape)
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)


class RotaryEmbedding:
    """cos/sin tables for RoPE, computed in float64, kept in ``dtype`` on ``device``; grown on
    demand (doubling) so a lookup never recomputes them."""

    def __init__(self, rope_dim: int, dtype: torch.dtype, device: torch.device,
                 initial_positions: int = 4096) -> None:
        self.rope_dim = rope_dim
        self.dtype = dtype
        self.device = device
        self._inv_freq = rope_inv_freq(rope_dim) if rope_dim else torch.zeros(0,
                                                                             dtype=torch.float64)
        self._cos = torch.empty(0, rope_dim // 2, dtype=dtype, device=device)
        self._sin = torch.empty(0, rope_dim // 2, dtype=dtype, device=device)
        self._grow(initial_positions)

    def _grow(self, num_positions: int) -> None:
        pos = torch.arange(num_positions, dtype=torch.float64)
        freqs = torch.outer(pos, self._inv_freq)
        self._cos = freqs.cos().to(device=self.device, dtype=self.dtype)
        self._sin = freqs.sin().to(device=self.device, dtype=self.dtype)

    def cos_sin(self, positions: torch.Tensor, max_position: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """Tables for ``positions`` (int64 on ``device``); ``max_position`` bounds them (host)."""
        if max_position >= self._cos.shape[0]:
            self._grow(max(2 * self._cos.shape[0], max_position + 1))
        return self._cos.index_select(0, positions), self._sin.index_select(0, positions)


def _fast_low_precision(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu":
        return True
    # Read from the CPU itself (torch's capability string says AVX512 on CPUs with
    # AVX512-BF16, where a bf16 matmul measured ~4x the fp32 one).
    features = detect_cpu_features()
    return features.fast_bfloat16 if dtype == torch.bfloat16 else features.fast_float16


def default_compute_dtype(dtype: torch.dtype, device: torch.device | str,
                          fast_low_precision: bool | None = None) -> torch.dtype:
    """The dtype the layer's projections run in: ``dtype``, or float32 for a 16-bit ``dtype``
    on a device without fast 16-bit matmul (``fast_low_precision``; when None, a CPU's own
    features decide: AVX512-BF16 / AMX-BF16 for bf16, AVX512-FP16 for fp16)."""
    device = torch.device(device)
    if dtype not in (torch.bfloat16, torch.float16):
        return dtype
    fast = (_fast_low_precision(device, dtype) if fast_low_precision is None
            else fast_low_precision)
    return dtype if fast else torch.float32


class MLALayer:
    """The engine-side layer: projections, latent norm, RoPE, up-projection, output projection.

    Attention itself is not here: ``app.mla.executor`` runs prefill through a prefill backend
    over the paged latent cache, ``app.mla.decode`` runs decode in the absorbed form
    (``absorb_query``, a decode backend, ``unabsorb_output``). All methods take and return
    tensors on ``device``.
    """

    def __init__(self, weights: MLALayerWeights, device: torch.device | str = "cpu",
                 compute_dtype: torch.dtype | None = None) -> None:
        model = weights.model
        self.model = model
        self.weights = weights
        self.device = torch.device(device)
        self.dtype = model.dtype
        self.compute_dtype = (default_compute_dtype(model.dtype, self.device)
                              if compute_dtype is None else compute_dtype)
        self.num_heads = model.num_heads
        self.kv_lora_rank = model.kv_lora_rank
        self.qk_nope_head_dim = model.qk_nope_head_dim
        self.qk_rope_head_dim = model.qk_rope_head_dim
        self.qk_head_dim = model.qk_head_dim
        self.v_head_dim = model.v_head_dim
        self.latent_dim = model.kv_lora_rank + model.qk_rope_head_dim
        cd, dev = self.compute_dtype, self.device
        # Transposed once, so the hot path is a plain ``x @ w`` (GEMM-friendly layout).
        self._w_q_t = weights.w_q.t().contiguous().to(device=dev, dtype=cd)
        self._w_kv_a_t = weights.w_kv_a.t().contiguous().to(device=dev, dtype=cd)
        self._kv_a_norm = weights.kv_a_norm.to(device=dev, dtype=cd)
        self._w_kv_b_t = weights.w_kv_b.t().contiguous().to(device=dev, dtype=cd)
        self._w_o_t = weights.w_o.t().contiguous().to(device=dev, dtype=cd)
        # The absorbed (decode) form splits W_kv_b [H*(P+V), L] per head into W_UK [H, P, L]
        # (folded into the query) and W_UV^T [H, L, V] (applied after latent attention).
        w_kv_b = weights.w_kv_b.view(self.num_heads, self.qk_nope_head_dim + self.v_head_dim,
                                     self.kv_lora_rank)
        self._w_uk = w_kv_b[:, :self.qk_nope_head_dim].contiguous().to(device=dev, dtype=cd)
        self._w_uv_t = w_kv_b[:, self.qk_nope_head_dim:].transpose(1, 2).contiguous().to(
            device=dev, dtype=cd)
        self.rope = RotaryEmbedding(self.qk_rope_head_dim, cd, dev)

    def project(self, x: torch.Tensor, positions: torch.Tensor, max_position: int
                ) -> tuple[torch.Tensor, torch.Tensor]:
        """The new tokens' query and latent.

        ``x [T, hidden]``, ``positions [T]`` int64 (absolute, on ``device``), ``max_position``
        their host-side maximum. Returns ``q [T, H, P+R]`` and ``latent [T, L+R]`` (``kv_c``
        normed, ``k_pe`` roped), both in the model dtype.
        """
        cd = self.compute_dtype
        xc = x.to(cd)
        t = xc.shape[0]
        h, p, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        lr = self.kv_lora_rank
        q = (xc @ self._w_q_t).view(t, h, p + r)
        c = xc @ self._w_kv_a_t
        latent = torch.empty(t, lr + r, dtype=self.dtype, device=self.device)
        latent[:, :lr] = rms_norm(c[:, :lr], self._kv_a_norm)
        if r:
            cos, sin = self.rope.cos_sin(positions, max_position)
            q[..., p:] = apply_rope(q[..., p:], cos, sin)
            latent[:, lr:] = apply_rope(c[:, lr:], cos, sin)
        return q.to(self.dtype), latent

    def up_project(self, latent: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values of cached or new tokens from their latent ``[N, L+R]``.

        Returns ``k [N, H, P+R]`` (contiguous: ``[k_nope, k_pe]``) and ``v [N, H, V]`` (a
        non-contiguous view into the up-projection), in the model dtype.
        """
        n = latent.shape[0]
        h, p, r = self.num_heads, self.qk_nope_head_dim, self.qk_rope_head_dim
        lr = self.kv_lora_rank
        kv = (latent[:, :lr].to(self.compute_dtype) @ self._w_kv_b_t).view(
            n, h, p + self.v_head_dim)
        if kv.dtype != self.dtype:
            kv = kv.to(self.dtype)
        k = torch.empty(n, h, p + r, dtype=self.dtype, device=self.device)
        k[..., :p] = kv[..., :p]
        if r:
            k[..., p:] = latent[:, None, lr:]
        return k, kv[..., p:]

    def absorb_query(self, q: torch.Tensor) -> torch.Tensor:
        """The absorbed decode query: ``q [T, H, P+R]`` (model dtype) -> ``[T, H, L+R]`` in the
        model dtype: ``q_nope @ W_UK`` per head (into the latent space), then ``q_pe``."""
        t = q.shape[0]
        p, lr = self.qk_nope_head_dim, self.kv_lora_rank
        q_latent = torch.bmm(q[..., :p].transpose(0, 1).to(self.compute_dtype), self._w_uk)
        out = torch.empty(t, self.num_heads, lr + self.qk_rope_head_dim, dtype=self.dtype,
                          device=self.device)
        out[..., :lr] = q_latent.transpose(0, 1)
        out[..., lr:] = q[..., p:]
        return out

    def unabsorb_output(self, latent_out: torch.Tensor) -> torch.Tensor:
        """``W_UV`` per head over the latent attention output ``[T, H, L]``: ``[T, H, V]`` (the
        attention output ``output`` takes), in the model dtype."""
        v = torch.bmm(latent_out.transpose(0, 1).to(self.compute_dtype), self._w_uv_t)
        return v.transpose(0, 1).to(self.dtype)

    def output(self, attn: torch.Tensor) -> torch.Tensor:
        """``W_o`` over the attention output ``[T, H, V]``: ``[T, hidden]`` in the model dtype."""
        flat = attn.reshape(attn.shape[0], self.num_heads * self.v_head_dim)
        return (flat.to(self.compute_dtype) @ self._w_o_t).to(self.dtype)

    def describe(self) -> dict[str, object]:
        """JSON-friendly dims and dtypes."""
        m = self.model
        return {"num_heads": m.num_heads, "hidden_size": m.hidden_size,
                "kv_lora_rank": m.kv_lora_rank, "qk_nope_head_dim": m.qk_nope_head_dim,
                "qk_rope_head_dim": m.qk_rope_head_dim, "v_head_dim": m.v_head_dim,
                "dtype": str(self.dtype).removeprefix("torch."),
                "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
                "seed": self.weights.seed}

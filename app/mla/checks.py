"""Teacher-forced checks of generated requests against a dense float64 reference.

A finished request's final sequence (prompt + generated tokens) is run through the float64
layer stack (the non-absorbed form of ``app.mla.reference``: keys and values up-projected, a
causal softmax, no cache, no chunks, no backend) and compared, row by row, with the outputs the
engine produced: prefill rows (the prefill backend) and decode rows (the absorbed decode
backend) are reported separately. The LM head then checks the tokens: each generated token must
be the float64 argmax of the row that chose it, unless the float64 gap between the two
candidates is within what the engine's own row error moves them (a *near-tie*: rounding may
pick either); a flip beyond that means a token came from the wrong row or a wrong logit.

Rows checked (``sample_rows``), per request: at most ``max_prefill_rows`` prefill rows (the
last ``tail_rows`` always) and at most ``max_decode_rows`` decode rows (the first and the last
``edge_rows`` always), the others at a stride; ``None`` checks every row of that kind. Keys
and values are needed for every token, so ``TeacherForcedReference`` reuses them along the
longest common prefix with the sequence it checked before: check requests sorted by
their tokens and a shared prompt prefix is computed once.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import torch

from app.mla.layer import MLALayerWeights, TokenEmbedding, apply_rope, rms_norm, rope_inv_freq
from app.mla.requests import RequestOutput, RowKind

__all__ = ["GenerationCheck", "TeacherForcedReference", "check_generation", "sample_rows"]

#: Query rows per block of the blocked causal softmax.
_ROW_BLOCK = 128


def _strided(rows: torch.Tensor, head: int, tail: int, most: int | None) -> torch.Tensor:
    """``rows`` (sorted), or when more than ``most``: the first ``head``, the last ``tail`` and
    the rest filled at a stride."""
    n = rows.numel()
    if most is None or n <= most:
        return rows
    head, tail = min(head, most), min(tail, max(most - head, 0))
    body = rows[head:n - tail]
    room = most - head - tail
    stride = -(-body.numel() // room) if room > 0 else body.numel() + 1
    middle = body[::stride][:room] if room > 0 else body[:0]
    return torch.cat([rows[:head], middle, rows[n - tail:] if tail else rows[:0]])


def sample_rows(row_kinds: torch.Tensor, max_prefill_rows: int | None = 32,
                tail_rows: int = 16, max_decode_rows: int | None = 32,
                edge_rows: int = 8) -> torch.Tensor:
    """The rows to check (sorted int64): at most ``max_prefill_rows`` ``PREFILL`` rows (the last
    ``tail_rows`` of them always, the others at a stride) and at most ``max_decode_rows``
    ``DECODE`` rows (the first and the last ``edge_rows`` always: the first decode rows and the
    request's last rows, the others at a stride). ``None`` keeps every row of that kind."""
    kinds = row_kinds.to("cpu")
    decode = (kinds == int(RowKind.DECODE)).nonzero().flatten()
    prefill = (kinds == int(RowKind.PREFILL)).nonzero().flatten()
    rows: torch.Tensor = torch.unique(torch.cat([
        _strided(prefill, 0, tail_rows, max_prefill_rows),
        _strided(decode, edge_rows, edge_rows, max_decode_rows)]))
    return rows


class _Layer64:
    """One layer's weights in float64 and its key/value/query maths."""

    def __init__(self, weights: MLALayerWeights) -> None:
        m = weights.model
        self.w = weights
        self.h, self.p, self.r, self.lr, self.v = (m.num_heads, m.qk_nope_head_dim,
                                                   m.qk_rope_head_dim, m.kv_lora_rank,
                                                   m.v_head_dim)
        self.scale = m.scale
        self.inv_freq = rope_inv_freq(self.r) if self.r else torch.zeros(0, dtype=torch.float64)

    def _cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(positions.to(torch.float64), self.inv_freq)
        return freqs.cos(), freqs.sin()

    def keys_values(self, x: torch.Tensor, start: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``x [n, hidden]`` at positions ``start..`` -> ``k [H, n, P+R]``, ``v [H, n, V]``
        (head-major views, not contiguous)."""
        n = x.shape[0]
        c = x @ self.w.w_kv_a.t()
        kv = (rms_norm(c[:, :self.lr], self.w.kv_a_norm) @ self.w.w_kv_b.t()).view(
            n, self.h, self.p + self.v)
        k = torch.empty(n, self.h, self.p + self.r, dtype=torch.float64)
        k[..., :self.p] = kv[..., :self.p]
        if self.r:
            cos, sin = self._cos_sin(torch.arange(start, start + n))
            k[..., self.p:] = apply_rope(c[:, self.lr:], cos, sin)[:, None, :]
        return k.transpose(0, 1), kv[..., self.p:].transpose(0, 1)

    def attend(self, x_rows: torch.Tensor, rows: torch.Tensor, k: torch.Tensor,
               v: torch.Tensor) -> torch.Tensor:
        """Outputs ``[n, hidden]`` of the query rows ``rows`` (sorted positions; inputs
        ``x_rows [n, hidden]``) over keys ``k``/``v`` of every earlier position."""
        n = x_rows.shape[0]
        q = (x_rows @ self.w.w_q.t()).view(n, self.h, self.p + self.r)
        if self.r:
            cos, sin = self._cos_sin(rows)
            q[..., self.p:] = apply_rope(q[..., self.p:], cos, sin)
        q_h = (q.transpose(0, 1) * self.scale).contiguous()
        out = torch.empty(self.h, n, self.v, dtype=torch.float64)
        for b0 in range(0, n, _ROW_BLOCK):
            pos = rows[b0:b0 + _ROW_BLOCK]
            end = int(pos[-1]) + 1
            scores = torch.bmm(q_h[:, b0:b0 + _ROW_BLOCK], k[:, :end].transpose(1, 2))
            hidden = torch.arange(end).view(1, -1) > pos.view(-1, 1)
            scores.masked_fill_(hidden, float("-inf"))
            torch.bmm(torch.softmax(scores, dim=-1), v[:, :end], out=out[:, b0:b0 + _ROW_BLOCK])
        return out.transpose(0, 1).reshape(n, self.h * self.v) @ self.w.w_o.t()


class TeacherForcedReference:
    """The float64 stack (``h_{l+1} = layer_l(h_l)``, ``h_0`` the embedding) of one engine's
    weights. ``outputs(tokens, rows)`` gives the last layer's output at ``rows``; the keys,
    values and hidden states of the previous sequence are reused along the common prefix."""

    def __init__(self, weights: Sequence[MLALayerWeights], embedding: TokenEmbedding) -> None:
        if not weights:
            raise ValueError("TeacherForcedReference needs at least one layer")
        self.layers = [_Layer64(w) for w in weights]
        self.embedding = embedding
        #: The tied LM head in float32 ``[hidden, vocab]`` (finds the argmax of a row).
        self.lm_head_f32 = embedding.table.t().float().contiguous()
        self._tokens: tuple[int, ...] = ()
        # Per layer, grown on demand and rewritten in place past the common prefix: keys
        # ``[H, capacity, P+R]``, values ``[H, capacity, V]`` of every position of the previous
        # sequence, and (all but the last layer) the layer's output ``[capacity, hidden]``.
        self._keys: list[torch.Tensor] = []
        self._values: list[torch.Tensor] = []
        self._hidden: list[torch.Tensor] = []
        self.reused_tokens = 0
        self.computed_tokens = 0

    @staticmethod
    def _fit(buffer: torch.Tensor | None, dim: int, n: int, keep: int,
             shape: tuple[int, ...]) -> torch.Tensor:
        """``buffer`` with room for ``n`` positions along ``dim`` (its first ``keep`` kept)."""
        if buffer is not None and buffer.shape[dim] >= n:
            return buffer
        size = list(shape)
        size[dim] = max(n, 2 * (0 if buffer is None else buffer.shape[dim]))
        grown = torch.empty(size, dtype=torch.float64)
        if buffer is not None and keep:
            grown.narrow(dim, 0, keep).copy_(buffer.narrow(dim, 0, keep))
        return grown

    def outputs(self, token_ids: Sequence[int], rows: torch.Tensor) -> torch.Tensor:
        """float64 ``[len(rows), hidden]``: the last layer's output at ``rows`` (sorted)."""
        tokens = tuple(token_ids)
        common = 0
        if self._keys:
            limit = min(len(self._tokens), len(tokens))
            while common < limit and self._tokens[common] == tokens[common]:
                common += 1
        n = len(tokens)
        x = self.embedding.lookup(torch.tensor(tokens[common:], dtype=torch.int64))
        result = x
        first = not self._keys
        for i, layer in enumerate(self.layers):
            k_new, v_new = layer.keys_values(x, common)
            old_k = None if first else self._keys[i]
            old_v = None if first else self._values[i]
            k = self._fit(old_k, 1, n, common, (layer.h, n, layer.p + layer.r))
            v = self._fit(old_v, 1, n, common, (layer.h, n, layer.v))
            k[:, common:n] = k_new
            v[:, common:n] = v_new
            if first:
                self._keys.append(k)
                self._values.append(v)
            else:
                self._keys[i], self._values[i] = k, v
            if i + 1 < len(self.layers):
                x = layer.attend(x, torch.arange(common, n), k, v)
                old_h = None if first else self._hidden[i]
                h = self._fit(old_h, 0, n, common, (n, x.shape[1]))
                h[common:n] = x
                if first:
                    self._hidden.append(h)
                else:
                    self._hidden[i] = h
            else:
                if self._hidden:
                    inputs = self._hidden[-1].index_select(0, rows)
                else:
                    inputs = self.embedding.lookup(torch.tensor(tokens, dtype=torch.int64)[rows])
                result = layer.attend(inputs, rows, k, v)
        self._tokens = tokens
        self.reused_tokens += common
        self.computed_tokens += n - common
        return result


@attrs.frozen
class GenerationCheck:
    """One request against the float64 reference: rows checked / computed per path, the
    largest absolute error per path, the reference's scale, and the token verdicts."""

    request_id: str
    prefill_rows_checked: int
    prefill_rows_computed: int
    decode_rows_checked: int
    decode_rows_computed: int
    prefill_max_abs_error: float
    decode_max_abs_error: float
    ref_max_abs: float
    tokens_checked: int
    tokens_agreeing: int
    near_ties: int
    token_mismatches: int

    @property
    def prefill_relative_error(self) -> float:
        """Prefill rows' largest error over the reference's largest value."""
        return _relative(self.prefill_max_abs_error, self.ref_max_abs)

    @property
    def decode_relative_error(self) -> float:
        """Decode rows' largest error over the reference's largest value."""
        return _relative(self.decode_max_abs_error, self.ref_max_abs)


def _relative(error: float, scale: float) -> float:
    """``error / scale``; infinite when either is not finite (a NaN reference made NaN, which
    every comparison and ``max`` dropped: a NaN run passed) or when a zero reference meets a
    non-zero error."""
    if not (math.isfinite(error) and math.isfinite(scale)):
        return float("inf")
    if scale == 0:
        return 0.0 if error == 0 else float("inf")
    return error / scale


def _max_error(got: torch.Tensor, want: torch.Tensor) -> float:
    if not got.numel():
        return 0.0
    # A NaN or inf anywhere is an infinite error (max propagates NaN; a NaN would otherwise
    # compare as "within tolerance").
    error = float((got - want).abs().max())
    return error if math.isfinite(error) else float("inf")


def check_generation(reference: TeacherForcedReference, output: RequestOutput,
                     max_prefill_rows: int | None = 32, max_decode_rows: int | None = 32
                     ) -> GenerationCheck:
    """Check ``output`` (kept ``hidden`` and ``row_kinds`` required) on ``sample_rows`` (the
    tokens chosen by the decode rows and the last prefill row checked)."""
    if output.hidden is None or output.row_kinds is None:
        raise ValueError(f"request {output.request_id!r} kept no outputs (keep_outputs=False)")
    kinds = output.row_kinds.to("cpu")
    rows = sample_rows(kinds, max_prefill_rows, max_decode_rows=max_decode_rows)
    tokens = output.token_ids
    if not rows.numel():
        return GenerationCheck(output.request_id, 0, 0, 0, 0, 0.0, 0.0, 0.0, 0, 0, 0, 0)
    want = reference.outputs(tokens, rows)
    got = output.hidden.index_select(0, rows.to(output.hidden.device)).to(
        device="cpu", dtype=torch.float64)
    is_decode = kinds.index_select(0, rows) == int(RowKind.DECODE)
    # Tokens: row p chose token p + 1 when p + 1 is a generated position.
    prompt_len = len(output.prompt_token_ids)
    chooser = (rows >= prompt_len - 1) & (rows < len(tokens) - 1)
    agree = ties = mismatches = 0
    if bool(chooser.any()):
        table = reference.embedding.table
        want_rows, got_rows = want[chooser], got[chooser]
        # The float64 argmax over the vocabulary (found in float32, then the two candidates'
        # logits recomputed in float64).
        best = (want_rows.float() @ reference.lm_head_f32).argmax(dim=1)
        chosen = torch.tensor(tokens, dtype=torch.int64)[rows[chooser] + 1]
        ref_best = (want_rows * table[best]).sum(dim=1)
        ref_chosen = (want_rows * table[chosen]).sum(dim=1)
        # How far the engine's own rows move those two logits: a flip within that is rounding.
        err = ((got_rows - want_rows) * table[best]).sum(dim=1).abs() \
            + ((got_rows - want_rows) * table[chosen]).sum(dim=1).abs()
        same = best == chosen
        tie = ~same & (ref_best - ref_chosen <= err + 1e-9 * ref_best.abs())
        agree, ties = int(same.sum()), int(tie.sum())
        mismatches = int((~same & ~tie).sum())
    return GenerationCheck(
        request_id=output.request_id,
        prefill_rows_checked=int((~is_decode).sum()),
        prefill_rows_computed=int((kinds == int(RowKind.PREFILL)).sum()),
        decode_rows_checked=int(is_decode.sum()),
        decode_rows_computed=int((kinds == int(RowKind.DECODE)).sum()),
        prefill_max_abs_error=_max_error(got[~is_decode], want[~is_decode]),
        decode_max_abs_error=_max_error(got[is_decode], want[is_decode]),
        ref_max_abs=_max_error(want, torch.zeros_like(want)),  # NaN: inf, never dropped
        tokens_checked=agree + ties + mismatches, tokens_agreeing=agree, near_ties=ties,
        token_mismatches=mismatches)

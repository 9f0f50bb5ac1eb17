"""The model a command serves: a Hugging Face checkpoint (``--model DIR``) or the random
DeepSeek model made in memory at the engine config's attention dims (``app.model.random``).

``add_model_arguments`` adds ``--model``, ``--dtype``, ``--layers`` and ``--seed``;
``build_model`` returns the engine config (the model's ``ModelConfig`` in it: dims, softmax
scale, dtype), the weights, and what to report about them.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import IO, Any

import attrs
import torch

from app.commands._args import int_in
from app.commands._output import ProgressBar
from app.config import DTYPE_ALIASES, EngineConfig, parse_dtype

#: Vocabulary of the random model.
RANDOM_VOCAB_SIZE = 4096


@attrs.frozen(eq=False)
class BuiltModel:
    """The engine config for the model, its weights, its eos tokens, the tokenizer path, and a
    JSON-friendly description (source, architecture, load report)."""

    config: EngineConfig
    weights: Any
    eos_token_ids: tuple[int, ...]
    tokenizer_path: Path | None
    description: dict[str, Any]


def add_model_arguments(parser: argparse.ArgumentParser, *, random_default: bool = True
                        ) -> None:
    """``--model DIR`` (required unless a random model is the default; then ``--layers`` and
    ``--seed`` too), ``--dtype``."""
    parser.add_argument("--model", type=Path, default=None, metavar="DIR",
                        required=not random_default,
                        help="a Hugging Face DeepSeek-V2/V3/V3.2 or GLM-5 checkpoint directory "
                             "(config.json and *.safetensors: one file or shards with their "
                             "index; bf16, fp16, fp32 or FP8 block-quantized; 'checkpoint' "
                             "writes a tiny one)"
                        + ("; default: a random DeepSeek-V3-shaped model made in memory (16 "
                           "heads, kv_lora_rank 512, rope 64, nope 128, v 128; or the "
                           "--deployment file's [model])" if random_default else ""))
    parser.add_argument("--dtype", default=None, choices=sorted(DTYPE_ALIASES),
                        help="model dtype: activations, KV cache, weights (default: the "
                             "checkpoint's, bfloat16 for FP8"
                        + ("; the random model's: bfloat16, or the --deployment file's"
                           if random_default else "")
                        + "); float32 computes everything in float32")
    if random_default:
        parser.add_argument("--layers", type=int_in(1, 64), default=None,
                            help="decoder layers of the random model (default: 1)")
        parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0,
                            help="seed of the random weights and the workload "
                                 "(default: %(default)s)")


def build_model(args: argparse.Namespace, base: EngineConfig, *, progress: bool = True,
                stream: IO[str] | None = None) -> BuiltModel:
    """Load ``args.model`` (with a progress bar on ``stream`` when ``progress``) or make the
    random model; ``base`` with its ``model`` section replaced by the model's."""
    from app.commands._memory import check_weights_fit
    from app.model import random_config, random_weights
    from app.model.loader import check_checkpoint

    dtype = None if args.dtype is None else parse_dtype(args.dtype, "--dtype")
    if args.model is not None:
        if getattr(args, "layers", None) is not None:
            raise ValueError("--layers sets the random model's depth; a checkpoint "
                             "(--model) has its own")
        # Every check of the checkpoint first (its config against its tensors: sizes bounded
        # by what is on disk), then whether it fits, then the load.
        arch = check_checkpoint(args.model)
        check_weights_fit(arch, dtype or arch.dtype or torch.bfloat16)
        loaded = _load(args.model, dtype, progress, stream)
        arch = loaded.config
        config = attrs.evolve(base, model=arch.model_config(loaded.weights.dtype))
        return BuiltModel(config=config, weights=loaded.weights,
                          eos_token_ids=loaded.eos_token_ids,
                          tokenizer_path=loaded.tokenizer_path,
                          description={"source": str(args.model), **arch.describe(),
                                       "load": loaded.report.describe()})
    model = base.model if dtype is None else attrs.evolve(base.model, dtype=dtype)
    arch = random_config(model, num_layers=args.layers or 1, vocab_size=RANDOM_VOCAB_SIZE)
    check_weights_fit(arch, model.dtype)
    weights = random_weights(arch, model.dtype, seed=args.seed)
    return BuiltModel(config=attrs.evolve(base, model=arch.model_config(model.dtype)),
                      weights=weights, eos_token_ids=(), tokenizer_path=None,
                      description={"source": f"random (seed {args.seed})", **arch.describe()})


def _load(directory: Path, dtype: torch.dtype | None, progress: bool,
          stream: IO[str] | None) -> Any:
    """``load_checkpoint`` with a bar redrawn in place on a terminal; elsewhere (a log, a pipe)
    one line before and one after, not a line per tenth."""
    from app.model import load_checkpoint

    out = sys.stderr if stream is None else stream
    if progress and not getattr(out, "isatty", lambda: False)():
        out.write(f"loading {directory} ...\n")
        out.flush()
        loaded = load_checkpoint(directory, dtype)
        report = loaded.report.describe()
        out.write(f"loaded {report['tensors']} tensors ({report['model_bytes'] / 2**20:.0f} "
                  f"MiB) in {report['seconds']} s\n")
        out.flush()
        return loaded
    bar = ProgressBar(100, "load", stream=out, enabled=progress)
    loaded = load_checkpoint(
        directory, dtype,
        progress=lambda done, total: bar.update(int(100 * done / max(total, 1)),
                                                f"{done / 2**20:.0f} MiB"))
    bar.close()
    return loaded


def model_line(description: dict[str, Any], dtype: torch.dtype, compute: torch.dtype) -> str:
    """One line saying what the model is."""
    d = description
    moe = d["moe"]
    mlp = "dense SwiGLU" if moe is None else (
        f"MoE {moe['n_routed_experts']} experts ({moe['scoring_func']}, "
        f"{moe['topk_method']}, top-{moe['num_experts_per_tok']}, groups "
        f"{moe['topk_group']}/{moe['n_group']}, {moe['n_shared_experts']} shared) from layer "
        f"{d['first_k_dense_replace']}")
    q = "q_proj" if d["q_lora_rank"] is None else f"q LoRA {d['q_lora_rank']}"
    rope = d["rope"]
    rope_text = rope["rope_type"] if rope["rope_type"] == "default" else \
        f"{rope['rope_type']} x{rope['factor']:g}"
    return (f"{d['architecture']} ({d['source']}): {d['num_hidden_layers']} layers, "
            f"hidden {d['hidden_size']}, MLA H={d['num_attention_heads']} "
            f"L={d['kv_lora_rank']} P={d['qk_nope_head_dim']} R={d['qk_rope_head_dim']} "
            f"V={d['v_head_dim']}, {q}, rope {rope_text}"
            f"{' interleaved' if d['rope_interleave'] else ''}, {mlp}, vocab "
            f"{d['vocab_size']}{_sparse_text(d)}, {str(dtype).removeprefix('torch.')} (compute "
            f"{str(compute).removeprefix('torch.')})")


def _sparse_text(description: dict[str, Any]) -> str:
    """The indexer of a sparse model, in words (empty for a dense one)."""
    indexer = description.get("indexer")
    if not indexer:
        return ""
    shared = indexer["shared_layers"]
    return (f", sparse attention: top-{indexer['index_topk']} of an indexer of "
            f"{indexer['index_n_heads']}x{indexer['index_head_dim']}"
            + (f" (layers {shared} shared)" if shared else ""))

"""``python -m app checkpoint --family v32 DIR``: a tiny random Hugging Face checkpoint of any
family the engine serves, to try ``generate``, ``run --model`` and the sparse-attention
commands without a 600 GB download.

``DIR`` (new, or an empty directory) receives ``config.json`` (the Hub's layout, or with
``--layout transformers`` the one transformers writes), ``generation_config.json`` and
``model.safetensors``: random bf16 weights drawn by transformers' own model class of the family
(``app.testing.deepseek_checkpoint``): ``v2`` (DeepSeek-V2-Lite-like), ``v3`` (DeepSeek-V3-like),
``v32`` (DeepSeek-V3.2: V3 with DeepSeek Sparse Attention) and ``glm`` (GLM-5: sparse, an
indexer per layer or shared, ``--indexer-pattern``). Attention runs at DeepSeek's dims
(``kv_lora_rank`` 512, rope 64, nope 128, v 128) unless told otherwise; everything else is small
(hidden 256, 4 experts, vocabulary 1024), a checkpoint of about 18 MB that loads in a second.

Needs ``transformers`` (``pip install 'app[test]'``, or ``pip install 'transformers>=5.0'``): its
model classes draw and name the weights, so the checkpoint is what transformers and vLLM read.
The options are checked (by the loader's own config checks) before transformers is imported;
the checkpoint is written to a temporary folder beside ``DIR`` and moved into place whole, then
read back with ``app.model.check_checkpoint``.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs

from app.commands._args import int_in
from app.commands._help import program_name
from app.commands._output import print_json, print_text

HELP = ("write a tiny random checkpoint of a family (v2, v3, v32, glm) to DIR, to try generate "
        "and run --model (needs transformers: pip install 'app[test]')")

#: Flag -> field of ``DeepseekCheckpointSpec``, with the flag's bounds.
SIZE_FLAGS: dict[str, tuple[str, int, int]] = {
    "--layers": ("num_layers", 1, 64),
    "--heads": ("num_heads", 1, 128),
    "--hidden-size": ("hidden_size", 1, 8192),
    "--intermediate-size": ("intermediate_size", 1, 32768),
    "--vocab-size": ("vocab_size", 2, 262144),
    "--kv-lora-rank": ("kv_lora_rank", 1, 4096),
    "--qk-rope-head-dim": ("qk_rope_head_dim", 2, 512),
    "--qk-nope-head-dim": ("qk_nope_head_dim", 1, 512),
    "--v-head-dim": ("v_head_dim", 1, 512),
    "--q-lora-rank": ("q_lora_rank", 1, 4096),
    "--experts": ("num_experts", 2, 256),
    "--moe-intermediate-size": ("moe_intermediate_size", 1, 8192),
}
#: The sparse families' flags (DeepSeek Sparse Attention): flag -> field, bounds.
SPARSE_FLAGS: dict[str, tuple[str, int, int]] = {
    "--index-topk": ("index_topk", 1, 2**31 - 1),
    "--index-head-dim": ("index_head_dim", 1, 512),
    "--index-n-heads": ("index_n_heads", 1, 128),
}
SPARSE_FAMILIES = ("v32", "glm")
#: The writer's peak host memory per parameter: transformers' float32 model, its bf16 copy, the
#: bytes saved.
_BYTES_PER_PARAMETER = 4 + 2 + 2


def _spec_default(field: str) -> Any:
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec

    return attrs.fields_dict(DeepseekCheckpointSpec)[field].default


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``DIR``, ``--family``, ``--layout``, ``--rope``, the sizes, the sparse settings."""
    parser.add_argument("directory", type=Path, metavar="DIR",
                        help="where to write it: a new or empty directory")
    parser.add_argument("--family", choices=("v2", "v3", "v32", "glm"),
                        default=_spec_default("family"),
                        help="v2: DeepSeek-V2-Lite-like (no q LoRA, softmax routing); v3: "
                             "DeepSeek-V3-like (q LoRA, sigmoid grouped routing); v32: "
                             "DeepSeek-V3.2 (v3 with DeepSeek Sparse Attention); glm: GLM-5 "
                             "(sparse, indexers shared per --indexer-pattern) "
                             "(default: %(default)s)")
    parser.add_argument("--layout", choices=("hub", "transformers"),
                        default=_spec_default("layout"),
                        help="config.json as the Hub's DeepSeek files write it, or as "
                             "transformers 5 writes it (default: %(default)s)")
    parser.add_argument("--rope", choices=("yarn", "default"), default=_spec_default("rope"),
                        help="yarn scaling as DeepSeek's checkpoints have it, or plain rope "
                             "(default: %(default)s)")
    for flag, (field, low, high) in SIZE_FLAGS.items():
        parser.add_argument(flag, type=int_in(low, high), default=_spec_default(field),
                            dest=field, help=f"{field} ({low}..{high}; default: %(default)s)")
    parser.add_argument("--dense", action="store_true",
                        help="no MoE: every layer a dense MLP (default: MoE from layer 1 on)")
    parser.add_argument("--seed", type=int_in(0, 2**63 - 1), default=_spec_default("seed"),
                        help="seed of the random weights; the same options and seed write the "
                             "same weights (default: %(default)s)")
    for flag, (field, low, high) in SPARSE_FLAGS.items():
        parser.add_argument(flag, type=int_in(low, high), default=None,
                            help=f"v32 and glm only: the indexer's {field} ({low}..{high}; "
                                 f"default: {_spec_default(field)})")
    parser.add_argument("--indexer-pattern", default=None, metavar="PATTERN",
                        help="glm only: one letter per layer, F (the layer's own indexer) or S "
                             "(reuses the previous layer's selection), the first F, e.g. FSFS "
                             "(default: all F)")


def build_spec(args: argparse.Namespace) -> Any:
    """The ``DeepseekCheckpointSpec`` the options describe. ``ValueError`` naming the flag for
    a sparse setting on a dense family, and (from the loader's own config checks, naming the
    config key each flag sets) for a model the engine cannot serve."""
    from app.model import DeepseekConfig
    from app.testing.deepseek_checkpoint import DeepseekCheckpointSpec, hub_config

    sparse = {field: getattr(args, field) for _, (field, _, _) in SPARSE_FLAGS.items()
              if getattr(args, field) is not None}
    given = [flag for flag, (field, _, _) in SPARSE_FLAGS.items() if field in sparse]
    if given and args.family not in SPARSE_FAMILIES:
        raise ValueError(f"{', '.join(given)}: the sparse families' settings (v32, glm); "
                         f"--family {args.family} is dense")
    if args.indexer_pattern is not None and args.family != "glm":
        raise ValueError(f"--indexer-pattern: GLM-5's setting (--family glm), not --family "
                         f"{args.family}'s")
    spec = DeepseekCheckpointSpec(
        family=args.family, layout=args.layout, rope=args.rope, moe=not args.dense,
        seed=args.seed, indexer_pattern=args.indexer_pattern, **sparse,
        **{field: getattr(args, field) for field, _, _ in SIZE_FLAGS.values()})
    # the loader's checks, before transformers is imported (seconds) or a file is written
    DeepseekConfig.from_dict(hub_config(spec), source=f"--family {args.family} config")
    return spec


def _parameters(spec: Any) -> int:
    from app.model import DeepseekConfig, weight_specs
    from app.testing.deepseek_checkpoint import hub_config

    arch = DeepseekConfig.from_dict(hub_config(spec))
    return sum(math.prod(s.shape) for s in weight_specs(arch).values())


def _check_target(directory: Path) -> None:
    if directory.is_symlink() or (directory.exists() and not directory.is_dir()):
        raise ValueError(f"{directory}: expected a new or empty directory, got a file or link")
    if directory.is_dir() and any(directory.iterdir()):
        raise ValueError(f"{directory}: the directory is not empty; give a new or empty one")
    parent = directory.absolute().parent
    if not parent.is_dir():
        raise ValueError(f"{directory}: its parent directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise ValueError(f"{directory}: its parent directory {parent} is not writable")


def _require_transformers() -> None:
    missing = [name for name in ("transformers", "safetensors")
               if importlib.util.find_spec(name) is None]
    if missing:
        raise ImportError(f"checkpoint needs {' and '.join(missing)} (transformers' model "
                          "classes draw and name the weights): pip install 'app[test]', or "
                          "pip install 'transformers>=5.0' safetensors")


def write(args: argparse.Namespace) -> dict[str, Any]:
    """Check everything, write the checkpoint, read it back; what was written."""
    from app.commands._memory import check_host_memory
    from app.model.loader import check_checkpoint
    from app.testing.deepseek_checkpoint import write_deepseek_checkpoint

    directory = Path(os.path.abspath(args.directory))
    spec = build_spec(args)
    _check_target(directory)
    _require_transformers()
    parameters = _parameters(spec)
    check_host_memory(f"a checkpoint of {parameters / 1e6:.1f} M parameters",
                      parameters * _BYTES_PER_PARAMETER)
    from transformers.utils import logging as hf_logging

    # its bars are lines of \r in a log; this command prints one line when done
    disable_bars: Any = hf_logging.disable_progress_bar    # untyped in transformers
    disable_bars()
    tmp = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-",
                                dir=directory.absolute().parent))
    try:
        write_deepseek_checkpoint(tmp / "out", spec)
        if directory.is_dir():
            directory.rmdir()                 # empty (checked): replaced whole
        os.replace(tmp / "out", directory)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    arch = check_checkpoint(directory)
    files = sorted(p.name for p in directory.iterdir())
    return {"directory": str(directory), "family": spec.family, "spec": attrs.asdict(spec),
            "architecture": arch.architecture, "parameters": parameters,
            "bytes": sum((directory / f).stat().st_size for f in files), "files": files,
            "sparse": arch.indexer is not None}


def run(args: argparse.Namespace) -> int:
    """Write the checkpoint and say what it is and how to use it."""

    result = write(args)
    if args.json:
        print_json(result)
        return 0
    spec, prog, where = result["spec"], program_name(), result["directory"]
    sparse = (f", sparse: top-{spec['index_topk']} of an indexer of {spec['index_n_heads']}x"
              f"{spec['index_head_dim']}" if result["sparse"] else "")
    print_text(f"wrote {where}: {result['architecture']}, {spec['num_layers']} layers, MLA "
               f"H={spec['num_heads']} L={spec['kv_lora_rank']} R={spec['qk_rope_head_dim']}"
               f"{sparse}; {result['parameters'] / 1e6:.1f} M random bf16 parameters, "
               f"{result['bytes'] / 2**20:.1f} MiB ({', '.join(result['files'])})")
    print_text(f"try: {prog} generate --model {where} --prompt-ids 1,2,3 --max-new-tokens 8")
    print_text(f"     {prog} run --model {where}")
    return 0

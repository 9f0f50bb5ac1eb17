"""``python -m app generate``: greedy generation from a Hugging Face DeepSeek checkpoint
(V2, V3, and the sparse V3.2 and GLM-5).

``--model DIR`` is loaded with ``safetensors`` (``app.model.load_checkpoint``: one file or
shards, bf16/fp16/fp32 or FP8 block-quantized, MTP layers skipped), the engine serves every
prompt at once (continuous batching, chunked prefill through the selected prefill backend,
absorbed decode through the selected decode backend, over the paged latent cache) and prints
each prompt's generated ids (new tokens only), one line per prompt, comma-separated. Prompts
are ``--prompt-ids 1,2,3`` (repeatable) or, where DIR has a ``tokenizer.json``, ``--prompt
TEXT`` (repeatable; needs the ``tokenizers`` package, the ``tokenizer`` extra), which prints
text. Generation stops at ``--max-new-tokens`` or an eos token of the checkpoint
(``generation_config.json``, else ``config.json``) unless ``--ignore-eos``.

``--json``: the last line of stdout is one JSON object ``{"outputs": [{"prompt_ids": [...],
"generated_ids": [...], "logprobs": [...], "finish_reason": ...}, ...], "timings": {...},
"model": {...}, "backends": {...}}``.

``--dtype float32`` computes everything (projections, attention, MoE, LM head) in float32;
the default follows the checkpoint's dtype (bfloat16 for FP8) and, for a 16-bit dtype, the
CPU (projections in float32 where it has no fast 16-bit matmul).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from app._cpu import apply_thread_count
from app.commands._args import add_kv_cache_dtype_argument, positive_int
from app.commands._model import add_model_arguments, build_model, model_line
from app.commands._output import json_text, print_text, raise_for_errors
from app.commands._tokenizer import CheckpointTokenizer
from app.config import EngineConfig, dtype_name

HELP = ("greedy generation from a Hugging Face DeepSeek-V2/V3/V3.2 or GLM-5 checkpoint "
        "(--model DIR): --prompt-ids 1,2,3 or --prompt TEXT")

#: Blocks of the KV cache beyond what the prompts need (block 0 is reserved).
_SPARE_BLOCKS = 8


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(part) for part in text.replace(" ", "").split(",") if part]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated token ids like 1,2,3, got {text!r}") from None
    if not ids or min(ids) < 0:
        raise argparse.ArgumentTypeError(f"expected non-negative token ids, got {text!r}")
    return ids


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The checkpoint, the prompts, how many tokens, the dtype, the block size."""
    add_model_arguments(parser, random_default=False)
    parser.add_argument("--prompt-ids", type=_token_ids, action="append", default=[],
                        metavar="IDS", help="a prompt as comma-separated token ids "
                                            "(repeat for more prompts)")
    parser.add_argument("--prompt", action="append", default=[], metavar="TEXT",
                        help="a prompt as text, tokenized with DIR/tokenizer.json (needs the "
                             "tokenizers package: pip install 'app[tokenizer]'); prints text")
    parser.add_argument("--max-new-tokens", type=positive_int, default=32,
                        help="most tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="do not stop at the checkpoint's eos token(s)")
    parser.add_argument("--block-size", type=positive_int, default=16,
                        help="tokens per KV-cache block (default: %(default)s)")
    add_kv_cache_dtype_argument(parser, "auto", "%(default)s")
    parser.add_argument("--no-progress", action="store_true",
                        help="no loading progress bar on stderr")


def _tokenizer(model: Path) -> CheckpointTokenizer:
    path = model / "tokenizer.json"
    if not path.exists() and not path.is_symlink():
        raise ValueError(f"--prompt needs {path}, which does not exist; pass token ids with "
                         "--prompt-ids")
    return CheckpointTokenizer(path)


def execute(args: argparse.Namespace) -> dict[str, Any]:
    """Load, generate, and return the result (see the module docstring)."""
    import attrs

    from app.containers import create_container
    from app.mla.engine import MLAEngine
    from app.mla.requests import Request

    if args.model is None:
        raise ValueError("generate needs --model DIR (a Hugging Face checkpoint directory)")
    if not args.prompt_ids and not args.prompt:
        raise ValueError("give at least one prompt: --prompt-ids 1,2,3 or --prompt TEXT")
    tokenizer = _tokenizer(args.model) if args.prompt else None  # before loading: fails at once
    threads = apply_thread_count()
    start = time.perf_counter()
    built = build_model(args, EngineConfig(), progress=not args.no_progress)
    load_seconds = time.perf_counter() - start
    prompts = [list(p) for p in args.prompt_ids]
    prompts += [tokenizer.encode(text) for text in args.prompt] if tokenizer else []
    if any(not p for p in prompts):
        raise ValueError("a --prompt tokenized to no tokens")
    blocks = sum(-(-(len(p) + args.max_new_tokens) // args.block_size) for p in prompts)
    config = attrs.evolve(built.config, cache=attrs.evolve(
        built.config.cache, block_size=args.block_size, num_blocks=blocks + _SPARE_BLOCKS,
        kv_cache_dtype=args.kv_cache_dtype))
    engine = MLAEngine(create_container(config), weights=built.weights,
                       step_tokens=max(8192, max(len(p) for p in prompts)), keep_outputs=False)
    stop = () if args.ignore_eos else built.eos_token_ids
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"prompt-{i}", prompt, max_new_tokens=args.max_new_tokens,
                                   stop_token_ids=stop))
    gen_start = time.perf_counter()
    outputs = {o.request_id: o for o in engine.run()}
    gen_seconds = time.perf_counter() - gen_start
    raise_for_errors(outputs.values())
    stats = engine.stats
    results = []
    for i, prompt in enumerate(prompts):
        out = outputs[f"prompt-{i}"]
        item: dict[str, Any] = {"prompt_ids": prompt, "generated_ids": list(out.output_token_ids),
                                "logprobs": [round(x, 6) for x in out.logprobs],
                                "finish_reason": out.finish_reason.value}
        if tokenizer is not None:
            item["text"] = tokenizer.decode(out.output_token_ids)
        results.append(item)
    return {
        "outputs": results,
        "timings": {"load_seconds": round(load_seconds, 3),
                    "generate_seconds": round(gen_seconds, 3),
                    "prefill_tokens": stats.prefill_tokens,
                    "prefill_seconds": round(stats.prefill_seconds, 3),
                    "prefill_tokens_per_s": round(stats.prefill_tokens_per_second, 1),
                    "decode_tokens": stats.decode_emitted_tokens,
                    "decode_seconds": round(stats.decode_seconds, 3),
                    "decode_tokens_per_s": round(stats.decode_tokens_per_second, 1)},
        "model": {**built.description, "dtype": dtype_name(config.model.dtype),
                  "compute_dtype": dtype_name(engine.model.compute_dtype),
                  "line": model_line(built.description, config.model.dtype,
                                     engine.model.compute_dtype)},
        "backends": {"prefill": engine.backend_class.get_name(),
                     "decode": engine.decode_backend_class.get_name()},
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "stop_token_ids": list(stop),
        "threads": threads.as_dict(),
    }


def run(args: argparse.Namespace) -> int:
    """Print the generated ids (or text) per prompt; with ``--json`` one JSON line last."""
    result = execute(args)
    if args.json:
        sys.stdout.write(json_text(result) + "\n")
        return 0
    for item in result["outputs"]:
        if "text" in item:
            print_text(item["text"])
        else:
            print_text(",".join(str(t) for t in item["generated_ids"]))
    return 0

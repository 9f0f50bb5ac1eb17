"""``python -m app kv-plan --config FILE.toml``: KV-cache groups, managers, page sizes, blocks.

The TOML file lists the model's layers and their KV-cache specs::

    [cache]                       # optional; block_size is every layer's default block size
    block_size = 16

    [plan]                        # optional; the command-line options override these
    memory = "80GiB"              # KV-cache budget: bytes, or a number with B/KB/MB/GB/KiB/MiB/GiB
    max_model_len = 32768         # per-request blocks and how many such requests fit
    max_num_batched_tokens = 8192 # tokens per step (sliding-window / chunked-local peaks)

    [defaults]                    # optional; given to every layer whose spec has the field
    dtype = "bfloat16"
    num_kv_heads = 8
    head_size = 128

    [[layers]]
    name = "model.layers.{i}.self_attn"  # "{i}" is replaced by each index
    count = 24                    # i = 0 .. 23; or: indices = [0, 6, 12]; or neither (one layer)
    spec = "full_attention"       # a kind below, or "package.module:SpecClass"
    # ... any field of the spec: sliding_window = 4096, head_size = 576, sink_len = 64 ...

Kinds: ``full_attention``, ``mla``, ``sliding_window``, ``sliding_window_mla``,
``chunked_local``, ``cross_attention``, ``sink_full_attention``, ``tq_full_attention``,
``hidden_state``, ``mamba`` (``shapes = [[...], ...]``, ``dtypes = [...]``), and
``indexer_keys`` (DeepSeek Sparse Attention's key cache, ``app.model.IndexerKeyCacheSpec``:
``head_size`` is ``index_head_dim``; bound in the active container's registry as a plugin
binds it). MLA kinds also take ``kv_lora_rank`` + ``qk_rope_head_dim`` instead of
``head_size``. Specs are registered and grouped in the active container, so a platform's
custom spec kinds work too. The plan shows each group's specs with their bytes per token, and
the bytes per token of the whole cache (``examples/kv_plan_deepseek_v32.toml``: a DeepSeek-V3.2
latent cache and its indexer keys in one group).
"""

from __future__ import annotations

import argparse
import math
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from app._files import load_toml
from app._imports import import_object
from app._validation import INT32_MAX, check_int
from app.commands._args import positive_int
from app.commands._kv_rows import AUXILIARY_SPECS
from app.commands._output import format_table, print_json, print_text

HELP = "plan the KV cache of a model: groups, managers, page sizes, blocks in a memory budget"

#: Spec kinds accepted in ``spec = "..."`` -> class in ``app.kvcache``.
SPEC_KINDS: dict[str, str] = {
    "full_attention": "FullAttentionSpec",
    "mla": "MLAAttentionSpec",
    "sliding_window": "SlidingWindowSpec",
    "sliding_window_mla": "SlidingWindowMLASpec",
    "chunked_local": "ChunkedLocalAttentionSpec",
    "cross_attention": "CrossAttentionSpec",
    "sink_full_attention": "SinkFullAttentionSpec",
    "tq_full_attention": "TQFullAttentionSpec",
    "hidden_state": "HiddenStateCacheSpec",
    "mamba": "MambaSpec",
}
#: Spec kinds defined outside ``app.kvcache`` (as a third party's are), by import path.
EXTERNAL_SPEC_KINDS: dict[str, str] = {
    "indexer_keys": "app.model.sparse.kv_spec:IndexerKeyCacheSpec",
}

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}
_UNITS_TEXT = "bytes or a number with B, KB, MB, GB, TB, KiB, MiB, GiB or TiB"
#: The largest memory budget accepted: 1 EiB (a finite, sane bound; no machine has more).
MAX_MEMORY = 2**60
#: Keys of a ``[[layers]]`` entry that are not spec fields.
_LAYER_KEYS = ("name", "count", "indices", "spec")
#: Tables of the file.
_TABLES = ("cache", "plan", "defaults", "layers")
_PLAN_KEYS = ("memory", "max_model_len", "max_num_batched_tokens")
#: Most layers the file may name (in all its ``[[layers]]`` entries), the longest layer name,
#: and the largest head size / rank accepted. A 100 KB file naming 100000 layers of 100 KB
#: names would otherwise expand to 10 GB of names.
_MAX_LAYERS = 100_000
_MAX_NAME_CHARS = 1024
_MAX_DIM = 2**16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--config`` (required), ``--memory``, ``--max-model-len``, ``--max-num-batched-tokens``."""
    parser.add_argument("--config", required=True, type=Path, help="the layers TOML file")
    parser.add_argument("--memory", default=None,
                        help="KV-cache memory budget, e.g. 40GiB (overrides [plan].memory)")
    parser.add_argument("--max-model-len", type=positive_int, default=None,
                        help="longest request, for per-request blocks (overrides [plan])")
    parser.add_argument("--max-num-batched-tokens", type=positive_int, default=None,
                        help="tokens per step, for windowed layers' peaks (overrides [plan])")


def parse_memory(value: object, where: str = "memory") -> int:
    """Bytes from an int or a string like ``"40GiB"``, ``"512 MB"``, ``"1e9"``: a whole number
    of bytes in ``[1, MAX_MEMORY]``. ``ValueError`` (``TypeError`` for a bool, a list ...)
    naming ``where`` (e.g. ``"kv.toml: plan.memory"`` or ``"--memory"``) otherwise."""
    allowed = f"{_UNITS_TEXT}, at most 1 EiB"
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise TypeError(f"{where}: expected a size ({allowed}), got {value!r} "
                        f"({type(value).__name__})")
    if isinstance(value, str):
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*", value,
                             flags=re.ASCII)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(f"{where}: cannot read {value!r}; use {_UNITS_TEXT}")
        number: float = float(match.group(1)) * _UNITS[match.group(2).lower()]
    else:
        number = value
    if isinstance(number, float) and not math.isfinite(number):
        raise ValueError(f"{where}: expected a finite size ({allowed}), got {value!r}")
    if not 1 <= number <= MAX_MEMORY:
        raise ValueError(f"{where}: expected a size of 1 B to 1 EiB ({allowed}), got {value!r}")
    return int(number)


def _spec_class(kind: object, where: str) -> type[Any]:
    import app.kvcache.specs as kv

    where = f"{where}.spec"
    if not isinstance(kind, str) or not kind:
        raise ValueError(f"{where}: expected a kind name, got {kind!r}; kinds: "
                         f"{', '.join([*SPEC_KINDS, *EXTERNAL_SPEC_KINDS])}")
    if kind in SPEC_KINDS:
        cls: type[Any] = getattr(kv, SPEC_KINDS[kind])
    elif kind in EXTERNAL_SPEC_KINDS:
        cls = import_object(EXTERNAL_SPEC_KINDS[kind])
    elif kind in SPEC_KINDS.values():
        cls = getattr(kv, kind)
    elif "." in kind or ":" in kind:
        try:
            cls = import_object(kind)
        except (ImportError, ValueError) as exc:
            raise ImportError(f"{where} = {kind!r} does not import: {exc}") from None
    else:
        raise ValueError(f"{where}: unknown spec kind {kind!r}; kinds: "
                         f"{', '.join([*SPEC_KINDS, *EXTERNAL_SPEC_KINDS])}, or "
                         f"'package.module:SpecClass'")
    if not (isinstance(cls, type) and issubclass(cls, kv.KVCacheSpec)):
        raise ValueError(f"{where}: {kind!r} is not a KVCacheSpec subclass")
    return cls


def _layer_names(entry: Mapping[str, Any], where: str) -> list[str]:
    name = entry.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}.name = {name!r}: expected a non-empty string")
    if len(name) > _MAX_NAME_CHARS:
        raise ValueError(f"{where}.name: {len(name)} characters; a layer name may have at most "
                         f"{_MAX_NAME_CHARS}")
    count, indices = entry.get("count"), entry.get("indices")
    if count is not None and indices is not None:
        raise ValueError(f"{where}: give 'count' or 'indices', not both")
    if count is None and indices is None:
        if "{i}" in name:
            raise ValueError(f"{where}: a name with '{{i}}' needs 'count' or 'indices'")
        return [name]
    if count is not None:
        indices = list(range(check_int(f"{where}.count", count, 1, _MAX_LAYERS)))
    if not isinstance(indices, list) or not indices:
        raise ValueError(f"{where}.indices = {indices!r}: expected a non-empty list of ints "
                         f"(the layer indices)")
    if len(indices) > _MAX_LAYERS:
        raise ValueError(f"{where}.indices: {len(indices)} entries; at most {_MAX_LAYERS}")
    for i, index in enumerate(indices):
        check_int(f"{where}.indices[{i}]", index, 0, INT32_MAX)
    if "{i}" not in name:
        raise ValueError(f"{where}: with 'count' or 'indices' the name needs '{{i}}'")
    return [name.replace("{i}", str(i)) for i in indices]


def _int_fields(cls: type[Any]) -> set[str]:
    """The spec's fields annotated ``int`` or ``int | None``."""
    return {f.name for f in attrs.fields(cls) if f.type in ("int", "int | None", int)}


def _cache_dtype_fields(cls: type[Any], given: dict[str, Any], kv_cache_dtype: str) -> None:
    """``[cache] kv_cache_dtype`` on an MLA layer that does not name its own
    ``cache_dtype_str``: the FP8 dtypes store the layer in FP8 (``app.kvcache.cache_dtypes``;
    ``fp8_ds_mla``: 656-byte rows at 512 + 64)."""
    fields = {f.name for f in attrs.fields(cls)}
    if kv_cache_dtype == "auto" or "cache_dtype_str" not in fields \
            or "cache_dtype_str" in given:
        return
    given["cache_dtype_str"] = kv_cache_dtype
    given.setdefault("dtype", "uint8" if kv_cache_dtype == "fp8_ds_mla" else "fp8")


def _build_spec(cls: type[Any], entry: Mapping[str, Any], defaults: Mapping[str, Any],
                block_size: int, where: str, kv_cache_dtype: str = "auto") -> Any:
    fields = {f.name for f in attrs.fields(cls)}
    given = {k: v for k, v in entry.items() if k not in _LAYER_KEYS}
    if "kv_lora_rank" in given or "qk_rope_head_dim" in given:
        if "head_size" in given:
            raise ValueError(f"{where}: give head_size or kv_lora_rank + qk_rope_head_dim")
        for key in ("kv_lora_rank", "qk_rope_head_dim"):
            if key not in given:
                raise ValueError(f"{where}: {key} is missing (MLA head_size is "
                                 f"kv_lora_rank + qk_rope_head_dim)")
        rope = check_int(f"{where}.qk_rope_head_dim", given.pop("qk_rope_head_dim"), 0,
                         _MAX_DIM)
        given["head_size"] = (
            check_int(f"{where}.kv_lora_rank", given.pop("kv_lora_rank"), 1, _MAX_DIM) + rope)
        if "qk_rope_head_dim" in fields:   # an MLA spec keeps it (fp8_ds_mla rows need it)
            given["qk_rope_head_dim"] = rope
    _cache_dtype_fields(cls, given, kv_cache_dtype)
    unknown = sorted(set(given) - fields)
    if unknown:
        raise ValueError(f"{where}: {cls.__name__} has no field(s) {unknown}; "
                         f"fields: {sorted(fields)}")
    kwargs = {k: v for k, v in defaults.items() if k in fields}
    kwargs.setdefault("block_size", block_size)
    kwargs.update(given)
    for key in sorted(_int_fields(cls) & set(kwargs)):
        if key in given:
            check_int(f"{where}.{key}", kwargs[key], 1, INT32_MAX)
        elif key in defaults:
            check_int(f"{where} (from defaults.{key})", kwargs[key], 1, INT32_MAX)
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        raise type(exc)(f"{where}: cannot build {cls.__name__}: {exc}") from None


def _table(value: object, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{where} = {value!r}: expected a table")
    return value


def load_plan_config(path: Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """Read the TOML file: ``({layer_name: spec}, plan_options)``. Every bad key or value
    raises one ``ValueError``/``TypeError``/``ImportError`` naming the file, the key, the value
    and what is allowed."""
    from app.config import CacheConfig

    data = load_toml(path, "config file")
    unknown = sorted(set(data) - set(_TABLES))
    if unknown:
        raise ValueError(f"{path}: unknown table(s) {unknown}; allowed: {', '.join(_TABLES)}")
    try:
        cache = CacheConfig(**_table(data.get("cache", {}), f"{path}: cache"))
    except TypeError as exc:
        raise TypeError(f"{path}: [cache]: {exc}") from None
    except ValueError as exc:
        raise ValueError(f"{path}: [cache]: {exc}") from None
    plan = dict(_table(data.get("plan", {}), f"{path}: plan"))
    bad_plan = sorted(set(plan) - set(_PLAN_KEYS))
    if bad_plan:
        raise ValueError(f"{path}: unknown [plan] key(s) {bad_plan}; allowed: "
                         f"{', '.join(_PLAN_KEYS)}")
    if "memory" in plan:
        plan["memory"] = parse_memory(plan["memory"], f"{path}: plan.memory")
    for key in ("max_model_len", "max_num_batched_tokens"):
        if key in plan:
            check_int(f"{path}: plan.{key}", plan[key], 1, INT32_MAX)
    plan["cache"] = cache
    defaults = _table(data.get("defaults", {}), f"{path}: defaults")
    layers = data.get("layers")
    if not isinstance(layers, list) or not layers:
        raise ValueError(f"{path}: no [[layers]] entries")
    specs: dict[str, Any] = {}
    for index, entry in enumerate(layers):
        where = f"{path}: layers[{index}]"
        names = _layer_names(_table(entry, where), where)
        if len(specs) + len(names) > _MAX_LAYERS:
            raise ValueError(f"{where}: the file names more than {_MAX_LAYERS} layers in all")
        cls = _spec_class(entry.get("spec"), where)
        spec = _build_spec(cls, entry, defaults, cache.block_size, where,
                           cache.kv_cache_dtype)
        for name in names:
            if name in specs:
                raise ValueError(f"{where}: layer {name!r} is listed twice")
            specs[name] = spec
    return specs, plan


def make_plan(specs: Mapping[str, Any], *, memory: int | None = None,
              max_model_len: int | None = None,
              max_num_batched_tokens: int | None = None) -> dict[str, Any]:
    """Groups, managers and page sizes of ``specs``; blocks in ``memory``; per-request needs."""
    from app.commands._kv_rows import count_layers
    from app.kvcache.grouping import get_kv_cache_bytes_per_block, get_kv_cache_groups
    from app.kvcache.specs import SinkFullAttentionSpec, spec_summary
    from app.model.sparse.kv_spec import IndexerKeyCacheSpec, register_indexer_key_cache_spec
    from app.seed_api import KVCacheSpecRegistry

    bindings = KVCacheSpecRegistry.bindings()  # the active container's
    if any(isinstance(spec, IndexerKeyCacheSpec) for spec in specs.values()):
        register_indexer_key_cache_spec(bindings)
    groups = get_kv_cache_groups(specs, bindings)
    bytes_per_block = get_kv_cache_bytes_per_block(groups)
    plan: dict[str, Any] = {"num_layers": count_layers(Counter(type(s).__name__
                                                           for s in specs.values())),
                            "num_specs": len(specs), "groups": [],
                            "bytes_per_block": bytes_per_block,
                            "bytes_per_token": sum(_group_bytes_per_token(g) for g in groups)}
    reserved = 0
    per_request = 0
    for group_id, group in enumerate(groups):
        manager = bindings.get_manager_class(group.kv_cache_spec)
        info: dict[str, Any] = {
            "group": group_id,
            "manager": None if manager is None else manager.__name__,
            "spec": spec_summary(group.kv_cache_spec),
            "num_layers": count_layers(Counter(type(s).__name__ for s in group.layer_specs)),
            "num_specs": len(group.layer_names),
            "layers": list(group.layer_names),
            "block_size": group.block_size,
            "page_size_bytes_per_layer": sorted({s.page_size_bytes for s in group.layer_specs}),
            "bytes_per_token_per_layer": sorted({s.page_size_bytes // group.block_size
                                                 for s in group.layer_specs}),
            "bytes_per_token": _group_bytes_per_token(group),
            "specs": _spec_breakdown(group),
        }
        if isinstance(group.kv_cache_spec, SinkFullAttentionSpec):
            reserved += group.kv_cache_spec.sink_len // group.block_size
        if max_model_len is not None:
            blocks = max(spec.max_num_blocks_per_request(
                max_model_len, max_num_batched_tokens=max_num_batched_tokens)
                for spec in group.layer_specs)
            info["blocks_per_request"] = blocks
            per_request += blocks
        plan["groups"].append(info)
    if max_model_len is not None:
        plan["max_model_len"] = max_model_len
        plan["max_num_batched_tokens"] = max_num_batched_tokens
        plan["blocks_per_request"] = per_request
        plan["bytes_per_request"] = per_request * bytes_per_block
    if memory is not None:
        num_blocks = memory // bytes_per_block if bytes_per_block else 0
        usable = max(num_blocks - 1 - reserved, 0)
        plan.update({"memory_bytes": memory, "num_blocks": num_blocks,
                     "usable_blocks": usable, "reserved_blocks": reserved})
        if max_model_len is not None and per_request:
            plan["max_concurrent_requests"] = usable // per_request
    return plan


def _group_bytes_per_token(group: Any) -> float:
    """Bytes one token costs in a group (over its layers; a Mamba state is per request, 0)."""
    from app.kvcache.specs import MambaSpec

    return float(sum(spec.page_size_bytes / spec.block_size for spec in group.layer_specs
                     if not isinstance(spec, MambaSpec)))


def _spec_breakdown(group: Any) -> list[dict[str, Any]]:
    """Each distinct spec type of a group: its layers, page and bytes per token per layer, and
    a token's row (its real bytes and layout: ``app.commands._kv_rows.token_row``)."""
    from app.commands._kv_rows import token_row

    out: dict[str, dict[str, Any]] = {}
    for spec in group.layer_specs:
        entry = out.setdefault(type(spec).__name__, {
            "type": type(spec).__name__, "num_layers": 0, "page_size_bytes": spec.page_size_bytes,
            "bytes_per_token_per_layer": spec.page_size_bytes / spec.block_size,
            "row": token_row(spec)})
        entry["num_layers"] += 1
    return list(out.values())


def _human(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{n} B"
        size /= 1024
    return f"{n} B"  # pragma: no cover


def _layers_line(plan: dict[str, Any]) -> str:
    """``61 layers, 122 KV-cache specs (61 IndexerKeyCacheSpec: ...) in 1 KV-cache group(s)``;
    the specs are said only where they are more than the layers."""
    if plan["num_specs"] == plan["num_layers"]:
        return f"{plan['num_layers']} layers in {len(plan['groups'])} KV-cache group(s)"
    aux: Counter[str] = Counter()
    for g in plan["groups"]:
        aux.update({s["type"]: s["num_layers"] for s in g["specs"]
                    if s["type"] in AUXILIARY_SPECS})
    return (f"{plan['num_layers']} layers, {plan['num_specs']} KV-cache specs ("
            + ", ".join(f"{n} {name}" for name, n in aux.items())
            + f": a cache beside a layer's own, not a layer) in {len(plan['groups'])} KV-cache "
              "group(s)")


def _spec_bytes(entry: dict[str, Any]) -> str:
    """``656 B/token per layer: 512 e4m3 + 4 float32 scales + 64 bfloat16 rope``."""
    from app.commands._kv_rows import row_text

    per_token, row = entry["bytes_per_token_per_layer"], entry["row"]
    text = f"{per_token:g} B/token per layer"
    if row is None:
        return text
    if row["bytes"] == per_token:
        return f"{text}: {row['layout']}"
    return f"{text} with padding; a token's row: {row_text(row)}"


def render_plan(plan: dict[str, Any]) -> str:
    """The plan as text."""
    rows = []
    for g in plan["groups"]:
        layers = g["layers"]
        count = (f"{len(layers)}" if g["num_specs"] == g["num_layers"]
                 else f"{g['num_specs']} specs of {g['num_layers']} layers")
        shown = ", ".join(layers[:2]) + (f", ... ({count})" if len(layers) > 2 else "")
        row = [g["group"], g["manager"], g["spec"]["type"], g["block_size"],
               "/".join(str(p) for p in g["page_size_bytes_per_layer"]),
               "/".join(str(p) for p in g["bytes_per_token_per_layer"]), shown]
        if "blocks_per_request" in g:
            row.append(g["blocks_per_request"])
        rows.append(row)
    headers = ["group", "manager", "spec", "block", "page B/layer", "B/token/layer", "layers"]
    if "max_model_len" in plan:
        headers.append("blocks/request")
    lines = [_layers_line(plan),
             format_table(headers, rows),
             f"bytes per block (all groups): {plan['bytes_per_block']} "
             f"({_human(plan['bytes_per_block'])}); bytes per token: "
             f"{plan['bytes_per_token']:g}"]
    for g in plan["groups"]:
        lines.append(f"group {g['group']}: " + "; ".join(
            f"{s['num_layers']} x {s['type']} ({_spec_bytes(s)})" for s in g["specs"]))
    if "max_model_len" in plan:
        lines.append(f"a request of {plan['max_model_len']} tokens holds at most "
                     f"{plan['blocks_per_request']} blocks ({_human(plan['bytes_per_request'])})")
    if "memory_bytes" in plan:
        lines.append(f"budget {_human(plan['memory_bytes'])}: {plan['num_blocks']} blocks, "
                     f"{plan['usable_blocks']} usable (block 0 is the null block"
                     + (f", {plan['reserved_blocks']} reserved for sinks" if
                        plan["reserved_blocks"] else "") + ")")
        if "max_concurrent_requests" in plan:
            lines.append(f"max concurrent requests of {plan['max_model_len']} tokens: "
                         f"{plan['max_concurrent_requests']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Load the file, plan, print."""
    specs, options = load_plan_config(args.config)
    memory = (parse_memory(args.memory, "--memory") if args.memory is not None
              else options.get("memory"))
    max_model_len = (args.max_model_len if args.max_model_len is not None
                     else options.get("max_model_len"))
    batched = (args.max_num_batched_tokens if args.max_num_batched_tokens is not None
               else options.get("max_num_batched_tokens"))
    plan = make_plan(specs, memory=memory, max_model_len=max_model_len,
                     max_num_batched_tokens=batched)
    plan["config"] = str(args.config)
    if args.json:
        print_json(plan)
    else:
        print_text(render_plan(plan))
    return 0

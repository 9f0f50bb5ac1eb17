"""Loading a Hugging Face DeepSeek-V2/V3 checkpoint with ``safetensors``.

``load_checkpoint(directory, dtype=None, progress=None)`` reads ``config.json``
(``DeepseekConfig``), finds the weights (``model.safetensors.index.json`` and its shards, or
one ``*.safetensors`` file), and checks *everything* before it allocates anything: every
tensor a file holds maps onto the model (``weight_specs``) with the right shape and a supported
dtype (F32, F16, BF16; F8_E4M3 with its ``weight_scale_inv`` when ``config.json`` has an FP8
``quantization_config``), every tensor the model needs is there exactly once, and the index
agrees with the files. A problem is a ``ValueError`` naming the tensor and the file.

A checkpoint directory may come from anywhere, so nothing in it can hang the process, exhaust
memory or read outside it: every JSON file (``config.json``, the index,
``generation_config.json``) is read only when it is a regular file of bounded size
(``app._files.load_json``: never a FIFO or a device; a symbolic link to a regular file, as the
Hub's cache lays out its snapshots, is followed); a ``*.safetensors`` file is opened only when it
is a regular file; shards are named by the index as plain file names in the directory; the
config's counts (layers, experts) are checked against the tensors the files hold before any
per-layer or per-expert work, so every size is bounded by what is on disk before anything is
allocated. ``check_checkpoint`` runs all of these checks without loading.

Accepted layouts: the Hub's (one tensor per projection and per expert, ``gate_proj`` and
``up_proj`` apart), and transformers 5's stacked experts (``mlp.experts.gate_up_proj``,
``mlp.experts.down_proj``). Multi-token-prediction layers (``model.layers.{N}`` and up, with
``num_nextn_predict_layers``) are skipped and counted; this engine does not run them.

Then tensor by tensor: each file is memory-mapped by ``safetensors``, each tensor copied (and
converted, or FP8-dequantized) straight into its slot of the model's preallocated tensors; the
file is reopened every ``REOPEN_BYTES`` so the pages already copied leave the resident set.
Peak RSS during the load is measured (``LoadReport``): about the model's size plus one
window.

FP8 e4m3 block quantization as DeepSeek-V3 ships it: a quantized ``W [out, in]`` is stored as
``float8_e4m3fn`` next to ``weight_scale_inv [ceil(out / bo), ceil(in / bi)]`` (float32):
block ``(i, j)`` of ``(bo, bi)`` elements dequantizes as ``fp8 * scale_inv[i, j]`` (the last
blocks may be partial). ``dequantize_fp8_block`` does that into a destination of any float
dtype, a few rows at a time (a bounded float32 temporary, whatever the block size);
``quantize_fp8_block`` is its inverse up to e4m3 rounding (absmax scaling to 448, e4m3's
largest finite value), for making FP8 copies of checkpoints. Both live in
``app.model.weights`` (the format of a weight) and are re-exported here.
"""

from __future__ import annotations

import logging
import os
import re
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch

from app._files import file_kind, load_json
from app.model.config import DeepseekConfig, parse_token_ids
from app.model.weights import (
    FP8_E4M3_MAX,
    ModelWeights,
    WeightSpec,
    dequantize_fp8_block,
    quantize_fp8_block,
    scale_shape,
    weight_specs,
)

__all__ = ["FP8_E4M3_MAX", "MAX_INDEX_BYTES", "REOPEN_BYTES", "LoadReport", "LoadedCheckpoint",
           "check_checkpoint", "dequantize_fp8_block", "load_checkpoint", "quantize_fp8_block",
           "read_rss", "scale_shape"]

logger = logging.getLogger(__name__)

#: Bytes read from one file between reopenings (drops the mapped pages from the RSS).
REOPEN_BYTES = 64 << 20
#: The largest ``model.safetensors.index.json`` read (DeepSeek-V3's, 163 shards and ~92k
#: tensors, is ~9 MB).
MAX_INDEX_BYTES = 64 << 20
_INDEX = "model.safetensors.index.json"
_DTYPES = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "F8_E4M3": torch.float8_e4m3fn}
_ITEM_BYTES = {"F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1}
# At most 9 digits: a longer index is no layer or expert of any model (and int() of thousands
# of digits is refused by Python itself).
_LAYER = re.compile(r"^model\.layers\.(\d{1,9})\.(.+)$")
_EXPERT = re.compile(r"^mlp\.experts\.(\d{1,9})\.(gate_proj|up_proj|down_proj)\.weight$")
_STACKED = re.compile(r"^mlp\.experts\.(gate_up_proj|down_proj)$")
_SPLIT = re.compile(r"^mlp\.(shared_experts\.)?(gate_proj|up_proj)\.weight$")


def read_rss() -> tuple[int, int]:
    """(current RSS, peak RSS) of this process in bytes, from ``/proc/self/status`` (0, 0
    where there is none)."""
    values = {"VmRSS": 0, "VmHWM": 0}
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                key, _, rest = line.partition(":")
                if key in values:
                    values[key] = int(rest.split()[0]) * 1024
    except OSError:
        pass
    return values["VmRSS"], values["VmHWM"]


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


@attrs.frozen
class LoadReport:
    """What a load did: files, tensors, MTP tensors skipped, bytes, seconds, and the RSS before
    the load and at its peak (``peak_rss_is_load_peak``: the kernel's high-water mark was reset
    at the start; otherwise it is the process's peak)."""

    path: str
    files: tuple[str, ...]
    tensors: int
    skipped_mtp_tensors: int
    skipped_mtp_layers: tuple[int, ...]
    checkpoint_bytes: int
    model_bytes: int
    dtype: str
    fp8_tensors: int
    seconds: float
    rss_before: int
    peak_rss: int
    peak_rss_is_load_peak: bool

    @property
    def peak_rss_ratio(self) -> float:
        """(peak RSS - RSS before) / the loaded model's bytes."""
        return (self.peak_rss - self.rss_before) / self.model_bytes if self.model_bytes else 0.0

    def describe(self) -> dict[str, Any]:
        """JSON-friendly, with the ratio."""
        return {**attrs.asdict(self), "peak_rss_ratio": round(self.peak_rss_ratio, 4)}


@attrs.frozen(eq=False)
class LoadedCheckpoint:
    """The weights, the load report, the eos tokens (``generation_config.json``, else
    ``config.json``) and the ``tokenizer.json`` path when the directory has one."""

    weights: ModelWeights
    report: LoadReport
    eos_token_ids: tuple[int, ...]
    tokenizer_path: Path | None

    @property
    def config(self) -> DeepseekConfig:
        """The architecture."""
        return self.weights.config


@attrs.frozen
class _Entry:
    key: str
    file: Path
    shape: tuple[int, ...]
    dtype: str


@attrs.frozen
class _Piece:
    """Where a checkpoint tensor goes: ``dest[expert][rows]`` (None: the whole dim)."""

    dest: str
    part: object
    expert: int | None
    rows: tuple[int, int] | None
    shape: tuple[int, ...]


def _present(path: Path) -> bool:
    """Whether anything is at ``path`` (a dangling symbolic link too: reading it then says
    what is wrong)."""
    return path.exists() or path.is_symlink()


def _check_regular(path: Path, what: str) -> None:
    """``ValueError`` unless ``path`` is a regular file (a link to one is followed): a FIFO
    would block the open forever, a device never ends."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise ValueError(f"{path}: {what} cannot be read: {exc.strerror or exc}") from None
    if not stat.S_ISREG(mode):
        raise ValueError(f"{path}: {what} is {file_kind(mode)}, not a regular file")


def _files(directory: Path) -> tuple[list[Path], dict[str, str] | None]:
    index = directory / _INDEX
    if _present(index):
        return _indexed_files(directory, index)
    single = directory / "model.safetensors"
    files = [single] if _present(single) else sorted(directory.glob("*.safetensors"))
    if len(files) != 1:
        raise ValueError(f"{directory}: expected model.safetensors, or "
                         f"{_INDEX} with its shards; found {[f.name for f in files]}")
    _check_regular(files[0], "the safetensors file")
    return files, None


def _indexed_files(directory: Path, index: Path) -> tuple[list[Path], dict[str, str]]:
    raw = load_json(index, "safetensors index", limit=MAX_INDEX_BYTES)
    weight_map = raw.get("weight_map") if isinstance(raw, dict) else None
    if not isinstance(weight_map, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()):
        raise ValueError(f"{index}: weight_map must be a JSON object mapping tensor names to "
                         f"file names")
    if not weight_map:
        raise ValueError(f"{index}: weight_map is empty: the index lists no tensors")
    names = sorted(set(weight_map.values()))
    for name in names:
        if Path(name).name != name or name in (".", "..") or not _present(directory / name):
            raise ValueError(f"{index}: shard {name!r} is not a file in {directory}")
        _check_regular(directory / name, f"shard {name!r} of {_INDEX}")
    return [directory / n for n in names], weight_map


def _entries(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, _Entry]:
    from safetensors import SafetensorError, safe_open

    entries: dict[str, _Entry] = {}
    for path in files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                    view = f.get_slice(key)
                    if key in entries:
                        raise ValueError(f"{path}: tensor {key!r} is also in "
                                         f"{entries[key].file}")
                    entries[key] = _Entry(key, path, tuple(view.get_shape()),
                                          str(view.get_dtype()))
        except (SafetensorError, OSError) as exc:
            raise ValueError(f"{path}: not a readable safetensors file: {exc}") from None
    if not entries:
        raise ValueError(f"{files[0].parent}: the checkpoint holds no tensors (files: "
                         f"{[f.name for f in files]})")
    if weight_map is not None:
        index = files[0].parent / _INDEX
        for key, name in weight_map.items():
            entry = entries.get(key)
            if entry is None or entry.file.name != name:
                where = "in no file" if entry is None else f"in {entry.file.name}"
                raise ValueError(f"{index}: tensor {key!r} is listed in {name} but is {where}")
        unlisted = sorted(set(entries) - set(weight_map))
        if unlisted:
            more = f" (and {len(unlisted) - 1} more)" if len(unlisted) > 1 else ""
            raise ValueError(f"{index}: tensor {unlisted[0]!r}{more} is in "
                             f"{entries[unlisted[0]].file.name} but not in the index's "
                             f"weight_map")
    return entries


def _check_counts(config: DeepseekConfig, entries: dict[str, _Entry], source: Path) -> None:
    """``ValueError`` naming ``config.json``'s key when it counts more decoder layers or
    routed experts than the files hold tensors for: every per-layer and per-expert structure
    is sized from the config, so this bounds them by what is on disk before any is built."""
    layers: set[int] = set()
    experts = 0
    for key, entry in entries.items():
        match = _LAYER.match(key)
        if match is None:
            continue
        layers.add(int(match.group(1)))
        expert = _EXPERT.match(match.group(2))
        if expert is not None:
            experts = max(experts, int(expert.group(1)) + 1)
        elif _STACKED.match(match.group(2)) and entry.shape:
            experts = max(experts, entry.shape[0])
    n = config.num_hidden_layers
    if n > len(layers):
        held = f"layers {min(layers)}..{max(layers)}" if layers else "no decoder layer"
        raise ValueError(f"{source}: num_hidden_layers = {n}, but the checkpoint's tensors hold "
                         f"{len(layers)} decoder layer(s) ({held})")
    moe = config.moe
    if moe is not None and moe.n_routed_experts > experts and any(
            config.is_moe_layer(i) for i in range(n)):
        raise ValueError(f"{source}: n_routed_experts = {moe.n_routed_experts}, but the "
                         f"checkpoint's tensors hold {experts} routed expert(s) per MoE layer")


def _piece(key: str, specs: dict[str, WeightSpec], config: DeepseekConfig) -> _Piece | None:
    """Where checkpoint tensor ``key`` goes (None: nowhere, an extra tensor)."""
    match = _LAYER.match(key)
    if match is None:
        spec = specs.get(key)
        return None if spec is None else _Piece(key, "all", None, None, spec.shape)
    layer, rest = match.group(1), match.group(2)
    prefix = f"model.layers.{layer}"
    expert = _EXPERT.match(rest)
    if expert is not None:
        e, proj = int(expert.group(1)), expert.group(2)
        dest = f"{prefix}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"
        spec = specs.get(dest)
        if spec is None or e >= spec.shape[0]:
            return None
        if proj == "down_proj":
            return _Piece(dest, (e, "down"), e, None, spec.shape[1:])
        inter = spec.shape[1] // 2
        rows = (0, inter) if proj == "gate_proj" else (inter, 2 * inter)
        return _Piece(dest, (e, proj), e, rows, (inter, spec.shape[2]))
    split = _SPLIT.match(rest)
    if split is not None:
        dest = f"{prefix}.mlp.{split.group(1) or ''}gate_up_proj.weight"
        spec = specs.get(dest)
        if spec is None:
            return None
        inter = spec.shape[0] // 2
        rows = (0, inter) if split.group(2) == "gate_proj" else (inter, 2 * inter)
        return _Piece(dest, split.group(2), None, rows, (inter, spec.shape[1]))
    spec = specs.get(key)
    return None if spec is None else _Piece(key, "all", None, None, spec.shape)


def _required_parts(name: str, spec: WeightSpec) -> dict[object, str]:
    """The parts a tensor of the model is assembled from, each with its Hub checkpoint name."""
    if name.endswith("mlp.experts.gate_up_proj"):
        base = name.removesuffix(".gate_up_proj")
        return {(e, p): f"{base}.{e}.{p}.weight" for e in range(spec.shape[0])
                for p in ("gate_proj", "up_proj")}
    if name.endswith("mlp.experts.down_proj"):
        base = name.removesuffix(".down_proj")
        return {(e, "down"): f"{base}.{e}.down_proj.weight" for e in range(spec.shape[0])}
    if name.endswith("gate_up_proj.weight"):
        return {p: name.replace("gate_up_proj", p) for p in ("gate_proj", "up_proj")}
    return {"all": name}


@attrs.frozen
class _Plan:
    pieces: dict[str, tuple[_Piece, str | None]]   # key -> (piece, its scale key)
    skipped: tuple[str, ...]
    skipped_layers: tuple[int, ...]


def _plan(config: DeepseekConfig, entries: dict[str, _Entry]) -> _Plan:
    specs = weight_specs(config)
    n = config.num_hidden_layers
    pieces: dict[str, tuple[_Piece, str | None]] = {}
    skipped: list[str] = []
    skipped_layers: set[int] = set()
    scales = {k for k in entries if k.endswith(".weight_scale_inv")}
    covered: dict[str, dict[object, str]] = {}
    for key, entry in sorted(entries.items()):
        if key in scales:
            continue
        layer = _LAYER.match(key)
        if layer is not None and n <= int(layer.group(1)) < n + config.num_nextn_predict_layers:
            skipped.append(key)
            skipped_layers.add(int(layer.group(1)))
            continue
        piece = _piece(key, specs, config)
        if piece is None:
            raise ValueError(f"{entry.file}: tensor {key!r} is not part of this "
                             f"{config.architecture} ({n} layers"
                             + (", tied LM head" if config.tie_word_embeddings else "") + ")")
        if entry.shape != piece.shape:
            raise ValueError(f"{entry.file}: tensor {key!r} has shape {list(entry.shape)}, "
                             f"the config says {list(piece.shape)}")
        scale = _check_dtype(config, entry, entries)
        parts = covered.setdefault(piece.dest, {})
        if piece.part in parts or "all" in parts or (piece.part == "all" and parts):
            other = parts.get(piece.part) or next(iter(parts.values()))
            raise ValueError(f"{entry.file}: tensor {key!r} holds weights that {other!r} "
                             f"holds too ({piece.dest})")
        parts[piece.part] = key
        pieces[key] = (piece, scale)
    used_scales = {s for _, s in pieces.values() if s is not None}
    skipped_set = set(skipped)
    for key in sorted(scales - used_scales):
        base = key.removesuffix("_scale_inv")
        if base in skipped_set:
            skipped.append(key)
        else:
            raise ValueError(f"{entries[key].file}: tensor {key!r} scales {base!r}, which is "
                             "not an FP8 weight of this model")
    for name, spec in specs.items():
        parts = covered.get(name, {})
        if "all" in parts:
            continue
        required = _required_parts(name, spec)
        missing = [key for part, key in required.items() if part not in parts]
        if missing:
            files = sorted({e.file.name for e in entries.values()})
            more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
            raise ValueError(f"tensor {missing[0]!r}{more} is missing: it is in none of "
                             f"{files} ({next(iter(entries.values())).file.parent})")
    return _Plan(pieces, tuple(skipped), tuple(sorted(skipped_layers)))


def _check_dtype(config: DeepseekConfig, entry: _Entry, entries: dict[str, _Entry]
                 ) -> str | None:
    """The scale key of an FP8 tensor (None for others); ``ValueError`` for a dtype this
    loader does not read."""
    if entry.dtype not in _DTYPES:
        raise ValueError(f"{entry.file}: tensor {entry.key!r} has dtype {entry.dtype}; "
                         f"supported: {sorted(_DTYPES)}")
    if entry.dtype != "F8_E4M3":
        return None
    q = config.quantization
    if q is None:
        raise ValueError(f"{entry.file}: tensor {entry.key!r} is F8_E4M3 but config.json has "
                         "no FP8 quantization_config")
    scale_key = entry.key.removesuffix("weight") + "weight_scale_inv"
    scale = entries.get(scale_key)
    if len(entry.shape) != 2 or not entry.key.endswith(".weight") or scale is None:
        raise ValueError(f"{entry.file}: FP8 tensor {entry.key!r} needs a 2-D weight and its "
                         f"{scale_key!r} (block-quantized FP8)")
    want = scale_shape((entry.shape[0], entry.shape[1]), (q.block_out, q.block_in))
    if scale.shape != want or scale.dtype not in ("F32", "BF16"):
        raise ValueError(f"{scale.file}: tensor {scale_key!r} is {scale.dtype} "
                         f"{list(scale.shape)}; a {list(entry.shape)} weight in "
                         f"[{q.block_out}, {q.block_in}] blocks needs F32 {list(want)}")
    return scale_key


def _eos(directory: Path, config: DeepseekConfig) -> tuple[int, ...]:
    """``generation_config.json``'s ``eos_token_id`` (the config's when the file is absent or
    the key null); ``ValueError`` naming the file and the key for a bad one."""
    path = directory / "generation_config.json"
    if not _present(path):
        return config.eos_token_ids
    raw = load_json(path, "generation_config.json")
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    if raw.get("eos_token_id") is None:
        return config.eos_token_ids
    return parse_token_ids(raw["eos_token_id"], f"{path}: eos_token_id")


@attrs.frozen(eq=False)
class _Checked:
    """What the checks before any allocation found (``_check``)."""

    directory: Path
    config: DeepseekConfig
    files: list[Path]
    entries: dict[str, _Entry]
    plan: _Plan
    eos_token_ids: tuple[int, ...]


def _check(directory: str | Path) -> _Checked:
    directory = Path(directory)
    if not directory.is_dir():
        raise ValueError(f"{directory}: not a directory (a Hugging Face checkpoint directory "
                         "holds config.json and *.safetensors)")
    config_path = directory / "config.json"
    config = DeepseekConfig.from_json_file(config_path)
    files, weight_map = _files(directory)
    entries = _entries(files, weight_map)
    _check_counts(config, entries, config_path)
    plan = _plan(config, entries)
    return _Checked(directory, config, files, entries, plan, _eos(directory, config))


def check_checkpoint(directory: str | Path) -> DeepseekConfig:
    """Run every check ``load_checkpoint`` makes before it allocates anything (the JSON
    files, the files' kinds, the index against the shards, the config's counts against the
    tensors, every tensor's name, shape and dtype) without loading a weight; the model's
    architecture. ``ValueError`` as ``load_checkpoint``."""
    return _check(directory).config


def load_checkpoint(directory: str | Path, dtype: torch.dtype | None = None, *,
                    progress: Callable[[int, int], None] | None = None) -> LoadedCheckpoint:
    """Load the checkpoint in ``directory`` into ``dtype`` (default: the checkpoint's dtype;
    bfloat16 for FP8 or when unstated); ``progress(bytes_read, total_bytes)`` after each
    tensor. See the module docstring for what is checked first."""
    start = time.perf_counter()
    checked = _check(directory)
    directory, config, files = checked.directory, checked.config, checked.files
    entries, plan = checked.entries, checked.plan
    target = dtype or config.dtype or torch.bfloat16
    if target not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"load_checkpoint: dtype must be float32, float16 or bfloat16, "
                         f"got {target}")
    rss_before, _ = read_rss()
    reset = _reset_peak_rss()
    specs = weight_specs(config)
    tensors = {name: torch.empty(spec.shape, dtype=torch.float32 if spec.float32 else target)
               for name, spec in specs.items()}
    total = sum(_bytes(entries[k]) + (_bytes(entries[s]) if s else 0)
                for k, (_, s) in plan.pieces.items())
    done = 0
    by_file: dict[Path, list[str]] = {}
    for key in plan.pieces:
        by_file.setdefault(entries[key].file, []).append(key)
    for path, keys in by_file.items():
        done = _copy_file(path, keys, plan, entries, tensors, config, done, total, progress)
    weights = ModelWeights.from_tensors(config, tensors)
    _, peak = read_rss()
    if plan.skipped:
        logger.info("skipped %d tensors of %d multi-token-prediction layer(s) %s "
                    "(num_nextn_predict_layers=%d): this engine does not run MTP",
                    len(plan.skipped), len(plan.skipped_layers), list(plan.skipped_layers),
                    config.num_nextn_predict_layers)
    report = LoadReport(
        path=str(directory), files=tuple(p.name for p in files), tensors=len(plan.pieces),
        skipped_mtp_tensors=len(plan.skipped), skipped_mtp_layers=plan.skipped_layers,
        checkpoint_bytes=sum(p.stat().st_size for p in files), model_bytes=weights.nbytes,
        dtype=str(target).removeprefix("torch."),
        fp8_tensors=sum(1 for _, s in plan.pieces.values() if s is not None),
        seconds=round(time.perf_counter() - start, 3), rss_before=rss_before, peak_rss=peak,
        peak_rss_is_load_peak=reset)
    tokenizer = directory / "tokenizer.json"
    return LoadedCheckpoint(weights=weights, report=report, eos_token_ids=checked.eos_token_ids,
                            tokenizer_path=tokenizer if tokenizer.is_file() else None)


def _bytes(entry: _Entry) -> int:
    n = _ITEM_BYTES.get(entry.dtype, 1)
    for size in entry.shape:
        n *= size
    return n


def _copy_file(path: Path, keys: list[str], plan: _Plan, entries: dict[str, _Entry],
               tensors: dict[str, torch.Tensor], config: DeepseekConfig, done: int, total: int,
               progress: Callable[[int, int], None] | None) -> int:
    from safetensors import SafetensorError, safe_open

    window = 0
    handle: Any = None
    try:
        for key in keys:
            if handle is None or window >= REOPEN_BYTES:
                if handle is not None:
                    handle.__exit__(None, None, None)
                handle = safe_open(str(path), framework="pt")
                handle.__enter__()
                window = 0
            piece, scale_key = plan.pieces[key]
            dest = tensors[piece.dest]
            if piece.expert is not None:
                dest = dest[piece.expert]
            if piece.rows is not None:
                dest = dest[piece.rows[0]:piece.rows[1]]
            source = handle.get_tensor(key)
            if scale_key is not None and config.quantization is not None:
                scale = _scale(scale_key, entries, handle, path)
                dequantize_fp8_block(source, scale, (config.quantization.block_out,
                                                     config.quantization.block_in), dest)
                size = _bytes(entries[key]) + _bytes(entries[scale_key])
            else:
                dest.copy_(source)
                size = _bytes(entries[key])
            del source
            window += size
            done += size
            if progress is not None:
                progress(done, total)
    except SafetensorError as exc:
        raise ValueError(f"{path}: reading failed: {exc}") from None
    finally:
        if handle is not None:
            handle.__exit__(None, None, None)
    return done


def _scale(key: str, entries: dict[str, _Entry], handle: Any, path: Path) -> torch.Tensor:
    if entries[key].file == path:
        return handle.get_tensor(key)  # type: ignore[no-any-return]
    from safetensors import safe_open

    with safe_open(str(entries[key].file), framework="pt") as other:
        return other.get_tensor(key)  # type: ignore[no-any-return]

"""``python -m app backends``: every MLA backend, whether it is valid here, and why not.

Prints ``explain_mla_prefill_selection`` (``--kind decode``: ``explain_mla_decode_selection``;
``--kind all``: both) for the active container's config and platform as a table (``--json``:
the full explanation; with ``--kind all`` an object keyed by kind). ``--backend NAME`` shows an
explicit choice instead of the automatic one (of every kind shown), ``--query-len N`` the decode
selection for N tokens per request per step, ``--dtype`` changes the model dtype,
``--capability 10.0`` pretends to run on a CUDA GPU of that compute capability (``cpu`` on a
CPU), ``--mla-dimensions 192,64,256`` changes the model's MLA dimensions, ``--index-topk 2048``
makes the model sparse (DeepSeek Sparse Attention; ``--index-head-dim``, ``--index-n-heads``: its
indexer), ``--deployment FILE`` explains a deployment's container.
Exit status 0 when a backend is chosen (for every kind shown), 1 when none is.
"""

from __future__ import annotations

import argparse
from typing import Any

from app._types import DeviceCapability
from app.commands._args import add_kv_cache_dtype_argument, int_in
from app.commands._output import format_mapping, format_table, print_json, print_text

HELP = "show which MLA backends are valid here, why not, and which one is chosen"

KINDS = ("prefill", "decode")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """``--kind``, ``--backend``, ``--dtype``, ``--capability``, ``--deployment``,
    ``--mla-dimensions``, ``--query-len``."""
    parser.add_argument("--kind", choices=(*KINDS, "all"), default="prefill",
                        help="which backends: prefill (default), decode or all")
    parser.add_argument("--query-len", type=int_in(1, 16), default=1, metavar="N",
                        help="decode: tokens per request per step (1..16; default 1)")
    parser.add_argument("--backend", metavar="NAME", default=None,
                        help="an explicit backend (e.g. FLASHINFER) instead of auto selection")
    parser.add_argument("--dtype", default=None,
                        help="the model dtype (bfloat16, float16, float32 or an alias)")
    parser.add_argument("--capability", metavar="MAJOR.MINOR", default=None,
                        help="pretend to run on a CUDA GPU of this compute capability "
                             "(e.g. 9.0, 10.0), or 'cpu'")
    parser.add_argument("--deployment", metavar="FILE", default=None,
                        help="explain for this deployment file's container (app.deployment)")
    add_kv_cache_dtype_argument(parser)
    parser.add_argument("--mla-dimensions", metavar="NOPE,ROPE,V", default=None,
                        help="the model's qk_nope_head_dim,qk_rope_head_dim,v_head_dim "
                             "(e.g. 192,64,256)")
    _add_sparse_arguments(parser)


#: The sparse settings (DeepSeek Sparse Attention) -> ``ModelConfig`` field.
SPARSE_FLAGS = {"--index-topk": "index_topk", "--index-head-dim": "index_head_dim",
                "--index-n-heads": "index_n_heads"}


def _add_sparse_arguments(parser: argparse.ArgumentParser) -> None:
    from app.config import ModelConfig

    defaults = ModelConfig()
    parser.add_argument("--index-topk", type=int_in(1), default=None,
                        help="make the model sparse (DeepSeek Sparse Attention, as V3.2 and "
                             "GLM-5): each query attends to the N cached tokens its indexer "
                             "selects, e.g. 2048 (default: dense, or the --deployment file's)")
    parser.add_argument("--index-head-dim", type=int_in(1), default=None,
                        help="with --index-topk: the indexer's key width (default: "
                             f"{defaults.index_head_dim})")
    parser.add_argument("--index-n-heads", type=int_in(1), default=None,
                        help="with --index-topk: the indexer's heads (default: "
                             f"{defaults.index_n_heads})")


def _parse_capability(text: str) -> DeviceCapability | None:
    from app.platforms.detect import CAPABILITY_ALLOWED, parse_device_capability

    if text.strip().lower() == "cpu":
        return None
    try:
        return parse_device_capability(text.strip())
    except ValueError:
        raise ValueError(f"--capability {text!r}: expected 'cpu' or {CAPABILITY_ALLOWED}"
                         ) from None


def _parse_dimensions(text: str) -> dict[str, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 3 or not all(p.isascii() and p.isdigit() and len(p) < 7 for p in parts):
        raise ValueError(f"--mla-dimensions: expected three integers NOPE,ROPE,V "
                         f"(e.g. 128,64,128), got {text!r}")
    nope, rope, v = (int(p) for p in parts)
    return {"qk_nope_head_dim": nope, "qk_rope_head_dim": rope, "v_head_dim": v}


def _kinds(args: argparse.Namespace) -> list[str]:
    kind = getattr(args, "kind", "prefill")
    return list(KINDS) if kind == "all" else [kind]


def build_config(args: argparse.Namespace, base: Any) -> Any:
    """``base`` (an ``EngineConfig``) with the command-line changes applied. ``--backend`` must
    name a backend of every kind shown (``ValueError`` listing the valid names)."""
    from app.backends.registry import KINDS as BACKEND_KINDS
    from app.config import EngineConfig

    data = base.to_dict()
    if args.dtype is not None:
        data["model"]["dtype"] = args.dtype
    if args.mla_dimensions is not None:
        data["model"].update(_parse_dimensions(args.mla_dimensions))
    if getattr(args, "kv_cache_dtype", None) is not None:
        data["cache"]["kv_cache_dtype"] = args.kv_cache_dtype
    _apply_sparse(args, data["model"])
    if args.backend is not None:
        for name in _kinds(args):
            kind = BACKEND_KINDS[name]
            data["attention"][kind.config_field] = kind.catalog.resolve(args.backend)
    return EngineConfig.from_dict(data)


def _apply_sparse(args: argparse.Namespace, model: dict[str, Any]) -> None:
    """The sparse flags into ``model`` (a ``ModelConfig`` dict); ``ValueError`` for an indexer
    setting on a model that stays dense (it would be read by nothing)."""
    given = {field: getattr(args, field) for field in SPARSE_FLAGS.values()
             if getattr(args, field, None) is not None}
    model.update(given)
    if model.get("index_topk") is None and given:
        flags = [flag for flag, field in SPARSE_FLAGS.items() if field in given]
        raise ValueError(f"{', '.join(flags)}: an indexer setting of a sparse model; the model "
                         "is dense: add --index-topk N")


def build_container(args: argparse.Namespace) -> Any:
    """The container to explain: the deployment's (``--deployment``) or the active one; with
    ``--capability`` a fresh one (general plugins applied) on the pretend device."""
    from app import deployment
    from app.containers import create_container, get_container
    from app.platforms import platform_for_device

    container = (get_container() if args.deployment is None
                 else deployment.load(args.deployment))
    if args.capability is not None:
        capability = _parse_capability(args.capability)
        platform = (platform_for_device("cpu") if capability is None
                    else platform_for_device("cuda", capability))
        container = create_container(container.config(), platform)
    return container


def collect(args: argparse.Namespace) -> dict[str, Any]:
    """The explanation ``backends`` prints (``--kind all``: keyed by kind)."""
    from app.seed_api import explain_mla_decode_selection, explain_mla_prefill_selection

    container = build_container(args)
    config = build_config(args, container.config())
    out: dict[str, Any] = {}
    for kind in _kinds(args):
        if kind == "prefill":
            out[kind] = dict(explain_mla_prefill_selection(config, container=container))
        else:
            out[kind] = dict(explain_mla_decode_selection(
                config, query_len=args.query_len, container=container))
    return out if len(out) > 1 else next(iter(out.values()))


def render(info: dict[str, Any]) -> str:
    """The explanation as a header, a table and the outcome (``--kind all``: one per kind)."""
    if "backends" not in info:
        return "\n\n".join(f"[{kind}]\n{render(part)}" for kind, part in info.items())
    header = {
        "kind": info.get("kind", "prefill"),
        "platform": info["platform"],
        "device capability": info["device_capability"] or "-",
        "dtype": info["dtype"],
    }
    if "mla_dimensions" in info:
        header["mla dimensions"] = (
            "({qk_nope_head_dim}, {qk_rope_head_dim}, {v_head_dim})".format(
                **info["mla_dimensions"]))
    else:
        header.update({key.replace("_", " "): str(value)
                       for key, value in info.get("selector_config", {}).items()
                       if key != "dtype"})
    topk = info.get("selector_config", {}).get("index_topk")
    header["index topk"] = "- (dense)" if topk is None else str(topk)
    header.update({
        "requested": info["requested"] or "auto",
        "priorities": ", ".join(info["priorities"]) or "-",
    })
    rows = []
    for verdict in info["backends"].values():
        priority = verdict["priority"]
        rows.append([
            verdict["name"],
            "-" if priority is None else priority + 1,
            "yes" if verdict["valid"] else "no",
            (verdict["class_path"] or "(unregistered)")
            + (" (overridden)" if verdict["overridden"] else ""),
            "; ".join(verdict["reasons"]),
        ])
    lines = [format_mapping(header), "",
             format_table(["backend", "priority", "valid", "class", "reasons"], rows), ""]
    if info["chosen"] is not None:
        lines.append(f"chosen: {info['chosen']} ({info['chosen_class']})")
        if info.get("kernel_path"):
            lines.append(f"kernel path: {info['kernel_path']}")
    else:
        lines.append(f"chosen: none\nerror: {info['error']}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    """Print the explanation; 0 when a backend is chosen, 1 when none is."""
    info = collect(args)
    if args.json:
        print_json(info)
    else:
        print_text(render(info))
    parts = [info] if "backends" in info else list(info.values())
    return 0 if all(part["chosen"] is not None for part in parts) else 1

"""The public API as one sorted text file, and the comparison that keeps it from changing by
accident.

The surface is every name in the ``__all__`` of the public packages
(``tests.test_house_rules.PUBLIC_PACKAGES``), one line per promise a caller can rely on:

- a function: its parameters (names, kinds, annotations as written, defaults) and return;
- a class: its constructor (when one of ours defines it), its public methods, class and static
  methods (each with its signature), properties and class attributes (names; annotated names
  too, so attrs fields, NamedTuple fields and TypedDict keys count); what an external base
  (torch, dependency-injector, enum) defines is that library's API, not ours, and is left out;
- an enum: its members, in order;
- anything else: its type (and its value when that is a plain literal).

Annotations are the text the source wrote (``from __future__ import annotations``), never
evaluated types, and object addresses are dropped, so the file reads the same on every Python
from 3.10 and every torch version. It is built in a fresh interpreter (a test's run-time
backend registrations must not show up as enum members).

Regenerate it on purpose, after a public change was decided (`docs/public-api.md`)::

    python -m tests.api.surface --update
"""

from __future__ import annotations

import argparse
import ast
import enum
import importlib
import inspect
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

#: The recorded surface, committed beside this module.
SNAPSHOT = Path(__file__).with_name("public_api.txt")
#: The one-line command that regenerates it.
UPDATE_COMMAND = "python -m tests.api.surface --update"

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
_LITERALS = (str, int, float, bool, type(None))


def _public_packages() -> list[str]:
    from tests.test_house_rules import PUBLIC_PACKAGES

    return list(PUBLIC_PACKAGES)


# -- rendering ---------------------------------------------------------------------------------

def _annotation(value: Any) -> str:
    if isinstance(value, str):
        return value
    return _ADDRESS.sub("", inspect.formatannotation(value))


def _is_literal(value: Any) -> bool:
    if isinstance(value, _LITERALS):
        return True
    return isinstance(value, (tuple, frozenset)) and all(_is_literal(item) for item in value)


def _default(value: Any, written: str | None) -> str:
    """A literal as its repr, an enum member by name, an attrs factory as ``<factory>``,
    anything else as the source wrote it (``BUILTIN_KV_CACHE_SPECS``, not its contents)."""
    if isinstance(value, enum.Enum) and type(value).__name__ == "_Nothing":
        return "<factory>"  # attrs' NOTHING: the field has a default factory
    if isinstance(value, enum.Enum):  # before literals: an IntEnum member is an int too
        return f"{type(value).__name__}.{value.name}"
    if _is_literal(value):
        return repr(value)
    if written is not None:
        return written
    return f"<{type(value).__name__}>"


def _written_defaults(func: Any) -> dict[str, str]:
    """``{parameter: its default as the source wrote it}`` (empty where there is no source)."""
    try:
        source = textwrap.dedent(inspect.getsource(func))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):
        return {}
    node = next((n for n in ast.walk(tree)
                 if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))), None)
    if node is None:
        return {}
    arguments = node.args
    positional = [*arguments.posonlyargs, *arguments.args]
    written = {a.arg: ast.unparse(d) for a, d in zip(positional[len(positional)
                                                                 - len(arguments.defaults):],
                                                     arguments.defaults, strict=True)}
    written.update({a.arg: ast.unparse(d) for a, d in zip(arguments.kwonlyargs,
                                                          arguments.kw_defaults, strict=True)
                    if d is not None})
    return written


def render_signature(func: Any) -> str:
    """``(a, /, b: int = 1, *args, c: str, **kw) -> R`` for ``func``, annotations as written."""
    try:
        signature = inspect.signature(func)
    except (TypeError, ValueError):
        return "(<no signature>)"
    parts: list[str] = []
    kinds = inspect.Parameter
    written = _written_defaults(func)
    previous = None
    for parameter in signature.parameters.values():
        kind = parameter.kind
        if previous == kinds.POSITIONAL_ONLY and kind != kinds.POSITIONAL_ONLY:
            parts.append("/")
        if kind == kinds.KEYWORD_ONLY and previous not in (kinds.KEYWORD_ONLY,
                                                          kinds.VAR_POSITIONAL):
            parts.append("*")
        text = {kinds.VAR_POSITIONAL: "*", kinds.VAR_KEYWORD: "**"}.get(kind, "")
        text += parameter.name
        if parameter.annotation is not kinds.empty:
            text += f": {_annotation(parameter.annotation)}"
        if parameter.default is not kinds.empty:
            text += f" = {_default(parameter.default, written.get(parameter.name))}"
        parts.append(text)
        previous = kind
    if previous == kinds.POSITIONAL_ONLY:
        parts.append("/")
    rendered = f"({', '.join(parts)})"
    if signature.return_annotation is not inspect.Signature.empty:
        rendered += f" -> {_annotation(signature.return_annotation)}"
    return rendered


def _is_ours(obj: Any) -> bool:
    module = getattr(obj, "__module__", None) or ""
    return module == "app" or module.startswith("app.")


def _value(name: str, obj: Any) -> str:
    if name.startswith("__"):  # __version__: its value changes with every release
        return type(obj).__name__
    if isinstance(obj, _LITERALS):
        return f"{type(obj).__name__} = {obj!r}"
    if isinstance(obj, (tuple, frozenset, set, list)) and all(
            isinstance(item, _LITERALS) for item in obj):
        items = sorted(obj, key=repr) if isinstance(obj, (set, frozenset)) else list(obj)
        return f"{type(obj).__name__} = {items!r}"
    return type(obj).__name__


def _member(value: Any) -> str:
    """How one entry of a class's ``__dict__`` reads."""
    if isinstance(value, classmethod):
        return f"classmethod{render_signature(value.__func__)}"
    if isinstance(value, staticmethod):
        return f"staticmethod{render_signature(value.__func__)}"
    if inspect.isfunction(value):
        return f"method{render_signature(value)}"
    if isinstance(value, property) or type(value).__name__ == "cached_property":
        return "property"
    if inspect.isclass(value):
        return "class"
    return "attribute"


def _class_entries(prefix: str, cls: type) -> Iterator[tuple[str, str]]:
    ours = [c for c in cls.__mro__ if _is_ours(c)]
    external = [c for c in cls.__mro__ if not _is_ours(c)]
    bases = ", ".join(c.__name__ for c in cls.__bases__)
    kind = "enum" if issubclass(cls, enum.Enum) else "class"
    yield prefix, f"{kind}({bases})"
    if issubclass(cls, enum.Enum):
        yield f"{prefix}.<members>", ", ".join(cls.__members__)
    init_owner = next((c for c in cls.__mro__ if "__init__" in vars(c)), object)
    init = vars(init_owner).get("__init__")
    # Ours: written in a class of ours, or generated for it (attrs); not typing's Protocol stub.
    if _is_ours(init_owner) and _is_ours(init) and not issubclass(cls, enum.Enum):
        yield f"{prefix}.__init__", f"constructor{render_signature(init)}"
    seen: dict[str, str] = {}
    for owner in ours:
        names = [*vars(owner), *getattr(owner, "__annotations__", {})]
        for name in names:
            if name.startswith("_") or name in seen or any(hasattr(c, name) for c in external):
                continue
            if issubclass(cls, enum.Enum) and name in cls.__members__:
                continue
            raw = vars(owner).get(name)
            seen[name] = "attribute" if name not in vars(owner) else _member(raw)
    for name, description in seen.items():
        yield f"{prefix}.{name}", description


def _entries(prefix: str, obj: Any) -> Iterator[tuple[str, str]]:
    if inspect.ismodule(obj):
        yield prefix, "module"
    elif inspect.isclass(obj):
        yield from _class_entries(prefix, obj)
    elif inspect.isfunction(obj) or inspect.isbuiltin(obj):
        yield prefix, f"function{render_signature(obj)}"
    else:
        yield prefix, _value(prefix.rpartition('.')[2], obj)


def collect(packages: list[str] | None = None) -> dict[str, str]:
    """``{dotted name: description}`` of every public name of ``packages`` (default: the
    public packages), in this interpreter."""
    surface: dict[str, str] = {}
    for package in packages if packages is not None else _public_packages():
        module = importlib.import_module(package)
        for name in sorted(module.__all__):
            for key, description in _entries(f"{package}.{name}", getattr(module, name)):
                surface[key] = description
    return dict(sorted(surface.items()))


def render(surface: Mapping[str, str]) -> str:
    """The snapshot file's text: one ``name: description`` line per entry, sorted."""
    return "".join(f"{key}: {value}\n" for key, value in sorted(surface.items()))


def parse(text: str) -> dict[str, str]:
    """The inverse of ``render``."""
    surface = {}
    for line in text.splitlines():
        if line.strip():
            key, _, value = line.partition(": ")
            surface[key] = value
    return surface


def collect_fresh() -> dict[str, str]:
    """``collect()`` run in a fresh interpreter (no registrations of this process leak in)."""
    root = Path(__file__).resolve().parent.parent.parent
    proc = subprocess.run([sys.executable, "-m", "tests.api.surface", "--print"],
                          capture_output=True, text=True, timeout=300, check=False, cwd=root,
                          env=_clean_environment())
    if proc.returncode != 0:
        raise RuntimeError(f"collecting the public API failed:\n{proc.stderr}")
    return parse(proc.stdout)


def _clean_environment() -> dict[str, str]:
    import os

    env = dict(os.environ)
    env["APP_PLUGINS"] = ""  # no general plugin registers anything
    env["PYTHONHASHSEED"] = "0"
    return env


# -- comparing ---------------------------------------------------------------------------------

def differences(recorded: Mapping[str, str], current: Mapping[str, str]) -> str:
    """What changed from ``recorded`` to ``current`` and what to do about it, or "" when they
    are the same."""
    removed = sorted(set(recorded) - set(current))
    added = sorted(set(current) - set(recorded))
    changed = sorted(k for k in set(recorded) & set(current) if recorded[k] != current[k])
    if not (removed or added or changed):
        return ""
    lines = ["The public API differs from the recorded snapshot (tests/api/public_api.txt)."]
    if removed:
        lines += ["", f"REMOVED ({len(removed)}): code written against the README breaks:"]
        lines += [f"  - {key}: {recorded[key]}" for key in removed]
    if changed:
        lines += ["", f"CHANGED SIGNATURE ({len(changed)}): callers may break:"]
        for key in changed:
            lines += [f"  ~ {key}", f"      was: {recorded[key]}", f"      now: {current[key]}"]
    if added:
        lines += ["", f"ADDED ({len(added)}): nothing breaks, but a new name is a new promise:"]
        lines += [f"  + {key}: {current[key]}" for key in added]
    lines += ["", "If this change is deliberate:"]
    if removed or changed:
        lines += ["  1. keep the old form working: an alias for a renamed or moved name, the old",
                  "     parameters accepted (with a DeprecationWarning) for a changed signature;",
                  "  2. add a line to CHANGELOG.md under 'Unreleased' (Changed / Deprecated /",
                  "     Removed) saying what changed and what callers should use;"]
    else:
        lines += ["  1. add a line to CHANGELOG.md under 'Unreleased' (Added);"]
    lines += [f"  then regenerate the snapshot with `{UPDATE_COMMAND}` and commit it with",
              "  the change. If it is not deliberate, undo the change."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """``--print`` the current surface, ``--update`` the snapshot, or ``--check`` (default)."""
    parser = argparse.ArgumentParser(prog="python -m tests.api.surface",
                                     description="the public API snapshot")
    action = parser.add_mutually_exclusive_group()
    action.add_argument("--update", action="store_true", help=f"rewrite {SNAPSHOT.name}")
    action.add_argument("--print", action="store_true", help="print the current surface")
    args = parser.parse_args(argv)
    if args.print:
        sys.stdout.write(render(collect()))
        return 0
    current = collect_fresh()
    if args.update:
        SNAPSHOT.write_text(render(current))
        sys.stdout.write(f"wrote {len(current)} entries to {SNAPSHOT}\n")
        return 0
    problem = differences(parse(SNAPSHOT.read_text()), current)
    sys.stdout.write((problem or "the public API matches the snapshot") + "\n")
    return 1 if problem else 0


if __name__ == "__main__":
    sys.exit(main())

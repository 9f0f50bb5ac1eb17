"""Resolving objects by dotted path (``pkgutil.resolve_name``), with errors that say what was
expected."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

__all__ = ["import_object", "object_path"]


def import_object(path: str) -> Any:
    """``pkgutil.resolve_name(path)``: ``"pkg.mod.Name"`` or ``"pkg.mod:Name"``.

    Raises ``TypeError`` when ``path`` is not a string, ``ValueError`` when it is not a dotted
    path, and ``ImportError`` (naming the path) when the module or the attribute does not
    exist, or when importing the module fails in any other way (it raises, or has a syntax
    error): the error says what the module raised, on one line.
    """
    if not isinstance(path, str):
        raise TypeError(f"expected a dotted path string, got {path!r} ({type(path).__name__})")
    module_name, sep, attr_path = path.partition(":")
    if not sep:
        module_name, _, attr_path = path.rpartition(".")
    if not module_name or not attr_path:
        raise ValueError(f"expected a dotted path like 'package.module.Name', got {path!r}")
    try:
        return pkgutil.resolve_name(path)
    except AttributeError as exc:
        try:  # say which module is missing rather than which attribute the walk missed
            importlib.import_module(module_name)
        except ImportError as missing:
            raise ImportError(f"cannot import module {module_name!r} for {path!r}: "
                              f"{missing}") from exc
        except Exception:  # the module itself raises: reported as below
            pass
        raise ImportError(f"module {module_name!r} has no attribute {attr_path!r} "
                          f"({path!r})") from exc
    except ImportError as exc:
        raise ImportError(f"cannot import module {module_name!r} for {path!r}: {exc}") from exc
    except ValueError as exc:
        raise ValueError(f"expected a dotted path like 'package.module.Name', got {path!r}: "
                         f"{exc}") from None
    except Exception as exc:  # the module's own code failed: still "does not import"
        raise ImportError(f"importing module {module_name!r} for {path!r} raised "
                          f"{_one_line(exc)}") from exc


def _one_line(exc: BaseException) -> str:
    """``"Type: message"`` on one line (a SyntaxError's message names its file and line)."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def object_path(obj: Any) -> str:
    """The dotted path ``import_object`` would need to find ``obj`` again."""
    return f"{obj.__module__}.{obj.__qualname__}"

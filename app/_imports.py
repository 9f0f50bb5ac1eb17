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
    exist, or the module raises while it is imported.
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
    except Exception as exc:  # the module itself raised while being imported
        raise ImportError(f"importing {path!r} raised {type(exc).__name__}: {exc}") from exc


def object_path(obj: Any) -> str:
    """The dotted path ``import_object`` would need to find ``obj`` again."""
    return f"{obj.__module__}.{obj.__qualname__}"

"""Rules that keep the library honest: no assert for validation, no print, a complete __all__."""

from __future__ import annotations

import ast
import functools
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

#: parses every module of the package: outside the quick subset (-m "not slow").
pytestmark = pytest.mark.slow

APP = Path(__file__).parent.parent / "app"
PUBLIC_PACKAGES = ["app", "app.backends", "app.kvcache", "app.platforms", "app.testing",
                   "app.mla", "app.model", "app.deployment", "app.plugins", "app.config",
                   "app.containers", "app.integrations"]


def _sources() -> list[Path]:
    return sorted(APP.rglob("*.py"))


def test_no_assert_statements_in_the_library() -> None:
    offenders = [f"{path.relative_to(APP.parent)}:{node.lineno}"
                 for path in _sources()
                 for node in ast.walk(ast.parse(path.read_text()))
                 if isinstance(node, ast.Assert)]
    assert offenders == [], "validation must raise typed errors, not assert"


def test_no_print_outside_the_cli() -> None:
    offenders = []
    for path in _sources():
        rel = path.relative_to(APP)
        if rel.parts[0] == "commands" or rel.name in ("cli.py", "__main__.py"):
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id == "print"):
                offenders.append(f"{rel}:{node.lineno}")
    assert offenders == [], "the library logs through the 'app' logger"


def test_no_file_over_600_lines() -> None:
    long = {str(p.relative_to(APP)): n for p in _sources()
            if (n := len(p.read_text().splitlines())) > 600}
    assert long == {}


@pytest.mark.parametrize("name", PUBLIC_PACKAGES)
def test_all_is_complete_and_documented(name: str) -> None:
    """Every public class or function of ours that a public module holds is in ``__all__``;
    every ``__all__`` name exists; every exported class and function has a docstring."""
    module = importlib.import_module(name)
    exported = set(module.__all__)
    # A package re-exports its submodules' API; a plain module exports what it defines.
    is_package = hasattr(module, "__path__")
    api = {n for n, v in vars(module).items()
           if not n.startswith("_") and _is_api(v)
           and ((getattr(v, "__module__", None) or "").startswith("app") if is_package
                else getattr(v, "__module__", None) == name)}
    assert sorted(api - exported) == [], f"{name}.__all__ is missing names"
    assert sorted(n for n in exported if not hasattr(module, n)) == []
    undocumented = sorted(n for n in exported
                          if _is_api(getattr(module, n)) and not inspect.getdoc(getattr(module, n)))
    assert undocumented == []


def _is_api(value: object) -> bool:
    return inspect.isclass(value) or inspect.isfunction(value)


def test_validation_survives_python_O() -> None:
    code = """
import sys
from app.config import ModelConfig, CacheConfig
from app.containers import use_container
checks = [
    lambda: ModelConfig(num_heads=-1),
    lambda: CacheConfig(block_size=3),
    lambda: ModelConfig(dtype="int4"),
    lambda: use_container("x").__enter__(),
]
for check in checks:
    try:
        check()
    except (ValueError, TypeError):
        continue
    sys.exit("validation vanished under -O")
assert False, "asserts are off"  # must not fire under -O
print("ok")
"""
    proc = subprocess.run([sys.executable, "-O", "-c", code], capture_output=True, text=True,
                          timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"


# -- no import cycles and no arrow back up, deferred and TYPE_CHECKING imports included ---------

def _module_names(root: Path) -> dict[str, Path]:
    names = {}
    for path in root.rglob("*.py"):
        parts = path.with_suffix("").relative_to(root.parent).parts
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return names


def _imports_of(name: str, path: Path, modules: dict[str, Path],
                type_checking: bool = True) -> set[str]:
    """The package modules ``name`` imports: every import statement anywhere in the file
    (inside functions, classes, ``try`` and ``if`` included: a deferred import hides a cycle,
    it does not remove it), and the body of an ``if TYPE_CHECKING:`` block too unless
    ``type_checking`` is False (a type-only import is still an arrow in the drawing). ``from
    pkg import mod`` names ``pkg.mod`` only; ``from pkg import name`` names ``pkg``."""
    base = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    class Visitor(ast.NodeVisitor):
        def visit_If(self, node: ast.If) -> None:
            if not type_checking and "TYPE_CHECKING" in ast.unparse(node.test):
                for child in node.orelse:
                    self.visit(child)
                return
            self.generic_visit(node)

        def visit_Import(self, node: ast.Import) -> None:
            found.update(alias.name for alias in node.names)

        def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
            module = node.module or ""
            if node.level:
                package = base
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                module = f"{package}.{module}" if node.module else package
            for alias in node.names:
                submodule = f"{module}.{alias.name}"
                found.add(submodule if submodule in modules else module)

    Visitor().visit(ast.parse(path.read_text()))
    targets = set()
    for target in found:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            targets.add(target)
    return targets


@functools.lru_cache(maxsize=8)
def import_graph(root: Path, type_checking: bool = True) -> dict[str, set[str]]:
    """Module -> the package modules it imports (see ``_imports_of``); read once per root
    (callers do not change it)."""
    modules = _module_names(root)
    return {name: _imports_of(name, path, modules, type_checking)
            for name, path in modules.items()}


def import_cycles(root: Path, type_checking: bool = True) -> list[list[str]]:
    """The strongly connected components (more than one module) of ``root``'s import graph."""
    return strongly_connected(import_graph(root, type_checking))


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node of ``graph`` (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    old_limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(old_limit, 10_000))
    try:
        for v in sorted(graph):
            if v not in index:
                connect(v)
    finally:  # later tests (the 500-deep TOML corpus entry) rely on the default limit
        sys.setrecursionlimit(old_limit)
    return cycles


def test_no_import_cycles_deferred_and_type_checking_imports_included() -> None:
    assert import_cycles(APP) == []


def test_the_cycle_check_sees_deferred_and_type_checking_imports(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from pkg.a import x\n")
    (pkg / "c.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                              "    from pkg.d import y\n")
    (pkg / "d.py").write_text("from . import c\n")
    assert import_cycles(pkg) == [["pkg.a", "pkg.b"], ["pkg.c", "pkg.d"]]
    assert import_cycles(pkg, type_checking=False) == [["pkg.a", "pkg.b"]]


#: The floors of the house, bottom up. A module imports only modules on its own floor or below
#: (deferred and TYPE_CHECKING imports included). A module sits on the floor that names it, else
#: on the floor of its longest listed ``prefix.*``. The public faces are the package
#: ``__init__`` modules that gather the API; nothing in the library imports them (library
#: modules import the module that defines a name). ``FOLDER_FLOORS`` below is the same house
#: seen by a reader, one unit per folder.
FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("app._types", "app._validation", "app._imports", "app._cpu", "app._cpu.*",
                "app._files", "app._container_state", "app.catalog")),
    ("config", ("app.config",)),
    ("platforms and plugin discovery", ("app.platforms", "app.platforms.*", "app.plugins")),
    ("kv cache", ("app.kvcache.*",)),
    ("backend pieces both kinds share: declarations, the contract's checks, vendor facts, "
     "LSE and merge, workspaces, the native CPU kernels, sparse attention's pieces",
     ("app.backends.declarations", "app.backends.contract", "app.backends.vendors",
      "app.backends.lse", "app.backends.merge", "app.backends.workspaces", "app.backends.cpu",
      "app.backends.cpu.*", "app.backends.sparse", "app.backends.sparse.*")),
    ("backend kinds, side by side (neither imports the other)",
     ("app.backends.prefill", "app.backends.prefill.*", "app.backends.decode",
      "app.backends.decode.*")),
    ("backend registry and selection", ("app.backends.*",)),
    ("the model the engine serves", ("app.model", "app.model.*")),
    ("composition root", ("app.containers",)),
    ("seed API, gathered", ("app.seed_api",)),
    ("engine, deployments, conformance kit, integrations",
     ("app.mla", "app.mla.*", "app.deployment", "app.testing", "app.testing.*",
      "app.integrations", "app.integrations.*")),
    ("front door", ("app.commands", "app.commands.*", "app.bench", "app.bench.*", "app.cli",
                    "app.__main__")),
    ("public faces", ("app", "app.backends", "app.kvcache")),
]


def floor_of(module: str) -> int:
    """The index in ``FLOORS`` of ``module``'s floor."""
    for index, (_, names) in enumerate(FLOORS):
        if module in names:
            return index
    prefixes = [(len(name), index) for index, (_, names) in enumerate(FLOORS)
                for name in names if name.endswith(".*") and module.startswith(name[:-1])]
    if not prefixes:
        raise AssertionError(f"{module} is on no floor: add it to FLOORS")
    return max(prefixes)[1]


def arrows_up(root: Path) -> list[str]:
    """Every import that runs from a floor to a higher one."""
    return sorted(f"{source} ({FLOORS[floor_of(source)][0]}) -> {target} "
                  f"({FLOORS[floor_of(target)][0]})"
                  for source, targets in import_graph(root).items() for target in targets
                  if floor_of(target) > floor_of(source))


def test_no_import_runs_back_up_a_floor() -> None:
    """The drawing of the house: arrows only go down (or stay on their floor)."""
    assert arrows_up(APP) == []


@pytest.mark.parametrize(("kind", "other"), [("prefill", "decode"), ("decode", "prefill")])
def test_prefill_and_decode_never_import_each_other(kind: str, other: str) -> None:
    """The two kinds stand on one floor with no arrow between them: what both need (vendor
    facts, the scale check, the ``out=`` rule, the native kernels) lives on the floor below."""
    graph = import_graph(APP)
    arrows = sorted(f"{source} -> {target}" for source, targets in graph.items()
                    if source.startswith(f"app.backends.{kind}")
                    for target in targets if target.startswith(f"app.backends.{other}"))
    assert arrows == []


def test_the_floor_check_sees_an_arrow_up(tmp_path: Path) -> None:
    app = tmp_path / "app"
    (app / "kvcache").mkdir(parents=True)
    for name in ("__init__.py", "config.py", "containers.py", "kvcache/__init__.py"):
        (app / name).write_text("")
    (app / "kvcache" / "grouping.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
        "    from app.containers import Application\n")
    assert arrows_up(app) == ["app.kvcache.grouping (kv cache) -> app.containers "
                              "(composition root)"]


#: The seed API's modules: below the composition root, the only ones that ask which container is
#: active (each package face re-exports its own, so the face needs no import from above).
SEED_API_MODULES = ("app/backends/seed_api.py", "app/kvcache/seed_api.py")


#: The house as a reader sees it (``farm-studio look``): one unit per folder (``app/<dir>/``, its
#: ``__init__`` and subfolders included) and one per top-level module, bottom up. No import runs
#: from a unit to a higher floor's, and no circle joins units (deferred and TYPE_CHECKING
#: imports included). A unit sits on the floor that names it.
FOLDER_FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("leaves", ("app._types", "app._validation", "app._imports", "app._cpu", "app._files",
                "app._container_state", "app.catalog")),
    ("config", ("app.config",)),
    ("platforms and plugin discovery", ("app.platforms", "app.plugins")),
    ("kv cache", ("app.kvcache",)),
    ("backends", ("app.backends",)),
    ("the model the engine serves", ("app.model",)),
    ("composition root", ("app.containers",)),
    ("seed API, gathered", ("app.seed_api",)),
    ("engine, deployments, conformance kit, integrations",
     ("app.mla", "app.deployment", "app.testing", "app.integrations")),
    ("front door", ("app.commands", "app.bench", "app.cli", "app.__main__")),
    ("public face", ("app",)),
]


def unit_of(module: str) -> str:
    """The folder or top-level module ``module`` belongs to: ``app.backends.prefill.base`` ->
    ``app.backends``; ``app.config`` -> ``app.config``; ``app`` -> ``app``."""
    return ".".join(module.split(".")[:2])


def folder_floor_of(unit: str) -> int:
    """The index in ``FOLDER_FLOORS`` of ``unit``'s floor."""
    for index, (_, units) in enumerate(FOLDER_FLOORS):
        if unit in units:
            return index
    raise AssertionError(f"{unit} is on no floor: add it to FOLDER_FLOORS")


def folder_graph(root: Path) -> dict[str, dict[str, list[str]]]:
    """Unit -> the units it imports -> the module imports that make that arrow."""
    graph: dict[str, dict[str, list[str]]] = {}
    for source, targets in import_graph(root).items():
        arrows = graph.setdefault(unit_of(source), {})
        for target in sorted(targets):
            if unit_of(target) != unit_of(source):
                arrows.setdefault(unit_of(target), []).append(f"{source} -> {target}")
    return graph


def folder_arrows_up(root: Path) -> list[str]:
    """Every arrow from a unit to a higher floor's unit, with the imports that make it."""
    return sorted(f"{source} ({FOLDER_FLOORS[folder_floor_of(source)][0]}) -> {target} "
                  f"({FOLDER_FLOORS[folder_floor_of(target)][0]}): {', '.join(imports)}"
                  for source, arrows in folder_graph(root).items()
                  for target, imports in arrows.items()
                  if folder_floor_of(target) > folder_floor_of(source))


def folder_cycles(root: Path) -> list[list[str]]:
    """The circles between units."""
    return strongly_connected({unit: set(arrows) for unit, arrows in folder_graph(root).items()})


def test_no_folder_imports_a_folder_above_it() -> None:
    """The folder drawing: arrows only go down (or stay on their floor)."""
    assert folder_arrows_up(APP) == []


def test_no_circle_between_folders() -> None:
    assert folder_cycles(APP) == []


def test_every_folder_floor_names_a_unit_that_exists() -> None:
    units = {unit_of(module) for module in _module_names(APP)}
    listed = {unit for _, names in FOLDER_FLOORS for unit in names}
    assert sorted(listed - units) == [] and sorted(units - listed) == []


def test_the_folder_check_sees_an_arrow_up_and_a_circle(tmp_path: Path) -> None:
    """The shape the house had before issue 34: the config read the catalog inside
    ``backends/``, whose face re-exported the seed API from above the composition root."""
    app = tmp_path / "app"
    (app / "backends").mkdir(parents=True)
    (app / "__init__.py").write_text("")
    (app / "config.py").write_text("from app.backends.catalog import CATALOGS\n")
    (app / "backends" / "__init__.py").write_text(
        "def __getattr__(name):\n    import app.seed_api\n")
    (app / "backends" / "catalog.py").write_text("CATALOGS = {}\n")
    (app / "backends" / "registry.py").write_text("import app.config\n")
    (app / "seed_api.py").write_text("from app.backends import registry\n")
    assert folder_arrows_up(app) == [
        "app.backends (backends) -> app.seed_api (seed API, gathered): "
        "app.backends -> app.seed_api",
        "app.config (config) -> app.backends (backends): "
        "app.config -> app.backends.catalog"]
    assert folder_cycles(app) == [["app.backends", "app.config", "app.seed_api"]]


def test_only_the_seed_api_asks_for_the_active_container() -> None:
    """The active container (``get_container``, ``active_container``, ``ACTIVE_CONTAINER``) is
    asked for by the seed API's modules and by the floors above the composition root (engine,
    front door), never by another module below it."""
    below = [p for p in _sources() if p.name != "_container_state.py"  # where it is held
             and str(p.relative_to(APP.parent)) not in SEED_API_MODULES
             and floor_of(_module_of(p)) < floor_of("app.containers")]
    assert len(below) > 50
    pattern = r"\bget_container\b|\bactive_container\b|\bACTIVE_CONTAINER\b"
    offenders = [str(p.relative_to(APP)) for p in below if re.search(pattern, p.read_text())]
    assert offenders == []


def _module_of(path: Path) -> str:
    parts = path.with_suffix("").relative_to(APP.parent).parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_no_attribute_name_is_built_from_a_string() -> None:
    """``getattr(obj, f"...")`` / ``setattr(obj, f"...", ...)`` hide an attribute from grep
    (a native library's C symbols, ``getattr(cdll, ...)``, are not attributes of ours)."""
    offenders = [f"{p.relative_to(APP)}:{node.lineno}" for p in _sources()
                 for node in ast.walk(ast.parse(p.read_text()))
                 if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                 and node.func.id in ("getattr", "setattr", "hasattr", "delattr")
                 and len(node.args) > 1 and isinstance(node.args[1], ast.JoinedStr)
                 and not (isinstance(node.args[0], ast.Name) and node.args[0].id == "cdll")]
    assert offenders == []


@pytest.mark.parametrize("bottom", ["app.config", "app.kvcache.specs"])
def test_config_and_specs_sit_at_the_bottom(bottom: str) -> None:
    """Config and specs import nothing above them (only small leaf helpers)."""
    modules = _module_names(APP)
    seen, todo = set(), [bottom]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(_imports_of(name, modules[name], modules))
    # app.kvcache.cache_dtypes: the cache dtypes' row layouts, over app.config alone (a spec's
    # page size follows its dtype)
    assert seen - {bottom} <= {"app._files", "app._types", "app._validation",
                               "app.catalog", "app.config",
                               "app.kvcache.cache_dtypes"}, sorted(seen)


def test_only_the_catalog_names_built_in_backend_classes() -> None:
    """No module but the kinds' catalog (which the container reads) names a concrete backend
    class for wiring."""
    from app.catalog import DECODE_BACKENDS, PREFILL_BACKENDS

    paths = [*PREFILL_BACKENDS.builtins.values(), *DECODE_BACKENDS.builtins.values()]
    offenders = [f"{p.relative_to(APP)}: {path}" for p in _sources()
                 if p.name != "catalog.py" for path in paths if path in p.read_text()]
    assert offenders == []


def test_each_backend_name_is_written_once() -> None:
    """A built-in's name appears as a string literal in the catalog only: no ``get_name``
    returns it again (platforms and messages may refer to it, through the catalog's
    ``check``)."""
    from app.catalog import DECODE_BACKENDS, PREFILL_BACKENDS

    names = {*PREFILL_BACKENDS.builtins, *DECODE_BACKENDS.builtins}
    offenders = []
    for p in _sources():
        for node in ast.walk(ast.parse(p.read_text())):
            if (isinstance(node, ast.FunctionDef) and node.name == "get_name"
                    and any(isinstance(n, ast.Constant) and n.value in names
                            for n in ast.walk(node))):
                offenders.append(f"{p.relative_to(APP)}:{node.lineno}")
    assert offenders == []


def test_only_the_platforms_package_builds_concrete_platforms() -> None:
    """Outside ``app/platforms`` a platform comes from the container, ``detect_platform`` or
    ``platform_for_device``: no other module constructs ``CpuPlatform`` / ``CudaPlatform``."""
    pattern = re.compile(r"\b(CpuPlatform|CudaPlatform)\(")
    offenders = [str(p.relative_to(APP)) for p in _sources()
                 if "platforms" not in p.relative_to(APP).parts
                 and pattern.search(p.read_text())]
    assert offenders == []


def is_compatibility_shim(path: Path) -> bool:
    """Whether ``path`` only keeps an old import path working: a docstring, ``from ... import``
    of names defined elsewhere, and ``__all__``; no code of its own."""
    body = ast.parse(path.read_text()).body
    if not body or not (isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                        and str(body[0].value.value).startswith("Compatibility:")):
        return False
    return all(isinstance(node, ast.ImportFrom)
               or (isinstance(node, ast.Assign) and len(node.targets) == 1
                   and isinstance(node.targets[0], ast.Name) and node.targets[0].id == "__all__")
               for node in body[1:])


def test_no_folder_holds_more_than_15_modules() -> None:
    """A reader finds a module by its folder: none holds more than 15 modules directly (a
    compatibility shim, which holds no code, is not a module a reader looks for)."""
    crowded = {str(folder.relative_to(APP.parent)): n for folder in [APP, *APP.rglob("*")]
               if folder.is_dir() and (n := len([p for p in folder.glob("*.py")
                                                 if not is_compatibility_shim(p)])) > 15}
    assert crowded == {}


@pytest.mark.parametrize(("old", "new"), [("app.plugins", "app.platforms.plugins"),
                                          ("app.backends.catalog", "app.catalog")])
def test_a_moved_module_keeps_its_old_import_path_as_a_shim(old: str, new: str) -> None:
    """A module that moved leaves a shim behind: the old path names the very same objects."""
    old_module, new_module = importlib.import_module(old), importlib.import_module(new)
    assert is_compatibility_shim(Path(old_module.__file__ or ""))
    assert old_module.__all__ == new_module.__all__
    for name in new_module.__all__:
        assert getattr(old_module, name) is getattr(new_module, name), name


def test_the_seed_api_is_one_set_of_objects_under_every_path() -> None:
    """``app.seed_api`` gathers what ``app.backends.seed_api`` and ``app.kvcache.seed_api``
    define; the package faces and ``app`` re-export the very same objects."""
    import app
    import app.backends
    import app.backends.seed_api
    import app.kvcache
    import app.kvcache.seed_api
    import app.seed_api

    homes = {**{n: app.backends.seed_api for n in app.backends.seed_api.__all__},
             **{n: app.kvcache.seed_api for n in app.kvcache.seed_api.__all__}}
    assert sorted(homes) == sorted(app.seed_api.__all__)
    for name, home in homes.items():
        assert getattr(app.seed_api, name) is getattr(home, name), name
        for face in (app, app.backends, app.kvcache):
            if name in face.__all__:
                assert getattr(face, name) is getattr(home, name), (face.__name__, name)


def test_a_module_with_code_is_not_a_shim(tmp_path: Path) -> None:
    shim = tmp_path / "shim.py"
    shim.write_text('"""Compatibility: moved."""\n\nfrom x import y\n\n__all__ = ["y"]\n')
    assert is_compatibility_shim(shim)
    shim.write_text('"""Compatibility: moved."""\n\nfrom x import y\n\n__all__ = ["y"]\n'
                    "z = 1\n")
    assert not is_compatibility_shim(shim)
    shim.write_text('"""Moved."""\n\nfrom x import y\n\n__all__ = ["y"]\n')
    assert not is_compatibility_shim(shim)

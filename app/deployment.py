"""Deployments: one TOML file -> one fresh, fully configured container.

A deployment is config plus overrides, never a subclass of ``Application``. The file::

    [deployment]
    name = "h100-prod"                 # optional, shown by the CLI
    platform = "auto"                  # auto | cpu | cuda | cuda:9.0 (emulated) | pkg.mod.Platform
    prefill_backend = "auto"           # auto | a backend name (built-in or from [backends])
    decode_backend = "auto"            # auto | a name (built-in or from [decode_backends])

    [backends]                         # prefill backend class overrides, by dotted path
    FLASHINFER = "my_pkg.prefill.MyFlashInfer"
    MY_KERNEL = "my_pkg.prefill.MyKernel"      # a new name adds a backend

    [decode_backends]                  # decode backend class overrides, likewise
    MY_DECODE = "my_pkg.decode.MyDecode"

    [[kv_cache_specs]]                 # extra KV-cache spec registrations
    spec = "my_pkg.kv.MySpec"
    manager = "my_pkg.kv.MyManager"
    uniform_base = "app.kvcache.FullAttentionSpec"   # optional

    [model]      # EngineConfig sections (see app.config)
    [attention]
    [cache]

``load(path)`` validates the whole file before it builds anything, so a bad file raises one
error (``ValueError``, ``TypeError`` or ``ImportError``) naming the key, the value and what is
allowed, and nothing is half-applied. Two deployments loaded in one process are independent.
Class paths are imported: load only files the deployer controls.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from app._container_state import rollback_on_error
from app._files import load_toml
from app._imports import import_object
from app.backends.registry import (
    DECODE,
    PREFILL,
    BackendKind,
    check_backend_class,
    check_name_form,
    check_new_name,
    register_backend,
)
from app.config import EngineConfig
from app.containers import Application, create_container
from app.kvcache.specs import KVCacheSpec
from app.platforms import Platform, parse_device_capability, platform_for_device

__all__ = ["Deployment", "load", "parse", "parse_dict"]

_TOP_LEVEL = {"deployment", "backends", "decode_backends", "kv_cache_specs", "model",
              "attention", "cache"}
_DEPLOYMENT_KEYS = {"name", "platform", "prefill_backend", "decode_backend"}
_SPEC_KEYS = {"spec", "manager", "uniform_base"}
_PLATFORM_ALLOWED = "'auto', 'cpu', 'cuda', 'cuda:<major>.<minor>' or a Platform class path"


@attrs.frozen
class _SpecBinding:
    spec: type[Any]
    manager: type[Any]
    uniform_base: type[Any] | None


@attrs.frozen
class Deployment:
    """A parsed, validated deployment file (``parse``); ``build()`` makes its container."""

    name: str
    source: str
    platform: Platform | None
    prefill_backend: str | None
    backend_overrides: dict[str, type[Any]]
    kv_cache_specs: tuple[_SpecBinding, ...]
    #: The validated ``[model]``/``[attention]``/``[cache]`` config (built once, at parse).
    config: EngineConfig
    decode_backend: str | None = None
    decode_backend_overrides: dict[str, type[Any]] = attrs.field(factory=dict)

    def build(self) -> Application:
        """A fresh container with this deployment's platform, backends, specs and config.

        Everything is checked before anything is registered, and a failure takes back what
        was registered (``rollback_on_error``): a refused build adds no backend name to the
        process-wide enum."""
        container = create_container(self.config, platform=self.platform)
        kinds = ((PREFILL, self.backend_overrides), (DECODE, self.decode_backend_overrides))
        try:
            # Every new name against this container first (a general plugin may have taken
            # one here since parse()).
            for kind, overrides in kinds:
                backends = kind.backends_of(container)
                for name in overrides:
                    if name not in kind.catalog:
                        check_new_name(kind, backends, name)
            with rollback_on_error():
                # Container-local registrations first: a spec conflict fails before any new
                # backend name reaches the process-wide enum.
                bindings = container.kv_cache_spec_bindings()
                for binding in self.kv_cache_specs:
                    bindings.register(binding.spec, binding.manager,
                                      uniform_type_base_spec=binding.uniform_base)
                for kind, overrides in kinds:
                    backends = kind.backends_of(container)
                    for name, cls in overrides.items():
                        # An existing name is overridden; a new name is added to the catalog.
                        register_backend(kind, backends, name, cls,
                                         new_name=name not in kind.catalog)
        except (ValueError, TypeError, ImportError) as exc:
            if str(exc).startswith(self.source):
                raise
            raise type(exc)(f"{self.source}: {exc}") from exc
        return container


def load(path: str | Path) -> Application:
    """Read a deployment file and return a fresh container configured by it."""
    return parse(path).build()


def parse(path: str | Path) -> Deployment:
    """Read and validate a deployment file without building anything."""
    data = load_toml(path, "deployment file")
    return parse_dict(data, source=f"deployment file {str(path)!r}")


def parse_dict(data: Mapping[str, Any], source: str = "deployment") -> Deployment:
    """Validate a deployment given as a dict (the parsed TOML)."""
    if not isinstance(data, Mapping):
        raise TypeError(f"{source}: expected a table (a dict of sections), got {data!r} "
                        f"({type(data).__name__})")
    _check_keys(source, "", data, _TOP_LEVEL)
    section = _table(source, "deployment", data.get("deployment", {}))
    _check_keys(source, "deployment.", section, _DEPLOYMENT_KEYS)
    name = section.get("name", "")
    if not isinstance(name, str):
        raise TypeError(f"{source}: deployment.name = {name!r}: expected a string")
    overrides = _backend_overrides(source, PREFILL,
                                   _table(source, "backends", data.get("backends", {})))
    decode_overrides = _backend_overrides(
        source, DECODE, _table(source, "decode_backends", data.get("decode_backends", {})))
    prefill_backend = _backend_name(source, PREFILL, section.get("prefill_backend", "auto"),
                                    overrides)
    decode_backend = _backend_name(source, DECODE, section.get("decode_backend", "auto"),
                                   decode_overrides)
    sections = {key: dict(_table(source, key, data[key]))
                for key in ("model", "attention", "cache") if key in data}
    # The config may force a name [backends] adds: declared while it is built, added to the
    # catalog only when the container is built.
    with PREFILL.catalog.declared(overrides), DECODE.catalog.declared(decode_overrides):
        config = _engine_config(source, sections, {PREFILL: prefill_backend,
                                                   DECODE: decode_backend})
    return Deployment(
        name=name, source=source,
        platform=_platform(source, section.get("platform", "auto")),
        prefill_backend=prefill_backend, backend_overrides=overrides,
        kv_cache_specs=_kv_cache_specs(source, data.get("kv_cache_specs", [])),
        config=config, decode_backend=decode_backend,
        decode_backend_overrides=decode_overrides)


def _check_keys(source: str, prefix: str, table: Mapping[str, Any], allowed: set[str]) -> None:
    for key in table:
        if not isinstance(key, str):
            raise TypeError(f"{source}: key {prefix}{key!r}: expected a string key, got "
                            f"{type(key).__name__}; allowed: {sorted(allowed)}")
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ValueError(f"{source}: unknown key '{prefix}{unknown[0]}'; "
                         f"allowed: {sorted(allowed)}")


def _table(source: str, key: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise TypeError(f"{source}: {key} = {value!r}: expected a table")
    return value


def _platform(source: str, value: object) -> Platform | None:
    where = f"{source}: deployment.platform = {value!r}"
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected {_PLATFORM_ALLOWED}")
    if value == "auto":
        return None
    if value == "cpu":
        return platform_for_device("cpu")
    try:
        if value.startswith("cuda:"):
            capability = parse_device_capability(value.removeprefix("cuda:"))
            return platform_for_device("cuda", capability)
        if value == "cuda":
            return platform_for_device("cuda")
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}") from None
    if "." not in value:
        raise ValueError(f"{where}: expected {_PLATFORM_ALLOWED}")
    cls = _import(source, "deployment.platform", value)
    if not (isinstance(cls, type) and issubclass(cls, Platform)):
        raise TypeError(f"{where}: {cls!r} is not a Platform subclass")
    try:
        platform: Platform = cls()
    except Exception as exc:  # a third party's constructor: any failure is a bad platform
        raise ValueError(f"{where}: constructing {cls.__name__}() raised "
                         f"{type(exc).__name__}: {' '.join(str(exc).split())}") from exc
    return platform


def _backend_overrides(source: str, kind: BackendKind, table: Mapping[str, Any]
                       ) -> dict[str, type[Any]]:
    key = "backends" if kind is PREFILL else f"{kind.name}_backends"
    result: dict[str, type[Any]] = {}
    for name, path in table.items():
        where = f"{source}: {key}.{name} = {path!r}"
        if not isinstance(name, str):
            raise TypeError(f"{source}: {key} key {name!r}: a backend name must be a string "
                            f"(an upper-case identifier, e.g. MY_KERNEL), got "
                            f"{type(name).__name__}")
        if not name.isidentifier() or name != name.upper() or name.startswith("_"):
            raise ValueError(f"{where}: a backend name must be an upper-case identifier not "
                             f"starting with '_' (e.g. MY_KERNEL)")
        if name not in kind.catalog:  # a new name: what registering it would refuse
            try:
                check_name_form(kind, name)
            except ValueError as exc:
                raise ValueError(f"{where}: {exc}") from None
        if not isinstance(path, str):
            raise TypeError(f"{where}: expected a dotted class path string")
        result[name] = check_backend_class(kind, _import(source, f"{key}.{name}", path), where)
    return result


def _backend_name(source: str, kind: BackendKind, value: object,
                  overrides: Mapping[str, Any]) -> str | None:
    key = f"deployment.{kind.name}_backend"
    where = f"{source}: {key} = {value!r}"
    if not isinstance(value, str):
        raise TypeError(f"{where}: expected 'auto' or a backend name")
    if value.lower() == "auto":
        return None
    name = value.upper()
    known = list(kind.catalog)
    if name not in known and name not in overrides:
        raise ValueError(f"{where}: unknown backend; allowed: 'auto', "
                         f"{', '.join(known + sorted(set(overrides) - set(known)))}")
    return name


def _kv_cache_specs(source: str, entries: object) -> tuple[_SpecBinding, ...]:
    from app.kvcache.managers import SingleTypeKVCacheManager

    if not isinstance(entries, list):
        raise TypeError(f"{source}: kv_cache_specs = {entries!r}: expected an array of tables "
                        "([[kv_cache_specs]])")
    bindings = []
    for i, entry in enumerate(entries):
        key = f"kv_cache_specs[{i}]"
        table = _table(source, key, entry)
        _check_keys(source, f"{key}.", table, _SPEC_KEYS)
        for required in ("spec", "manager"):
            if required not in table:
                raise ValueError(f"{source}: {key} is missing {required!r}; "
                                 f"required: ['manager', 'spec']")
        classes: dict[str, type[Any] | None] = {}
        for field in ("spec", "manager", "uniform_base"):
            path = table.get(field)
            if path is None:
                classes[field] = None
                continue
            if not isinstance(path, str):
                raise TypeError(f"{source}: {key}.{field} = {path!r}: expected a class path")
            obj = _import(source, f"{key}.{field}", path)
            if not isinstance(obj, type):
                raise TypeError(f"{source}: {key}.{field} = {path!r}: {obj!r} is not a class")
            if field != "manager" and not issubclass(obj, KVCacheSpec):
                raise TypeError(f"{source}: {key}.{field} = {path!r}: not a KVCacheSpec "
                                "subclass")
            if field == "manager" and not issubclass(obj, SingleTypeKVCacheManager):
                raise TypeError(f"{source}: {key}.{field} = {path!r}: not a "
                                "SingleTypeKVCacheManager subclass")
            classes[field] = obj
        spec, manager = classes["spec"], classes["manager"]
        if spec is None or manager is None:  # pragma: no cover - checked above
            raise ValueError(f"{source}: {key} needs spec and manager")
        base = classes["uniform_base"]
        if base is not None and not issubclass(spec, base):
            raise ValueError(f"{source}: {key}.uniform_base = {table['uniform_base']!r}: "
                             f"{spec.__name__} does not inherit from it")
        bindings.append(_SpecBinding(spec=spec, manager=manager,
                                     uniform_base=classes["uniform_base"]))
    return tuple(bindings)


def _import(source: str, key: str, path: str) -> Any:
    try:
        return import_object(path)
    except (ImportError, ValueError) as exc:
        raise ImportError(f"{source}: {key} = {path!r} does not import: {exc}") from None


def _engine_config(source: str, sections: dict[str, dict[str, Any]],
                   forced: Mapping[BackendKind, str | None]) -> EngineConfig:
    sections = {k: dict(v) for k, v in sections.items()}
    attention = sections.setdefault("attention", {})
    for kind, name in forced.items():
        if name is None:
            continue
        given = attention.get(kind.config_field)
        if given is not None and str(given).upper() != name:
            raise ValueError(f"{source}: deployment.{kind.name}_backend = {name!r} conflicts "
                             f"with attention.{kind.config_field} = {given!r}; give one")
        attention[kind.config_field] = name
    try:
        return EngineConfig.from_dict(sections)
    except (ValueError, TypeError) as exc:
        raise type(exc)(f"{source}: {exc}") from None

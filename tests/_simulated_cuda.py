"""A CUDA device simulated on the CPU: what would make the host wait for a GPU, counted.

Tensors "on the GPU" are ``SimTensor`` s: wrapper tensors that say ``cuda:0`` and hold a CPU
tensor; every op on them runs on the CPU (a ``TorchDispatchMode``), so the library's CUDA code
paths (``device.type == "cuda"`` branches, ``copy_to_device``, the GPU backends with stand-in
kernels) run here unchanged. Each crossing between host and device is recorded where CUDA would
make the host wait:

- a **readback**: a device value read on the host (``tolist``, ``item``, ``bool``, ``int``,
  ``float``, ``.cpu()``, a copy into a host tensor), or an op whose output size depends on device
  values (``nonzero``, boolean-mask indexing, ``bincount``, ``unique``, ``masked_select``,
  ``repeat_interleave`` without ``output_size``);
- a **blocking upload**: a host tensor copied to the device from pageable memory or without
  ``non_blocking`` (torch then waits for the stream), ``torch.tensor(..., device="cuda")``, a
  host tensor other than a 0-dim scalar handed to an op on device tensors.

Non-blocking uploads from pinned memory (``pin_memory()``, simulated) are recorded but do not
wait. The stand-in kernels' own work runs inside ``kernel()`` and is not recorded (on a GPU it
is the kernel's). Nothing here touches a real GPU; ``torch.cuda`` is patched for the duration.
"""

from __future__ import annotations

import contextlib
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)

#: Ops whose output size depends on device values: CUDA reads them back first.
_DATA_DEPENDENT = {"aten.nonzero.default", "aten.masked_select.default",
                   "aten.bincount.default", "aten._unique2.default", "aten.unique_dim.default",
                   "aten.unique_consecutive.default", "aten.repeat_interleave.Tensor"}
_READ_METHODS = {torch.Tensor.tolist, torch.Tensor.item, torch.Tensor.__bool__,
                 torch.Tensor.__int__, torch.Tensor.__float__, torch.Tensor.__index__,
                 torch.Tensor.numpy, torch.Tensor.cpu}


class SimTensor(torch.Tensor):
    """A tensor "on cuda:0" whose data is the CPU tensor ``inner``."""

    inner: torch.Tensor

    @staticmethod
    def __new__(cls, inner: torch.Tensor) -> SimTensor:
        r = torch.Tensor._make_wrapper_subclass(  # type: ignore[attr-defined]
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(),
            dtype=inner.dtype, device=CUDA, requires_grad=False)
        r.inner = inner
        return r  # type: ignore[no-any-return]

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SimTensor({self.inner!r})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        raise RuntimeError(f"{func} on a SimTensor outside SimulatedCuda")


@attrs.frozen
class Event:
    """One crossing: ``kind`` (``readback``, ``upload``, ``async upload``, ``mixed``), what did
    it, and where in the library (the innermost ``app/`` frame)."""

    kind: str
    what: str
    where: str

    @property
    def waits(self) -> bool:
        """Whether the host waits for the device here."""
        return self.kind != "async upload"


def _where() -> str:
    frames = [f for f in traceback.extract_stack() if "/app/" in f.filename]
    if not frames:
        return "?"
    f = frames[-1]
    return f"{f.filename.split('/app/')[-1]}:{f.lineno} ({f.name})"


def _is_cuda(device: object) -> bool:
    return device is not None and torch.device(device).type == "cuda"  # type: ignore[arg-type]


class SimulatedCuda:
    """``with SimulatedCuda(monkeypatch) as sim:`` everything on ``cuda`` is simulated;
    ``with sim.recording():`` collects ``events``; ``with sim.kernel():`` hides a stand-in
    kernel's own work. ``waits()``: the recorded events that make the host wait."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.events: list[Event] = []
        #: Ops on device tensors while recording (outside kernels): launches and views.
        self.device_ops = 0
        self._recording = False
        self._kernel_depth = 0
        self._pinned: set[int] = set()   # ids of live simulated pinned tensors
        self._stack = contextlib.ExitStack()

    # -- scopes -------------------------------------------------------------------------

    def __enter__(self) -> SimulatedCuda:
        patch = self.monkeypatch.setattr
        patch(torch.cuda, "_lazy_init", lambda: None)
        patch(torch.cuda, "is_available", lambda: True)
        patch(torch.cuda, "mem_get_info", lambda device=None: (64 << 30, 80 << 30))
        patch(torch.cuda, "synchronize", lambda device=None: None)
        self._stack.enter_context(_Dispatch(self))
        self._stack.enter_context(_Functions(self))
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Record the crossings inside the block."""
        self._recording = True
        try:
            yield
        finally:
            self._recording = False

    @contextlib.contextmanager
    def kernel(self) -> Iterator[None]:
        """A stand-in kernel's own work: not recorded (on a GPU it runs on the device)."""
        self._kernel_depth += 1
        try:
            yield
        finally:
            self._kernel_depth -= 1

    def as_kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        """``fn`` run inside ``kernel()``."""
        def run(*args: Any, **kwargs: Any) -> Any:
            with self.kernel():
                return fn(*args, **kwargs)
        return run

    def is_pinned(self, host: torch.Tensor) -> bool:
        """Whether ``host`` is (simulated) pinned memory."""
        return id(host) in self._pinned

    def waits(self) -> list[Event]:
        """The recorded events that make the host wait for the device."""
        return [e for e in self.events if e.waits]

    # -- recording ------------------------------------------------------------------------

    def record(self, kind: str, what: str) -> None:
        if self._recording and not self._kernel_depth:
            self.events.append(Event(kind, what, _where()))

    def upload(self, host: torch.Tensor, non_blocking: bool, what: str) -> None:
        pinned = id(host) in self._pinned
        self.record("async upload" if non_blocking and pinned else "upload",
                    f"{what} ({'pinned' if pinned else 'pageable'}, non_blocking="
                    f"{non_blocking})")

    def pin(self, host: torch.Tensor) -> torch.Tensor:
        pinned = host.clone()
        self._pinned.add(id(pinned))
        weakref.finalize(pinned, self._pinned.discard, id(pinned))
        return pinned


def _unwrap(x: Any) -> Any:
    return x.inner if isinstance(x, SimTensor) else x


class _Dispatch(TorchDispatchMode):
    """Runs every op on the CPU, wraps what lands "on cuda", records crossings."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        name = str(func)
        flat, _ = tree_flatten((args, kwargs))
        sims = [x for x in flat if isinstance(x, SimTensor)]
        hosts = [x for x in flat if isinstance(x, torch.Tensor)
                 and not isinstance(x, SimTensor)]
        to_cuda = _is_cuda(kwargs.get("device"))
        if to_cuda:
            kwargs["device"] = torch.device("cpu")
        if name == "aten._to_copy.default" and sims and kwargs.get("device") is not None \
                and not to_cuda:
            self.sim.record("readback", "copy to the host")
            return func(*tree_map(_unwrap, args), **tree_map(_unwrap, kwargs))
        if name == "aten.copy_.default" and len(args) >= 2:
            dst, src = args[0], args[1]
            if isinstance(dst, SimTensor) and not isinstance(src, SimTensor) and src.dim():
                self.sim.upload(src, bool(args[2]) if len(args) > 2 else False, "copy_")
            elif isinstance(src, SimTensor) and not isinstance(dst, SimTensor):
                self.sim.record("readback", "copy_ into a host tensor")
        elif sims:
            if name in _DATA_DEPENDENT or (name.startswith("aten.index.Tensor") and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool
                    for i in (args[1] if len(args) > 1 else []) if i is not None)):
                self.sim.record("readback", f"{name} (output size read from the device)")
            elif name == "aten._local_scalar_dense.default":
                self.sim.record("readback", "a device scalar read on the host")
            big_hosts = [h for h in hosts if h.dim() > 0 and h.numel() > 1]
            if big_hosts and not name.startswith("aten.copy_"):
                self.sim.record("mixed", f"{name} with a host tensor of shape "
                                         f"{list(big_hosts[0].shape)}")
        if (sims or to_cuda) and self.sim._recording and not self.sim._kernel_depth:
            self.sim.device_ops += 1
        inner_args, inner_kwargs = tree_map(_unwrap, args), tree_map(_unwrap, kwargs)
        out = func(*inner_args, **inner_kwargs)
        if not (sims or to_cuda):
            return out
        inputs = {id(_unwrap(x)): x for x in flat if isinstance(x, SimTensor)}

        def wrap(x: Any) -> Any:
            if not isinstance(x, torch.Tensor) or isinstance(x, SimTensor):
                return x
            if id(x) in inputs:        # in place / out=: the caller's own device tensor
                return inputs[id(x)]
            return SimTensor(x)

        if name == "aten._local_scalar_dense.default":
            return out
        return tree_map(wrap, out)


def _index(sim: SimulatedCuda, index: Any) -> Any:
    def unwrap(i: Any) -> Any:
        if isinstance(i, SimTensor) and i.dtype == torch.bool:
            sim.record("readback", "boolean-mask indexing (output size read from the device)")
        return _unwrap(i)
    return tree_map(unwrap, index)


def _getitem(sim: SimulatedCuda, t: SimTensor, index: Any) -> SimTensor:
    return SimTensor(t.inner[_index(sim, index)])


def _setitem(sim: SimulatedCuda, t: SimTensor, index: Any, value: Any) -> None:
    if isinstance(value, torch.Tensor) and not isinstance(value, SimTensor) and value.dim():
        sim.upload(value, False, "__setitem__")
    t.inner[_index(sim, index)] = _unwrap(value)


def _contiguous(sim: SimulatedCuda, t: SimTensor, *args: Any, **kwargs: Any) -> SimTensor:
    if t.is_contiguous(*args, **kwargs):
        return t
    return SimTensor(t.inner.contiguous(*args, **kwargs))


def _copy(sim: SimulatedCuda, t: SimTensor, src: torch.Tensor, non_blocking: bool = False
          ) -> SimTensor:
    out: SimTensor = torch.ops.aten.copy_.default(t, src, non_blocking)
    return out


_GUARDED: dict[Any, Callable[..., Any]] = {
    torch.Tensor.__getitem__: _getitem, torch.Tensor.__setitem__: _setitem,
    torch.Tensor.contiguous: _contiguous, torch.Tensor.copy_: _copy,
    torch.Tensor.__invert__: lambda sim, t: torch.bitwise_not(t)}


def _target(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, bool]:
    """The device and ``non_blocking`` of a ``Tensor.to`` call."""
    device, non_blocking = kwargs.get("device"), bool(kwargs.get("non_blocking", False))
    bools = []
    for a in args:
        if isinstance(a, (torch.device, str)):
            device = a
        elif isinstance(a, torch.Tensor):
            device = a.device
        elif isinstance(a, bool):
            bools.append(a)
    if bools:
        non_blocking = bools[0]
    return device, non_blocking


class _Functions(TorchFunctionMode):
    """Host reads of device values, uploads and simulated pinned memory."""

    def __init__(self, sim: SimulatedCuda) -> None:
        super().__init__()
        self.sim = sim

    def __torch_function__(self, func: Any, types: Any, args: Any = (),
                           kwargs: Any = None) -> Any:
        kwargs = dict(kwargs or {})
        sim = self.sim
        first = args[0] if args else None
        if func in _READ_METHODS and isinstance(first, SimTensor):
            sim.record("readback", f"Tensor.{func.__name__}")
            return func(first.inner, *args[1:], **kwargs)
        if isinstance(first, SimTensor) and func in _GUARDED:
            # these bindings open a CUDA device guard before any dispatch: done on the data
            return _GUARDED[func](sim, first, *args[1:], **kwargs)
        if func is torch.Tensor.pin_memory:
            return sim.pin(first)
        if func is torch.Tensor.data_ptr and isinstance(first, SimTensor):
            return first.inner.data_ptr()
        if func in (torch.Tensor.to, torch.Tensor.cuda) and isinstance(first, torch.Tensor):
            device, non_blocking = (_target(args[1:], kwargs) if func is torch.Tensor.to
                                    else (CUDA, bool(kwargs.get("non_blocking", False))))
            if _is_cuda(device) and not isinstance(first, SimTensor):
                sim.upload(first, non_blocking, "Tensor.to")
                rest = {k: v for k, v in kwargs.items()
                        if k in ("dtype", "memory_format")}
                dtype = next((a for a in args[1:] if isinstance(a, torch.dtype)), None)
                moved = first.to(dtype=dtype or rest.get("dtype") or first.dtype, copy=True)
                return SimTensor(moved)
            if device is not None and not _is_cuda(device) and isinstance(first, SimTensor):
                sim.record("readback", "Tensor.to(cpu)")
                return func(first.inner, *args[1:], **kwargs)
        if func in (torch.tensor, torch.as_tensor) and _is_cuda(kwargs.get("device")):
            sim.record("upload", f"torch.{func.__name__}(..., device=cuda) (pageable)")
            kwargs["device"] = "cpu"
            return SimTensor(func(*args, **kwargs))
        return func(*args, **kwargs)

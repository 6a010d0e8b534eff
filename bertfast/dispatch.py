"""Backend selection for the fused ops (after xformers' dispatch).

Each op form bertfast.registry lists has three backends, registered here on first use and tried
in preference order (``PREFERENCE``). A backend is a module implementing the op's launcher
contract (``<op>_fwd``/``<op>_bwd`` functions with the same signatures for every backend) plus
two questions:

* ``availability()``: can it run at all on this machine (imports, built extension)?
* ``not_supported_reasons(forced, **inputs)``: can it run these inputs (device, dtype, sizes)?

The first backend with no reasons runs. A forced backend (``BERTFAST_BACKEND=torch|triton|cuda``,
``BERTFAST_BACKEND_<OP>=...``, or ``use_backend``) runs or raises; it never falls back. When
nothing fits, one error lists every backend and why. When a backend that would have served a
CUDA input is unavailable (a broken build, a failed import), the op falls back to the next one
and says so: a warning once, and a record that ``bertfast info`` prints.

Choices are cached (``select`` runs on every op call, and asking every backend costs tens of
microseconds of host time): keyed by the op, the forced backend, each input's device, dtype and
shape (the only properties ``not_supported_reasons`` may read), TRITON_INTERPRET, and each
backend's availability and state (``state_fn``: the CUDA backend's device type).
``register_backend``, a change of bertfast.registry's list and ``reload_preferences`` clear the
cache, as does ``clear_cache()``. Errors are never cached.
"""
from __future__ import annotations

import contextlib
import importlib
import json
import logging
import os
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Mapping, Optional, Tuple, Union

import torch

log = logging.getLogger("bertfast.dispatch")

BACKEND_NAMES = ("torch", "triton", "cuda")
# Default order. On a GPU where `bertfast bench` timed both fast backends, the measured order
# (bertfast.bench.preference) replaces the first two for that GPU model.
PREFERENCE = ("triton", "cuda", "torch")

ReasonsFn = Callable[..., List[str]]
_MEASURED: Optional[Dict[str, Dict[str, List[str]]]] = None  # GPU name -> op -> fastest-first backends
_DEVICE_NAMES: Dict[int, str] = {}  # CUDA device index -> name: asked once, not on every op call


def preference_file() -> str:
    """Where `bertfast bench` records the measured backend order per GPU (BERTFAST_PREFERENCE_FILE)."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "bertfast", "backend_preference.json")
    return os.environ.get("BERTFAST_PREFERENCE_FILE", default)


def read_preferences(path: Optional[str] = None) -> Dict[str, Dict[str, List[str]]]:
    path = path or preference_file()
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        log.warning("bertfast: ignoring unreadable backend preference file %s: %s", path, exc)
        return {}


def reload_preferences() -> None:
    global _MEASURED
    _MEASURED = None
    _DEVICE_NAMES.clear()
    clear_cache()


def preference(op: str, device: Optional[torch.device]) -> Tuple[str, ...]:
    """PREFERENCE, with the fast backends reordered as measured on this GPU model, if measured."""
    global _MEASURED
    if device is None or device.type != "cuda":
        return PREFERENCE
    if _MEASURED is None:
        _MEASURED = read_preferences()
    index = device.index if device.index is not None else torch.cuda.current_device()
    name = _DEVICE_NAMES.get(index)
    if name is None:
        name = _DEVICE_NAMES[index] = torch.cuda.get_device_name(index)
    measured = _MEASURED.get(name, {}).get(op)
    if not measured:
        return PREFERENCE
    return tuple(measured) + tuple(name for name in PREFERENCE if name not in measured)


@dataclass
class Backend:
    """One implementation of one op."""

    op: str
    name: str
    module: str  # import path of the module holding the launcher functions
    not_supported_reasons: ReasonsFn
    availability_fn: Callable[[], Tuple[bool, str]] = field(default=lambda: (True, ""))
    auto_select: bool = True  # False: runs only when forced
    # What else its reasons read (beyond the inputs), for the decision cache's key; None: nothing
    state_fn: Optional[Callable[[], object]] = None
    _impl: object = field(default=None, repr=False)
    _available: Optional[Tuple[bool, str]] = field(default=None, repr=False)

    def availability(self) -> Tuple[bool, str]:
        if self._available is None:
            ok, reason = self.availability_fn()
            if ok:
                try:
                    self._impl = importlib.import_module(self.module)
                except Exception as exc:  # a broken kernel module must be visible, not hidden
                    ok, reason = False, f"import of {self.module} failed: {type(exc).__name__}: {exc}"
            self._available = (ok, reason)
        return self._available

    @property
    def impl(self):
        ok, reason = self.availability()
        if not ok:
            raise RuntimeError(f"bertfast: backend {self.name!r} of op {self.op!r} is unavailable: {reason}")
        return self._impl

    def reasons(self, forced: bool, **inputs) -> List[str]:
        ok, reason = self.availability()
        if not ok:
            return [reason]
        return self.not_supported_reasons(forced=forced, **inputs)


_REGISTRY: Dict[str, Dict[str, Backend]] = {}
_OVERRIDES: List[Dict[str, str]] = []  # stack of use_backend() contexts
FALLBACKS: Dict[Tuple[str, str], str] = {}  # (op, skipped backend) -> reason, for `bertfast info`


def register_backend(backend: Backend) -> None:
    """Add or replace a backend of an op (tests use this to inject a deliberately wrong one)."""
    if backend.name not in BACKEND_NAMES:
        raise ValueError(f"backend name must be one of {BACKEND_NAMES}, got {backend.name!r}")
    _REGISTRY.setdefault(backend.op, {})[backend.name] = backend
    clear_cache()


_SYNCED: Dict[str, object] = {}  # form -> the registry Op its backends were registered from
_IN_SYNC = False


def _register_ops() -> None:
    """Every form of every op in bertfast.registry gets its backends here, on first use and again
    after the list changes (registry.register, registry.registered); backends registered over them
    since (tests inject deliberately wrong ones) stay until the form's op changes."""
    global _IN_SYNC
    if _IN_SYNC:
        return
    from bertfast import registry
    current = {f.name: op for op in registry.ops() for f in op.forms}
    for name, op in list(_SYNCED.items()):
        if current.get(name) is not op:
            _REGISTRY.pop(name, None)
            del _SYNCED[name]
    for name, op in current.items():
        if name not in _SYNCED:
            register_backends(op, name)
            _SYNCED[name] = op
    _IN_SYNC = True


def registry_changed() -> None:
    """bertfast.registry calls this when its list changes: the next question re-reads it."""
    global _IN_SYNC
    _IN_SYNC = False
    clear_cache()


def register_backends(op, form: str) -> None:
    """Register the torch, triton and cuda backends of one form of ``op`` (a bertfast.registry.Op),
    implemented in ``op.module(backend)``.

    A fused backend runs an input when its device fits, the form's float inputs are fp32, fp16 or
    bf16, and its module's ``unsupported(inputs)`` gives no reason. ``unsupported`` may read only the
    inputs' device, dtype and shape: dispatch caches its answer per those.
    """
    float_inputs = next(f for f in op.forms if f.name == form).float_inputs

    def fused_reasons(name: str):
        def reasons(forced: bool, **inputs) -> List[str]:
            out = device_reasons(name, forced, inputs)
            out += dtype_reasons({k: inputs[k] for k in float_inputs if k in inputs})
            return out or get(form, name).impl.unsupported(inputs)
        return reasons

    register_backend(Backend(form, "torch", op.module("torch"), lambda forced, **inputs: []))
    register_backend(Backend(form, "triton", op.module("triton"), fused_reasons("triton"),
                             availability_fn=triton_availability))
    register_backend(Backend(form, "cuda", op.module("cuda"), fused_reasons("cuda"),
                             availability_fn=cuda_ext_availability, state_fn=_cuda_state))


def backends(op: str) -> Dict[str, Backend]:
    _register_ops()
    if op not in _REGISTRY:
        raise ValueError(f"unknown op {op!r}; known ops: {ops()}")
    return _REGISTRY[op]


def ops() -> List[str]:
    """The dispatch forms, in bertfast.registry's order (then any registered only here)."""
    _register_ops()
    from bertfast import registry
    listed = [f.name for f in registry.forms()]
    return listed + sorted(name for name in _REGISTRY if name not in listed)


def get(op: str, name: str) -> Backend:
    table = backends(op)
    if name not in table:
        raise ValueError(f"op {op!r} has no backend {name!r}; it has {sorted(table)}")
    return table[name]


def _getenv(name: str) -> Optional[str]:
    """os.environ.get(name) without its two exceptions per unset name (~2 us; select reads three
    names on every op call). Still live: tests and users may set them at any time."""
    env = os.environ
    try:
        raw = env._data.get(env.encodekey(name))
    except AttributeError:  # not CPython's os._Environ
        return env.get(name)
    return None if raw is None else env.decodevalue(raw)


_OP_ENV: Dict[str, str] = {}  # op -> its BERTFAST_BACKEND_<OP> variable


def _env_override(op: str) -> Optional[str]:
    name = _OP_ENV.get(op)
    if name is None:
        name = _OP_ENV[op] = f"BERTFAST_BACKEND_{op.upper()}"
    value = _getenv(name) or _getenv("BERTFAST_BACKEND")
    if value and value not in BACKEND_NAMES:
        raise ValueError(f"BERTFAST_BACKEND must be one of {BACKEND_NAMES}, got {value!r}")
    return value or None


def forced_backend(op: str) -> Optional[str]:
    for overrides in reversed(_OVERRIDES):
        if op in overrides:
            return overrides[op]
        if "*" in overrides:
            return overrides["*"]
    return _env_override(op)


@contextlib.contextmanager
def use_backend(choice: Union[str, Mapping[str, str]]) -> Iterator[None]:
    """Force a backend for every op (``"triton"``) or per op (``{"attention_varlen": "torch"}``)."""
    overrides = {"*": choice} if isinstance(choice, str) else dict(choice)
    for name in overrides.values():
        if name not in BACKEND_NAMES:
            raise ValueError(f"backend must be one of {BACKEND_NAMES}, got {name!r}")
    _OVERRIDES.append(overrides)
    try:
        yield
    finally:
        _OVERRIDES.pop()


class NoBackendError(ValueError):
    pass


# ---------------------------------------------------------------- the decision cache
CACHE_SIZE = 4096  # choices kept (least recently used dropped): unpadded batches change the row count
_CACHE: "OrderedDict[tuple, str]" = OrderedDict()


def clear_cache() -> None:
    """Forget every cached backend choice (after anything a choice depends on has changed)."""
    _CACHE.clear()


def _cache_key(op: str, forced: Optional[str], inputs: Mapping[str, object]) -> Optional[tuple]:
    """Everything ``_select`` reads, as a hashable key (None: do not cache, e.g. an unknown op).
    Of a tensor input: its device, dtype and full shape (a limit may read any size, e.g. the CUDA
    attention's batch); of any other input, its value."""
    table = _REGISTRY.get(op)
    if table is None:
        return None
    return (op, forced, _getenv("TRITON_INTERPRET"),
            # the table's backends, their availability and state (tests replace all three)
            tuple([(id(b), b._available, b.state_fn and b.state_fn()) for b in table.values()]),
            tuple([(name, (v.device, v.dtype, v.shape) if isinstance(v, torch.Tensor) else v)
                   for name, v in inputs.items()]))


def select(op: str, **inputs) -> str:
    """Name of the backend that runs ``op`` on these inputs (only their metadata is read).

    Outside torch.compile the choice is cached (see the module docstring). Under torch.compile
    it is made once at trace time from a description of the inputs and baked into the graph as
    a constant (Dynamo never traces the dispatcher).
    """
    if torch.compiler.is_compiling():
        spec = tuple((name, None if t is None else (t.device.type, t.device.index, str(t.dtype).split(".")[-1],
                                                    _described_shape(t)))
                     for name, t in inputs.items())
        return _select_from_spec(op, spec)
    forced = forced_backend(op)  # resolved first: part of the key
    try:
        key = _cache_key(op, forced, inputs)
        hit = _CACHE.get(key) if key is not None else None
    except TypeError:  # an unhashable input value: decide without the cache
        key = hit = None
    if hit is not None:
        try:
            _CACHE.move_to_end(key)
        except KeyError:  # dropped by another thread meanwhile
            pass
        return hit
    name = _select(op, forced, **inputs)  # raises, never cached, when nothing can run these inputs
    if key is not None:
        # Keyed on the state after deciding: a backend's availability is filled in on first use.
        _CACHE[_cache_key(op, forced, inputs)] = name
        while len(_CACHE) > CACHE_SIZE:
            try:
                _CACHE.popitem(last=False)
            except KeyError:  # emptied by another thread meanwhile
                break
    return name


def _described_shape(t: torch.Tensor) -> Tuple[int, ...]:
    """A traced input's shape as constants for ``_select_from_spec``: a float input's last size (features,
    head dim: what backends' limits read, static since it comes from the weights), every other size
    described as 1. Rows are data-dependent on the unpadded path, and a sequence length is symbolic
    once a dynamic-shape compile has seen two (Dynamo cannot pass a symbolic size as a constant)."""
    if t.dim() == 0:
        return ()
    return (1,) * (t.dim() - 1) + (int(t.shape[-1]) if t.is_floating_point() else 1,)


@torch.compiler.assume_constant_result
def _select_from_spec(op: str, spec) -> str:
    def stand_in(desc):  # a one-element tensor with the described metadata
        device_type, index, dtype, shape = desc
        return torch.empty_strided(shape, [0] * len(shape), dtype=getattr(torch, dtype),
                                   device=torch.device(device_type, index))

    return _select(op, forced_backend(op), **{name: None if desc is None else stand_in(desc) for name, desc in spec})


def _select(op: str, forced: Optional[str], **inputs) -> str:
    """The choice itself, uncached: ``forced`` (forced_backend(op)) runs or raises, else the first
    backend in preference order with no reasons."""
    table = backends(op)
    if forced is not None:
        reasons = get(op, forced).reasons(True, **inputs)
        if reasons:
            raise NoBackendError(f"bertfast: backend {forced!r} was forced for op {op!r} but cannot run "
                                 f"these inputs: {'; '.join(reasons)}")
        return forced
    why: Dict[str, List[str]] = {}
    cuda = next((t.device for t in inputs.values() if isinstance(t, torch.Tensor) and t.device.type == "cuda"), None)
    for name in preference(op, cuda):
        backend = table.get(name)
        if backend is None:
            continue
        if not backend.auto_select:
            why[name] = ["runs only when forced (BERTFAST_BACKEND)"]
            continue
        reasons = backend.reasons(False, **inputs)
        if not reasons:
            if cuda is not None:
                _note_fallbacks(op, name, why)
            return name
        why[name] = reasons
    listing = "\n".join(f"  {name}: {'; '.join(r)}" for name, r in why.items())
    raise NoBackendError(f"bertfast: no backend of op {op!r} can run these inputs:\n{listing}")


def _note_fallbacks(op: str, chosen: str, skipped: Dict[str, List[str]]) -> None:
    """For a CUDA input: warn once per (op, backend) skipped because it is broken or unavailable."""
    for name in skipped:
        ok, reason = table_availability(op, name)
        if not ok and (op, name) not in FALLBACKS:
            FALLBACKS[(op, name)] = reason
            log.warning("bertfast: op %s falls back from %s to %s: %s", op, name, chosen, reason)


def table_availability(op: str, name: str) -> Tuple[bool, str]:
    return get(op, name).availability()


# ---------------------------------------------------------------- shared support checks
def triton_availability() -> Tuple[bool, str]:
    try:
        import triton  # noqa: F401
    except Exception as exc:
        return False, f"triton is not importable ({type(exc).__name__}: {exc})"
    return True, ""


def cuda_ext_availability() -> Tuple[bool, str]:
    try:
        from bertfast.cuda import _common
    except Exception as exc:
        return False, f"bertfast.cuda failed to import ({type(exc).__name__}: {exc})"
    return _common.extension_status()


def _cuda_state() -> object:
    common = sys.modules.get("bertfast.cuda._common")
    return common.dispatch_state() if common is not None else None


def device_reasons(backend: str, forced: bool, tensors: Mapping[str, Optional[torch.Tensor]]) -> List[str]:
    """Device rules: torch runs anywhere; cuda as bertfast.cuda says (CUDA tensors); triton needs
    CUDA tensors, or CPU tensors under TRITON_INTERPRET=1 when forced (the interpreter is for tests)."""
    devices = {t.device.type for t in tensors.values() if isinstance(t, torch.Tensor)}
    if backend == "torch":
        return []
    if backend == "cuda":
        from bertfast.cuda import _common
        return _common.device_reasons(devices)
    if devices == {"cuda"}:
        return []
    if backend == "triton" and devices <= {"cpu"}:
        if (_getenv("TRITON_INTERPRET") or "0") != "1":
            return ["CPU tensors need TRITON_INTERPRET=1 (the Triton interpreter)"]
        if not forced:
            return ["CPU tensors run the Triton interpreter only when triton is forced"]
        return []
    return [f"needs CUDA tensors, got {sorted(devices)}"]



def dtype_reasons(tensors: Mapping[str, Optional[torch.Tensor]],
                  allowed=(torch.float32, torch.float16, torch.bfloat16)) -> List[str]:
    return [f"{name} has dtype {t.dtype}, expected one of {[str(d) for d in allowed]}"
            for name, t in tensors.items() if isinstance(t, torch.Tensor) and t.dtype not in allowed]

"""How every Triton launcher starts its kernels (argument checks are bertfast.contract's).

Every launcher starts its kernels through ``launch``, which picks the configuration the way this
process is set up to:

  interpreter   TRITON_INTERPRET=1 (CPU tensors): the launcher's fixed interpreter config
                (autotuning cannot run there).
  fixed         BERTFAST_AUTOTUNE=0: the first candidate config of each kernel, no benchmarking;
                every list is ordered so its first candidate is a known-good, spill-free one.
                The GPU check's correctness stage runs this way.
  tuned         the default on GPU: Triton's autotuner over the candidates (the list pruned for
                the shape), each timed briefly; results cached on disk in Triton's cache
                (TRITON_CACHE_DIR), so a later process reuses them without re-tuning.
  compile-only  inside ``compile_only(record)`` (bertfast.gpucheck.compile_report): nothing
                runs; ``record`` receives each launch with its candidate configs.
  pinned        inside ``pinned_candidate(kernel, i)`` (tests): that kernel runs its candidate i,
                the others their first, untimed, so tests can check each candidate's results.

In the tuned and fixed modes the config is chosen on a launch key's first launch; later launches
with that key pass it to the JIT function directly (_LAUNCH_KWARGS).

Kernels that modify their inputs (the in-place softmax-CE, atomics into zeroed buffers) are
tuned once per tuning key on scratch copies of those buffers, then launched on the real ones
with the chosen config: no clone or zeroing inside the timed call, and no trial can clobber
the data.
"""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch
import triton

AUTOTUNE_ENV = "BERTFAST_AUTOTUNE"
# Compile options every launch and every compile for a report passes. FP contraction (FMA) on, as the
# kernels were checked and tuned: triton 3.9 warns on each run that leaves it to the default, and
# triton 3.10 turns that default off.
COMPILE_OPTIONS = {"enable_fp_fusion": True}
# Per config: 5 ms warm-up and 20 ms of timed calls (Triton's default is 25 + 100 ms). The
# choice between candidates that are each a few microseconds apart does not need more.
TUNE_WARMUP_MS = 5
TUNE_REP_MS = 20
MAX_CANDIDATES = 6  # configs tried per tuning key; tests/test_kernel_launch.py holds every kernel to it


def interpreting() -> bool:
    """True when kernels run under the Triton interpreter (TRITON_INTERPRET=1, CPU tensors)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def autotune_enabled() -> bool:
    """False under BERTFAST_AUTOTUNE=0: every autotuned kernel runs its first candidate config."""
    value = os.environ.get(AUTOTUNE_ENV, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{AUTOTUNE_ENV}: expected 0 or 1, got {value!r}")
    return value == "1"


# --------------------------------------------------------------------------- autotuning
def _short_bench(kernel_call, quantiles):
    return triton.testing.do_bench(kernel_call, warmup=TUNE_WARMUP_MS, rep=TUNE_REP_MS, quantiles=quantiles)


def autotune(configs: List[triton.Config], key: List[str], prune: Optional[Callable] = None):
    """triton.autotune with bertfast's policy: short timing, results cached on disk, no hooks.

    The first config of ``configs`` (after ``prune``) is the kernel's default: the one the fixed
    mode runs. No restore_value / reset_to_zero: a kernel that modifies its inputs names them
    in ``launch(..., scratch=...)`` instead. Every mode leaves out the candidates EXCLUDE_ENV names.
    """
    def register(fn):
        name = fn.__name__

        def pruned(configs, named_args, **kwargs):
            kept = list(prune(configs, named_args, **kwargs)) if prune is not None else list(configs)
            return without_excluded(name, kept)
        tuner = triton.autotune(configs, key=key, prune_configs_by={"early_config_prune": pruned},
                                do_bench=_short_bench, cache_results=True)(fn)
        _TUNERS.append(tuner)
        return tuner
    return register


# --------------------------------------------------------------------------- excluded candidates
# BERTFAST_EXCLUDE_CANDIDATES="kernel:config; ...", each config as config_text writes it (and as a failing
# tests/ops/test_candidates.py names it): candidates no mode may run. A GPU check whose stage 2 found a
# candidate wrong times the others in its later stages (scripts/gpu-loan.sh); `bertfast info` and the
# bench's results say which were left out.
EXCLUDE_ENV = "BERTFAST_EXCLUDE_CANDIDATES"
_EXCLUDED_PARSED: Dict[str, frozenset] = {}


def excluded_candidates() -> frozenset:
    """The (kernel name, config_text) pairs EXCLUDE_ENV names (empty when unset)."""
    text = os.environ.get(EXCLUDE_ENV, "")
    parsed = _EXCLUDED_PARSED.get(text)
    if parsed is None:
        pairs = []
        for entry in (e.strip() for e in text.split(";")):
            if not entry:
                continue
            kernel, sep, config = entry.partition(":")
            if not sep or not kernel.strip() or not config.strip():
                raise ValueError(f"{EXCLUDE_ENV}: expected 'kernel:config' entries separated by ';' (the config "
                                 f"as config_text writes it, e.g. '_attention_fwd_kernel:BLOCK_M=64 BLOCK_N=32 "
                                 f"num_warps=4 num_stages=4'), got {entry!r}")
            pairs.append((kernel.strip(), " ".join(config.split())))
        parsed = _EXCLUDED_PARSED[text] = frozenset(pairs)
    return parsed


def excluded_summary() -> str:
    """A line naming the excluded candidates ('' when none), for `bertfast info` and the bench's results."""
    excluded = sorted(excluded_candidates())
    if not excluded:
        return ""
    return (f"autotune candidates excluded ({EXCLUDE_ENV}): "
            + "; ".join(f"{kernel}: {config}" for kernel, config in excluded))


def without_excluded(kernel_name: str, configs: List[triton.Config]) -> List[triton.Config]:
    """``configs`` less those EXCLUDE_ENV names for this kernel; an error when it names all of them."""
    excluded = excluded_candidates()
    if not excluded:
        return configs
    kept = [c for c in configs if (kernel_name, config_text(c)) not in excluded]
    if not kept:
        raise RuntimeError(f"{kernel_name}: {EXCLUDE_ENV} excludes every candidate config this launch has: "
                           + "; ".join(config_text(c) for c in configs))
    return kept


_TUNERS: List = []  # every kernel autotune() made, for tuned_configs()


def config_text(config: triton.Config) -> str:
    """A config as one line: its meta-parameters, then warps and stages."""
    params = " ".join(f"{k}={v}" for k, v in config.kwargs.items())
    return f"{params} num_warps={config.num_warps} num_stages={config.num_stages}".strip()


def tuned_configs() -> Dict[str, List[Dict[str, object]]]:
    """The configs Triton's autotuner chose in this process (or read from its disk cache), per kernel
    and tuning key: what a GPU run's timings ran, for the perf model to predict the same. Empty in the
    fixed and interpreter modes, which tune nothing; a list of one candidate is not tuned either."""
    chosen: Dict[str, List[Dict[str, object]]] = {}
    for tuner in _TUNERS:
        for key, config in getattr(tuner, "cache", {}).items():
            chosen.setdefault(jit_function(tuner).__name__, []).append(
                {"key": list(key_values(key)), "config": config_text(config)})
    return chosen


def key_values(key: Sequence) -> Tuple:
    """A tuning key as JSON keeps it (numbers and flags as they are, anything else, dtypes, as text),
    so a key written by a GPU run compares equal to the one compile_only records offline."""
    return tuple(k if isinstance(k, (int, float, bool)) else str(k) for k in key)


def _is_tuned(kernel) -> bool:
    return isinstance(kernel, triton.runtime.Autotuner)


def jit_function(kernel):
    """The @triton.jit function behind an autotuned kernel (or the kernel itself)."""
    return kernel.fn if _is_tuned(kernel) else kernel


def candidates(kernel, args: Sequence, consts: Dict) -> List[triton.Config]:
    """The configs an autotuned kernel would try for these arguments (its list, pruned)."""
    nargs = dict(zip(kernel.arg_names, args))
    configs = list(kernel.configs)
    if kernel.early_config_prune is not None:
        configs = list(kernel.early_config_prune(configs, nargs, **consts))
    if not configs:
        raise RuntimeError(f"{jit_function(kernel).__name__}: no candidate config left after pruning")
    return configs


def _tuning_key(kernel, args: Sequence, consts: Dict) -> Tuple:
    """What Triton's autotuner keys on: the key arguments' values and every tensor's dtype."""
    named = {**dict(zip(kernel.arg_names, args)), **consts}
    key = [named[k] for k in kernel.keys if k in named]
    key += [str(a.dtype) for a in named.values() if hasattr(a, "dtype")]
    return tuple(key)


def _choose_on_scratch(kernel, grid, args: Sequence, consts: Dict, scratch: Sequence[str]) -> triton.Config:
    """The tuned config for these arguments, found by running the autotuner on scratch copies of the
    arguments named in ``scratch`` (their contents do not change a kernel's speed)."""
    # Same sizes and strides (a row-strided view keeps its row stride, which the kernel is given).
    spare = [torch.empty_strided(a.size(), a.stride(), dtype=a.dtype, device=a.device) if name in scratch
             else a for name, a in zip(kernel.arg_names, args)]
    kernel[grid](*spare, **consts, **COMPILE_OPTIONS)
    return kernel.best_config


# An autotuned kernel's launch keyword arguments (its constexprs, the config chosen for it, the compile
# options) per _launch_key: a launch after the first with the same key passes them to the JIT function
# directly. Triton's autotuner builds its key from dicts of every argument on each call, about 12 us
# of a 29 us launch on a CPU (benchmarks/host-overhead/cpu-2026-12-06-launch.md).
_LAUNCH_KWARGS: Dict[Tuple, Dict] = {}
_KEY_POSITIONS: Dict[int, Tuple[int, ...]] = {}


def _launch_key(kernel, args: Sequence, consts: Dict, tuned: bool) -> Tuple:
    """What decides an autotuned kernel's config: its tuning key's arguments and every tensor's dtype
    (Triton's autotuner key), the constexprs (which the candidates' pruning reads too) and the mode."""
    positions = _KEY_POSITIONS.get(id(kernel))
    if positions is None:
        positions = _KEY_POSITIONS[id(kernel)] = tuple(
            i for i, name in enumerate(kernel.arg_names) if name in kernel.keys)
    return (id(kernel), tuned, tuple(args[i] for i in positions if i < len(args)),
            tuple(a.dtype for a in args if isinstance(a, torch.Tensor)), tuple(consts.items()),
            os.environ.get(EXCLUDE_ENV, ""))


def _choose(kernel, grid, args: Sequence, consts: Dict, scratch: Sequence[str], autotuned: bool
            ) -> Tuple[triton.Config, bool]:
    """The config of a launch key's first launch, and whether choosing it launched the kernel."""
    if not autotuned:
        return candidates(kernel, args, consts)[0], False
    if scratch:
        return _choose_on_scratch(kernel, grid, args, consts, scratch), False
    kernel[grid](*args, **consts, **COMPILE_OPTIONS)  # the autotuner chooses (or reads its disk cache) and launches
    return kernel.best_config, True


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def resident_programs(device: torch.device, per_sm: int) -> int:
    """Programs for a grid sized to the GPU: per_sm on each streaming multiprocessor of a CUDA device;
    3 elsewhere (the interpreter), so its tests cross program borders."""
    if device.type != "cuda":
        return 3
    return per_sm * _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) on the host, as triton.cdiv: triton 3.9's is a constexpr function, ~2 us a call there."""
    return (a + b - 1) // b


def next_power_of_2(n: int) -> int:
    """The smallest power of 2 >= n (0 for n <= 0), as triton.next_power_of_2, on the host (see cdiv)."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


# --------------------------------------------------------------------------- pinning a candidate
# The autotuner times a kernel's candidates and keeps the fastest; it never checks their results. Tests
# do (tests/ops/test_candidates.py): each candidate of each kernel, pinned, against the first.
_PINNED: Dict[str, int] = {}             # kernel name -> candidate index its launches run, untimed
_PIN_SEEN: Dict[str, List[str]] = {}     # kernel name -> the longest candidate list a launch of it had


@contextlib.contextmanager
def pinned_candidate(kernel_name: str = "", index: int = 0) -> Iterator[Dict[str, List[str]]]:
    """Within this block every launch of the autotuned kernel ``kernel_name`` runs candidate ``index`` of
    its pruned list (its last where it lists fewer), untimed; the other autotuned kernels run their first.
    No name: every autotuned kernel runs its first. Yields, filled when the block ends, kernel name -> the
    longest candidate list (config_text) a launch of it had, for the caller to know what there is to pin."""
    global _PINNED
    saved = _PINNED
    _PINNED, seen = {kernel_name: index}, {}
    _PIN_SEEN.clear()
    try:
        yield seen
    finally:
        seen.update(_PIN_SEEN)
        _PINNED = saved
        _PIN_SEEN.clear()


def _launch_pinned(kernel, fn, grid, args: Sequence, consts: Dict) -> None:
    configs = candidates(kernel, args, consts)
    name = fn.__name__
    if len(configs) > len(_PIN_SEEN.get(name, ())):
        _PIN_SEEN[name] = [config_text(c) for c in configs]
    config = configs[min(_PINNED.get(name, 0), len(configs) - 1)]
    fn[grid](*args, **{**consts, **COMPILE_OPTIONS, **config.all_kwargs()})


# --------------------------------------------------------------------------- launching
# (jit function, grid, args, consts, candidate configs, tuning key or None for a plain kernel)
Recorder = Callable[[object, object, Sequence, Dict, List[triton.Config], Optional[Tuple]], None]
_RECORDER: Optional[Recorder] = None


@contextlib.contextmanager
def compile_only(record: Recorder) -> Iterator[None]:
    """Within this block launches run nothing: ``record(kernel, grid, args, consts, configs, key)``
    receives each one with the configs it would try (one, for a plain kernel) and the autotuner's
    key for these arguments (None for a plain kernel): one tuning per distinct key."""
    global _RECORDER
    saved, _RECORDER = _RECORDER, record
    try:
        yield
    finally:
        _RECORDER = saved


def launch(kernel, grid, args: Sequence, consts: Dict, *, interp: Optional[Dict] = None,
           scratch: Sequence[str] = ()) -> None:
    """Launch ``kernel`` (an ``autotune``d kernel, or a plain @triton.jit one whose ``consts``
    include its block sizes) over ``grid`` (a tuple, or a function of the meta-parameters).

    interp: the block sizes to use under the interpreter (autotuned kernels only).
    scratch: names of arguments the kernel modifies and reads (tuned on scratch copies).
    """
    tuned = _is_tuned(kernel)
    fn = jit_function(kernel)
    if interpreting():
        fn[grid](*args, **consts, **(interp or {}))
        return
    if _RECORDER is not None:
        configs = candidates(kernel, args, consts) if tuned else [None]
        _RECORDER(fn, grid, args, consts, configs, _tuning_key(kernel, args, consts) if tuned else None)
        return
    if not tuned:
        fn[grid](*args, **consts, **COMPILE_OPTIONS)
        return
    if _PINNED:
        _launch_pinned(kernel, fn, grid, args, consts)
        return
    key = _launch_key(kernel, args, consts, autotune_enabled())
    kwargs = _LAUNCH_KWARGS.get(key)
    if kwargs is None:
        config, launched = _choose(kernel, grid, args, consts, scratch, autotuned=key[1])
        # In the autotuner's order: Triton's in-memory kernel cache keys on the options' text, so
        # another order would compile the same kernel again.
        kwargs = _LAUNCH_KWARGS[key] = {**consts, **COMPILE_OPTIONS, **config.all_kwargs()}
        if launched:
            return
    fn[grid](*args, **kwargs)

"""What both suites share: realistic sequence lengths, the suite context, timing a callable into a row."""
from __future__ import annotations

import contextlib
import gc
import signal
import time
import zlib
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from bertfast.bench.clocks import ClockSampler
from bertfast.bench.device import DeviceInfo, compiler_status
from bertfast.bench.results import Row
from bertfast.bench.timing import TimingPolicy, peak_memory, time_cpu_interleaved, time_fn

# --------------------------------------------------------------------------- lengths
LENGTH_MODES = ("none", "pretrain", "finetune")


def generator_for(*key: object) -> torch.Generator:
    """A CPU generator seeded from a description of the case: same case, same data, every run."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()) & 0x7FFFFFFF)


def sequence_lengths(mode: str, batch: int, max_len: int, gen: torch.Generator) -> List[int]:
    """Real lengths of a batch padded to ``max_len``.

    none: every sequence full. pretrain: BERT's NSP pairs, mostly full: 90% at max_len, 10%
    shorter (uniform in [max_len/4, max_len]), as create_pretraining_data's short_seq_prob=0.1.
    finetune: mean length 50% of max_len, lengths in pairs (l, max_len - l) with l uniform in
    [10%, 50%] of max_len, so the batch holds exactly batch * max_len / 2 real tokens (and the
    same tokens fit batch / 2 full sequences without padding).
    """
    if mode == "none":
        return [max_len] * batch
    if mode == "pretrain":
        short = torch.rand(batch, generator=gen) < 0.1
        lo = max(1, max_len // 4)
        other = torch.randint(lo, max_len + 1, (batch,), generator=gen)
        return [int(o) if s else max_len for s, o in zip(short.tolist(), other.tolist())]
    if mode == "finetune":
        if batch % 2:
            raise ValueError(f"finetune lengths come in pairs: batch must be even, got {batch}")
        lo, hi = max(1, max_len // 10), max(1, max_len // 2)
        firsts = torch.randint(lo, hi + 1, (batch // 2,), generator=gen).tolist()
        out: List[int] = []
        for first in firsts:
            out += [int(first), max_len - int(first)]
        return out
    raise ValueError(f"length mode must be one of {LENGTH_MODES}, got {mode!r}")


def cu_seqlens(lengths: Sequence[int], device: torch.device) -> torch.Tensor:
    out = torch.zeros(len(lengths) + 1, dtype=torch.int32)
    out[1:] = torch.cumsum(torch.tensor(list(lengths), dtype=torch.int64), 0)
    return out.to(device)


def mask_from(lengths: Sequence[int], max_len: int, device: torch.device) -> torch.Tensor:
    """bool [B, max_len], tokens first."""
    return (torch.arange(max_len)[None, :] < torch.tensor(list(lengths))[:, None]).to(device)


# --------------------------------------------------------------------------- context
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def dtype_name(dtype: torch.dtype) -> str:
    return {v: k for k, v in DTYPES.items()}[dtype]


@dataclass
class SuiteContext:
    device: DeviceInfo
    quick: bool
    dtype: torch.dtype
    # CPU without --quick: the model suite times MiniLM-sized steps against transformers (the kernel
    # suite stays on its tiny CPU shapes).
    cpu_model_cases: bool = False
    backends: Tuple[str, ...] = ("triton", "cuda", "torch")
    compile: bool = True
    with_transformers: bool = True
    policy: TimingPolicy = field(default_factory=TimingPolicy)  # kernel suite
    step_policy: TimingPolicy = field(default_factory=lambda: TimingPolicy.steps(True))  # model suite
    ops: Optional[Tuple[str, ...]] = None  # kernel-suite filter (None: all)
    models: Optional[Tuple[str, ...]] = None  # model-suite filter
    impls: Optional[Tuple[str, ...]] = None  # implementation families (options.IMPL_FAMILIES); None: all
    cases: Dict[str, str] = field(default_factory=dict)  # case field -> value every case run must have
    deadline: Optional[float] = None  # time.monotonic() after which no new case starts
    budget_s: Optional[float] = None
    log: Callable[[str], None] = print
    notes: List[str] = field(default_factory=list)
    gates: Dict[Tuple, Tuple] = field(default_factory=dict)  # (group, case, impl) -> gate verdict of a case
    rows: List[Row] = field(default_factory=list)  # the rows of every case recorded so far, in order
    on_record: Callable[[List[Row]], None] = lambda rows: None  # cli.main: save them (a partial results.json)

    @property
    def torch_device(self) -> torch.device:
        return self.device.torch_device

    def note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)
            self.log(f"note: {text}")

    def wants(self, impl: str) -> bool:
        """Is this implementation's family selected (--impls)?"""
        from bertfast.bench.results import impl_family
        return self.impls is None or impl_family(impl) in self.impls

    def wants_case(self, case: Dict[str, object]) -> bool:
        """Does the case match every --case field (compared as text)?"""
        return all(str(case.get(k)) == v for k, v in self.cases.items())

    def budget_spent(self) -> bool:
        return self.deadline is not None and time.monotonic() >= self.deadline

    def budget_reason(self) -> str:
        return f"not run: the --time-budget of {self.budget_s:g} s was spent"

    def record(self, rows: List[Row]) -> List[Row]:
        """Keep the rows of a case that ended (and save them) before the next one starts, so that a
        run stopped later keeps them; returns them."""
        self.rows += rows
        self.on_record(self.rows)
        return rows


class Stopped(BaseException):
    """SIGTERM or Ctrl-C, raised by cli.main's signal handler: the run stops at once. A BaseException,
    so the suites' `except Exception` blocks (a failure becomes a row) let it through."""

    def __init__(self, signum: int):
        self.signum = signum
        self.why = signal.Signals(signum).name  # "SIGTERM", "SIGINT"
        super().__init__(self.why)

    def reason(self, running: bool = False) -> str:
        """The skip reason of the case it cut short (running) or of one it did not reach."""
        if running:
            return f"not finished: the bench was stopped ({self.why}) while this case ran"
        return f"not run: the bench was stopped ({self.why}) before this case"


def compile_skip_reason(ctx: SuiteContext) -> Optional[str]:
    """Why torch.compile rows are skipped here, or None when they can run."""
    if not ctx.compile:
        return "torch.compile disabled (--no-compile)"
    status = compiler_status()
    if ctx.device.is_cuda and status["triton"] is None:
        return "torch.compile cannot run here: inductor needs triton on GPU and it is not installed"
    if not ctx.device.is_cuda and status["cxx"] is None:
        return "torch.compile cannot run here: inductor needs a C++ compiler on CPU and none was found"
    return None


@contextlib.contextmanager
def strict_fp32() -> Iterator[None]:
    """fp32 matmuls in fp32 (no TF32) while a reference or a parity check runs."""
    saved = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def free_memory() -> None:
    """Return freed GPU memory between implementations (a no-op without CUDA: gc.collect is slow)."""
    if torch.cuda.is_available():
        gc.collect()
        torch.cuda.empty_cache()


def time_plans(ctx: "SuiteContext", plans: Sequence[Tuple[str, Callable[[], Callable[[], object]], object]],
               policy: TimingPolicy, timed: Callable[[str, object, object, object, Dict], None]) -> None:
    """Time each plan (implementation, make: builds its step, the report of its gate) and hand
    ``timed`` (implementation, its Stat or the exception raised, its peak memory or None, report, the
    GPU's clocks while it was timed: bench.clocks, empty on a CPU).
    On a GPU one implementation after the other, each step built just before it is timed and its
    memory freed after; on a CPU (a shared machine, where the ratio against transformers is the
    figure) in turns, a call of each per round."""
    if ctx.torch_device.type == "cpu":
        steps = []
        for impl, make, report in plans:
            try:
                steps.append((impl, make(), report))
            except Exception as exc:  # noqa: BLE001
                timed(impl, exc, None, report, {})
        for (impl, _, report), t in zip(steps, time_cpu_interleaved([step for _, step, _ in steps], policy)):
            timed(impl, t, None, report, {})
        return
    for impl, make, report in plans:
        try:
            step = make()
            with ClockSampler(ctx.torch_device) as sampler:
                t = time_fn(step, ctx.torch_device, policy)
            mem = peak_memory(step, ctx.torch_device)
        except Exception as exc:  # noqa: BLE001
            t, mem = exc, None
        timed(impl, t, mem, report, sampler.summary() if not isinstance(t, BaseException) else {})
        free_memory()


def short_error(exc: BaseException, limit: int = 400) -> str:
    text = f"{type(exc).__name__}: {exc}".strip().replace("\n", " ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def describe_lengths(lengths: Sequence[int], max_len: int) -> Dict[str, float]:
    total = sum(lengths)
    return {"real_tokens": int(total), "fill": round(total / (len(lengths) * max_len), 3)}

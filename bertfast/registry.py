"""The list of fused ops: the one place an op is named for everything that handles ops one by one.

An entry says where the op lives and how each part of the project exercises it:

* its files, all named after it: ``bertfast/ops/<name>.py`` (the contract, the custom op, the
  torch backend), ``kernels/<name>.py`` (Triton), ``bertfast/cuda/<name>.py`` and
  ``csrc/<name>*.cu`` (CUDA), ``tests/ops/test_<name>.py``;
* its forms: the entry points dispatch chooses a backend for (``BERTFAST_BACKEND_<FORM>``), each
  with a typical call's inputs (``bertfast info`` and the parity report ask dispatch with them);
* the launcher functions every backend implements (the contract ``tests/test_ops.py`` checks);
* its benchmark cases (the kernel suite's and the overhead suite's), the sanitizer's calls, the
  compile report's launches and, for the ops Nsight Compute profiles, the case it profiles.

Readers: ``bertfast.dispatch`` registers every form's backends from here; the kernel and overhead
suites, ``bertfast.bench.preference``, ``bertfast.bench.targets`` and ``bertfast.bench.ncu`` take
their cases; ``bertfast.parity`` its forward order; ``bertfast info`` and ``bertfast parity`` the
sample inputs; the GPU check (sanitize, compile_report, sizing, stages) and the perf model their ops.

Hooks are named ``"module:function"`` and imported only when used, so reading this list imports
neither Triton nor the CUDA extension. Adding an op is its files plus one ``Op`` here
(docs/ops.md, "Adding an op"); ``tests/test_registry.py`` checks every name resolves and that an op
registered with ``register`` reaches every reader.
"""
from __future__ import annotations

import contextlib
import importlib
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Dict, Iterator, List, Mapping, Optional, Tuple

if TYPE_CHECKING:
    import torch

# What an op is, for the readers that treat kinds differently.
ATTENTION = "attention"  # the attention kernels (the perf model's attention budget)
ROW = "row"              # memory-bound row ops: the bandwidth target, the GPU check's row-op step
HEAD = "head"            # the MLM head: its GEMMs dominate
OPTIMIZER = "optimizer"  # kernels with no dispatch: the optimizers' steps
KINDS = (ATTENTION, ROW, HEAD, OPTIMIZER)

BACKENDS = ("torch", "triton", "cuda")
ACT = "act"  # a sample input in the call's activation dtype: a float input of the fused backends


def act(*shape: int) -> Tuple[str, Tuple[int, ...]]:
    """A sample input of this shape in the activation dtype."""
    return (ACT, shape)


def of(dtype: str, *shape: int) -> Tuple[str, Tuple[int, ...]]:
    """A sample input of this shape and a fixed dtype (``"int64"``, ``"int32"``, ``"bool"``)."""
    return (dtype, shape)


@dataclass(frozen=True)
class Form:
    """One entry point of an op that dispatch chooses a backend for, by this name."""

    name: str
    # A typical call's inputs, as dispatch.select receives them: name -> act(...) or of(dtype, ...).
    # The act ones are the inputs whose dtype the fused backends check (fp32, fp16 or bf16).
    sample: Mapping[str, Tuple[str, Tuple[int, ...]]]

    @property
    def float_inputs(self) -> Tuple[str, ...]:
        return tuple(name for name, (dtype, _) in self.sample.items() if dtype == ACT)

    def sample_inputs(self, device: "torch.device", dtype: "torch.dtype") -> Dict[str, "torch.Tensor"]:
        """Empty tensors describing the call (dispatch reads only their device, dtype and shape)."""
        import torch
        return {name: torch.empty(shape, device=device, dtype=dtype if kind == ACT else getattr(torch, kind))
                for name, (kind, shape) in self.sample.items()}


@dataclass(frozen=True)
class Op:
    """One op: the name its files share, its kind, and what each part of the project runs of it."""

    name: str
    kind: str
    forms: Tuple[Form, ...] = ()  # none: kernels without dispatch (the optimizers)
    launchers: Tuple[str, ...] = ()  # the functions each backend's module implements
    bench: Mapping[str, str] = field(default_factory=dict)  # kernel-suite case -> builder(ctx) -> [OpCase]
    # The kernel-suite case whose times order the op's fast backends (bertfast.bench.preference);
    # None: the case named after the op.
    preference_case: Optional[str] = None
    overhead: Mapping[str, str] = field(default_factory=dict)  # overhead-suite case -> builder(gen, dtype, device)
    sanitize: Mapping[str, str] = field(default_factory=dict)  # sanitizer call -> fn(device, dtype) -> [tensors]
    launches: Optional[str] = None  # compile report: fn(LaunchSetting) calling the Triton launchers
    # Nsight Compute's case (a kernel-suite case of BERT-large's seq-128 pre-training shapes; of the
    # preference case where the op names one: the kernels training runs)
    profile_case: Optional[Mapping[str, object]] = None
    modules: Mapping[str, str] = field(default_factory=dict)  # backend -> module, where not the convention

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"op {self.name!r}: kind must be one of {KINDS}, got {self.kind!r}")
        if self.forms and self.kind == OPTIMIZER:
            raise ValueError(f"op {self.name!r}: an optimizer's kernels have no dispatch forms")

    def module(self, backend: str) -> str:
        """The module of a backend's launchers: bertfast.ops.<name> (torch), bertfast.kernels.<name>
        (Triton), bertfast.cuda.<name> (CUDA)."""
        default = {"torch": f"bertfast.ops.{self.name}", "triton": f"bertfast.kernels.{self.name}",
                   "cuda": f"bertfast.cuda.{self.name}"}
        if backend not in default:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        return self.modules.get(backend, default[backend])


def resolve(ref: str) -> Callable:
    """The function a hook names, ``"package.module:function"``, imported now."""
    module, sep, name = ref.partition(":")
    if not sep or not module or not name:
        raise ValueError(f"a hook is named 'package.module:function', got {ref!r}")
    return getattr(importlib.import_module(module), name)


_KC = "bertfast.bench.kernel_cases"
_OC = "bertfast.bench.optimizer_cases"
_OH = "bertfast.bench.overhead_suite"
_SAN = "bertfast.gpucheck.sanitize"
_OL = "bertfast.gpucheck.op_launches"
_ROW_PROFILE = {"tokens": 16384, "hidden": 1024, "params": "fp32"}

# In the order a pre-training step runs them (parity names the first divergent op in this order).
_OPS: List[Op] = [
    Op("embeddings", ROW,
       forms=(Form("embeddings", {"input_ids": of("int64", 8), "word": act(100, 768), "pos": act(512, 768),
                                  "token_type": act(2, 768), "ln_weight": act(768), "ln_bias": act(768)}),),
       launchers=("embeddings_fwd", "embeddings_bwd"),
       bench={"embeddings": f"{_KC}:embeddings_cases"},
       overhead={"embeddings": f"{_OH}:embeddings_case"},
       sanitize={"embeddings": f"{_SAN}:embeddings"},
       launches=f"{_OL}:embeddings_launches",
       profile_case=_ROW_PROFILE),
    Op("attention", ATTENTION,
       forms=(Form("attention_varlen", {"q": act(8, 3, 12, 64), "cu_seqlens": of("int32", 3)}),
              Form("attention_padded", {"q": act(2, 4, 12, 64), "k": act(2, 4, 12, 64), "v": act(2, 4, 12, 64),
                                        "key_padding_mask": of("bool", 2, 4)})),
       launchers=("attention_varlen_fwd", "attention_varlen_bwd", "attention_padded_fwd", "attention_padded_bwd",
                  "attention_varlen_dropout_mask", "attention_padded_dropout_mask", "dropout_keep_shape"),
       bench={"attention": f"{_KC}:attention_cases"},
       overhead={"attention_varlen": f"{_OH}:attention_varlen_case", "attention": f"{_OH}:attention_padded_case"},
       sanitize={"attention_varlen": f"{_SAN}:attention_varlen", "attention_padded": f"{_SAN}:attention_padded"},
       launches=f"{_OL}:attention_launches",
       profile_case={"batch": 128, "seqlen": 128, "heads": 16, "head_dim": 64, "padding": "pretrain",
                     "dropout": 0.1}),
    Op("bias_dropout_residual_layernorm", ROW,
       forms=(Form("bias_dropout_residual_layernorm", {"x": act(8, 768), "bias": act(768), "residual": act(8, 768),
                                                       "weight": act(768), "ln_bias": act(768)}),),
       launchers=("bias_dropout_residual_layernorm_fwd", "bias_dropout_residual_layernorm_bwd"),
       bench={"bias_dropout_residual_layernorm": f"{_KC}:bias_dropout_residual_layernorm_cases"},
       overhead={"bias_dropout_residual_layernorm": f"{_OH}:bias_dropout_residual_layernorm_case"},
       sanitize={"bias_dropout_residual_layernorm": f"{_SAN}:bias_dropout_residual_layernorm"},
       launches=f"{_OL}:bias_dropout_residual_layernorm_launches",
       profile_case={**_ROW_PROFILE, "dropout": 0.1}),
    # In training bias_gelu runs inside the FFN's GEMMs where the backend has them (Triton), so
    # the FFN case orders its backends, and ncu profiles it.
    Op("bias_gelu", ROW,
       forms=(Form("bias_gelu", {"x": act(8, 3072), "bias": act(3072)}),),
       launchers=("bias_gelu_fwd", "bias_gelu_bwd"),
       bench={"bias_gelu": f"{_KC}:bias_gelu_cases", "ffn": f"{_KC}:ffn_cases"},
       preference_case="ffn",
       overhead={"bias_gelu": f"{_OH}:bias_gelu_case"},
       sanitize={"bias_gelu": f"{_SAN}:bias_gelu"},
       launches=f"{_OL}:bias_gelu_launches",
       profile_case={"tokens": 16384, "hidden": 1024, "features": 4096}),
    Op("mlm_head_loss", HEAD,
       forms=(Form("mlm_head_loss", {"x": act(8, 768), "weight": act(100, 768), "bias": act(100),
                                     "labels": of("int64", 8)}),),
       launchers=("mlm_head_loss_fwd",),
       bench={"mlm_head_loss_decoder": f"{_KC}:mlm_head_loss_decoder_cases",
              "mlm_head_loss": f"{_KC}:mlm_head_loss_cases"},
       overhead={"mlm_head_loss": f"{_OH}:mlm_head_loss_case"},
       sanitize={"mlm_head_loss": f"{_SAN}:mlm_head_loss"},
       launches=f"{_OL}:mlm_head_loss_launches"),
    Op("adamw", OPTIMIZER, bench={"adamw": f"{_OC}:adamw_cases"}, launches=f"{_OL}:adamw_launches"),
    Op("lamb", OPTIMIZER, bench={"lamb": f"{_OC}:lamb_cases"}, launches=f"{_OL}:lamb_launches"),
]


def ops(*kinds: str) -> Tuple[Op, ...]:
    """Every op (or those of these kinds), in the order a pre-training step runs them."""
    for kind in kinds:
        if kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    return tuple(op for op in _OPS if not kinds or op.kind in kinds)


def names(*kinds: str) -> Tuple[str, ...]:
    return tuple(op.name for op in ops(*kinds))


def get(name: str) -> Op:
    for op in _OPS:
        if op.name == name:
            return op
    raise ValueError(f"unknown op {name!r}; the ops are {list(names())}")


def forms() -> Tuple[Form, ...]:
    """Every dispatch form, in op order."""
    return tuple(form for op in _OPS for form in op.forms)


def form(name: str) -> Tuple[Op, Form]:
    """The op a dispatch form belongs to, and the form."""
    for op in _OPS:
        for f in op.forms:
            if f.name == name:
                return op, f
    raise ValueError(f"unknown op form {name!r}; the forms are {[f.name for f in forms()]}")


def step_forms() -> Tuple[str, ...]:
    """The form of each op a pre-training step calls (its first), in the step's order."""
    return tuple(op.forms[0].name for op in _OPS if op.forms)


def hooks(what: str, *kinds: str) -> Dict[str, str]:
    """Case name -> hook of every op's ``bench``, ``overhead`` or ``sanitize`` table, in op order
    (named, not imported: the GPU check counts them without torch)."""
    if what not in ("bench", "overhead", "sanitize"):
        raise ValueError(f"what must be bench, overhead or sanitize, got {what!r}")
    out: Dict[str, str] = {}
    owner: Dict[str, str] = {}
    for op in ops(*kinds):
        for case, ref in getattr(op, what).items():
            if case in out:
                raise ValueError(f"{what} case {case!r} is named by ops {owner[case]!r} and {op.name!r}")
            out[case], owner[case] = ref, op.name
    return out


def functions(what: str, *kinds: str) -> Dict[str, Callable]:
    """``hooks``, each imported: case name -> its function."""
    return {case: resolve(ref) for case, ref in hooks(what, *kinds).items()}


def register(op: Op) -> None:
    """Add an op (after the others), or replace the one of its name in place."""
    for name in [f.name for f in op.forms]:
        owner = next((o for o in _OPS if o.name != op.name and any(f.name == name for f in o.forms)), None)
        if owner is not None:
            raise ValueError(f"op {op.name!r}: form {name!r} already belongs to op {owner.name!r}")
    for i, existing in enumerate(_OPS):
        if existing.name == op.name:
            _OPS[i] = op
            break
    else:
        _OPS.append(op)
    _changed()


@contextlib.contextmanager
def registered(op: Op) -> Iterator[Op]:
    """``op`` in the list for the block's length (tests, experiments); whatever it replaced is back after."""
    before = list(_OPS)
    register(op)
    try:
        yield op
    finally:
        _OPS[:] = before
        _changed()


def _changed() -> None:
    dispatch = sys.modules.get("bertfast.dispatch")  # not imported yet: it reads the list on first use
    if dispatch is not None:
        dispatch.registry_changed()

"""Working copies: the bf16 (or fp16) weights a mixed-precision forward computes with, written by
the optimizer as it updates the fp32 masters, instead of cast from every master in every forward.

Under autocast, each GEMM's fp32 weight is cast to bf16 every forward: 6 bytes a parameter read
and written, 0.67 ms of a BERT-large step on an H100 as docs/perf-model.md predicts it. bertfast's
AdamW (bertfast.training.optim.AdamW, kernels/adamw.py) writes the bf16 copy as it writes each
updated weight, 2 bytes a parameter more in a pass it makes anyway, and the forward
(bertfast.model.residual_linear) takes the copy. The query, key and value weights' copies are rows of
one [3H, H] buffer (and their biases of one [3H]): the attention's one QKV GEMM reads it as it is.

A copy is used only while it holds exactly what a cast would give: the optimizer's kernel rounds
to nearest even as torch's cast does, and a copy is stale as soon as its master changes by any
other means. Writes through torch ops bump the master's version counter, which the lookup
compares with the version recorded when the copy was written. bertfast's optimizer kernels write
through raw pointers and bump nothing, so they report what they wrote (``written``): a weight
written with its registered copy stays fresh, one written without it (LAMB, or an AdamW holding
no copies or another set's) goes stale. A write that bypasses the version counter outside
bertfast's optimizers (through ``param.data``) is not seen: call ``refresh()`` after one.

Only for what is differentiated on plain tensors: not while torch.compile traces (the weights are
cast as autocast would), not for DTensors (FSDP).
"""
from __future__ import annotations

import weakref
from typing import Dict, Iterable, List, Optional, Sequence

import torch
from torch import nn

Tensor = torch.Tensor


class _Entry:
    __slots__ = ("ref", "buffer", "index", "size", "rows", "version")

    def __init__(self, param: Tensor, buffer: Tensor, index: int, size: int, rows: Tensor):
        self.ref = weakref.ref(param)
        self.buffer, self.index, self.size, self.rows = buffer, index, size, rows
        self.version = -1  # not written yet


# id(parameter) -> its copy; the weak reference tells a live parameter from one whose id was reused
_ENTRIES: Dict[int, _Entry] = {}


def lookup(params: Sequence[Tensor], dtype: Optional[torch.dtype]) -> Optional[Tensor]:
    """The working copy of ``params`` concatenated along dim 0, in ``dtype``: one buffer their copies
    fill in this order, each written since its master last changed; else None (cast them)."""
    if not _ENTRIES or dtype is None or torch.compiler.is_compiling():
        return None
    buffer = None
    for i, p in enumerate(params):
        entry = _ENTRIES.get(id(p))
        if (entry is None or entry.ref() is not p or entry.index != i or entry.size != len(params)
                or entry.version != p._version or (buffer is not None and entry.buffer is not buffer)):
            return None
        buffer = entry.buffer
    return buffer if buffer is not None and buffer.dtype == dtype else None


def written(params: Sequence[Tensor], copies: Sequence[Optional[Tensor]]) -> None:
    """An optimizer kernel wrote these masters, and beside each the copy given (or none), through
    raw pointers: a master written with its registered copy stays fresh, any other goes stale."""
    if not _ENTRIES:
        return
    for p, c in zip(params, copies):
        entry = _ENTRIES.get(id(p))
        if entry is not None and entry.ref() is p:
            fresh = c is not None and c.data_ptr() == entry.rows.data_ptr()
            entry.version = p._version if fresh else -1


def _forget(entries: Dict[int, _Entry]) -> None:
    for key, entry in entries.items():
        if _ENTRIES.get(key) is entry:
            del _ENTRIES[key]


def weight_groups(model: nn.Module) -> List[List[nn.Parameter]]:
    """The fp32 GEMM weights of ``model``'s bertfast encoder layers (the GEMMs that take
    bertfast.model.residual_linear), in groups that share one copy buffer: each attention's query, key
    and value weights, and their biases; every other nn.Linear's weight and bias alone. The heads'
    and the pooler's weights are cast as before (the MLM head's op casts its own, on the masked rows
    only). Parameters that do not require a gradient are left out."""
    from bertfast.model.modeling import BertEncoder, BertSelfAttention

    groups, grouped = [], set()
    encoders = [m for m in model.modules() if isinstance(m, BertEncoder)]
    for module in (m for e in encoders for m in e.modules()):
        if isinstance(module, BertSelfAttention):
            linears = (module.query, module.key, module.value)
            if all(type(m) is nn.Linear for m in linears):
                for name in ("weight", "bias"):
                    params = [getattr(m, name) for m in linears]
                    if all(p is not None for p in params):
                        groups.append(params)
                        grouped.update(map(id, params))
    for module in (m for e in encoders for m in e.modules()):
        if type(module) is nn.Linear:
            groups += [[p] for p in (module.weight, module.bias) if p is not None and id(p) not in grouped]
    return [g for g in groups
            if all(p.requires_grad and p.dtype == torch.float32 and type(p) is nn.Parameter for p in g)
            and len({p.device for p in g}) == 1 and len({tuple(p.shape[1:]) for p in g}) == 1]


class WorkingWeights:
    """The working copies (in ``dtype``) of ``model``'s GEMM weights (``weight_groups``), made from
    the masters at once; ``copy_of(p)`` is the [p.numel()] view an optimizer writes (and then
    reports with ``written``). A newer set for the same weights takes them over; a set's copies are
    forgotten when it is released or collected."""

    def __init__(self, model: nn.Module, dtype: torch.dtype = torch.bfloat16):
        if dtype not in (torch.bfloat16, torch.float16):
            raise ValueError(f"working copies: expected dtype torch.bfloat16 or torch.float16, got {dtype}")
        self.dtype = dtype
        self.entries: Dict[int, _Entry] = {}
        for group in weight_groups(model):
            rows = [p.shape[0] if p.dim() else 1 for p in group]
            buffer = torch.empty((sum(rows), *group[0].shape[1:]), dtype=dtype, device=group[0].device)
            for index, (p, part) in enumerate(zip(group, buffer.split(rows))):
                entry = _Entry(p, buffer, index, len(group), part)
                self.entries[id(p)] = _ENTRIES[id(p)] = entry
        self._finalizer = weakref.finalize(self, _forget, dict(self.entries))
        self.refresh()

    def __len__(self) -> int:
        return len(self.entries)

    @property
    def numel(self) -> int:
        return sum(e.rows.numel() for e in self.entries.values())

    def copy_of(self, param: Tensor) -> Optional[Tensor]:
        """The flat copy an optimizer writes for ``param`` (None: it has none)."""
        entry = self.entries.get(id(param))
        return entry.rows.view(-1) if entry is not None and entry.ref() is param else None

    @torch.no_grad()
    def refresh(self, params: Optional[Iterable[Tensor]] = None) -> None:
        """Cast the masters (all, or ``params``) into their copies."""
        for entry in self._entries(params):
            p = entry.ref()
            if p is not None:
                entry.rows.copy_(p.view(entry.rows.shape))
                entry.version = p._version

    def release(self) -> None:
        """Forget the copies: the forward casts again."""
        self._finalizer()
        self.entries.clear()

    def _entries(self, params: Optional[Iterable[Tensor]]) -> List[_Entry]:
        if params is None:
            return list(self.entries.values())
        return [e for e in (self.entries.get(id(p)) for p in params) if e is not None and e.ref() is not None]

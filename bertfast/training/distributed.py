"""Joining torchrun's process group (NCCL on CUDA, gloo on CPU) and the collectives a run needs."""
from __future__ import annotations

import datetime
import os
from typing import Any, List, Optional

import torch
import torch.distributed as dist


class DistInfo:
    def __init__(self, rank: int = 0, world_size: int = 1, local_rank: int = 0,
                 device: torch.device = torch.device("cpu"), initialized_here: bool = False):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.device = device
        self.initialized_here = initialized_here

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def shutdown(self) -> None:
        if self.initialized_here and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(device: Optional[str] = None, backend: Optional[str] = None,
                     timeout_s: int = 1800) -> DistInfo:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE, ...).

    A single process without those variables runs undistributed. ``device``: 'cuda', 'cpu'
    or None (CUDA when available). Each rank uses cuda:LOCAL_RANK.
    """
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device is None:
        device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError("--device cuda requested but CUDA is not available")
        torch.cuda.set_device(local_rank)
        dev = torch.device("cuda", local_rank)
    else:
        dev = torch.device(device)
    here = False
    if world > 1 and not dist.is_initialized():
        backend = backend or ("nccl" if dev.type == "cuda" else "gloo")
        kwargs = {"device_id": dev} if dev.type == "cuda" else {}
        dist.init_process_group(backend, rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=timeout_s), **kwargs)
        here = True
    if dist.is_initialized():
        rank, world = dist.get_rank(), dist.get_world_size()
    return DistInfo(rank, world, local_rank, dev, here)


def all_reduce_sum(values: torch.Tensor, info: DistInfo) -> torch.Tensor:
    if info.distributed:
        values = values.clone()
        dist.all_reduce(values, op=dist.ReduceOp.SUM)
    return values


def broadcast_object(obj: Any, info: DistInfo) -> Any:
    if not info.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def gather_objects(obj: Any, info: DistInfo) -> List[Any]:
    if not info.distributed:
        return [obj]
    out: List[Any] = [None] * info.world_size
    dist.all_gather_object(out, obj)
    return out


def all_reduce_max(value: float, info: DistInfo) -> float:
    """The largest ``value`` over ranks (inf travels as 1e30, which every backend reduces)."""
    if not info.distributed:
        return value
    t = torch.tensor([min(value, 1e30)], dtype=torch.float64, device=info.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float("inf") if t.item() >= 1e30 else t.item()


def any_rank(flag: bool, info: DistInfo) -> bool:
    """True when ``flag`` is set on any rank."""
    return all_reduce_max(1.0 if flag else 0.0, info) > 0

"""Shared training machinery for ``bertfast pretrain`` and ``bertfast finetune``.

  * optimizers: parameter groups without weight decay on biases and LayerNorm; AdamW (torch's
    fused kernel on CUDA) and LAMB (below) for large batches;
  * the schedule: linear warm-up, then linear decay to zero;
  * distributed set-up (torchrun's environment; NCCL on CUDA, gloo on CPU) and helpers;
  * RNG state capture/restore (python, numpy, torch CPU, CUDA) for exact resumption;
  * atomic checkpoint directories (temp dir, fsync, rename) with keep-last-K pruning;
  * metrics: FLOPs per step, model FLOPs utilisation against the GPU's peak bf16 rate,
    a JSONL logger (TensorBoard too when installed) and a loss-curve plot.

LAMB (You et al., 2019, "Large batch optimization for deep learning"), per parameter w with
gradient g at step t:
    m = b1*m + (1-b1)*g ;  v = b2*v + (1-b2)*g^2
    u = (m / (1-b1^t)) / (sqrt(v / (1-b2^t)) + eps) + wd * w
    r = ||w|| / ||u||   (1 when either norm is 0; the layer-wise trust ratio)
    w = w - lr * r * u
"""
from __future__ import annotations

import contextlib
import datetime
import json
import os
import random
import re
import shutil
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch
import torch.distributed as dist

from bertfast.data.shards import fsync_dir

def parse_overrides(items: Sequence[str]) -> Dict[str, Any]:
    """``--set KEY=VALUE`` flags -> config overrides; VALUE is read as JSON when it parses, else as a string."""
    out: Dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"--set expects KEY=VALUE, got {item!r}")
        key, value = item.split("=", 1)
        try:
            out[key.strip()] = json.loads(value)
        except json.JSONDecodeError:
            out[key.strip()] = value
    return out


# --------------------------------------------------------------------------- optimizers
NO_DECAY_PATTERNS = ("bias", "LayerNorm.weight", "LayerNorm.bias", "layer_norm", "layernorm")


def parameter_groups(model: torch.nn.Module, weight_decay: float) -> List[Dict[str, Any]]:
    """Two groups: decayed weights, and biases + LayerNorm parameters with weight_decay 0."""
    decay, no_decay = [], []
    seen = set()
    for name, p in model.named_parameters():
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        if p.ndim < 2 or any(pat in name for pat in NO_DECAY_PATTERNS):
            no_decay.append(p)
        else:
            decay.append(p)
    return [{"params": decay, "weight_decay": weight_decay},
            {"params": no_decay, "weight_decay": 0.0}]


class Lamb(torch.optim.Optimizer):
    """LAMB: Adam moments with a per-parameter trust ratio ||w|| / ||update|| (see module docstring)."""

    def __init__(self, params, lr: float = 1e-3, betas: Tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-6, weight_decay: float = 0.01, bias_correction: bool = True,
                 max_trust_ratio: Optional[float] = 10.0):
        if lr < 0 or eps < 0 or weight_decay < 0 or not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"invalid LAMB hyper-parameters lr={lr} betas={betas} eps={eps} wd={weight_decay}")
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        bias_correction=bias_correction, max_trust_ratio=max_trust_ratio)
        super().__init__(params, defaults)

    @torch.no_grad()
    def step(self, closure: Optional[Callable] = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                if p.grad.is_sparse:
                    raise RuntimeError("LAMB does not support sparse gradients")
                g = p.grad.float()
                state = self.state[p]
                if not state:
                    state["step"] = 0
                    state["exp_avg"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, dtype=torch.float32, memory_format=torch.preserve_format)
                state["step"] += 1
                m, v = state["exp_avg"], state["exp_avg_sq"]
                m.mul_(b1).add_(g, alpha=1 - b1)
                v.mul_(b2).addcmul_(g, g, value=1 - b2)
                if group["bias_correction"]:
                    m_hat = m / (1 - b1 ** state["step"])
                    v_hat = v / (1 - b2 ** state["step"])
                else:
                    m_hat, v_hat = m, v
                w = p.float()
                update = m_hat / (v_hat.sqrt() + group["eps"])
                if group["weight_decay"]:
                    update.add_(w, alpha=group["weight_decay"])
                w_norm = torch.linalg.vector_norm(w)
                u_norm = torch.linalg.vector_norm(update)
                trust = torch.where((w_norm > 0) & (u_norm > 0), w_norm / u_norm, torch.ones_like(w_norm))
                if group["max_trust_ratio"] is not None:
                    trust = trust.clamp(max=group["max_trust_ratio"])
                p.add_((update * (-group["lr"] * trust)).to(p.dtype))
        return loss


def build_optimizer(model: torch.nn.Module, name: str, lr: float, weight_decay: float = 0.01,
                    betas: Tuple[float, float] = (0.9, 0.999), eps: float = 1e-6,
                    fused: Optional[bool] = None) -> torch.optim.Optimizer:
    """'adamw' (the paper's Adam with decoupled weight decay) or 'lamb'."""
    groups = parameter_groups(model, weight_decay)
    if name == "adamw":
        device_types = {p.device.type for g in groups for p in g["params"]}
        if fused is None:
            fused = device_types == {"cuda"}
        kwargs = {"fused": True} if fused else {}
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kwargs)
    if name == "lamb":
        return Lamb(groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
    raise ValueError(f"unknown optimizer {name!r}; expected 'adamw' or 'lamb'")


def warmup_linear_decay(optimizer: torch.optim.Optimizer, warmup_steps: int,
                        total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """lr * step/warmup during warm-up, then linear decay to 0 at total_steps."""
    warmup_steps = max(0, int(warmup_steps))
    total_steps = max(1, int(total_steps))

    def factor(step: int) -> float:
        if warmup_steps and step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / max(1, total_steps - warmup_steps))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- distributed
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


# --------------------------------------------------------------------------- RNG state
def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def capture_rng_state(device: Optional[torch.device] = None) -> Dict[str, Any]:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch_cpu": torch.get_rng_state()}
    if device is not None and device.type == "cuda":
        state["torch_cuda"] = torch.cuda.get_rng_state(device)
    return state


def restore_rng_state(state: Dict[str, Any], device: Optional[torch.device] = None) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch_cpu"])
    if device is not None and device.type == "cuda" and "torch_cuda" in state:
        torch.cuda.set_rng_state(state["torch_cuda"], device)


# --------------------------------------------------------------------------- checkpoints
CKPT_RE = re.compile(r"^step_(\d+)$")


def fsync_tree(path: str) -> None:
    for root, _dirs, files in os.walk(path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(root)


def list_checkpoints(directory: str) -> List[Tuple[int, str]]:
    """Complete checkpoints in ``directory`` as (step, path), oldest first."""
    if not os.path.isdir(directory):
        return []
    out = []
    for name in os.listdir(directory):
        m = CKPT_RE.match(name)
        if m and os.path.isfile(os.path.join(directory, name, "training_state.pt")):
            out.append((int(m.group(1)), os.path.join(directory, name)))
    return sorted(out)


def latest_checkpoint(directory: str) -> Optional[str]:
    found = list_checkpoints(directory)
    return found[-1][1] if found else None


def atomic_checkpoint(directory: str, step: int, write: Callable[[str], None], keep_last: Optional[int] = None) -> str:
    """Call ``write(tmp_dir)``, fsync everything, rename to ``directory/step_<step>``, prune to ``keep_last``.

    A crash at any point leaves either the previous checkpoints untouched or the new one
    complete: the final name appears only through one atomic rename of a synced directory.
    """
    os.makedirs(directory, exist_ok=True)
    final = os.path.join(directory, f"step_{step:08d}")
    tmp = os.path.join(directory, f".tmp_step_{step:08d}_{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    write(tmp)
    fsync_tree(tmp)
    if os.path.exists(final):  # re-saving the same step: move the old one aside first
        old = final + f".old_{os.getpid()}"
        os.rename(final, old)
        os.rename(tmp, final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.rename(tmp, final)
    fsync_dir(directory)
    if keep_last is not None and keep_last > 0:
        for _step, path in list_checkpoints(directory)[:-keep_last]:
            shutil.rmtree(path, ignore_errors=True)
    return final


def remove_stale_temp(directory: str) -> None:
    """Delete temp directories left by a run killed while saving."""
    if os.path.isdir(directory):
        for name in os.listdir(directory):
            if name.startswith(".tmp_step_") or ".old_" in name:
                shutil.rmtree(os.path.join(directory, name), ignore_errors=True)


def torch_save_atomic(obj: Any, path: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


# --------------------------------------------------------------------------- FLOPs / MFU
# Dense bf16 tensor-core peak, FLOP/s (vendor data sheets, without sparsity).
PEAK_BF16_FLOPS = [
    ("H200", 989.4e12), ("H100 PCIe", 756.0e12), ("H100 NVL", 835.0e12), ("H100", 989.4e12),
    ("GH200", 989.4e12), ("B200", 2250e12), ("A100", 312e12), ("A800", 312e12), ("L40S", 362e12),
    ("L40", 181e12), ("L4", 121e12), ("A10G", 125e12), ("A10", 125e12), ("RTX 4090", 165e12),
    ("RTX 3090", 71e12), ("V100", 125e12), ("T4", 65e12),
]


def peak_bf16_flops(device: torch.device) -> Optional[float]:
    """Peak dense bf16 FLOP/s of ``device``'s GPU, or None (CPU, or a GPU not in the table)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, flops in PEAK_BF16_FLOPS:
        if key in name:
            return flops
    return None


class FlopCounter:
    """Training FLOPs of BertForPreTraining on the real tokens of a batch.

    6 FLOPs per weight per token (2 forward, 4 backward) for the encoder's weights on every
    real token, and for the MLM transform + vocabulary projection on masked tokens only (the
    head runs there only); attention adds 12 * L * H * sum(len_i^2) (QK^T and PV, forward
    and backward). Embedding lookups and the pooler/NSP head are negligible and not counted.
    """

    def __init__(self, config):
        h, l, i = config.hidden_size, config.num_hidden_layers, config.intermediate_size
        self.layers, self.hidden = l, h
        self.encoder_params = l * (4 * h * h + 2 * h * i)  # QKV + output projection, FFN up + down
        self.head_params = h * h + config.vocab_size * h

    def __call__(self, real_tokens: float, masked_tokens: float, sum_len_sq: float) -> float:
        return (6.0 * (self.encoder_params * real_tokens + self.head_params * masked_tokens)
                + 12.0 * self.layers * self.hidden * sum_len_sq)


# --------------------------------------------------------------------------- logging
class MetricsLogger:
    """JSON lines (one object per record) and, when installed and asked for, TensorBoard."""

    def __init__(self, path: Optional[str], tensorboard_dir: Optional[str] = None, enabled: bool = True,
                 append: bool = False):
        self.enabled = enabled
        self.path = path
        self._f = None
        self._tb = None
        if not enabled:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            self._f = open(path, "a" if append else "w", encoding="utf-8")
        if tensorboard_dir:
            try:
                from torch.utils.tensorboard import SummaryWriter
                self._tb = SummaryWriter(tensorboard_dir)
            except Exception:  # tensorboard not installed: JSONL only
                self._tb = None

    def log(self, record: Dict[str, Any]) -> None:
        if not self.enabled:
            return
        if self._f is not None:
            self._f.write(json.dumps(record, default=_json_default) + "\n")
            self._f.flush()
        if self._tb is not None and "step" in record:
            kind = record.get("type", "train")
            for k, v in record.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "step":
                    self._tb.add_scalar(f"{kind}/{k}", v, record["step"])

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def _json_default(o):
    if isinstance(o, (np.integer,)):
        return int(o)
    if isinstance(o, (np.floating,)):
        return float(o)
    if isinstance(o, torch.Tensor):
        return o.item() if o.numel() == 1 else o.tolist()
    return str(o)


def read_jsonl(path: str) -> List[Dict[str, Any]]:
    out = []
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if line:
                    out.append(json.loads(line))
    return out


def plot_loss_curve(jsonl_path: str, png_path: str, title: str = "bertfast pre-training") -> Optional[str]:
    """Training (and held-out) loss against step from a metrics file; None if matplotlib is missing."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    records = read_jsonl(jsonl_path)
    # A resumed run appends: keep the last record of each step.
    train = {r["step"]: r for r in records if r.get("type", "train") == "train" and "loss" in r}
    evals = {r["step"]: r for r in records if r.get("type") == "eval" and "loss" in r}
    if not train:
        return None
    fig, ax = plt.subplots(figsize=(7, 4), dpi=110)
    steps = sorted(train)
    ax.plot(steps, [train[s]["loss"] for s in steps], lw=1, label="train loss (MLM + NSP)")
    if evals:
        es = sorted(evals)
        ax.plot(es, [evals[s]["loss"] for s in es], "o-", ms=3, label="held-out loss")
    lengths = [train[s].get("seq_len") for s in steps]
    for prev, cur, step in zip(lengths, lengths[1:], steps[1:]):
        if prev != cur and cur is not None:  # a new phase (sequence length)
            ax.axvline(step, color="gray", ls="--", lw=0.8)
            ax.text(step, ax.get_ylim()[1], f" seq {cur}", va="top", fontsize=8, color="gray")
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return png_path


def format_duration(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"


def autocast_context(device: torch.device, precision: str):
    """bf16/fp16 autocast on CUDA (bf16 also on CPU if asked); fp32: no autocast."""
    if precision == "fp32":
        return contextlib.nullcontext()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float16
    return torch.autocast(device_type=device.type, dtype=dtype)


def resolve_precision(precision: Optional[str], device: torch.device) -> str:
    if precision in (None, "auto"):
        return "bf16" if device.type == "cuda" and torch.cuda.is_bf16_supported() else "fp32"
    if precision not in ("fp32", "bf16", "fp16"):
        raise ValueError(f"precision must be fp32, bf16, fp16 or auto, got {precision!r}")
    if precision == "fp16" and device.type != "cuda":
        raise ValueError("fp16 with loss scaling needs CUDA; use fp32 (or bf16) on CPU")
    return precision


def load_json_config(path: str) -> Dict[str, Any]:
    with open(path, encoding="utf-8") as f:
        try:
            values = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(values, dict):
        raise ValueError(f"{path}: expected a JSON object of option names to values")
    return values


def set_parser_defaults(parser, values: Dict[str, Any], source: str) -> None:
    """Make ``values`` (option names with '-' or '_') the parser's defaults; unknown keys are errors."""
    dests = {a.dest for a in parser._actions}
    normalised = {}
    for k, v in values.items():
        dest = k.lstrip("-").replace("-", "_")
        if dest not in dests:
            raise ValueError(f"{source}: unknown option {k!r}")
        normalised[dest] = v
    parser.set_defaults(**normalised)


def apply_config_file(parser, argv: Sequence[str], config_key: str = "config"):
    """Parse ``argv``; if it names a JSON config file, its values become defaults under the flags."""
    args, _ = parser.parse_known_args(argv)
    path = getattr(args, config_key, None)
    if path:
        set_parser_defaults(parser, load_json_config(path), path)
    return parser.parse_args(argv)

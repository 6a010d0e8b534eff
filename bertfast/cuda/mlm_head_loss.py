"""The kernel of mlm_head_loss on the CUDA backend (csrc/mlm_head_loss.cu): softmax cross-entropy
over one chunk of decoder logits, its gradient written in place. The chunked driver is
bertfast.ops.mlm_head_loss's, shared by every backend."""
from __future__ import annotations

from typing import Tuple

import torch

from bertfast.contract import ID_DTYPES, check_logits, check_tensor, row_stride
from bertfast.cuda import _common as C


def unsupported(inputs) -> list:
    """Dispatch: reasons these inputs exceed this backend's limits: none (any vocabulary)."""
    return []


def mlm_head_loss_fwd(logits: torch.Tensor, labels: torch.Tensor, grad_scale: float,
                      compute_grad: bool) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row softmax cross-entropy over logits [M, V] (stride 1 along V), MODIFIED IN PLACE when
    compute_grad: grad_scale * (softmax - onehot(label)) on labelled rows, 0 on ignored ones.
    labels [M] int64 (int32 accepted); -100 and (unchecked) out-of-range labels are ignored.
    Returns (loss [M] fp32, 0 at ignored rows; lse [M] fp32; correct [M] bool)."""
    C.on_device(logits=logits, labels=labels)
    m, v = check_logits(logits)
    check_tensor("labels", labels, dtypes=ID_DTYPES, shape=(m,), device=logits.device)
    labels = labels.to(torch.int64).contiguous()
    dev = logits.device
    loss = torch.empty(m, dtype=torch.float32, device=dev)
    lse = torch.empty(m, dtype=torch.float32, device=dev)
    correct = torch.empty(m, dtype=torch.bool, device=dev)
    if m > 0:
        C.launch(dev, "mlm_head_loss_fwd", logits.data_ptr(), row_stride(logits), labels.data_ptr(), loss.data_ptr(),
                 lse.data_ptr(), correct.data_ptr(), m, v, float(grad_scale), int(bool(compute_grad)),
                 C.DTYPE_CODE[logits.dtype])
    return loss, lse, correct

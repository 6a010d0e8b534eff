"""How one forward of the encoder lays its tokens out as rows [N, H], the one thing its three
input forms change: every layer runs the same code over a ``Layout``.

* unpadded (the default): a padded batch [B, S] loses its padding once (``bertfast.padding``); the
  rows are the real tokens, the attention is the varlen op over cu_seqlens, the output is padded
  back with zeros. Any mask pattern works, left padding too. Given position ids that restart and
  no attention mask (packed sequences, as transformers 5.25 reads them), every position is a row
  and cu_seqlens cut each row where its positions restart (``Layout.segmented``; not under
  torch.compile, which takes packed sequences as cu_seq_lens_q).
* padded (under torch.compile): every position is a row, static shapes; the attention is the
  padded op with the key mask (unpadding has a data-dependent size).
* packed (transformers' cu_seq_lens_q / max_length_q on a [1, T] row): the row is already the
  unpadded layout, every shape fixed, nothing read back to the host.

``plain`` is what the model decided for the layers after the embeddings: None, or the torch
backend's attention with the batch worked out once (``ops.attention.varlen_inference``), when
every layer op would run its plain-PyTorch backend with nothing to differentiate; the layers then
run the modules' own math (``reference.layer_math``), without the ops' host time.
"""
from __future__ import annotations

from typing import Callable, List, Optional

import torch

from bertfast import ops
from bertfast.padding import pad_rows, unpad, unpad_mask

Tensor = torch.Tensor
UNPADDED, PADDED, PACKED = "unpadded", "padded", "packed"


class Layout:
    __slots__ = ("kind", "batch", "seqlen", "index", "cu_seqlens", "max_seqlen", "key_mask", "plain")

    def __init__(self, kind: str, batch: int, seqlen: int, index: Optional[Tensor] = None,
                 cu_seqlens: Optional[Tensor] = None, max_seqlen: int = 0, key_mask: Optional[Tensor] = None):
        self.kind, self.batch, self.seqlen = kind, batch, seqlen
        self.index = index  # unpadded: each row's position in the flattened [B * S] batch
        self.cu_seqlens, self.max_seqlen = cu_seqlens, max_seqlen  # unpadded, packed
        self.key_mask = key_mask  # padded: [B, S], True at tokens
        self.plain: Optional[Callable[[Tensor, Tensor, Tensor], Tensor]] = None

    @classmethod
    def unpadded(cls, attention_mask: Tensor) -> "Layout":
        """The real tokens of attention_mask [B, S] (one host read: the row count)."""
        index, cu_seqlens, max_seqlen = unpad_mask(attention_mask)
        return cls(UNPADDED, *attention_mask.shape, index=index, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    @classmethod
    def segmented(cls, starts: Tensor) -> "Layout":
        """Every position of a batch [B, S] a row, in the sequences ``starts`` [B, S] begin (True at
        each one's first token, every row's first among them: ``model_inputs.position_restarts``).
        One host read: the sequences' count and the longest."""
        if torch.compiler.is_compiling():
            raise ValueError(
                "position_ids with no attention_mask: bertfast reads positions that restart as packed sequences "
                "(as transformers 5.25 does), and cutting them has a size torch.compile cannot trace. Pass "
                "cu_seq_lens_q and max_length_q for packed sequences (DataCollatorWithFlattening("
                "return_flash_attn_kwargs=True), bertfast.pack_batch), or an attention_mask (of ones) for one "
                "sequence a row")
        batch, seqlen = starts.shape
        firsts = starts.flatten().nonzero().flatten()
        cu_seqlens = torch.cat([firsts, firsts.new_full((1,), batch * seqlen)]).to(torch.int32)
        return cls(UNPADDED, batch, seqlen, index=torch.arange(batch * seqlen, device=starts.device),
                   cu_seqlens=cu_seqlens, max_seqlen=int(cu_seqlens.diff().max()))

    @classmethod
    def padded(cls, attention_mask: Tensor) -> "Layout":
        return cls(PADDED, *attention_mask.shape, key_mask=attention_mask.bool())

    @classmethod
    def packed(cls, cu_seqlens: Tensor, max_seqlen: int, tokens: int) -> "Layout":
        return cls(PACKED, 1, tokens, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)

    @property
    def takes_qkv_bias(self) -> bool:
        """Whether ``attend`` forms the gradient of the QKV biases it is given: the varlen op does (its
        Triton backward sums it as it writes dqkv), so the QKV GEMM's node leaves it out."""
        return self.kind != PADDED

    def rows(self, t: Optional[Tensor]) -> Optional[Tensor]:
        """[B, S, ...] -> the rows [N, ...] (None stays None)."""
        if t is None:
            return None
        return unpad(t, self.index) if self.kind == UNPADDED else t.reshape((-1,) + tuple(t.shape[2:]))

    def restore(self, x: Tensor) -> Tensor:
        """Rows [N, H] -> [B, S, H] (zeros at padding)."""
        if self.kind == UNPADDED:
            return pad_rows(x, self.index, self.batch, self.seqlen)
        return x.view(self.batch, self.seqlen, x.shape[-1])

    def attend(self, qkv: Tensor, dropout_p: float, qkv_bias: List[Tensor]) -> Tensor:
        """The fused attention on the rows' qkv [N, 3, A, D] -> [N, A, D]; ``qkv_bias``: the biases
        whose gradient it forms (takes_qkv_bias), else empty."""
        if self.kind == PADDED:
            q, k, v = qkv.view(self.batch, self.seqlen, 3, *qkv.shape[2:]).unbind(2)  # [B, S, A, D] each
            return ops.attention(q, k, v, self.key_mask, dropout_p).reshape(qkv.shape[0], *qkv.shape[2:])
        return ops.attention_varlen(qkv, self.cu_seqlens, self.max_seqlen, dropout_p, qkv_bias=qkv_bias)

    def first_tokens(self, sequence: Tensor, rows: Tensor, attention_mask: Tensor) -> Tensor:
        """Each sequence's first real token [B, 1, H] (what the pooler reads) from the output
        sequence [B, S, H] or, packed, from its rows (an empty sequence's index is clamped: the
        model pools it to 0)."""
        if self.kind == PACKED:
            return rows.index_select(0, self.cu_seqlens[:-1].clamp(max=rows.shape[0] - 1))[:, None]
        return first_real_tokens(sequence, attention_mask)


def first_real_tokens(sequence: Tensor, attention_mask: Tensor) -> Tensor:
    """Each row's first real token [B, 1, H], what the pooler reads: position 0 unless the row is
    left-padded (transformers pools position 0 whatever it holds, an encoded pad token there; the
    unpadded layout has none). A row without a real token gives its position 0."""
    first = attention_mask.ne(0).to(torch.int32).argmax(dim=1)  # argmax returns the first maximum
    return sequence.gather(1, first.view(-1, 1, 1).expand(-1, 1, sequence.shape[-1]))

"""sentence-transformers on bertfast's unpadded path, end to end.

sentence-transformers (5.4 and later) can encode a batch as one row of tokens with its sequences'
boundaries (transformers' cu_seq_lens_q / max_length_q) and pool straight from those rows (mean,
CLS, last token, max, weighted mean), but turns it on only for FlashAttention models.
``unpadded(model)`` turns it on for the bertfast encoders inside a model, with a collator of its
own: transformers' DataCollatorWithFlattening carries no token_type_ids, and losing those of
sentence pairs would change BERT's embeddings without a word. The encoder numbers each
sequence's positions itself (from padding_idx + 1 for the RoBERTa family).

    bertfast.register_auto()                                   # the encoders are bertfast's
    model = bertfast.unpadded(SentenceTransformer("intfloat/e5-small-v2"))
    model.encode(texts)                                        # no padding anywhere

Saved models stay plain sentence-transformers models.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from typing import Any, Dict, Iterator, List, Optional, Sequence

import torch

# What sentence-transformers' tokenizer gives per text with return_attention_mask=False, and what
# the flattened row carries of it.
TOKEN_KEYS = ("input_ids", "token_type_ids")
MIN_VERSION = (5, 4)  # the first sentence-transformers that encodes and pools flattened batches
TASKS = ("feature-extraction", "fill-mask")  # the Transformer tasks whose outputs are per token


class FlattenTexts:
    """Tokenized texts (a list of {"input_ids": [...], "token_type_ids": [...]}) as one row of
    tokens: input_ids (and token_type_ids) [1, T] int64, cu_seq_lens_q [texts + 1] int32 and
    max_length_q, what bertfast's models take for packed sequences and sentence-transformers'
    Pooling reads. Every text must have at least one token (an empty one would shift the pooling
    of the next), and nothing the row cannot carry may be given."""

    def __call__(self, features: Sequence[Dict[str, Any]], return_tensors: str = "pt") -> Dict[str, Any]:
        if not features:
            raise ValueError("FlattenTexts: expected at least one tokenized text, got none")
        keys = [k for k in TOKEN_KEYS if k in features[0]]
        for i, feature in enumerate(features):
            other = sorted(set(feature) - set(TOKEN_KEYS))
            if other:
                raise ValueError(f"FlattenTexts: the batch's text {i} has {other}: a flattened row carries only "
                                 f"{list(TOKEN_KEYS)} (the tokenizer must not pad or return a mask)")
            if sorted(feature) != sorted(keys):
                raise ValueError(f"FlattenTexts: the batch's text {i} has {sorted(feature)}, its text 0 {sorted(keys)}")
            if len(feature["input_ids"]) == 0:
                raise ValueError(f"FlattenTexts: the batch's text {i} has no tokens (a tokenizer without special tokens "
                                 f"and an empty text): a sequence needs at least one token to be pooled")
        lengths = torch.tensor([len(f["input_ids"]) for f in features], dtype=torch.int64)
        out: Dict[str, Any] = {k: torch.tensor([t for f in features for t in _ids(f[k])], dtype=torch.int64)[None]
                               for k in keys}
        out["cu_seq_lens_q"] = torch.nn.functional.pad(lengths.cumsum(0), (1, 0)).to(torch.int32)
        out["max_length_q"] = int(lengths.max())
        return out


def _ids(value: Any) -> List[int]:
    return value.tolist() if hasattr(value, "tolist") else list(value)


def unsupported_version() -> Optional[str]:
    """Why the installed sentence-transformers cannot encode flattened batches, or None."""
    try:
        import sentence_transformers
    except ImportError:
        return "sentence-transformers is not installed (pip install bertfast[hf])"
    version = sentence_transformers.__version__
    if tuple(int(p) for p in version.split(".")[:2] if p.isdigit()) < MIN_VERSION:
        return (f"sentence-transformers {version} cannot encode or pool flattened batches; "
                f"{'.'.join(map(str, MIN_VERSION))} or later can (pip install -U sentence-transformers)")
    return None


def _is_bertfast(encoder: torch.nn.Module) -> bool:
    return type(encoder).__module__.startswith("bertfast.")


def _transformer_modules(model: torch.nn.Module) -> List[torch.nn.Module]:
    """sentence-transformers' Transformer modules inside ``model`` (a Router may hold several)."""
    try:
        from sentence_transformers.base.modules.transformer import Transformer
    except ImportError:  # before 5.4 (unsupported_version says so first)
        return []
    return [m for m in model.modules() if isinstance(m, Transformer)]


def unpadded(model: torch.nn.Module) -> torch.nn.Module:
    """Make ``model`` (a sentence-transformers SentenceTransformer) encode without padding: every
    Transformer module holding a bertfast encoder tokenizes without padding, runs the encoder on
    one row of tokens and hands the rows to the pooling as they are. In place; returns ``model``.
    Raises what is missing: a sentence-transformers before 5.4, no Transformer module, an encoder
    that is transformers' own (load the model with ``bertfast.register_auto()`` in effect), a task
    whose outputs are not per token. Setting a module's ``unpad_inputs`` afterwards undoes it."""
    problem = unsupported_version()
    if problem:
        raise RuntimeError(f"bertfast.unpadded: {problem}")
    modules = _transformer_modules(model)
    if not modules:
        raise ValueError(f"bertfast.unpadded: expected a sentence-transformers model with a Transformer module, "
                         f"got {type(model).__name__} without one")
    for module in modules:
        encoder = module.auto_model
        if not _is_bertfast(encoder):
            raise ValueError(f"bertfast.unpadded: the encoder is {type(encoder).__module__}.{type(encoder).__name__}, "
                             f"not bertfast's: load the model with bertfast.register_auto() in effect "
                             f"(bertfast.register_auto(); model = SentenceTransformer(...))")
        task = getattr(module, "transformer_task", "feature-extraction")
        if task not in TASKS:
            raise ValueError(f"bertfast.unpadded: the Transformer module's task is {task!r}; a flattened batch "
                             f"serves the tasks with an output per token: {list(TASKS)}")
        if getattr(module, "backend", "torch") != "torch":
            raise ValueError(f"bertfast.unpadded: the Transformer module runs the {module.backend!r} backend; "
                             f"bertfast's encoders run on 'torch'")
    for module in modules:  # every module checked before any changes
        module.data_collator = FlattenTexts()
        module._flatten_position_offset = 0  # no position_ids: the encoder numbers each sequence itself
        if module.model_forward_params is not None:  # None: the forward takes **kwargs, so everything passes
            module.model_forward_params |= {"cu_seq_lens_q", "max_length_q"}
        module.can_flatten_inputs = True
    if not hasattr(model.encode, "bertfast_modules"):
        model.encode = _padded_for_token_outputs(model.encode)
    model.encode.bertfast_modules = modules
    return model


@contextlib.contextmanager
def _padded(modules: List[torch.nn.Module]) -> Iterator[None]:
    saved = [m.can_flatten_inputs for m in modules]
    for m in modules:
        m.can_flatten_inputs = False
    try:
        yield
    finally:
        for m, flag in zip(modules, saved):
            m.can_flatten_inputs = flag


def _padded_for_token_outputs(encode):
    """``encode`` run padded when it is to return token embeddings (output_value "token_embeddings"
    or None): sentence-transformers cuts those out of a padded batch by its attention mask, which a
    flattened one does not have (it raises KeyError: 'attention_mask')."""
    signature = inspect.signature(encode)

    @functools.wraps(encode)
    def encode_(*args, **kwargs):
        output = signature.bind_partial(*args, **kwargs).arguments.get("output_value", "sentence_embedding")
        if output == "sentence_embedding":
            return encode(*args, **kwargs)
        with _padded(encode_.bertfast_modules):
            return encode(*args, **kwargs)
    return encode_

"""Reading and writing Hugging Face BERT checkpoint directories. Never touches a network.

Reads config.json + model.safetensors (or a sharded model.safetensors.index.json, or
pytorch_model.bin); accepts legacy LayerNorm names (gamma/beta), the
``embeddings.position_ids`` buffer, and checkpoints saved with or without the ``bert.``
prefix. Writes config.json + model.safetensors without the tied duplicates, which
transformers' from_pretrained loads.
"""
from __future__ import annotations

import json
import logging
import os
from typing import Dict, List

import torch
import torch.nn as nn

log = logging.getLogger("bertfast.checkpoint")

SAFETENSORS, SAFETENSORS_INDEX, TORCH_BIN = "model.safetensors", "model.safetensors.index.json", "pytorch_model.bin"
# Keys that mirror another parameter (tied) or are buffers transformers may write.
TIED_KEYS = ("cls.predictions.decoder.weight", "cls.predictions.decoder.bias")
IGNORED_SUFFIXES = ("embeddings.position_ids",)


def read_state_dict(directory: str) -> Dict[str, torch.Tensor]:
    if not os.path.isdir(directory):
        raise FileNotFoundError(f"expected a local checkpoint directory, got {directory!r} (bertfast never "
                                f"downloads from a hub)")
    path = os.path.join(directory, SAFETENSORS)
    index = os.path.join(directory, SAFETENSORS_INDEX)
    if os.path.isfile(path):
        from safetensors.torch import load_file
        return load_file(path)
    if os.path.isfile(index):
        from safetensors.torch import load_file
        shards = sorted(set(json.load(open(index))["weight_map"].values()))
        state: Dict[str, torch.Tensor] = {}
        for shard in shards:
            state.update(load_file(os.path.join(directory, shard)))
        return state
    path = os.path.join(directory, TORCH_BIN)
    if os.path.isfile(path):
        return torch.load(path, map_location="cpu", weights_only=True)
    raise FileNotFoundError(f"no weights in {directory!r}: expected {SAFETENSORS}, {SAFETENSORS_INDEX} or "
                            f"{TORCH_BIN}; found {sorted(os.listdir(directory))}")


def normalise_keys(state: Dict[str, torch.Tensor], model: nn.Module) -> Dict[str, torch.Tensor]:
    """Map legacy names and prefixes onto the model's own keys."""
    own = set(model.state_dict().keys())
    model_has_prefix = any(k.startswith("bert.") for k in own)
    out: Dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if key.endswith(IGNORED_SUFFIXES):
            continue
        key = key.replace("LayerNorm.gamma", "LayerNorm.weight").replace("LayerNorm.beta", "LayerNorm.bias")
        has_prefix = key.startswith("bert.")
        if model_has_prefix and not has_prefix and ("bert." + key) in own:
            key = "bert." + key
        elif not model_has_prefix and has_prefix:
            key = key[len("bert."):]
        out[key] = value
    return out


def load_into(model: nn.Module, directory: str, strict: bool = False) -> None:
    """Load a checkpoint directory into ``model``.

    Missing encoder weights are an error. Missing head weights (e.g. a classifier on top of
    a pre-trained encoder) are initialised fresh and logged; so are unexpected keys (e.g.
    the pre-training heads when loading a fine-tuning model). strict=True makes any
    mismatch an error.
    """
    state = normalise_keys(read_state_dict(directory), model)
    own = model.state_dict()
    tied = {k for k in TIED_KEYS if k in own}
    missing = sorted(k for k in own if k not in state and k not in tied)
    unexpected = sorted(k for k in state if k not in own)
    shape_errors = [f"{k}: checkpoint {tuple(state[k].shape)} vs model {tuple(own[k].shape)}"
                    for k in state if k in own and state[k].shape != own[k].shape]
    if shape_errors:
        raise ValueError(f"checkpoint {directory!r} does not fit the model's shapes:\n  " + "\n  ".join(shape_errors))
    encoder_missing = [k for k in missing if _is_encoder_key(k)]
    if encoder_missing or (strict and (missing or unexpected)):
        raise ValueError(_mismatch_message(directory, missing, unexpected))
    if missing:
        log.warning("bertfast: newly initialised (not in %s): %s", directory, ", ".join(missing))
    if unexpected:
        log.warning("bertfast: unused weights in %s: %s", directory, ", ".join(unexpected))
    for key in tied:
        state.pop(key, None)
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    model.tie_weights()


def _is_encoder_key(key: str) -> bool:
    body = key[len("bert."):] if key.startswith("bert.") else key
    return body.startswith(("embeddings.", "encoder."))


def _mismatch_message(directory: str, missing: List[str], unexpected: List[str]) -> str:
    lines = [f"checkpoint {directory!r} does not match the model:"]
    if missing:
        lines.append(f"  missing keys ({len(missing)}): {', '.join(missing)}")
    if unexpected:
        lines.append(f"  unexpected keys ({len(unexpected)}): {', '.join(unexpected)}")
    return "\n".join(lines)


def save_model(model: nn.Module, directory: str) -> None:
    """config.json (with architectures) + model.safetensors, tied duplicates left out."""
    from safetensors.torch import save_file

    os.makedirs(directory, exist_ok=True)
    config = model.config.to_dict()
    config["architectures"] = [type(model).__name__]
    with open(os.path.join(directory, "config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items() if k not in TIED_KEYS}
    save_file(state, os.path.join(directory, SAFETENSORS), metadata={"format": "pt"})

"""Checks and atomicity around transformers' ``from_pretrained`` and ``save_pretrained``.

transformers does the loading and the saving; bertfast's models wrap both:

* loading: when transformers fails, a weight file of a local checkpoint that cannot be read
  (truncated, corrupt) is named in an OSError; after loading, NaN or inf in the weights is a
  ValueError naming the parameter (checked once here, never per forward).
* saving: transformers writes the config before the weights, into the target directory, so a
  failed weights write (disk full) leaves a new config.json beside the old weights. bertfast lets
  transformers write into a staging directory next to the target (same filesystem), then moves
  the files in, weights first and config last, so a reader never sees a new config with old
  weights. Weight files of the previous save that the new one did not write (old shards and
  their index, an old single file after a sharded save, an old ``pytorch_model.bin``) are removed
  before the config moves in. On failure the previous save is untouched and the staging
  directory is removed.
"""
from __future__ import annotations

import errno
import inspect
import itertools
import json
import os
import re
import shutil
import uuid
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from bertfast.data.shards import process_alive

# ------------------------------------------------------------------ loading
_WEIGHT_PREFIXES = ("model", "pytorch_model", "adapter_model")


def load_checked(load: Callable[..., Any], source: Any, *args: Any, **kwargs: Any) -> Any:
    """``load(source, ...)`` (transformers' from_pretrained), with the file named when a weight file
    cannot be read, and the parameter named when a weight is NaN or inf."""
    try:
        loaded = load(source, *args, **kwargs)
    except Exception as e:
        bad = unreadable_weight_file(source, kwargs.get("subfolder") or "")
        if bad is None:
            raise
        raise OSError(f"{bad[0]}: cannot read the weights: {bad[1]}; the file is truncated or corrupt, "
                      f"save or download it again") from e
    model = loaded[0] if isinstance(loaded, tuple) else loaded  # (model, loading_info)
    check_finite_weights(model, source)
    return loaded


def unreadable_weight_file(source: Any, subfolder: str = "") -> Optional[Tuple[str, str]]:
    """(path, problem) of the first weight file of a local checkpoint directory that cannot be read,
    or None. Only runs after a failed load: it opens each file's header (safetensors) or archive (.bin)."""
    try:
        folder = os.path.join(os.fspath(source), subfolder)
    except TypeError:
        return None
    if not os.path.isdir(folder):
        return None
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if not name.startswith(_WEIGHT_PREFIXES) or not os.path.isfile(path):
            continue
        try:
            if name.endswith(".safetensors"):
                from safetensors import safe_open

                with safe_open(path, framework="pt"):
                    pass
            elif name.endswith(".bin"):
                torch.load(path, map_location="meta", weights_only=True)
            elif name.endswith(".json"):
                with open(path, encoding="utf-8") as f:
                    json.load(f)
        except Exception as e:  # noqa: BLE001 - any failure to read is the finding
            problem = re.split(r"(?<=\.)\s", (str(e).strip().splitlines() or [""])[0])[0][:300]
            return path, f"{type(e).__name__}: {problem.rstrip('.')} (the file has {os.path.getsize(path)} bytes)"
    return None


def nonfinite_weights(model: torch.nn.Module) -> List[str]:
    """'name (k of n values)' for each floating parameter and buffer holding NaN or inf (this
    process's shard under FSDP). One host read per device."""
    by_device: Dict[torch.device, List[Tuple[str, torch.Tensor]]] = {}
    for name, t in itertools.chain(model.named_parameters(), model.named_buffers()):
        t = t.to_local() if hasattr(t, "to_local") else t  # an FSDP DTensor: this rank's shard
        if t.is_floating_point() and not t.is_meta and t.numel():
            by_device.setdefault(t.device, []).append((name, t))
    bad: List[str] = []
    with torch.no_grad():
        for group in by_device.values():
            finite = torch.stack([t.isfinite().all() for _, t in group]).tolist()
            bad += [f"{n} ({int(t.numel() - t.isfinite().sum())} of {t.numel()} values)"
                    for (n, t), ok in zip(group, finite) if not ok]
    return bad


def check_finite_weights(model: torch.nn.Module, source: Any) -> None:
    """ValueError naming the parameters (and buffers) holding NaN or inf."""
    bad = nonfinite_weights(model)
    if bad:
        raise ValueError(f"{source}: the loaded weights hold NaN or inf values: {', '.join(bad[:5])}"
                         + (f" and {len(bad) - 5} more" if len(bad) > 5 else ""))


# ------------------------------------------------------------------ saving
def save_atomically(model: torch.nn.Module, save: Callable[..., Any], save_directory: Any, *args: Any,
                    **kwargs: Any) -> Any:
    """``save(save_directory, ...)`` (transformers' save_pretrained, every keyword passed through),
    written into a staging directory next to ``save_directory`` and then moved in."""
    signature = inspect.signature(save)
    options: Dict[str, Any] = {}
    for name, value in signature.bind(save_directory, *args, **kwargs).arguments.items():
        if signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            options.update(value)
        else:
            options[name] = value
    directory = options.pop(next(iter(signature.parameters)))
    saves_here = getattr(model, "should_save_on_this_rank", lambda main: main)(options.get("is_main_process", True))
    # Uploads, distributed checkpoints (every rank writes), other ranks and a file path (transformers
    # logs an error) stay transformers' own.
    if (options.get("push_to_hub") or options.get("distributed_checkpoint") or not saves_here
            or os.path.isfile(directory)):
        return save(directory, **options)
    target = os.path.abspath(os.fspath(directory))
    if not os.path.isdir(target) or not os.listdir(target):
        return save(directory, **options)  # nothing there to protect (a checkpoint's temp dir, a new directory)
    parent = os.path.dirname(target)
    _remove_stale_staging(parent, os.path.basename(target))
    staging = os.path.join(parent, f".{os.path.basename(target)}.saving-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.mkdir(staging)
    try:
        try:
            result = save(staging, **options)
        except OSError as e:
            raise _save_error(e, target, parent, model) from e
        except Exception as e:
            e.add_note(f"save_pretrained({target}): nothing was changed there; the partial save was removed")
            raise
        _move_into(staging, target, options.get("variant"))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return result


def _remove_stale_staging(parent: str, name: str) -> None:
    """Delete the staging directories of saves into ``name`` whose process no longer runs (killed)."""
    pattern = re.compile(re.escape(f".{name}.saving-") + r"(\d+)-[0-9a-f]+")
    for entry in os.listdir(parent):
        m = pattern.fullmatch(entry)
        if m and not process_alive(int(m.group(1))):
            shutil.rmtree(os.path.join(parent, entry), ignore_errors=True)


def disk_full(e: BaseException) -> bool:
    """Whether ``e`` says the disk is full: safetensors and torch.save do not keep the errno
    ("I/O error: No space left on device (os error 28)", "... file write failed")."""
    text = str(e)
    return (getattr(e, "errno", None) == errno.ENOSPC or "No space left on device" in text or "StorageFull" in text
            or "file write failed" in text)


def _save_error(e: OSError, target: str, parent: str, model: torch.nn.Module) -> OSError:
    unchanged = f"nothing was changed in {target} (a previous save there is untouched)"
    if disk_full(e):
        # Measured before the partial save is removed: the space the write found.
        free = shutil.disk_usage(parent).free
        need = sum(t.numel() * t.element_size() for t in model.state_dict().values())
        return OSError(errno.ENOSPC, f"save_pretrained({target}): the disk is full ({_size(free)} free on "
                                     f"{parent} when the write failed; the weights need about {_size(need)}); "
                                     f"{unchanged}")
    return OSError(e.errno, f"save_pretrained({target}): {e}; {unchanged}")


def _size(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def _is_index(name: str) -> bool:
    return name.endswith(".json") and ".index" in name


def weight_file_names(variant: Optional[str]) -> Tuple[set, List[re.Pattern]]:
    """Names (single files and indexes) and shard patterns of transformers' weight files for ``variant``."""
    from transformers.modeling_utils import _add_variant

    names, shards = set(), []
    for single in ("model.safetensors", "pytorch_model.bin"):
        name = _add_variant(single, variant)
        names |= {name, _add_variant(single + ".index.json", variant)}
        stem, ext = name.rsplit(".", 1)
        shards.append(re.compile(re.escape(stem) + r"-\d{5}-of-\d{5}\." + re.escape(ext)))
    return names, shards


def _move_into(staging: str, target: str, variant: Optional[str]) -> None:
    """Move the new save into ``target``: weights, then their index, then the stale weights of the
    previous save go, and the config files last."""
    os.makedirs(target, exist_ok=True)
    new = sorted(os.listdir(staging))
    names, shards = weight_file_names(variant)
    is_weight = lambda n: n in names or any(p.fullmatch(n) for p in shards)  # noqa: E731
    configs = [n for n in new if n.endswith("config.json")]
    indexes = [n for n in new if _is_index(n) and n not in configs]
    for name in [n for n in new if n not in configs and n not in indexes] + indexes:
        _replace(os.path.join(staging, name), os.path.join(target, name))
    if any(is_weight(n) for n in new):  # an adapter-only save leaves the base model's weights alone
        for name in os.listdir(target):
            path = os.path.join(target, name)
            if name not in new and is_weight(name) and os.path.isfile(path):
                os.remove(path)
    for name in configs:
        _replace(os.path.join(staging, name), os.path.join(target, name))


def _replace(src: str, dst: str) -> None:
    if os.path.isdir(src) and os.path.isdir(dst) and not os.path.islink(dst):
        shutil.rmtree(dst)  # os.replace moves a directory only onto an empty one
    os.replace(src, dst)

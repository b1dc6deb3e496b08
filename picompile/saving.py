"""Save and load compiled plans, so a model is profiled once.

A saved plan is a directory:
    manifest.json         format, version, the model's fingerprint, sha256 of each file
    plan.json             the Plan (every decision, as JSON)
    tensors.safetensors   predictors and the hot-first neuron orders

The model's own weights are not written again: `load(model, dir)` rewrites the given model the
same way `compile` did and applies the saved decisions, after checking the model is the one the
plan was made for. Nothing is pickled. The directory is written next to its final place and
swapped in, so a crash leaves either the old plan or the new one, never half of one.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import tempfile

import torch
from safetensors.torch import load_file, save_file
from torch import nn

FORMAT = "picompile-plan"
VERSION = 1
FILES = ("plan.json", "tensors.safetensors")


class PlanError(ValueError):
    """A saved plan that cannot be used: corrupt, truncated, of another model or version."""


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's architecture and weights, taken before compile rewrites it.

    Every tensor's name, shape and dtype, the HF config if any, and a strided sample of up to
    4096 values per tensor: cheap on a 7B model, and different weights give a different hash."""
    h = hashlib.sha256(type(model).__name__.encode())
    config = getattr(model, "config", None)
    if config is not None and hasattr(config, "to_json_string"):
        h.update(config.to_json_string(use_diff=False).encode())
    for name, t in sorted(model.state_dict(keep_vars=False).items()):
        h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
        flat = t.detach().reshape(-1)
        if flat.numel():
            step = max(1, flat.numel() // 4096)
            sample = flat[::step].to("cpu", torch.float32).contiguous()
            h.update(sample.numpy().tobytes())
    return h.hexdigest()


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _fsync_write(path: pathlib.Path, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def save(plan_json: dict, tensors: dict[str, torch.Tensor], model_fingerprint: str,
         directory: str | os.PathLike) -> pathlib.Path:
    """Write a plan directory atomically (see the module docstring)."""
    target = pathlib.Path(directory)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _fsync_write(tmp / "plan.json", json.dumps(plan_json, indent=1, sort_keys=True).encode())
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                  str(tmp / "tensors.safetensors"), metadata={"format": FORMAT})
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "fingerprint": model_fingerprint,
            "files": {name: _sha256(tmp / name) for name in FILES},
        }
        _fsync_write(tmp / "manifest.json", json.dumps(manifest, indent=1).encode())
        if target.exists():
            old = target.with_name(f".{target.name}.old-{os.getpid()}")
            os.replace(target, old)
            os.replace(tmp, target)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def read(directory: str | os.PathLike, model_fingerprint: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (plan JSON, tensors), after checking format, version, checksums and fingerprint."""
    d = pathlib.Path(directory)
    manifest_path = d / "manifest.json"
    if not manifest_path.is_file():
        raise PlanError(f"{d} is not a saved picompile plan: no manifest.json (save one with cm.save(dir))")
    try:
        manifest = json.loads(manifest_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise PlanError(f"{manifest_path} is corrupt ({e}); compile the model again and save it") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PlanError(f"{manifest_path} is not a picompile plan manifest")
    if manifest.get("version") != VERSION:
        raise PlanError(f"{d} has plan format version {manifest.get('version')!r}; this picompile "
                        f"reads version {VERSION}: compile the model again and save it")
    for name in FILES:
        path = d / name
        want = manifest.get("files", {}).get(name)
        if not path.is_file():
            raise PlanError(f"{path} is missing; the saved plan is incomplete")
        if _sha256(path) != want:
            raise PlanError(f"{path} does not match its checksum in manifest.json: the file was "
                            "changed or truncated; compile the model again and save it")
    if manifest.get("fingerprint") != model_fingerprint:
        raise PlanError(f"the plan in {d} was made for a different model (architecture or "
                        "weights differ); load it with the model it was compiled from, or compile again")
    plan_json = json.loads((d / "plan.json").read_text())
    return plan_json, load_file(str(d / "tensors.safetensors"))

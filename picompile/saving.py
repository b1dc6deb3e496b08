"""Save and load compiled plans, so a model is profiled once.

A saved plan is a directory DIR:
    manifest.json         format, version, the model's fingerprint, sha256 of each file
    plan.json             the Plan (every decision, as JSON)
    tensors.safetensors   predictors and the hot-first neuron orders

The model's own weights are not written again: `load(model, dir)` rewrites the given model the
same way `compile` did and applies the saved decisions, after checking the model is the one the
plan was made for, that every plan field holds a value compile can make (plan.Plan.from_json)
and that the tensors fit the plan. Nothing is pickled.

Where `save` writes. DIR must be absent (created like mkdir: umask permissions), empty, or a
picompile plan (its manifest.json is a picompile manifest). Anything else, a regular file, a
directory holding other files, a plan directory or plan file without write permission, is refused
(SaveRefused). picompile only ever replaces or removes the files it writes: the three above and
its own work directories DIR/.picompile-new-* and DIR/.picompile-commit; other files in a plan
directory are left alone.

Crash safety: a reader sees the old plan or the new one, never none and never a mix. A save is a
journal inside DIR (DIR itself is never renamed, so its permissions, owner and any symlink to it
stay):
    1. write the new files into DIR/.picompile-new-<random>, fsync each (manifest last), fsync it;
    2. rename it to DIR/.picompile-commit (atomic): the commit point, from here on the new plan;
    3. roll forward: os.replace each file from there into DIR (the manifest last), fsync DIR,
       remove the then empty DIR/.picompile-commit.
A reader (and every later save and load that may write DIR) resolves the plan the same way: when
DIR/.picompile-commit/manifest.json exists, that manifest is the plan's and each file is taken from
DIR/.picompile-commit when still there, else from DIR (already moved: the new one); otherwise the
plan is DIR's own files. A crash before step 2 leaves the old plan (plus a work directory), one
during step 3 the new plan in two places. The next save or load of DIR finishes a committed roll
forward and removes work directories. Saves and loads of DIR lock it (flock on the directory;
where that is unsupported, a reader racing a save gets a checksum PlanError, never a mix), and
the manifest's checksums are checked on every load.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import pathlib
import secrets
import stat

import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_bytes
from safetensors.torch import save_file
from torch import nn

from picompile.plan import DTYPES, BlockPlan, Plan, PlanError

FORMAT = "picompile-plan"
VERSION = 2  # 2: a block's decisions and measurements nested apart from its structure
MANIFEST = "manifest.json"
FILES = ("plan.json", "tensors.safetensors")
OURS = (*FILES, MANIFEST)  # every file picompile writes in a plan directory
STAGING_PREFIX = ".picompile-new-"  # step 1's work directory: DIR/.picompile-new-<random>
COMMIT = ".picompile-commit"  # step 2: a committed save not yet rolled forward
MAX_MANIFEST_BYTES = 1 << 20

__all__ = ["PlanError", "SaveRefused", "fingerprint", "save", "read", "check_target", "check_tensors",
           "check_blocks", "check_tensor"]


class SaveRefused(PlanError, OSError):
    """cm.save(path) would overwrite something that is not a picompile plan, or a protected one."""


def fingerprint(model: nn.Module) -> str:
    """A hash of the model's architecture and weights, taken before compile rewrites it.

    Every tensor's name, shape and dtype, the HF config if any, and a strided sample of up to
    4096 values per tensor: cheap on a 7B model, and another model's weights (or these
    trained, converted or quantized) give a different hash; a change to single values outside
    the sample does not."""
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


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


# -- filesystem steps (every change goes through `os`, so tests can stop a save at any step) --


def _fsync_write(path: pathlib.Path, data: bytes) -> None:
    with open(path, "xb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _fsync_file(path: pathlib.Path) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: pathlib.Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # no directory fds here (Windows)
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems cannot fsync a directory
        pass
    finally:
        os.close(fd)


def _remove_ours(directory: pathlib.Path) -> None:
    """Remove a work directory of picompile's: the files picompile writes, then the directory if
    that left it empty. Anything else in it (not picompile's) stays, and so does the directory."""
    for name in OURS:
        with contextlib.suppress(OSError):
            os.unlink(directory / name)
    with contextlib.suppress(OSError):
        os.rmdir(directory)


@contextlib.contextmanager
def _locked(directory: pathlib.Path, exclusive: bool):
    """flock on the directory itself: saves exclusive, loads shared (exclusive when they may
    clean up). A lock picompile cannot take (no fcntl, a filesystem without flock) is skipped."""
    try:
        import fcntl
    except ImportError:
        fcntl = None
    fd = None
    if fcntl is not None:
        try:
            fd = os.open(directory, os.O_RDONLY)
        except OSError:
            fd = None
    try:
        if fd is not None:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
            except OSError:
                pass
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


# -- what is at a path ----------------------------------------------------------------------


def _is_our_manifest(path: pathlib.Path) -> bool:
    try:
        if not path.is_file() or path.stat().st_size > MAX_MANIFEST_BYTES:
            return False
        data = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):
        return False
    return isinstance(data, dict) and data.get("format") == FORMAT


def _is_work_dir(name: str) -> bool:
    return name == COMMIT or name.startswith(STAGING_PREFIX)


def _is_plan(d: pathlib.Path) -> bool:
    return _is_our_manifest(d / MANIFEST) or _is_our_manifest(d / COMMIT / MANIFEST)


def protected(path: pathlib.Path) -> bool:
    """Read-only for us: no write permission, or no write bit at all (made read-only: root's
    writes ignore permissions, the mode still says what the owner wants)."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    return not (mode & 0o222) or not os.access(path, os.W_OK)


def _writable_dir(d: pathlib.Path) -> bool:
    return not protected(d) and os.access(d, os.W_OK | os.X_OK)


def check_target(target: str | os.PathLike) -> None:
    """Refuse (SaveRefused) to save onto anything but an absent path, an empty directory or a
    writable picompile plan. `save` calls it; callers may too, before work that a refused save
    would waste (a compile)."""
    target = pathlib.Path(target)
    if not target.exists():
        if os.path.lexists(target):
            raise SaveRefused(f"{target} is a symlink to nothing; picompile will not save through "
                              "it: remove the link or choose another path")
        parent = next((p for p in target.parents if p.exists()), None)
        if parent is not None and not parent.is_dir():
            raise SaveRefused(f"{parent} is a file, so {target} cannot be made under it: choose "
                              "another path")
        return
    if not target.is_dir():
        raise SaveRefused(f"{target} is a file, not a plan directory; picompile will not overwrite "
                          "it: choose another path (a new or empty directory), or move the file "
                          "away first")
    entries = sorted(name for name in os.listdir(target) if not _is_work_dir(name))
    if entries and not _is_plan(target):
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries)} entries)" if len(entries) > 5 else "")
        raise SaveRefused(f"{target} is a directory holding other files ({shown}) and is not a "
                          "picompile plan (no picompile manifest.json); picompile will not write "
                          "into it or delete anything there: save to a new or empty directory")
    if not _writable_dir(target):
        what = "a plan directory" if entries else "a directory"
        raise SaveRefused(f"{target} is read-only; picompile will not write into {what} you "
                          "cannot write or made read-only: make it writable (chmod u+w) or save "
                          "elsewhere")
    protected_files = [name for name in OURS if protected(target / name)]
    if protected_files:
        raise SaveRefused(f"{target} holds a plan whose files {', '.join(protected_files)} are "
                          "read-only; picompile will not overwrite them: make them writable "
                          "(chmod u+w) or save elsewhere")


# -- the journal ----------------------------------------------------------------------------


def _roll_forward(d: pathlib.Path) -> None:
    """Step 3: move a committed save's files into DIR, the manifest last; remove the commit
    directory. Idempotent: a crash here leaves what the next call finishes."""
    commit = d / COMMIT
    for name in OURS:  # manifest last
        if os.path.lexists(commit / name):
            os.replace(commit / name, d / name)
    _fsync_dir(d)
    with contextlib.suppress(FileNotFoundError):
        os.rmdir(commit)
        _fsync_dir(d)


def _recover(d: pathlib.Path) -> None:
    """Finish a committed save and remove work directories that a failed save left. The caller
    holds DIR's exclusive lock, so no other save is writing them."""
    commit = d / COMMIT
    if commit.is_dir() and not commit.is_symlink():
        if _is_our_manifest(commit / MANIFEST):
            _roll_forward(d)
        else:  # rolled forward; only the empty directory was left
            _remove_ours(commit)
    for name in os.listdir(d):
        path = d / name
        if name.startswith(STAGING_PREFIX) and path.is_dir() and not path.is_symlink():
            _remove_ours(path)


def _resolve(d: pathlib.Path) -> tuple[pathlib.Path, dict[str, pathlib.Path]]:
    """-> (manifest path, {file: path}) of the plan a reader sees (see the module docstring)."""
    commit = d / COMMIT
    if (commit / MANIFEST).is_file():
        return commit / MANIFEST, {n: commit / n if os.path.lexists(commit / n) else d / n
                                   for n in FILES}
    return d / MANIFEST, {n: d / n for n in FILES}


def save(plan_json: dict, tensors: dict[str, torch.Tensor], model_fingerprint: str,
         directory: str | os.PathLike) -> pathlib.Path:
    """Write a plan into `directory`, crash-safely (see the module docstring); SaveRefused
    when `directory` is neither absent, empty nor a writable picompile plan."""
    target = pathlib.Path(directory)
    check_target(target)
    created = False
    if not target.exists():
        os.makedirs(target.parent, exist_ok=True)
        os.mkdir(target)  # mode 0o777 less the umask, like mkdir
        created = True
    try:
        with _locked(target, exclusive=True):
            check_target(target)  # again, now that no other save can change it
            _recover(target)
            staging = _new_staging(target)
            try:
                _fsync_write(staging / "plan.json",
                             json.dumps(plan_json, indent=1, sort_keys=True).encode())
                try:
                    save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()},
                              str(staging / "tensors.safetensors"), metadata={"format": FORMAT})
                except SafetensorError as e:  # its I/O errors (a full disk) are not OSErrors
                    raise OSError(f"could not write {target / 'tensors.safetensors'}: {e}") from e
                # safetensors writes 0o600; give it the umask's mode, as open() gave plan.json
                os.chmod(staging / "tensors.safetensors",
                         stat.S_IMODE(os.stat(staging / "plan.json").st_mode))
                _fsync_file(staging / "tensors.safetensors")
                manifest = {
                    "format": FORMAT,
                    "version": VERSION,
                    "fingerprint": model_fingerprint,
                    "files": {name: _sha256((staging / name).read_bytes()) for name in FILES},
                }
                _fsync_write(staging / MANIFEST, json.dumps(manifest, indent=1).encode())
                _fsync_dir(staging)
            except BaseException:
                _remove_ours(staging)
                raise
            os.rename(staging, target / COMMIT)  # the commit point
            _fsync_dir(target)
            _roll_forward(target)
    except BaseException:
        if created:  # a save that made the directory and failed before its commit: take it back
            with contextlib.suppress(OSError):
                os.rmdir(target)
        raise
    return target


def _in_dtype(plan_json) -> str:
    """', in float32 (--dtype float32, model.to(torch.float32))': the weights' dtype the plan's
    blocks were compiled in, as a hint; '' where the JSON does not say (checked later)."""
    blocks = plan_json.get("blocks") if isinstance(plan_json, dict) else None
    if not isinstance(blocks, list):
        return ""
    dtypes = {b.get("dtype") for b in blocks if isinstance(b, dict)}
    if len(dtypes) != 1 or not dtypes <= set(DTYPES):
        return ""
    (dtype,) = dtypes
    return f", in {dtype} (--dtype {dtype} on the command line, model.to(torch.{dtype}))"


def _legacy(target: pathlib.Path) -> list[pathlib.Path]:
    """Work directories of picompile before issue 12, next to DIR: .DIR.tmp-* and .DIR.old-PID.
    Named, never removed: outside DIR nothing proves a directory of that name is picompile's
    (a user's backup .DIR.old-backup holds the same files)."""
    try:
        names = os.listdir(target.parent)
    except OSError:
        return []
    prefixes = (f".{target.name}.tmp-", f".{target.name}.old-")
    return sorted(target.parent / n for n in names
                  if n.startswith(prefixes) and (target.parent / n).is_dir()
                  and not (target.parent / n).is_symlink())


def _new_staging(d: pathlib.Path) -> pathlib.Path:
    while True:
        path = d / f"{STAGING_PREFIX}{secrets.token_hex(6)}"
        try:
            os.mkdir(path)
            return path
        except FileExistsError:
            continue


def read(directory: str | os.PathLike, model_fingerprint: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """-> (plan JSON, tensors), after checking format, version, checksums, fingerprint, every
    plan field (Plan.from_json) and the tensors' names and shapes against the plan."""
    d = pathlib.Path(directory)
    if not d.is_dir():
        what = "does not exist" if not os.path.lexists(d) else "is not a directory"
        old = [p for p in _legacy(d) if _is_our_manifest(p / MANIFEST)]
        hint = (f"; an interrupted save of an earlier picompile left a plan in {old[-1]}: rename "
                f"it to {d}" if old and not os.path.lexists(d) else "")
        raise PlanError(f"{d} {what}: not a saved picompile plan (save one with cm.save(dir))"
                        f"{hint}")
    writable = _writable_dir(d) and _is_plan(d)
    with _locked(d, exclusive=writable):
        if writable:
            with contextlib.suppress(OSError):  # cleaning up is a courtesy; reading still works
                _recover(d)
        manifest_path, paths = _resolve(d)
        if not manifest_path.is_file():
            raise PlanError(f"{d} is not a saved picompile plan: no manifest.json (save one with "
                            "cm.save(dir))")
        manifest_bytes = manifest_path.read_bytes()
        data = {}
        for name, path in paths.items():
            if not path.is_file():
                raise PlanError(f"{d / name} is missing; the saved plan is incomplete")
            data[name] = path.read_bytes()
    manifest = _parse_manifest(manifest_bytes, d / MANIFEST)
    for name in FILES:
        if _sha256(data[name]) != manifest["files"].get(name):
            raise PlanError(f"{d / name} does not match its checksum in manifest.json: the file was "
                            "changed or truncated; compile the model again and save it")
    try:
        plan_json = json.loads(data["plan.json"])
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise PlanError(f"{d / 'plan.json'} is not valid JSON ({e}); compile the model again and "
                        "save it") from e
    if manifest["fingerprint"] != model_fingerprint:
        raise PlanError(f"the plan in {d} was made for a different model (its architecture, "
                        "weights or dtype differ); load it with the model it was compiled from"
                        f"{_in_dtype(plan_json)}, or compile again")
    plan = Plan.from_json(plan_json)
    if plan.fingerprint != manifest["fingerprint"]:  # one model: a later save writes plan's
        raise PlanError(f"{d / 'plan.json'} names another model than manifest.json (their "
                        "fingerprints differ): the plan was edited; compile the model again and "
                        "save it")
    try:
        tensors = load_bytes(data["tensors.safetensors"])
    except (SafetensorError, ValueError, RuntimeError) as e:
        raise PlanError(f"{d / 'tensors.safetensors'} is not a readable safetensors file ({e}); "
                        "compile the model again and save it") from e
    check_tensors(plan.blocks, tensors, quant_blocks=plan.quant_calibration_tokens > 0)
    return plan_json, tensors


def _parse_manifest(raw: bytes, path: pathlib.Path) -> dict:
    try:
        manifest = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as e:  # nested too deep
        raise PlanError(f"{path} is corrupt ({e}); compile the model again and save it") from e
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise PlanError(f"{path} is not a picompile plan manifest")
    if manifest.get("version") != VERSION:
        raise PlanError(f"{path.parent} has plan format version {manifest.get('version')!r}; this "
                        f"picompile reads version {VERSION}: compile the model again and save it")
    files = manifest.get("files")
    if not isinstance(files, dict) or not all(isinstance(files.get(n), str) for n in FILES):
        raise PlanError(f"{path} is corrupt (its 'files' must map {', '.join(FILES)} to sha256 "
                        f"checksums, got {files!r:.80}); compile the model again and save it")
    if not isinstance(manifest.get("fingerprint"), str):
        raise PlanError(f"{path} is corrupt (its 'fingerprint' must be a string, got "
                        f"{manifest.get('fingerprint')!r:.80}); compile the model again and save it")
    return manifest


# -- do the tensors fit the plan, and the plan the model --------------------------------------

PREDICTOR_TENSORS = ("p1", "pb1", "p2", "pb2")


def check_tensor(name: str, t, shape: tuple[int, ...], kind: str = "float") -> None:
    """PlanError unless `t` is a tensor of `shape` and of `kind` ("float" or "int"; float
    values finite: a predictor of NaNs would silently predict nothing)."""
    if not isinstance(t, torch.Tensor):
        raise PlanError(f"saved tensor {name} is {type(t).__name__}, not a tensor")
    if tuple(t.shape) != tuple(shape):
        raise PlanError(f"saved tensor {name} has shape {tuple(t.shape)}; the plan needs "
                        f"{tuple(shape)}: compile the model again and save it")
    ok = t.is_floating_point() if kind == "float" else (
        not t.is_floating_point() and not t.is_complex() and t.dtype != torch.bool)
    if not ok:
        raise PlanError(f"saved tensor {name} has dtype {t.dtype}; the plan needs "
                        f"{'a floating point' if kind == 'float' else 'an integer'} dtype")
    if kind == "float" and not bool(torch.isfinite(t).all()):
        raise PlanError(f"saved tensor {name} holds NaN or infinite values: compile the model "
                        "again and save it")


def check_tensors(blocks: list[BlockPlan], tensors: dict[str, torch.Tensor],
                  quant_blocks: bool = False) -> None:
    """PlanError unless `tensors` are exactly what the blocks' plan needs: per block an optional
    hot-first order (a permutation of its d_ff neurons) and, where predictor_rank is set, its
    predictor p1 [rank, d_model], pb1 [rank], p2 [d_ff, rank], pb2 [d_ff]; with quant_blocks
    (a plan quantized by GPTQ), "<weight>.blocks" uint8 matrices (their shapes are checked
    against the weights when loaded); nothing else."""
    expected = set()
    if quant_blocks:
        for key, t in tensors.items():
            if key.endswith(".blocks"):
                if not isinstance(t, torch.Tensor) or t.dtype != torch.uint8 or t.dim() != 2:
                    raise PlanError(f"saved tensor {key} is not a uint8 matrix of quantized blocks")
                expected.add(key)
    for b in blocks:
        key = f"{b.name}.order"
        expected.add(key)
        if key in tensors:
            order = tensors[key]
            check_tensor(key, order, (b.d_ff,), "int")
            if not torch.equal(torch.sort(order.long()).values, torch.arange(b.d_ff)):
                raise PlanError(f"saved tensor {key} is not a permutation of 0..{b.d_ff - 1}")
        keys = [f"{b.name}.predictor.{k}" for k in PREDICTOR_TENSORS]
        if b.decided.predictor_rank is None:
            continue
        expected.update(keys)
        r = b.decided.predictor_rank
        for k, shape in zip(keys, ((r, b.d_model), (r,), (b.d_ff, r), (b.d_ff,))):
            if k not in tensors:
                raise PlanError(f"saved tensor {k} is missing (block {b.name!r} has "
                                f"predictor_rank={r}); compile the model again and save it")
            check_tensor(k, tensors[k], shape)
    extra = sorted(set(tensors) - expected)
    if extra:
        raise PlanError(f"saved tensors {', '.join(extra[:5])} belong to no block of the plan "
                        "(or to a block without a predictor); compile the model again and save it")


STRUCTURE = ("name", "module", "kind", "act", "d_model", "d_ff", "bias", "dtype", "linears",
             "fused_gate_half")


def check_blocks(found: list[BlockPlan], saved: list[BlockPlan]) -> None:
    """PlanError unless the saved blocks are the ones detect finds in the model now, field by
    field (name, module, kind, act, sizes, bias, dtype, linears): the fingerprint ties the plan
    to the model's weights, this ties plan.json's description of each block to them."""
    if [b.name for b in found] != [b.name for b in saved]:
        raise PlanError(f"the saved plan's blocks {[b.name for b in saved]} are not the ones "
                        f"found now {[b.name for b in found]}")
    for now, then in zip(found, saved):
        for f in STRUCTURE:
            if getattr(now, f) != getattr(then, f):
                raise PlanError(f"invalid plan: block {then.name!r} has {f}={getattr(then, f)!r} but "
                                f"the model's block has {f}={getattr(now, f)!r}: compile the model "
                                "again and save it")

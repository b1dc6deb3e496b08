"""An English text corpus that is available offline, for calibration and evaluation.

Picompile needs text to profile FFN activity, to calibrate thresholds and to
measure perplexity, and it must not download anything at run time.  This module
builds that text only from files that ship with CPython itself:

1. ``pydoc_data.topics`` -- the Python Language Reference topics that ``help()``
   shows (about 465 kB of English prose in 79 topics on CPython 3.11).
   Source: the CPython documentation; licence PSF-2.0 (Python Software
   Foundation License Version 2).  Used for all three splits.
2. The docstrings of the standard library's own ``.py`` files (read with
   ``ast``, never imported; about 1.6 MB in ~490 files on CPython 3.11).
   Source: the CPython standard library; licence PSF-2.0.  Used for the
   ``"train"`` split only.

Splits
------
``default_texts(split)`` returns a list of documents; the three splits are
deterministic (no randomness, no dependence on hash seeds or file-system order)
and disjoint:

* The reference topics overlap one another (``pydoc`` repeats whole sections:
  ``specialnames`` contains ``customization``, ``compound`` contains ``try``...).
  Topics that share any run of 10 consecutive words are therefore grouped into
  one connected component, and whole components are assigned to splits, so no
  10-word run of one split appears in another.  Components are taken largest
  first (ties by name) and each goes to the split furthest below its target
  share of characters: train 50 %, calibration 30 %, held-out 20 %.  The largest
  component (``specialnames``, ``compound`` and 19 more, ~47 % of the text)
  therefore lands in train.
* The standard-library docstrings are added to ``"train"`` only, one document per
  source file (its docstrings of >= 40 characters, in ``ast.walk`` order, joined
  by blank lines; files sorted by path).  A docstring that shares a 10-word run
  with any reference topic is dropped (this removes e.g. ``pdb``'s command help,
  which duplicates the ``debugger`` topic).  Test packages, ``idlelib``,
  ``turtledemo``, ``lib2to3``, ``ensurepip`` and ``site-packages`` are skipped.

Sizes on CPython 3.11.7 (documents / characters; tokens with the 1024-token BPE
of ``tests/fixtures/relu_llama``):

* ``"train"``:       521 documents, 1,822,084 characters (33 topics with
  232,440 chars, plus 488 docstring files with 1,589,644 chars); 716,319 tokens
* ``"calibration"``:  24 documents (topics), 139,516 characters; 51,519 tokens
* ``"heldout"``:      22 documents (topics), 93,014 characters; 35,396 tokens

Other CPython versions ship slightly different text, so the exact contents (and
sizes) are deterministic per Python version, not across versions.

``token_batches(tokenizer, split, n_tokens, seq_len)`` tokenizes the documents of
a split in order (no special tokens; the tokenizer's EOS token, when it has one,
between documents), and cuts the stream into ``ceil(n_tokens / seq_len)``
contiguous rows of ``seq_len`` tokens.
"""

from __future__ import annotations

import ast
import collections
import functools
import math
import pathlib
import sysconfig
import warnings

import torch

__all__ = ["CORPUS_SOURCE", "SPLITS", "available_tokens", "default_texts", "token_batches"]

CORPUS_SOURCE = (
    "CPython's own pydoc_data.topics (Python Language Reference topics) plus, for the train split "
    "only, the docstrings of the CPython standard library's .py files; licence PSF-2.0"
)

SPLITS = ("train", "calibration", "heldout")

# Target share of reference-topic characters per split (train also gets the stdlib docstrings).
_TARGET_SHARE = {"train": 0.50, "calibration": 0.30, "heldout": 0.20}
_SHINGLE_WORDS = 10  # a run of this many words shared by two texts makes them "the same document"
_MIN_DOCSTRING = 40
_SKIP_DIRS = frozenset(
    {"test", "tests", "idle_test", "idlelib", "turtledemo", "lib2to3", "ensurepip",
     "site-packages", "dist-packages", "__pycache__"}
)


def _shingles(text: str) -> set[str]:
    """All runs of _SHINGLE_WORDS consecutive whitespace-separated words."""
    words = text.split()
    n = _SHINGLE_WORDS
    return {" ".join(words[i : i + n]) for i in range(len(words) - n + 1)}


@functools.lru_cache(maxsize=None)
def _topic_splits() -> dict[str, tuple[str, ...]]:
    """Map split name -> sorted tuple of reference-topic names."""
    from pydoc_data.topics import topics

    names = sorted(topics)
    # Union-find over topics sharing a 10-word run.
    parent = {n: n for n in names}

    def find(x: str) -> str:
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    owners: dict[str, list[str]] = collections.defaultdict(list)
    for n in names:
        for shingle in _shingles(topics[n]):
            owners[shingle].append(n)
    for line_owners in owners.values():
        root = find(line_owners[0])
        for other in line_owners[1:]:
            r = find(other)
            if r != root:
                # Keep the lexicographically smallest name as the root, so the result is order-free.
                a, b = sorted((root, r))
                parent[b] = a
                root = a

    comps: dict[str, list[str]] = collections.defaultdict(list)
    for n in names:
        comps[find(n)].append(n)
    sizes = {r: sum(len(topics[n]) for n in members) for r, members in comps.items()}
    total = sum(sizes.values())

    assigned: dict[str, list[str]] = {s: [] for s in SPLITS}
    filled = {s: 0 for s in SPLITS}
    for root in sorted(comps, key=lambda r: (-sizes[r], r)):
        # The split furthest below its target; ties go to the earlier one in SPLITS.
        best = max(SPLITS, key=lambda s: (_TARGET_SHARE[s] * total - filled[s], -SPLITS.index(s)))
        assigned[best].extend(comps[root])
        filled[best] += sizes[root]
    return {s: tuple(sorted(v)) for s, v in assigned.items()}


def _stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


@functools.lru_cache(maxsize=None)
def _stdlib_docstring_docs() -> tuple[str, ...]:
    """One document per standard-library source file: its docstrings, in ast.walk order."""
    from pydoc_data.topics import topics

    topic_shingles = set().union(*(_shingles(t) for t in topics.values()))
    root = _stdlib_dir()
    files = sorted(
        (p for p in root.rglob("*.py")
         if not (set(p.relative_to(root).parts[:-1]) & _SKIP_DIRS) and not p.name.startswith("test_")),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    if not files:
        raise RuntimeError(
            f"the train split needs the standard library's .py sources, but none were found under {root}"
        )
    docs = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # e.g. SyntaxWarning for invalid escapes
                tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        parts = []
        for node in ast.walk(tree):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node)
                if doc and len(doc) >= _MIN_DOCSTRING and topic_shingles.isdisjoint(_shingles(doc)):
                    parts.append(doc)
        if parts:
            docs.append("\n\n".join(parts))
    return tuple(docs)


def default_texts(split: str = "calibration") -> list[str]:
    """The documents of one split: ``"train"``, ``"calibration"`` or ``"heldout"``.

    Deterministic and disjoint (see the module docstring for the rule and sizes).
    Reference topics come first, sorted by topic name; ``"train"`` then has the
    standard-library docstrings, one document per file, sorted by path.
    """
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; expected one of {SPLITS}")
    from pydoc_data.topics import topics

    docs = [topics[name] for name in _topic_splits()[split]]
    if split == "train":
        docs.extend(_stdlib_docstring_docs())
    return docs


def _token_stream(tokenizer, split: str) -> list[int]:
    eos = getattr(tokenizer, "eos_token_id", None)
    ids: list[int] = []
    for i, text in enumerate(default_texts(split)):
        if i and eos is not None:
            ids.append(int(eos))
        # verbose=False: documents are longer than model_max_length; that is fine, we cut rows ourselves.
        ids.extend(tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
    return ids


def available_tokens(tokenizer, split: str) -> int:
    """How many tokens the split's stream has with this tokenizer (what token_batches can cut)."""
    return len(_token_stream(tokenizer, split))


def token_batches(tokenizer, split: str, n_tokens: int, seq_len: int = 256) -> torch.LongTensor:
    """``[ceil(n_tokens / seq_len), seq_len]`` token ids from ``split``.

    The split's documents are tokenized in order (EOS between documents when the
    tokenizer has one) into one stream, and the rows are its first consecutive
    ``seq_len``-token chunks: exactly enough rows to cover ``n_tokens``.
    Raises ``ValueError`` if the split has fewer tokens than that, saying how
    many it has.
    """
    if n_tokens <= 0:
        raise ValueError(f"n_tokens must be positive, got {n_tokens}")
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    rows = math.ceil(n_tokens / seq_len)
    ids = _token_stream(tokenizer, split)
    if len(ids) < rows * seq_len:
        raise ValueError(
            f"split {split!r} has only {len(ids)} tokens with this tokenizer "
            f"({len(ids) // seq_len} full rows of seq_len={seq_len}); "
            f"n_tokens={n_tokens} needs {rows} rows = {rows * seq_len} tokens"
        )
    return torch.tensor(ids[: rows * seq_len], dtype=torch.long).view(rows, seq_len)

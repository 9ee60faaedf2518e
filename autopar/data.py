"""Token corpora: a flat binary of token ids, read with ``numpy.memmap``, and the batches cut from it.

File format (nanoGPT's ``train.bin``): token ids back to back, little-endian, no header. The
file name says the width: ``uint32`` when one of its suffixes is ``.u32`` (``train.u32``,
``train.u32.bin``), for vocabularies over 65,536 ids; ``uint16`` otherwise. ``autopar
tokenize`` writes such files (``tokenize_file``): byte-level ids 0-255 by default, or the ids
of an HF ``tokenizers`` ``tokenizer.json``.

Batches. With S the plan's sequence length, the corpus of N tokens holds W = (N - 1) // S
*windows*: window w is tokens ``[w·S, w·S + S]`` (S + 1 tokens: inputs the first S, next-token
targets the last S), so an epoch reads every token once. Sample j of a training run is window
``(j·a) mod W``, where the stride a is the integer nearest W·0.618 that is coprime with W: every
window once per W samples, consecutive samples far apart in the text, no random generator (so
every rank of every node computes the same batches). The global batch of a step that begins at
sample s is samples s .. s + B - 1 (B the plan's global batch): the k-th step of a run from
scratch reads samples k·B ..; every plan of a model and global batch trains on the same tokens,
and each data-parallel rank takes its rows of the global batch. A checkpoint keeps s, so a
resumed run, on any plan, continues with the first sample it has not trained on.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from autopar.errors import UserError

U32_SUFFIX = ".u32"
"""A token file with this among its suffixes holds uint32 ids; any other holds uint16."""
UINT16_IDS = 1 << 16
"""Ids a uint16 file can hold (0 .. 65,535)."""


def token_dtype(path: str | Path) -> np.dtype:
    """The ids' type in the token file ``path``, by its name: little-endian uint32 (``.u32``)
    or uint16."""
    return np.dtype("<u4" if U32_SUFFIX in Path(path).suffixes else "<u2")


@dataclass(frozen=True, kw_only=True, slots=True)
class Corpus:
    """A token file, mapped read-only."""

    path: Path
    tokens: np.ndarray
    """The ids, a read-only ``numpy.memmap`` of the whole file (nothing is read until used)."""

    def windows(self, seq_len: int) -> int:
        """W: training samples of ``seq_len`` tokens (and one target more) per epoch."""
        return (len(self.tokens) - 1) // seq_len


def open_corpus(path: str | Path, seq_len: int | None = None) -> Corpus:
    """Map the token file ``path``; a missing, empty or truncated file, or one with fewer than
    ``seq_len + 1`` tokens, is a ``UserError`` naming the fix."""
    p = Path(path)
    if not p.is_file():
        raise UserError(f"token file {p} does not exist; write one with `autopar tokenize TEXT --out {p}`")
    dtype = token_dtype(p)
    size = p.stat().st_size
    if size % dtype.itemsize:
        raise UserError(f"token file {p} has {size} bytes, not a whole number of {dtype.itemsize}-byte ids "
                        f"({'uint32, by its .u32 suffix' if dtype.itemsize == 4 else 'uint16; name a uint32 file *.u32'})")
    count = size // dtype.itemsize
    if seq_len is not None and count < seq_len + 1:
        raise UserError(f"token file {p} has {count} tokens, fewer than one training sequence of {seq_len} "
                        "tokens and its target; use more text")
    if count == 0:
        raise UserError(f"token file {p} is empty")
    return Corpus(path=p, tokens=np.memmap(p, dtype=dtype, mode="r"))


def stride(windows: int) -> int:
    """The permutation's stride: the integer nearest ``windows``·0.618 coprime with it (1 for
    one or two windows)."""
    a = max(1, round(windows * (math.sqrt(5) - 1) / 2))
    while math.gcd(a, windows) != 1:
        a += 1
    return a


def sample_windows(first: int, count: int, windows: int) -> np.ndarray:
    """The window of each of samples ``first`` .. ``first + count - 1`` (int64)."""
    samples = np.arange(first, first + count, dtype=np.int64)
    return (samples % windows) * stride(windows) % windows


def batch_tokens(corpus: Corpus, first: int, rows: int, seq_len: int, vocab: int) -> np.ndarray:
    """Samples ``first`` .. ``first + rows - 1`` as [rows, seq_len + 1] int64 ids. An id not
    below ``vocab`` (the model's vocabulary) is a ``UserError``."""
    windows = corpus.windows(seq_len)
    if windows < 1:
        raise UserError(f"token file {corpus.path} has {len(corpus.tokens)} tokens, fewer than one training "
                        f"sequence of {seq_len} tokens and its target; use more text")
    starts = sample_windows(first, rows, windows) * seq_len
    out = np.stack([np.asarray(corpus.tokens[s:s + seq_len + 1], dtype=np.int64) for s in starts])
    top = int(out.max())
    if top >= vocab:
        row, col = np.argwhere(out == top)[0]
        raise UserError(f"token file {corpus.path} has id {top} (token {int(starts[row]) + int(col)}), not below the "
                        f"model's vocabulary of {vocab}; tokenize for this model's vocabulary or plan a model "
                        f"with vocab >= {top + 1}")
    return out


@dataclass(frozen=True, kw_only=True, slots=True)
class Tokenized:
    """What ``tokenize_file`` wrote."""

    path: Path
    tokens: int
    vocab: int
    """Ids the tokenizer can produce (256 byte-level)."""
    dtype: str
    """``uint16`` or ``uint32``."""


def write_tokens(ids: np.ndarray, out: str | Path, vocab: int) -> Tokenized:
    """Write ``ids`` (ids below ``vocab``) to the token file ``out``, in the width its name
    says; a vocabulary uint16 cannot hold, in a file not named ``*.u32``, is a ``UserError``."""
    p = Path(out)
    dtype = token_dtype(p)
    if dtype.itemsize == 2 and vocab > UINT16_IDS:
        raise UserError(f"the tokenizer has {vocab:,} ids, more than a uint16 file holds; name the output "
                        f"{p.name}{U32_SUFFIX} (uint32)")
    if vocab > 1 << 32:
        raise UserError(f"the tokenizer has {vocab:,} ids, more than uint32 holds")
    if p.parent and not p.parent.is_dir():
        raise UserError(f"directory {p.parent} does not exist")
    np.asarray(ids).astype(dtype).tofile(p)
    return Tokenized(path=p, tokens=len(ids), vocab=vocab, dtype=f"uint{dtype.itemsize * 8}")


def tokenize_file(text: str | Path, out: str | Path, tokenizer: str | Path | None = None) -> Tokenized:
    """Tokenize the file ``text`` into the token file ``out``: its bytes as ids 0-255, or the
    ids of the HF ``tokenizers`` file ``tokenizer`` (``tokenizer.json``; the text is read whole,
    as UTF-8)."""
    src = Path(text)
    if not src.is_file():
        raise UserError(f"text file {src} does not exist")
    if tokenizer is None:
        return write_tokens(np.frombuffer(src.read_bytes(), dtype=np.uint8), out, 256)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError("--tokenizer needs the `tokenizers` package (pip install tokenizers); "
                        "without it, tokenize byte-level (omit --tokenizer)") from None
    if not Path(tokenizer).is_file():
        raise UserError(f"tokenizer file {tokenizer} does not exist")
    try:
        tok = Tokenizer.from_file(str(tokenizer))
    except Exception as exc:  # tokenizers raises its own Exception types
        raise UserError(f"cannot read tokenizer {tokenizer}: {str(exc).splitlines()[0] if str(exc) else exc!r}") from None
    try:
        content = src.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"text file {src} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    ids = np.asarray(tok.encode(content, add_special_tokens=False).ids, dtype=np.int64)
    return write_tokens(ids, out, tok.get_vocab_size(with_added_tokens=True))

"""Training data: the global batch of every step, the same whatever the strategy.

Three sources, by what the user gave:

* `--data FILE`: a flat array of token ids (uint16 or uint32, as nanoGPT's and Megatron's
  preprocessing write them), memory-mapped. It is cut into non-overlapping windows of
  `seq_len + 1` tokens; each epoch visits them in a permutation drawn from (seed, epoch),
  and step k's global batch is samples `k*B .. k*B+B-1` of that order. A rank reads only
  the windows of its own rows. `--data 0.7:a.bin 0.3:b.bin` blends files as Megatron-LM's
  BlendedDataset does (`Blend`): sample i comes from the file whose share so far lags its
  weight most, and is that file's next sample in its own order.
* `--eval-data`: the same, read in file order (no shuffling): evaluation batch e is
  samples `e*B .. e*B+B-1`, the same batches at every evaluation.
* `train_batches(batch_size, seed)` in the model file: a generator of global batches;
  step k is its k-th (a rank makes every batch and keeps its rows).
* neither: `example_batch`, one fixed batch every step (the equivalence demonstrator).

The data position a checkpoint keeps is the step: every source is a function of it.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import torch

from piper.errors import PiperError
from piper.model_file import ModelSpec

CHECK_CHUNK = 2**26  # tokens read at a time while checking a file's ids
Rows = tuple[tuple[torch.Tensor, ...], Any]  # (flat inputs, targets) of some rows
Split = tuple[tuple[torch.Tensor, ...], dict[str, torch.Tensor], Any]  # (args, kwargs, targets)


class TokenFile:
    """Windows of `seq_len + 1` tokens of a memory-mapped token file. With `vocab`, every id
    is checked to be below it first (one pass over the file), so a file written for another
    tokenizer or read with the wrong `--data-dtype` is bad input, not a worker's IndexError
    in its first step."""

    def __init__(self, path: str, seq_len: int, dtype: str = "uint16", seed: int = 0,
                 vocab: int | None = None, shuffle: bool = True, flag: str = "--data") -> None:
        try:
            self.tokens = np.memmap(path, dtype=np.dtype(dtype), mode="r")
        except (OSError, ValueError) as e:
            raise PiperError(f"{flag} {path}: cannot read as {dtype} tokens: {e}") from None
        self.window = seq_len + 1
        self.count = len(self.tokens) // self.window
        if self.count < 1:
            raise PiperError(f"{flag} {path}: {len(self.tokens)} tokens hold no window of "
                             f"{self.window} (seq_len + 1)")
        if vocab is not None:
            top = max(int(self.tokens[i:i + CHECK_CHUNK].max())
                      for i in range(0, len(self.tokens), CHECK_CHUNK))
            if top >= vocab:
                raise PiperError(f"{flag} {path}: token id {top} is outside the model's "
                                 f"vocabulary of {vocab} (ids 0-{vocab - 1}): a file from "
                                 f"another tokenizer, or not {dtype} (--data-dtype)?")
        self.seed, self.shuffle = seed, shuffle
        self._perm: tuple[int, torch.Tensor] | None = None

    def _order(self, epoch: int) -> torch.Tensor:
        if not self.shuffle:
            if self._perm is None:
                self._perm = (0, torch.arange(self.count))
            return self._perm[1]
        if self._perm is None or self._perm[0] != epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._perm = (epoch, torch.randperm(self.count, generator=g))
        return self._perm[1]

    def windows(self, first: int, n: int) -> torch.Tensor:
        """Samples `first .. first+n-1` of the visiting order, as int64 [n, seq_len + 1]."""
        out = np.empty((n, self.window), dtype=np.int64)
        for i in range(n):
            epoch, j = divmod(first + i, self.count)
            w = int(self._order(epoch)[j])
            out[i] = self.tokens[w * self.window:(w + 1) * self.window]
        return torch.from_numpy(out)


BLEND_RESOLUTION = 1000
"""Blend weights are kept to 1/1000 of the whole: the choice of file repeats with a period
of at most that many samples, so sample i's file and its index there take O(1) to find."""


def parse_blend(data: str | Sequence[str] | None, flag: str = "--data"
                ) -> tuple[tuple[float, str], ...]:
    """`FILE`, or `W:FILE ...` (weights, normalised to sum 1), as (weight, path) pairs."""
    items = [data] if isinstance(data, str) else list(data or ())
    out: list[tuple[float | None, str]] = []
    for item in items:
        w, sep, path = item.partition(":")
        try:
            weight = float(w) if sep and path else None
        except ValueError:
            weight = None
        out.append((weight, path) if weight is not None else (None, item))
    if len(out) == 1 and out[0][0] is None:
        return ((1.0, out[0][1]),)
    if any(w is None for w, _ in out):
        raise PiperError(f"{flag}: one token file, or each with its weight (e.g. {flag} "
                         f"0.7:a.bin 0.3:b.bin); got {' '.join(items)}")
    weights = [float(w) for w, _ in out]  # type: ignore[arg-type]
    if not all(w > 0 and math.isfinite(w) for w in weights):
        raise PiperError(f"{flag}: blend weights must be finite and > 0, got "
                         f"{', '.join(f'{w:g}' for w in weights)}")
    total = sum(weights)
    return tuple((w / total, p) for w, (_, p) in zip(weights, out))


class Blend:
    """Token files blended by weight, as Megatron-LM's BlendedDataset: sample i of the blend
    is the next sample of the file whose share of samples 0..i-1 lags its weight most (ties
    to the first file), so every prefix follows the weights within one sample per file,
    and the blend is a function of the weights alone (the same for every strategy)."""

    def __init__(self, files: Sequence[TokenFile], weights: Sequence[float]) -> None:
        self.files = list(files)
        ints = [max(1, round(w * BLEND_RESOLUTION)) for w in weights]
        g = math.gcd(*ints)
        self.shares = [n // g for n in ints]
        self.period = sum(self.shares)
        self.which = np.empty(self.period, dtype=np.int64)  # position -> file
        self.index = np.empty(self.period, dtype=np.int64)  # position -> sample in the file
        counts = [0] * len(ints)
        for i in range(self.period):
            lag = [n * max(i, 1) / self.period - c for n, c in zip(self.shares, counts)]
            j = max(range(len(lag)), key=lambda k: (lag[k], -k))
            self.which[i], self.index[i] = j, counts[j]
            counts[j] += 1

    def source_of(self, i: int) -> tuple[int, int]:
        """(file, sample in that file) of blend sample `i`."""
        q, r = divmod(i, self.period)
        j = int(self.which[r])
        return j, q * self.shares[j] + int(self.index[r])

    def windows(self, first: int, n: int) -> torch.Tensor:
        return torch.cat([self.files[j].windows(k, 1) for j, k in
                          (self.source_of(i) for i in range(first, first + n))])


def token_source(data: str | Sequence[str], seq_len: int, dtype: str, seed: int,
                 vocab: int | None, shuffle: bool = True, flag: str = "--data"
                 ) -> TokenFile | Blend:
    """One token file, or a `Blend` of several (`parse_blend`)."""
    blend = parse_blend(data, flag)
    files = [TokenFile(p, seq_len, dtype, seed + j, vocab, shuffle, flag)
             for j, (_, p) in enumerate(blend)]
    return files[0] if len(files) == 1 else Blend(files, [w for w, _ in blend])


class BatchSource:
    """Rows `lo:hi` of step k's global batch of `batch_size`."""

    def __init__(self, spec: ModelSpec, batch_size: int, seed: int,
                 data: str | Sequence[str] | None = None, data_dtype: str = "uint16",
                 shuffle: bool = True, flag: str = "--data") -> None:
        """`data`: a token file or a blend (`parse_blend`); `shuffle`: False reads windows
        in file order (evaluation data)."""
        self.spec, self.batch_size, self.seed = spec, batch_size, seed
        vocab = None
        if data:
            with torch.device("meta"):  # a model file may size its batch as it builds
                vocab = input_vocabulary(spec.build())
        self.file = token_source(data, spec.seq_len(), data_dtype, seed, vocab, shuffle,
                                 flag) if data else None
        self.flag = flag
        self._gen: Iterator[Any] | None = None
        self._at = 0  # the generator's next step
        self._fixed: Split | None = None

    @property
    def fixed(self) -> bool:
        """One batch every step (no data given)."""
        return self.file is None and self.spec.train_batches is None

    def rows(self, step: int, lo: int, hi: int) -> Rows:
        """(inputs flattened in the order the captured graph takes them, targets)."""
        args, kwargs, targets = self.structured(step, lo, hi)
        return (*args, *kwargs.values()), targets

    def structured(self, step: int, lo: int, hi: int) -> Split:
        """(positional inputs, keyword inputs, targets) of rows `lo:hi` of step `step`."""
        if self.file is not None:
            windows = self.file.windows(step * self.batch_size + lo, hi - lo)
            return self.spec.split(self.spec.tokens_to_batch(windows), hi - lo, self.flag)
        if self.spec.train_batches is not None:
            return _slice(self._generated(step), lo, hi)
        if self._fixed is None:
            torch.manual_seed(self.seed)
            self._fixed = self.spec.example(self.batch_size)
        return _slice(self._fixed, lo, hi)

    def _generated(self, step: int) -> Split:
        if self._gen is None or step < self._at:
            self._gen, self._at = iter(self.spec.train_batches(self.batch_size, self.seed)), 0
        while True:
            try:
                out = next(self._gen)
            except StopIteration:
                raise PiperError(f"{self.spec.path}: train_batches ran out after "
                                 f"{self._at} batches (step {step} needs one)") from None
            self._at += 1
            if self._at > step:
                return self.spec.split(out, self.batch_size, "train_batches")


def input_vocabulary(model: torch.nn.Module) -> int | None:
    """Rows of the embedding token ids index: a Hugging Face model's input embeddings, else
    the first `nn.Embedding` the model registers (None: no embedding, ids not checked)."""
    get = getattr(model, "get_input_embeddings", None)
    emb = get() if callable(get) else None
    if not isinstance(emb, torch.nn.Embedding):
        emb = next((m for m in model.modules() if isinstance(m, torch.nn.Embedding)), None)
    return None if emb is None else emb.num_embeddings


def _slice(batch: Split, lo: int, hi: int) -> Split:
    args, kwargs, targets = batch
    return (tuple(t[lo:hi] for t in args), {k: t[lo:hi] for k, t in kwargs.items()},
            slice_tree(targets, lo, hi))


def slice_tree(x: Any, lo: int, hi: int) -> Any:
    """Rows `lo:hi` of every tensor in `x` (targets may be a tensor, a tuple or None)."""
    if isinstance(x, torch.Tensor):
        return x[lo:hi]
    if isinstance(x, (tuple, list)):
        return type(x)(slice_tree(t, lo, hi) for t in x)
    if isinstance(x, dict):
        return {k: slice_tree(t, lo, hi) for k, t in x.items()}
    return x


def write_synthetic_tokens(path: str, count: int, vocab: int, seed: int = 0) -> str:
    """A deterministic token file with structure a model can learn (each token follows
    from the previous one by a fixed random permutation, one in eight replaced by noise):
    data for tests and benchmarks that ship no corpus."""
    g = np.random.default_rng(seed)
    follow = g.permutation(vocab)
    noise = g.integers(0, vocab, count)
    flip = g.random(count) < 0.125
    out = np.empty(count, dtype=np.int64)
    out[0] = noise[0]
    for i in range(1, count):
        out[i] = noise[i] if flip[i] else follow[out[i - 1]]
    out.astype(np.uint16 if vocab <= 2**16 else np.uint32).tofile(path)
    return path

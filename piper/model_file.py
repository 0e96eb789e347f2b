"""Load a user's model file (the convention in DESIGN.md) into a `ModelSpec`."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from piper.errors import PiperError
from piper.pyfile import import_user_file

DEFAULT_BATCH_SIZE = 16


def default_loss(output: Any, targets: Any) -> torch.Tensor:
    """The model's own loss when it returns one (`output.loss` or `output["loss"]`, as a
    Hugging Face model given `labels` does); else mean cross-entropy over every position of
    the logits (the output, its `logits`, or its first element; last dim = classes)."""
    own = _field(output, "loss")
    if isinstance(own, torch.Tensor):
        return own
    logits = output if isinstance(output, torch.Tensor) else _field(output, "logits")
    if logits is None and isinstance(output, (tuple, list)) and output:
        logits = output[0]
    if not isinstance(logits, torch.Tensor) or targets is None:
        raise PiperError("the model returns no loss and no logits with targets to score: "
                         "define loss_fn(output, targets) in the model file")
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                             targets.reshape(-1))


def _field(output: Any, name: str) -> Any:
    if isinstance(output, Mapping):  # dicts and Hugging Face ModelOutputs
        return output.get(name)
    return getattr(output, name, None) if not isinstance(output, torch.Tensor) else None


def default_optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


@dataclass(frozen=True)
class ModelSpec:
    """What a model file provides, with defaults filled in."""

    path: str
    model_args: tuple[tuple[str, Any], ...] = ()
    build_model: Callable[..., torch.nn.Module] = field(repr=False, default=None)  # type: ignore
    example_batch: Callable[[int], Any] = field(repr=False, default=None)  # type: ignore
    loss_fn: Callable[[Any, Any], torch.Tensor] = field(repr=False, default=default_loss)
    make_optimizer: Callable[[Any], torch.optim.Optimizer] = field(repr=False,
                                                                  default=default_optimizer)
    batch_size: int = DEFAULT_BATCH_SIZE
    tp_plan: tuple[tuple[str, str], ...] = ()  # TP_PLAN: module glob -> tensor-parallel style
    options: tuple[tuple[str, Any], ...] = ()  # how it was loaded (a HF model's seq_len)
    weights: str | None = None  # a folder of *.safetensors each rank loads its part of
    notes: tuple[str, ...] = ()  # what the user should know about how it was read
    train_batches: Callable[[int, int], Any] | None = field(repr=False, default=None)
    """`train_batches(batch_size, seed)`: the model file's own data, global batches."""
    from_tokens: Callable[[torch.Tensor], Any] = field(repr=False, default=None)  # type: ignore
    """[B, T+1] token windows of `--data` -> (inputs, targets), as `example_batch` returns."""
    stored_as: Callable[[str, Any], str | tuple[tuple[str, ...], int] | None] | None = field(
        repr=False, default=None)
    """`stored_as(parameter, stored_names)`: where a checkpoint keeps a parameter it does
    not store under the parameter's own name (Hugging Face checkpoints of older layouts):
    another name, or for stacked experts kept one tensor per expert, their sources (each a
    template with `{e}` for the expert) and the per-expert dimension they join along."""
    index_attrs: tuple[str, ...] = ()
    """Attributes a repeated block keeps only as its position (transformers' `layer_idx`
    indexes the KV cache, which training does not keep): copies differing only there are
    identical for planning (`planner.search.repeats`)."""

    @property
    def source(self) -> tuple[str, tuple[tuple[str, Any], ...], tuple[tuple[str, Any], ...]]:
        """What `load_model` needs to load this spec again in another process."""
        return str(Path(self.path).resolve()), self.model_args, self.options

    def build(self) -> torch.nn.Module:
        try:
            model = self.build_model(**dict(self.model_args))
        except TypeError as e:
            raise PiperError(f"{self.path}: build_model({_fmt(self.model_args)}) failed: {e}")
        config = getattr(model, "config", None)
        if getattr(config, "use_cache", False):  # a Hugging Face model: training keeps no
            config.use_cache = False  # key/value cache (nor returns one to capture)
        return model

    def example(self, batch_size: int) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """(positional inputs, keyword inputs, targets): `example_batch`'s inputs may be a
        tensor, a tuple of tensors or a dict of tensors (keyword arguments of forward, as
        Hugging Face models take `input_ids`, `attention_mask`, `labels`)."""
        return self.split(self.example_batch(batch_size), batch_size, "example_batch")

    def split(self, out: Any, batch_size: int, what: str
              ) -> tuple[tuple[Any, ...], dict[str, Any], Any]:
        """`(inputs, targets)` as a model file returns them -> (args, kwargs, targets)."""
        if not (isinstance(out, tuple) and len(out) == 2):
            raise PiperError(f"{self.path}: {what} must return (inputs, targets)")
        inputs, targets = out
        if isinstance(inputs, Mapping):
            args, kwargs = (), dict(inputs)
        else:
            args, kwargs = (inputs if isinstance(inputs, tuple) else (inputs,)), {}
        for key, t in [*enumerate(args), *kwargs.items()]:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] != batch_size:
                raise PiperError(f"{self.path}: {what}({batch_size}) input {key!r} "
                                 f"must be a tensor with batch dimension {batch_size} first")
        return args, kwargs, targets

    def batch(self, batch_size: int) -> tuple[tuple[torch.Tensor, ...], Any]:
        """(inputs flattened in the order the captured graph takes them, targets)."""
        args, kwargs, targets = self.example(batch_size)
        return (*args, *kwargs.values()), targets

    def tokens_to_batch(self, windows: torch.Tensor) -> Any:
        """`--data` windows [B, T+1] as (inputs, targets): the model file's `from_tokens`,
        else next-token prediction (inputs the first T tokens, targets the last T)."""
        if self.from_tokens is not None:
            return self.from_tokens(windows)
        return windows[:, :-1], windows[:, 1:]

    def seq_len(self) -> int:
        """Tokens per sequence: the second dimension of the example batch's first input."""
        args, kwargs, _ = self.example(1)
        first = next(iter([*args, *kwargs.values()]))
        if first.dim() < 2:
            raise PiperError(f"{self.path}: --data needs token inputs [batch, seq]; the "
                             f"first input of example_batch has shape {tuple(first.shape)}")
        return int(first.shape[1])


def _tp_plan(path: str | Path, plan: Any) -> tuple[tuple[str, str], ...]:
    from piper.tensor_parallel import parse_style

    if not isinstance(plan, dict) or not all(isinstance(k, str) and isinstance(v, str)
                                             for k, v in plan.items()):
        raise PiperError(f"{path}: TP_PLAN must be a dict of module glob -> style string")
    for style in plan.values():
        try:
            parse_style(style)
        except ValueError as e:
            raise PiperError(f"{path}: TP_PLAN: {e}") from None
    return tuple(plan.items())


def _fmt(args: tuple[tuple[str, Any], ...]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in args)


def parse_model_args(items: list[str] | None) -> tuple[tuple[str, Any], ...]:
    """`KEY=VALUE` strings to keyword arguments; values are int, float, bool or str."""
    out = []
    for item in items or []:
        key, sep, raw = item.partition("=")
        if not sep or not key.isidentifier():
            raise PiperError(f"--model-arg {item!r}: expected KEY=VALUE")
        out.append((key, _parse_value(raw)))
    return tuple(out)


def _parse_value(raw: str) -> Any:
    for conv in (int, float):
        try:
            return conv(raw)
        except ValueError:
            pass
    return {"true": True, "false": False}.get(raw.lower(), raw)


def load_model_file(path: str | Path, model_args: tuple[tuple[str, Any], ...] = ()) -> ModelSpec:
    """Import the model file and check the contract; every problem is a `PiperError`."""
    p = Path(path)
    if p.is_dir():
        raise PiperError(f"{str(path)!r} is a folder without a config.json (a model folder "
                         "is what save_pretrained writes)")
    if not p.is_file():
        raise PiperError(f"model file {str(path)!r} not found")
    module = import_user_file(p, "model file")
    for required in ("build_model", "example_batch"):
        if not callable(getattr(module, required, None)):
            raise PiperError(f"{path}: model file must define {required}()")
    batch_size = getattr(module, "BATCH_SIZE", DEFAULT_BATCH_SIZE)
    if not isinstance(batch_size, int) or batch_size <= 0:
        raise PiperError(f"{path}: BATCH_SIZE must be a positive int, got {batch_size!r}")
    return ModelSpec(
        path=str(path),
        tp_plan=_tp_plan(path, getattr(module, "TP_PLAN", {})),
        model_args=model_args,
        build_model=module.build_model,
        example_batch=module.example_batch,
        loss_fn=getattr(module, "loss_fn", default_loss),
        make_optimizer=getattr(module, "make_optimizer", default_optimizer),
        batch_size=batch_size,
        train_batches=getattr(module, "train_batches", None),
    )

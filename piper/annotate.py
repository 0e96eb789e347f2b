"""Region tags. `annotate(name)` marks the ops traced inside it as belonging to region `name`.

Tags travel through `torch.fx.traceback.annotate` into `node.meta["custom"]`, so any PT2 tracer
(torch.export, dynamo) sees them. During capture a counter numbers repeated names in call order;
`capture` later drops the number from names that occur only once.
"""

from __future__ import annotations

import contextlib
import contextvars
import fnmatch
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from functools import partial

import torch
import torch.fx.traceback as fx_traceback

TAG_KEY = "piper_region"

# Active only inside `capture`: counts how often each region name has been entered.
_counter: contextvars.ContextVar[Counter | None] = contextvars.ContextVar("piper_counter",
                                                                        default=None)


@contextlib.contextmanager
def counting_regions() -> Iterator[Counter]:
    """Number region entries from zero for the duration of one trace."""
    token = _counter.set(Counter())
    try:
        yield _counter.get()
    finally:
        _counter.reset(token)


@contextlib.contextmanager
def annotate(name: str) -> Iterator[None]:
    """Tag every op traced inside this block as region `name` (numbered if repeated)."""
    if not name or "#" in name or "/" in name:
        raise ValueError(f"bad region name {name!r}: must be non-empty, without '#' or '/'")
    counter = _counter.get()
    tag = name
    if counter is not None:
        tag = f"{name}#{counter[name]}"
        counter[name] += 1
    with fx_traceback.annotate({TAG_KEY: tag}):
        yield


def annotate_modules(model: torch.nn.Module, regions: Mapping[str, str]) -> torch.nn.Module:
    """Tag submodules by path pattern, e.g. {"tok_emb": "embed", "blocks.*": "layer"}.

    For models you cannot edit: each matching submodule's forward runs inside `annotate(name)`.
    Patterns are `fnmatch` globs over `named_modules()` paths; nested matches are skipped so a
    block is not tagged twice. A name given to several modules by patterns that each match
    one module (`{"norm": "head", "lm_head": "head"}`) is one region; a name a pattern gives
    to many modules (`"blocks.*"`) is numbered per call, `layer.0`, `layer.1`, ... Returns
    the model for chaining.
    """
    tagged: list[tuple[str, str]] = []
    numbered: set[str] = set()
    for pat, name in regions.items():
        hits = [p for p, _ in model.named_modules() if fnmatch.fnmatchcase(p, pat)]
        if len(hits) > 1:
            numbered.add(name)
    modules = dict(model.named_modules())
    for path in modules:
        name = next((n for pat, n in regions.items() if fnmatch.fnmatchcase(path, pat)), None)
        if name is None or any(path.startswith(t + ".") for t, _ in tagged):
            continue
        tagged.append((path, name))
    if not tagged:
        raise ValueError(f"annotate_modules: no submodule matches {sorted(regions)}")
    for path, name in tagged:
        tag_calls(modules[path], partial(annotate if name in numbered else fixed_tag, name))
    return model


def tag_calls(module: torch.nn.Module,
              region: Callable[[], contextlib.AbstractContextManager]) -> None:
    """Run each call of `module`'s forward inside the context `region()` gives then (an
    `annotate` or `fixed_tag`), so the ops it traces carry that region's tag."""
    stack: list[contextlib.ExitStack] = []

    def pre(_mod: torch.nn.Module, _args: object) -> None:
        es = contextlib.ExitStack()
        es.enter_context(region())
        stack.append(es)

    def post(_mod: torch.nn.Module, _args: object, _out: object) -> None:
        stack.pop().close()

    module.register_forward_pre_hook(pre)
    # also when forward raises (a failed capture of one split): else the tag stays entered
    # and every later capture in the process inherits it
    module.register_forward_hook(post, always_call=True)


def fixed_tag(name: str) -> contextlib.AbstractContextManager:
    """Tag ops as region `name` without numbering: every module entering it joins one
    region."""
    if not name or "#" in name or "/" in name:
        raise ValueError(f"bad region name {name!r}: must be non-empty, without '#' or '/'")
    return fx_traceback.annotate({TAG_KEY: f"{name}#0"})

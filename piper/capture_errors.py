"""Why capturing a model failed, in one line that says where: the module and the model
file's line a plain run of its forward fails at, or the frame torch.export names."""

from __future__ import annotations

import os
import re
import traceback
from collections.abc import Callable
from typing import Any

import torch


def failing_module(run: Callable[[dict], None], path: str) -> str:
    """` in module NAME (Class) at FILE:LINE (`code`)`: where `run(seen)` (which builds the
    model into seen["model"] and runs its forward on fake tensors) fails: the innermost
    module running and the last frame in the model file `path`; "" if it runs."""
    seen: dict[str, Any] = {}
    running: list[torch.nn.Module] = []

    def enter(m: torch.nn.Module, args: Any) -> None:
        running.append(m)

    def leave(m: torch.nn.Module, args: Any, out: Any) -> None:  # None: the output stands
        if running:
            running.pop()

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(enter),
             torch.nn.modules.module.register_module_forward_hook(leave)]
    try:
        run(seen)
        return ""
    except Exception as e:  # noqa: BLE001 - the user's code fails: say where
        model = seen.get("model")
        names = ({m: n or "the model" for n, m in model.named_modules()}
                 if isinstance(model, torch.nn.Module) else {})
        inner = next((m for m in reversed(running) if m in names), None)
        where = f" in module {names[inner]} ({type(inner).__name__})" if inner else ""
        mine = os.path.realpath(path)
        frames = [f for f in traceback.extract_tb(e.__traceback__)
                  if os.path.realpath(f.filename) == mine]
        if frames:
            f = frames[-1]
            where += f" at {f.filename}:{f.lineno}" + (f" (`{f.line}`)" if f.line else "")
        return where
    finally:
        for h in hooks:
            h.remove()


def export_failure(e: Exception, where: str = "") -> str:
    """One line naming what torch.export could not capture (`where`: the module and line a
    plain run of the forward fails at), and what to do."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    msg = lines[0] if lines else ""
    kind = type(e).__name__
    untraceable = any(k in kind for k in ("DataDependent", "Unsupported", "UserError",
                                          "Guard", "Dynamic"))
    hint = ("; torch.export cannot follow Python that depends on tensor values (.item(), "
            ".tolist(), if on a tensor, data-dependent shapes): compute it with tensor ops "
            "or outside forward (docs/models.md)") if untraceable else ""
    return f"capturing the model failed{user_frame(lines) or where}: {kind}: {msg}{hint}"


def user_frame(lines: list[str]) -> str:
    """` at FILE:LINE in FUNC (`code`)`: the call torch.export names as raising, if any."""
    for i, ln in enumerate(lines):
        m = re.match(r'File "([^"]+)", line (\d+), in (\S+)', ln)
        if m and i and "raised this error" in " ".join(lines[max(0, i - 2):i]):
            code = lines[i + 1] if i + 1 < len(lines) else ""
            return (f" at {m[1]}:{m[2]} in {m[3]}" + (f" (`{code}`)" if code and not
                                                      code.startswith(("File ", "The "))
                                                      else ""))
    return ""

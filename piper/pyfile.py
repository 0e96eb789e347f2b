"""Import a user's Python file (model or strategy) by path; every failure is a `PiperError`."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

from piper.errors import PiperError


def import_user_file(path: str | Path, what: str) -> ModuleType:
    """Run the file as a fresh module named after its resolved path, so two loads of one
    file agree and two files never collide. `what` names the file in messages."""
    p = Path(path)
    mod_name = f"piper_user_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(mod_name, p)
    if spec is None or spec.loader is None:
        raise PiperError(f"{what} {str(path)!r} is not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = module
    try:
        spec.loader.exec_module(module)
    except SyntaxError as e:
        raise PiperError(f"{path}:{e.lineno}: syntax error: {e.msg}") from None
    except Exception as e:  # noqa: BLE001 - any import failure is the user's file
        raise PiperError(f"{path}: importing the {what} failed: {type(e).__name__}: {e}"
                         ) from None
    return module

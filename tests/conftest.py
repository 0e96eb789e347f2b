"""Shared fixtures: one Ray instance per test session, tiny models, the repo's paths."""

from __future__ import annotations

import os
import subprocess
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
GPT = str(ROOT / "examples" / "gpt.py")
TINY = ("--model-arg", "size=tiny")


@pytest.fixture(scope="session")
def ray_session():
    """Workers are Ray actors with num_cpus=0, so two CPUs host any number of ranks."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not ray.is_initialized():
        ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR",
                 log_to_driver=False)
    yield ray
    ray.shutdown()


class StderrLines:
    """A CLI subprocess's stderr, read line by line on a thread of its own while the test
    watches the run (a pipe left unread would block the process)."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p, self.lines = p, []
        self.reader = threading.Thread(target=lambda: self.lines.extend(p.stderr), daemon=True)
        self.reader.start()

    def wait_for(self, prefix: str, within_s: float) -> bool:
        """Until a line starts with `prefix` (True), the process ends or time runs out."""
        end = time.monotonic() + within_s
        while time.monotonic() < end and self.p.poll() is None:
            if any(line.startswith(prefix) for line in self.lines):
                return True
            time.sleep(0.1)
        return False

    def all(self) -> list[str]:
        """Every line, once the process has ended and its stderr is read to the end."""
        self.reader.join(timeout=10)
        return self.lines

    def __str__(self) -> str:
        return "".join(self.lines)


# a Python where importing ray or optuna fails, as on a machine that has neither (its
# spawned processes too: sitecustomize runs in every interpreter that PYTHONPATH reaches)
NO_RAY = """import importlib.abc, sys
class _Gone(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("ray", "optuna"):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
sys.meta_path.insert(0, _Gone())
"""


def without_ray(tmp_path: Path) -> dict[str, str]:
    """An environment whose Pythons cannot import ray or optuna (this tree importable)."""
    site = tmp_path / "site"
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(NO_RAY)
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), str(ROOT)])}

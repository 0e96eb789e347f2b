"""Paths of files a cluster run shipped to its workers (`runtime.cluster.join.ship`).

Ray unpacks a shipped folder somewhere of its choosing on each node, as an importable
package (`runtime_env` `py_modules`), and a worker's current directory may change under it
(Ray Tune moves trials into their own folders), so a shipped file is named by its package:
`shipped:<package>/<file>`, found on the node through the import system.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

PREFIX = "shipped:"


def shipped_path(package: str, name: str) -> str:
    return f"{PREFIX}{package}/{name}"


def local_path(path: str) -> str:
    """Where `path` is on this node: a shipped name resolved, any other path as it is."""
    if not path.startswith(PREFIX):
        return path
    package, _, name = path[len(PREFIX):].partition("/")
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"{path}: package {package} was not shipped to this node")
    return str(Path(next(iter(spec.submodule_search_locations))) / name)

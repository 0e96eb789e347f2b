"""Regenerate megatron_args.json: the option names Megatron-LM's `pretrain_gpt.py` accepts,
read from a checkout's source (its parser cannot be built on this machine: importing
megatron.training pulls Triton kernels).

    python tests/data/megatron_args.py /path/to/Megatron-LM > tests/data/megatron_args.json

Options are the literal `add_argument('--...')` flags of megatron/training/arguments.py and
the fields of the config dataclasses it turns into options (`ArgumentGroupFactory(Cls,
exclude=[...])`, each field `name` as `--name-with-dashes`), base classes included.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path


def _classes(root: Path) -> dict[str, ast.ClassDef]:
    out = {}
    for path in (root / "megatron").rglob("*.py"):
        try:
            tree = ast.parse(path.read_text())
        except (SyntaxError, UnicodeDecodeError):
            continue
        for node in tree.body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Config"):
                out.setdefault(node.name, node)
    return out


def _fields(cls: ast.ClassDef, classes: dict[str, ast.ClassDef]) -> dict[str, list[str]]:
    """Field -> its option names: `--field-name`, or the `arg_names` its
    `metadata={"argparse_meta": ...}` gives; base classes included."""
    out: dict[str, list[str]] = {}
    for base in cls.bases:
        if isinstance(base, ast.Name) and base.id in classes:
            out.update(_fields(classes[base.id], classes))
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            name = n.target.id
            out[name] = _arg_names(n.value) or ["--" + name.replace("_", "-")]
    return out


def _arg_names(value: ast.expr | None) -> list[str]:
    if not isinstance(value, ast.Call):
        return []
    for kw in value.keywords:
        if kw.arg == "metadata":
            try:
                meta = ast.literal_eval(kw.value)
            except ValueError:
                return []
            return list(meta.get("argparse_meta", {}).get("arg_names", []))
    return []


def options(root: Path) -> set[str]:
    source = (root / "megatron" / "training" / "arguments.py").read_text()
    tree = ast.parse(source)
    classes = _classes(root)
    out = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = getattr(node.func, "attr", getattr(node.func, "id", ""))
        if name == "add_argument":
            out |= {a.value for a in node.args
                    if isinstance(a, ast.Constant) and str(a.value).startswith("--")}
        elif name == "ArgumentGroupFactory" and node.args and isinstance(node.args[0], ast.Name):
            cls = classes.get(node.args[0].id)
            if cls is None:
                continue
            excluded: set[str] = set()
            for kw in node.keywords:
                if kw.arg == "exclude":
                    try:
                        excluded = set(ast.literal_eval(kw.value))
                    except ValueError:  # a variable: the list assigned above it
                        excluded = _assigned(tree, kw.value)
            out |= {a for f, names in _fields(cls, classes).items() if f not in excluded
                    for a in names}
    return out


def _assigned(tree: ast.Module, value: ast.expr) -> set[str]:
    if not isinstance(value, ast.Name):
        return set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == value.id
                                                 for t in node.targets)):
            try:
                return set(ast.literal_eval(node.value))
            except ValueError:
                return set()
    return set()


if __name__ == "__main__":
    root = Path(sys.argv[1])
    commit = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True,
                            text=True, check=False).stdout.strip() or "unknown"
    json.dump({"source": "NVIDIA/Megatron-LM megatron/training/arguments.py", "commit": commit,
               "options": sorted(options(root))}, sys.stdout, indent=0)
    print()

"""Every command the README and docs/*.md show runs as written, in the order written.

One test walks README.md, then docs/*.md by name, in a fresh folder that holds what the
text names (the examples, and under `path/to/` the Llama-3.1-8B config.json, a tiny saved
Llama and a tiny saved Mixtral), and runs each command of each `bash` block there as a user would (the installed
`piper-plan`, `python`, `torchrun`). Each must exit 0. Left out, each for its reason in
`NEEDS`: installs (CI has just installed), a cluster, a GPU, a server that runs until
stopped. Made small (what README says of its commands): step counts of 100 or more
divided by 100 (`--steps 400` runs 4), and at most 2 strategies measured for real.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from piper.model_file import DEFAULT_BATCH_SIZE
from tests.conftest import ROOT
from tests.hf_models import write_config, write_llama_31_8b

PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NEEDS = {  # a command containing this needs what it names, which this machine has not
    "pip install": "an install",
    "python -m pytest": "the test suite itself",
    "<head-ip>": "a Ray cluster",
    "ray start": "a Ray cluster",
    "ray get-auth-token": "a Ray cluster",
    "RAY_AUTH_TOKEN": "a Ray cluster",
    "--nnodes": "several hosts",
    "--device cuda": "a GPU",
    "tensorboard --logdir": "a server that runs until stopped",
}
STEP_FLAGS = ("--steps", "--checkpoint-every", "--eval-every", "--warmup", "--lr-decay-steps")
FENCE = re.compile(r"^(\s*)```(\w*)\s*$")


def commands(page: Path) -> list[str]:
    """The commands of `page`'s bash blocks: continuation lines joined, comments dropped."""
    out, block, lang, indent = [], None, "", ""
    for line in page.read_text().splitlines():
        m = FENCE.match(line)
        if m and block is None:
            block, lang, indent = [], m.group(2), m.group(1)
            continue
        if m and block is not None:
            if lang == "bash":
                text = "\n".join(block).replace("\\\n", " ")
                out += [c for c in (" ".join(shlex.split(t, comments=True))
                                    for t in text.splitlines()) if c]
            block = None
            continue
        if block is not None:
            block.append(line.removeprefix(indent))
    return out


def small(cmd: str) -> str:
    """`cmd` at the sizes this test runs (see the module's docstring)."""
    words = shlex.split(cmd)
    for i, w in enumerate(words[:-1]):
        nxt = words[i + 1]
        if w in STEP_FLAGS and nxt.isdigit() and int(nxt) >= 100:
            words[i + 1] = str(int(nxt) // 100)
        if w == "--measure" and nxt.isdigit():
            words[i + 1] = str(min(int(nxt), 2))
    return shlex.join(words)


def need(cmd: str) -> str | None:
    return next((why for key, why in NEEDS.items() if key in cmd), None)


def test_the_pages_show_commands_and_leave_out_only_what_needs_a_cluster_or_gpu():
    shown = [c for page in PAGES for c in commands(page)]
    assert len(shown) >= 20
    ran = [c for c in shown if need(c) is None]
    assert any(c.startswith("piper-plan run") for c in ran)
    assert any(c.startswith("torchrun") for c in ran)
    assert small("piper-plan run x.py --steps 400 --checkpoint-every 50 --measure 4") == \
        "piper-plan run x.py --steps 4 --checkpoint-every 50 --measure 2"


def test_hugging_face_default_batch_is_documented(capsys):
    from planner.cli import main

    with pytest.raises(SystemExit):
        main(["run", "--help"])
    assert f"a Hugging Face model: {DEFAULT_BATCH_SIZE}" in " ".join(capsys.readouterr().out.split())
    assert f"default {DEFAULT_BATCH_SIZE})" in (ROOT / "docs" / "models.md").read_text()


def test_every_command_of_the_readme_and_docs_runs_in_order(tmp_path):
    work = tmp_path / "work"
    work.mkdir()
    (work / "examples").symlink_to(ROOT / "examples")
    write_llama_31_8b(work / "path" / "to" / "Llama-3.1-8B")
    for name in ("tiny-llama", "my-tiny-llama"):
        write_config(work / "path" / "to" / name, "llama", weights=True)
    write_config(work / "path" / "to" / "tiny-mixtral", "mixtral", weights=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}"
                                 f"{os.environ.get('PATH', '')}"}
    env.pop("RAY_ADDRESS", None)
    for page in PAGES:
        for cmd in commands(page):
            if need(cmd) is not None:
                continue
            run = small(cmd)
            proc = subprocess.run(run, shell=True, cwd=work, env=env, capture_output=True,
                                  text=True, timeout=600, check=False)
            assert proc.returncode == 0, (f"{page.name}: `{run}` exited {proc.returncode}:\n"
                                          f"{proc.stderr[-3000:]}")

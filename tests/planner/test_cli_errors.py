"""Bad input: one `error: ...` line on stderr, exit code 2, never a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from planner.cli import main
from tests.conftest import GPT, TINY

NO_BUILD = "import torch\n\ndef example_batch(b):\n    return torch.zeros(b, 2), torch.zeros(b)\n"


def _write(tmp_path, name: str, text: str) -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BAD = {
    "missing model file": (["run", "nope.py", "--gpus", "2", "--pp", "2"], "not found"),
    "no build_model": (["run", "{no_build}", "--gpus", "2"], "must define build_model"),
    "syntax error": (["simulate", "{syntax}", "--gpus", "2"], "syntax error"),
    "gpus zero": (["run", GPT, *TINY, "--gpus", "0"], "--gpus must be >= 1"),
    "pp x dp != gpus": (["run", GPT, *TINY, "--gpus", "4", "--pp", "2", "--dp", "3"],
                        "pp=2 x dp=3"),
    "microbatches do not divide": (["run", GPT, *TINY, "--gpus", "2", "--pp", "2",
                                    "--microbatches", "3"], "--microbatches 3 does not divide"),
    "pp beyond regions": (["simulate", GPT, *TINY, "--gpus", "8", "--pp", "8"],
                          "needs at least 8 regions"),
    "virtual stages without interleaving": (["simulate", GPT, *TINY, "--gpus", "2", "--pp",
                                             "2", "--virtual-stages", "2"],
                                            "needs --schedule interleaved-1f1b"),
    "interleaved microbatches": (["simulate", GPT, *TINY, "--gpus", "2", "--pp", "2",
                                  "--schedule", "interleaved-1f1b", "--virtual-stages", "2",
                                  "--microbatches", "3"], "must be a multiple of pp=2"),
    "unsupported tp": (["simulate", GPT, *TINY, "--gpus", "2", "--tp", "2"],
                       "--tp 2 is not supported yet"),
    "unknown cluster": (["simulate", GPT, *TINY, "--gpus", "2", "--cluster", "tpu-v9"],
                        "tpu-v9"),
    "unknown flag": (["run", GPT, "--gpus", "2", "--frobnicate"], "unrecognized"),
    "strategy without strategy()": (["run", GPT, *TINY, "--gpus", "2", "--strategy",
                                     "{no_strategy}"], "must define strategy()"),
    "strategy needs other gpus": (["simulate", GPT, *TINY, "--gpus", "4", "--strategy",
                                   "{two_rank}"], "--gpus is 4"),
    "bad model arg": (["run", GPT, "--model-arg", "size", "--gpus", "1"], "KEY=VALUE"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_is_one_error_line_and_exit_2(case, tmp_path, capsys):
    files = {
        "no_build": _write(tmp_path, "no_build.py", NO_BUILD),
        "syntax": _write(tmp_path, "syntax.py", "def build_model(:\n"),
        "no_strategy": _write(tmp_path, "s.py", "X = 1\n"),
        "two_rank": _write(tmp_path, "two.py", (
            "from piper import Place, Program, Split\n"
            "def strategy():\n"
            "    return Program([Place(('embed', 'layer.*'), stage=0, device=0),\n"
            "                    Place(('head',), stage=1, device=1), Split(2)])\n")),
    }
    argv, needle = BAD[case]
    argv = [a.format(**files) for a in argv]
    rc = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1 and err[0].startswith("error: "), err
    assert needle in err[0]


def test_console_script_prints_no_traceback(tmp_path):
    """Through the installed entry point, as a user would see it."""
    r = subprocess.run([sys.executable, "-m", "planner.cli", "run", str(tmp_path / "x.py"),
                        "--gpus", "2"], capture_output=True, text=True, timeout=120, check=False)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == [f"error: model file '{tmp_path / 'x.py'}' not found"]
    assert r.stdout == ""

"""How long a tiny `piper-plan run` takes from the command to its exit, by launcher.

    python benchmarks/run_start.py [--repeats 2] [--before DIR]

Runs `piper-plan run examples/gpt.py --model-arg size=tiny --gpus 4 --device cpu --pp 2
--dp 2 --steps 3` as a subprocess (interpreter start, imports, planning, starting the ranks,
capture and process groups on each, three steps, shutdown) under each launcher:
- `local`: ranks forked from a fork server that imported torch and the runtime once;
- `torchrun`: `torchrun --standalone` starting 4 fresh interpreters (each imports everything);
- `ray`: a Ray instance started for the run, one actor per rank;
and, as the floor every launcher pays at least once, a Python that only imports torch and
`torch.export` (what capture needs); with `--before DIR` (a checkout of an earlier commit,
e.g. `git worktree add /tmp/before 8b4a1ba`), that tree's `--launcher local` and `ray` in the
same run. Wall seconds, medians over the repeats; stdout: a JSON line per measurement,
stderr: a table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUN = ["run", "examples/gpt.py", "--model-arg", "size=tiny", "--gpus", "4", "--device", "cpu",
       "--pp", "2", "--dp", "2", "--steps", "3"]
CASES = {
    "import floor (torch, torch.export)": [sys.executable, "-c",
                                          "import torch, torch.export, torch._dynamo"],
    "--launcher local": [sys.executable, "-m", "planner.cli", *RUN, "--launcher", "local"],
    "--launcher torchrun": [sys.executable, "-m", "torch.distributed.run", "--standalone",
                            "--nproc-per-node", "4", "-m", "planner.cli", *RUN,
                            "--launcher", "torchrun"],
    "--launcher ray": [sys.executable, "-m", "planner.cli", *RUN, "--launcher", "ray"],
}


def wall(cmd: list[str], cwd: str, tree: Path = ROOT) -> float:
    start = time.perf_counter()
    env = {**os.environ, "PYTHONPATH": str(tree)}
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=600,
                          check=False, env=env)
    took = time.perf_counter() - start
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed: {proc.stderr[-2000:]}")
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--before", type=Path, help="an earlier checkout to time beside this one")
    args = ap.parse_args()
    cases = [(name, cmd, ROOT) for name, cmd in CASES.items()]
    if args.before:
        cases += [(f"before: {name}", cmd, args.before.resolve())
                  for name, cmd in CASES.items() if name.endswith(("local", "ray"))]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, cmd, tree in cases:
            cmd = [str(tree / c) if c.startswith("examples/") else c for c in cmd]
            times = [wall(cmd, tmp, tree) for _ in range(args.repeats)]
            row = {"case": name, "wall_s": statistics.median(times), "runs": times}
            print(json.dumps(row), flush=True)
            rows.append(row)
    local = rows[1]["wall_s"]
    print(f"{'case':40s} {'wall s':>7s} {'/ local':>8s}", file=sys.stderr)
    for r in rows:
        print(f"{r['case']:40s} {r['wall_s']:7.1f} {r['wall_s'] / local:8.2f}", file=sys.stderr)


if __name__ == "__main__":
    main()

"""`piper-plan`: a thin CLI over the library. Logs go to stderr; `--json` prints one object.

Exit codes: 0 ok; 1 no feasible strategy or `--check` failed; 2 bad input; 3 runtime failure.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import sys
from typing import NoReturn

from piper.errors import PiperError
from piper.model_file import DEFAULT_BATCH_SIZE
from planner.commands.common import DEFAULT_CLUSTER, EXIT_BAD_INPUT, EXIT_RUNTIME

SAMPLERS = ("tpe", "gp", "nsga2", "grid")
"""Optuna samplers `search --sampler` offers (`planner.search.samplers` builds them; named here so
that parsing the command line needs no Optuna)."""
OPTIONAL = {"ray": "pip install 'ray[tune]'; `simulate`, `run --launcher local` or "
                   "`--launcher torchrun` and `profile --launcher local` run without it",
            "optuna": "pip install optuna; `simulate` and `run` run without it"}
"""Packages only some commands need, and what to say when one is missing."""


COMMANDS = {"search": ("search", "search"), "run": ("run", "run"),
            "simulate": ("simulate", "simulate"), "clusters": ("machine", "clusters"),
            "profile": ("machine", "profile"), "show": ("studies", "show"),
            "export": ("studies", "export"), "export-weights": ("studies", "export_weights")}
"""Subcommand -> (module of `planner.commands`, function): imported when run, so each
command pays only for what it uses (`simulate` and `run` need neither Ray nor Optuna)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:  # one line, exit 2, as DESIGN.md promises
        raise PiperError(message)


RAY_ADDRESS_HELP = ("Ray cluster to join: HOST:PORT from one of its nodes, ray://HOST:10001 "
                    "from anywhere, or auto (default: $RAY_ADDRESS, else a Ray of this "
                    "machine's own); docs/cluster.md")


def build_parser() -> argparse.ArgumentParser:
    from planner.commands.run import add_train_flags
    from planner.search.strategy import add_shorthand_flags
    from runtime.train.training import PRECISIONS

    p = _Parser(prog="piper-plan", description="Search, simulate and run distributed "
                "training strategies for a PyTorch model.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser)

    def model_cmd(name: str, help: str) -> argparse.ArgumentParser:
        c = sub.add_parser(name, help=help)
        c.add_argument("model", help="model file defining build_model() and example_batch(), "
                       "or a Hugging Face config.json / model folder")
        c.add_argument("--gpus", type=int, required=True, help="devices to plan for")
        c.add_argument("--model-arg", action="append", metavar="KEY=VALUE",
                       help="keyword argument for build_model (repeatable)")
        c.add_argument("--batch-size", type=int,
                       help="global batch, in samples (default: the model file's BATCH_SIZE, "
                            f"else {DEFAULT_BATCH_SIZE}; a Hugging Face model: "
                            f"{DEFAULT_BATCH_SIZE} sequences)")
        c.add_argument("--seq-len", type=int, help="tokens per sequence (Hugging Face models; "
                       "default: the context, at most 2048)")
        c.add_argument("--seed", type=int, default=0)
        c.add_argument("--json", action="store_true", help="print one JSON object on stdout")
        return c

    s = model_cmd("search", "search for the best strategy")
    planned = ("what the strategies will train in (default: bf16-mixed on a GPU cluster, "
               "fp32 on cpu)")
    s.add_argument("--precision", choices=PRECISIONS, help=planned)
    s.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    s.add_argument("--trials", type=int, default=64, help="trials to add to the study")
    s.add_argument("--timeout", type=float, help="stop asking for trials after S seconds")
    s.add_argument("--sampler", default="tpe", choices=SAMPLERS,
                   help="tpe (default), gp, nsga2, or grid: every valid point once")
    s.add_argument("--backend", default="optuna", choices=["optuna", "ray"],
                   help="optuna: trials in this process; ray: trials spread by Ray Tune")
    s.add_argument("--address", help=RAY_ADDRESS_HELP + " (--backend ray, --measure)")
    s.add_argument("--gpus-per-node", type=int, help="devices per node, as the strategies are "
                   "priced and --measure places its ranks (default: the --cluster spec's)")
    s.add_argument("--storage", help="Optuna storage URL (default sqlite:///OUT/study.db)")
    s.add_argument("--study-name", default="piper-plan")
    s.add_argument("--measure", type=int, default=0, metavar="K",
                   help="run the K best predicted strategies for real and re-rank them")
    s.add_argument("--device", choices=["cpu", "cuda"], help="where --measure runs")
    s.add_argument("--out", default="piper_plan_out", help="output folder")
    s.add_argument("--target", choices=["torchtitan", "megatron", "deepspeed"],
                   metavar="FRAMEWORK", help="search only what FRAMEWORK runs (its ZeRO "
                   "stages, schedules, recompute policies, TP with or without SP), priced "
                   "as it runs (torchtitan: an FSDP unit per block), and write its config "
                   "(as --to FRAMEWORK); docs/frameworks.md")
    s.add_argument("--to", action="append", choices=["torchtitan", "megatron", "deepspeed"],
                   metavar="FRAMEWORK", help="also write the best strategy as FRAMEWORK's "
                   "config beside best_strategy.py: torchtitan (best_torchtitan.toml), "
                   "megatron (best_megatron.args), deepspeed (best_deepspeed.json); "
                   "repeatable")

    r = model_cmd("run", "train a strategy for real on Ray workers")
    r.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    add_shorthand_flags(r)
    add_train_flags(r)
    r.add_argument("--device", choices=["cpu", "cuda"])
    r.add_argument("--address", help=RAY_ADDRESS_HELP)
    r.add_argument("--gpus-per-node", type=int, help="ranks per node: consecutive ranks share "
                   "a node in blocks of this many (default: on a cluster joined, its "
                   "smallest node's GPUs, or CPUs on --device cpu; else all on this machine)")
    r.add_argument("--check", action="store_true",
                   help="compare losses with single-device training (rtol 1e-4 in fp32, "
                        "2e-2 in bf16-mixed against torch.autocast)")
    r.add_argument("--trace", help="write the measured timeline as a Perfetto trace")
    r.add_argument("--timeout", type=float, default=300.0, help="seconds a collective or "
                   "transfer waits before it fails (the process groups' timeout)")
    r.add_argument("--hang-timeout", type=float, metavar="S",
                   help="a rank silent for S seconds (a stopped process) or a step in which "
                        "no rank moves on for S seconds is named as hung, exit 3 (default: "
                        "20 median steps, at least 60 s; --launcher ray)")
    r.add_argument("--elastic", action="store_true",
                   help="when a node is lost or a rank hangs, plan for the devices left and "
                        "go on from the newest checkpoint (at the same global batch); when "
                        "nodes join, plan upward at the next checkpoint (--launcher ray)")
    r.add_argument("--replan-budget", type=float, metavar="S",
                   help="seconds an --elastic re-plan may search (default 60)")

    m = model_cmd("simulate", "predict step time and memory of a strategy")
    m.add_argument("--precision", choices=PRECISIONS, help=planned)
    m.add_argument("--strategy", help="strategy file (.py with strategy() or .json)")
    m.add_argument("--from", dest="from_", nargs=2, metavar=("FRAMEWORK", "CONFIG"),
                   help="simulate what a framework's config runs: torchtitan JOB.toml, or "
                   "megatron \"ARGS\" (or a file holding them); the global batch is the "
                   "config's unless --batch-size is given")
    add_shorthand_flags(m)
    for priced in (s, m):
        priced.add_argument("--expert-skew", type=float, default=1.0, metavar="X",
                       help="routed experts: the busiest expert-parallel rank's routed rows "
                       "over the mean (a measured router's max/mean load); default 1, "
                       "a balanced router")
    m.add_argument("--cluster", help=f"catalog name or TOML file (default {DEFAULT_CLUSTER})")
    m.add_argument("--trace", help="write the predicted timeline as a Perfetto trace")
    m.add_argument("--timeline", metavar="PNG",
                   help="write the predicted timeline as a per-rank, per-stream Gantt chart")

    f = model_cmd("profile", "measure this machine and write a cluster spec (TOML)")
    f.add_argument("--device", choices=["cpu", "cuda"])
    f.add_argument("--launcher", choices=["ray", "local"], default="ray",
                   help="ray: Ray actors; local: one process per rank spawned here, no Ray")
    f.add_argument("--out", required=True, metavar="CLUSTER.toml",
                   help="cluster spec to write; pass it to search/simulate as --cluster")

    w = sub.add_parser("show", help="list a search's trials, best and Pareto front")
    w.add_argument("storage", help="Optuna storage URL, .db file, or a search's --out folder")
    w.add_argument("--study-name", default="piper-plan")
    w.add_argument("--json", action="store_true", help="print one JSON object on stdout")

    x = sub.add_parser("export", help="write one trial's strategy (default: the best)")
    x.add_argument("storage", help="Optuna storage URL, .db file, or a search's --out folder")
    x.add_argument("--study-name", default="piper-plan")
    x.add_argument("--trial", type=int, help="trial number (default: the best)")
    x.add_argument("--out", required=True, metavar="FILE",
                   help="strategy to write: .py (script) or .json; with --to, the "
                   "framework's config")
    x.add_argument("--to", choices=["torchtitan", "megatron", "deepspeed"],
                   metavar="FRAMEWORK", help="write the strategy as a torchtitan job TOML, "
                   "Megatron-LM arguments or a DeepSpeed config (docs/frameworks.md)")

    e = sub.add_parser("export-weights", help="write a checkpoint's model as one "
                       "single-device state dict")
    e.add_argument("checkpoint", help="a checkpoint folder, or a --checkpoint-dir (newest)")
    e.add_argument("--out", required=True, metavar="FILE.safetensors")

    cl = sub.add_parser("clusters", help="list the built-in cluster catalog, or print one "
                                         "entry as a TOML file to edit")
    cl.add_argument("name", nargs="?", help="a catalog entry to show in full")
    cl.add_argument("--toml", action="store_true",
                    help="print the entry as a cluster file (`--cluster FILE` reads it back)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = None
    # torch logs a traceback (or the partial graph) of its own when a model fails under
    # fake tensors or torch.export; the one `error:` line below says it all
    for name in ("torch._subclasses.fake_tensor", "torch.fx.experimental.symbolic_shapes"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    try:
        args = build_parser().parse_args(argv)
        module, name = COMMANDS[args.command]
        return getattr(importlib.import_module(f"planner.commands.{module}"), name)(args)
    except PiperError as e:
        print(f"error: {_in_file(args, e)}{' '.join(str(e).split())}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # a bug of ours: still one line, with the way to see more
        missing = (getattr(e, "name", None) or "").split(".")[0]
        if isinstance(e, ImportError) and missing in OPTIONAL:
            print(f"error: {getattr(args, 'command', 'this command')} needs {missing}, which "
                  f"this Python does not have ({OPTIONAL[missing]})", file=sys.stderr)
            return EXIT_BAD_INPUT
        if os.environ.get("PIPER_DEBUG"):
            raise
        print(f"error: internal error: {type(e).__name__}: {' '.join(str(e).split())} "
              "(set PIPER_DEBUG=1 for a traceback)", file=sys.stderr)
        return EXIT_RUNTIME


def _in_file(args: argparse.Namespace | None, e: PiperError) -> str:
    """A directive's error happens when the Program is applied, after its file was read:
    name the file, so the message says where as well as which directive."""
    from piper.errors import DirectiveError

    path = getattr(args, "strategy", None)
    if isinstance(e, DirectiveError) and path and not str(e).startswith(path):
        return f"{path}: "
    return ""


if __name__ == "__main__":
    sys.exit(main())

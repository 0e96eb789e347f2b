"""Shorthand flags (--pp --dp --tp --ep --schedule ...) to a Program, with degree checks."""

from __future__ import annotations

import argparse

from piper import schedules
from piper.errors import PiperError
from piper.program import Program
from search_spaces.partition import balanced_stages


def degrees(args: argparse.Namespace, gpus: int) -> tuple[int, int, int, int]:
    """(pp, dp, tp, ep) from the flags (`--cp` takes its share of `gpus` first); every
    mismatch names all degrees."""
    pp, dp = args.pp, args.dp
    tp, ep = getattr(args, "tp", None) or 1, getattr(args, "ep", None) or 1
    cp = getattr(args, "cp", None) or 1
    for name, v in (("--pp", pp), ("--dp", dp), ("--tp", getattr(args, "tp", None)),
                    ("--ep", getattr(args, "ep", None)), ("--cp", getattr(args, "cp", None)),
                    ("--microbatches", args.microbatches)):
        if v is not None and v < 1:
            raise PiperError(f"{name} must be >= 1, got {v}")
    if gpus % (tp * cp):
        what = f"--tp {tp} x --cp {cp}" if cp > 1 else f"--tp {tp}"
        raise PiperError(f"{what} does not divide --gpus {gpus}")
    rest = gpus // (tp * cp)
    if pp is None and dp is None:
        pp, dp = 1, rest
    elif pp is None:
        pp = rest // dp if rest % dp == 0 else -1
    elif dp is None:
        dp = rest // pp if rest % pp == 0 else -1
    if pp < 1 or dp < 1 or pp * dp * tp * cp != gpus:
        cps = f" x cp={cp}" if cp > 1 else ""
        raise PiperError(f"pp={args.pp} x dp={args.dp}{cps} x tp={tp} does not make --gpus "
                         f"{gpus}")
    over = bool(getattr(args, "ep_over_tp", False))
    if over and (tp == 1 or ep % tp):
        raise PiperError(f"--ep-over-tp spreads the experts over the tensor-parallel ranks "
                         f"too: it needs --tp > 1 and --ep {ep} divisible by it")
    if dp % (ep // tp if over else ep):
        span = f"--ep {ep} / --tp {tp}" if over else f"--ep {ep}"
        raise PiperError(f"{span} must divide the data-parallel degree dp={dp}: expert "
                         "parallelism splits the experts over data-parallel replicas")
    return pp, dp, tp, ep


def shorthand_program(args: argparse.Namespace, gpus: int, regions: tuple[str, ...],
                      region_costs: tuple[float, ...], expert_regions: tuple[str, ...] = (),
                      tokens: int = 0) -> Program:
    """The program the shorthand flags describe; `tokens`: of one sequence, the group a
    capacity factor counts over."""
    pp, dp, tp, ep = degrees(args, gpus)
    if ep > 1 and not expert_regions:
        raise PiperError(f"--ep {ep}: the model has no routed experts to split (piper.Experts, or a "
                         "Hugging Face experts module: see the expert-parallelism note)")
    schedule = args.schedule or "1f1b"
    v = args.virtual_stages
    if v is None:
        v = 2 if schedule == "dualpipev" else 1
    if v < 1:
        raise PiperError(f"--virtual-stages must be >= 1, got {v}")
    if schedule == "dualpipev" and v != 2:
        raise PiperError(f"dualpipev runs 2 stages per device (a V), not --virtual-stages {v}")
    if v > 1 and schedule not in ("interleaved-1f1b", "dualpipev"):
        raise PiperError(f"--virtual-stages {v} needs --schedule interleaved-1f1b, "
                         f"not {schedule}")
    if pp * v > len(regions):
        raise PiperError(f"--pp {pp} x --virtual-stages {v} needs at least {pp * v} regions; "
                         f"the model has {len(regions)}: {', '.join(regions)}")
    m = args.microbatches or (2 * pp if schedule == "dualpipev" else pp)
    stages = [[regions[i] for i in r] for r in balanced_stages(region_costs, pp * v)]
    try:
        prog = schedules.build(schedule, stages, microbatches=m, dp=dp, pp=pp,
                               zero=args.zero or 0,
                               recompute=getattr(args, "recompute", None) or False)
    except ValueError as e:
        raise PiperError(str(e)) from None
    sp = bool(getattr(args, "sp", False))
    if sp and tp == 1:
        raise PiperError("--sp (sequence parallelism) splits the sequence over the "
                         "tensor-parallel group: it needs --tp > 1")
    cp = getattr(args, "cp", None) or 1
    if cp > 1 and ep > 1:
        raise PiperError("--cp with --ep: context parallelism with expert parallelism is "
                         "not supported")
    etp = getattr(args, "etp", None) or 1
    if etp not in (1, tp):
        raise PiperError(f"--etp {etp}: expert tensor parallelism is 1 (experts whole on "
                         f"each tensor-parallel rank) or --tp ({tp})")
    if etp > 1 and not expert_regions:
        raise PiperError(f"--etp {etp}: the model has no routed experts to split")
    capacity = getattr(args, "capacity_factor", None) or 0.0
    if capacity:
        _check_capacity(capacity, expert_regions, sp, cp, tokens)
    prog = schedules.shard(prog, tp=tp, ep=ep, expert_regions=expert_regions, sp=sp, cp=cp,
                           cp_attention=getattr(args, "cp_attention", None) or "ring",
                           etp=etp, ep_over_tp=bool(getattr(args, "ep_over_tp", False)),
                           capacity=capacity, capacity_group=tokens)
    bucket = getattr(args, "bucket_mb", None)
    if bucket is not None:
        if not bucket > 0:
            raise PiperError(f"--bucket-mb must be > 0, got {bucket}")
        if dp * cp == 1:
            raise PiperError("--bucket-mb buckets the data-parallel collectives: it needs "
                             f"dp > 1 (got dp={dp})")
        prog = schedules.with_buckets(prog, bucket)
    if getattr(args, "comm_stream", False):
        prog = schedules.with_comm_stream(prog, args.zero or 0)
    return prog


def _check_capacity(capacity: float, expert_regions: tuple[str, ...], sp: bool, cp: int,
                    tokens: int) -> None:
    if not capacity > 0:
        raise PiperError(f"--capacity-factor must be > 0, got {capacity}")
    if not expert_regions:
        raise PiperError("--capacity-factor: the model has no routed experts")
    if sp or cp > 1:
        raise PiperError(f"--capacity-factor with {'--sp' if sp else '--cp'}: a capacity is "
                         "counted per sequence, which that splits over ranks: not supported")
    if tokens < 1:
        raise PiperError("--capacity-factor: the model's sequence length is not known")


def add_shorthand_flags(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("shorthand strategy (instead of --strategy)")
    g.add_argument("--pp", type=int, help="pipeline ranks")
    g.add_argument("--dp", type=int, help="data-parallel replicas")
    g.add_argument("--tp", type=int, help="tensor-parallel degree (the model's TP_PLAN)")
    g.add_argument("--sp", action="store_true", default=False,
                   help="sequence parallelism with --tp (Megatron): between the split "
                   "layers each rank keeps 1/tp of the sequence")
    g.add_argument("--ep", type=int, help="expert-parallel degree (splits routed experts "
                   "over data-parallel replicas)")
    g.add_argument("--etp", type=int, help="expert tensor parallelism: 1 (default: each "
                   "tensor-parallel rank holds its experts whole) or --tp (each holds 1/tp "
                   "of every expert's hidden features, as Megatron's "
                   "--expert-tensor-parallel-size)")
    g.add_argument("--ep-over-tp", action="store_true", default=False,
                   help="Megatron's expert mesh: each EP group of --ep ranks spans --ep/--tp "
                   "replicas and their tensor-parallel ranks, which hold different experts")
    g.add_argument("--capacity-factor", type=float, metavar="X",
                   help="routed experts keep at most X times their balanced share of each "
                   "sequence's routed rows (the highest-gated) and drop the rest, as "
                   "GShard/Switch and Megatron's --moe-expert-capacity-factor (default: "
                   "dropless)")
    g.add_argument("--cp", type=int, help="context-parallel degree: each rank keeps 1/cp "
                   "of every sequence (two chunks, one from each end) and attention "
                   "exchanges keys and values")
    g.add_argument("--cp-attention", choices=["ring", "all_gather"], default=None,
                   help="how context-parallel attention exchanges keys and values: ring "
                   "(passed round, overlapped with compute; default) or all_gather "
                   "(Llama 3's)")
    g.add_argument("--zero", type=int, choices=[0, 1, 2, 3],
                   help="ZeRO stage of the data-parallel replicas (default 0)")
    g.add_argument("--schedule", choices=sorted([*schedules.SCHEDULES, schedules.NO_PIPELINE]),
                   help=f"default 1f1b ({schedules.NO_PIPELINE}: pp=1, no pipeline)")
    g.add_argument("--virtual-stages", type=int,
                   help="stages per pipeline rank (interleaved-1f1b)")
    g.add_argument("--microbatches", type=int, help="microbatches per replica (default pp)")
    g.add_argument("--comm-stream", action="store_true", default=False,
                   help="run gradient collectives on their own stream, overlapping backward")
    g.add_argument("--bucket-mb", type=float, metavar="MIB",
                   help="data-parallel collectives in buckets of at most MIB MiB (dp > 1): "
                   "all-reduces started during the last backward (DDP's bucket_cap_mb), or "
                   "with --zero the units ZeRO shards, gathers and reduce-scatters (FSDP's)")
    g.add_argument("--recompute", nargs="?", const="full", default=None,
                   choices=["full", "attention", "selective", "op"], metavar="POLICY",
                   help="activation recompute on every stage. full (the default): keep "
                   "each region's inputs, rebuild its activations in backward (least "
                   "memory, about one more forward per backward); attention (alias "
                   "selective, Megatron's): recompute each attention op; op: recompute "
                   "the cheap ops between matmuls where that frees memory (norms, "
                   "activations: what fused kernels keep)")

"""`piper-plan run`: train a strategy on real worker processes — data, precision, LR schedule,
clipping, checkpoints and resume, metrics — and optionally check it against single-device
training. Ranks are Ray actors (`--launcher ray`), processes spawned on this machine
(`local`) or the processes torchrun started (`torchrun`: rank 0 drives, the others serve);
only the first imports Ray."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import os
import signal
import sys
import threading
from typing import Any, Self

from piper.errors import PiperError
from planner.commands.elastic import Grown, check_elastic, predicted_step, replanned
from planner.commands.steps import StepLoop
from runtime.train.training import PRECISIONS, SCHEDULES, TrainConfig

CHECK_RTOL = {"fp32": 1e-4, "bf16-mixed": 2e-2, "bf16": 5e-2}


LAUNCHERS = ("ray", "local", "torchrun")


def add_train_flags(r: argparse.ArgumentParser) -> None:
    r.add_argument("--launcher", choices=LAUNCHERS,
                   help="(default: torchrun in a process torchrun started, else ray) "
                        "ray: Ray actors, on this machine or a Ray cluster (--address); "
                        "local: one process per rank on this machine, no Ray; torchrun: "
                        "this process is one of those `torchrun --nproc-per-node K -m "
                        "planner.cli run ...` started (docs/training.md)")
    r.add_argument("--steps", type=int, default=3,
                   help="train until this step (a resumed run continues up to it)")
    r.add_argument("--precision", choices=PRECISIONS,
                   help="fp32 (default on CPU), bf16-mixed (default on CUDA: bf16 compute, "
                        "fp32 master weights and optimizer), or bf16")
    r.add_argument("--reduce-dtype", choices=["fp32", "bf16"], default="fp32",
                   help="dtype of gradient all-reduces and reduce-scatters")
    r.add_argument("--data", metavar="FILE", nargs="+",
                   help="pre-tokenized token file (flat uint16 or uint32 array), or a blend "
                        "of weighted files as Megatron-LM blends them (0.7:a.bin 0.3:b.bin); "
                        "default: the model file's train_batches or example_batch")
    r.add_argument("--data-dtype", choices=["uint16", "uint32"], default="uint16")
    r.add_argument("--eval-data", metavar="FILE", nargs="+",
                   help="held-out token file (or blend), read in order: its loss is shown "
                        "beside the step and logged as eval_loss")
    r.add_argument("--eval-every", type=int, default=0, metavar="K",
                   help="evaluate every K steps (default 0: after the last step only)")
    r.add_argument("--eval-steps", type=int, default=4, metavar="N",
                   help="global batches of --eval-data each evaluation averages (default 4)")
    r.add_argument("--lr", type=float, help="learning rate (default: the model's optimizer's)")
    r.add_argument("--weight-decay", type=float)
    r.add_argument("--warmup", type=int, default=0, metavar="STEPS")
    r.add_argument("--lr-schedule", choices=SCHEDULES, default="constant")
    r.add_argument("--min-lr", type=float, default=0.0)
    r.add_argument("--lr-decay-steps", type=int, metavar="N",
                   help="the schedule's horizon (default: --steps)")
    r.add_argument("--clip-grad", type=float, metavar="NORM",
                   help="clip the global gradient norm (over every shard) to NORM")
    r.add_argument("--checkpoint-dir", metavar="DIR")
    r.add_argument("--checkpoint-every", type=int, default=0, metavar="K",
                   help="save every K steps (and after the last) into --checkpoint-dir")
    r.add_argument("--resume", nargs="?", const="newest", choices=("newest", "auto"),
                   metavar="auto",
                   help="continue from the newest complete checkpoint in --checkpoint-dir "
                        "(an error when there is none); `--resume auto`: start at step 1 "
                        "when there is none, as a requeued job wants")
    r.add_argument("--log-dir", metavar="DIR",
                   help="write TensorBoard events and metrics.jsonl here")


def train_config(args: argparse.Namespace, device: str) -> TrainConfig:
    if args.lr_decay_steps is not None and args.lr_decay_steps < 1:
        raise PiperError(f"--lr-decay-steps must be >= 1, got {args.lr_decay_steps}")
    precision = args.precision or ("bf16-mixed" if device == "cuda" else "fp32")
    return TrainConfig(
        precision=precision, reduce_dtype=args.reduce_dtype, lr=args.lr,
        weight_decay=args.weight_decay, warmup=args.warmup, lr_schedule=args.lr_schedule,
        min_lr=args.min_lr, decay_steps=args.lr_decay_steps or args.steps,
        clip_grad=args.clip_grad, data=_files(args.data), data_dtype=args.data_dtype,
        eval_data=_files(args.eval_data), eval_every=args.eval_every,
        eval_steps=args.eval_steps).check()


def _files(items: list[str] | None) -> str | tuple[str, ...] | None:
    """One file as its path, a blend as its items (`runtime.train.data.parse_blend`)."""
    if not items:
        return None
    return items[0] if len(items) == 1 else tuple(items)


def run(args: argparse.Namespace) -> int:
    """Under torchrun, ranks other than 0 serve rank 0's calls and print nothing; rank 0
    checks the input, drives the run, and lets them go however it ends."""
    torchrun = None
    if args.launcher is None:  # torchrun names its workers' run: started by it, run under it
        args.launcher = "torchrun" if os.environ.get("TORCHELASTIC_RUN_ID") else "ray"
    if args.launcher == "torchrun":
        from runtime.cluster.process_ranks import Torchrun, serve

        torchrun = Torchrun.from_env()
        if torchrun is None:
            raise PiperError("--launcher torchrun: no torchrun environment (RANK, WORLD_SIZE, "
                             "MASTER_ADDR, MASTER_PORT); start it as `torchrun "
                             "--nproc-per-node K -m planner.cli run ...`")
        if torchrun.rank != 0:
            serve(torchrun.store, torchrun.rank, torchrun.world, torchrun.place())
            return 0
    elif args.launcher == "local":
        from runtime.cluster.process_ranks import prestart

        prestart()  # the ranks' imports, on the other core while this one plans
    try:
        rc = _drive(args, torchrun)
    finally:
        if torchrun is not None:
            torchrun.release()
    from planner.commands.common import EXIT_RUNTIME

    if torchrun is not None and rc == EXIT_RUNTIME:
        # rank 0's own part may still wait in a collective for the rank that failed: end
        # the process now (torchrun then stops the others), not at the interpreter's exit
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


def _drive(args: argparse.Namespace, torchrun: Any) -> int:
    from cost_models import CATALOG
    from cost_models.cluster import device_peak_flops
    from planner.commands.common import (
        EXIT_FAILED,
        EXIT_OK,
        EXIT_RUNTIME,
        batch_of,
        device_of,
        emit,
        log,
        program_of,
        spec_of,
        tell_regions,
        with_gpus_per_node,
    )
    from planner.report.export import predicted_of
    from planner.report.tables import summary_line
    from planner.report.trace import write_trace
    from planner.search.evaluate import Evaluator
    from runtime.cluster.jobs import RuntimeFailure, describe_nodes
    from runtime.lowering.lower import lower
    from runtime.train.data import BatchSource
    from runtime.train.metrics import MetricsLog
    from runtime.train.reference import max_rel_diff, reference_run

    spec = spec_of(args)
    if args.steps < 1:
        raise PiperError(f"--steps must be >= 1, got {args.steps}")
    if args.checkpoint_every < 0:
        raise PiperError(f"--checkpoint-every must be >= 0, got {args.checkpoint_every}")
    if args.hang_timeout is not None and args.hang_timeout <= 0:
        raise PiperError(f"--hang-timeout must be > 0, got {args.hang_timeout:g}")
    if (args.checkpoint_every or args.resume) and not args.checkpoint_dir:
        flag = "--resume" if args.resume else "--checkpoint-every"
        raise PiperError(f"{flag} needs --checkpoint-dir")
    check_elastic(args)
    device = device_of(args)
    _check_launch(args, device, torchrun)
    train = train_config(args, device)
    batch = batch_of(args, spec)
    BatchSource(spec, batch, args.seed, train.data, train.data_dtype)  # bad data: exit 2 now
    if train.eval_data:
        BatchSource(spec, batch, args.seed, train.eval_data, train.data_dtype, shuffle=False,
                    flag="--eval-data")
    done, folder = _resume_point(args, spec, batch) if args.resume else (0, None)
    if args.resume == "auto" and folder is None:
        log(f"--resume auto: no complete checkpoint in {args.checkpoint_dir}: starting at "
            "step 1")
    if done >= args.steps:
        log(f"{folder} is at step {done}: nothing to train up to --steps {args.steps}")
        return EXIT_OK
    # tensor parallelism is checked to stay inside a node of --gpus-per-node
    ev = Evaluator(spec, args.gpus, batch, with_gpus_per_node(CATALOG["cpu"],
                                                              args.gpus_per_node))
    tell_regions(ev)
    program = program_of(args, ev)
    plan = lower(spec, program, args.gpus, batch)
    summary = program.summary()
    info = {"batch_size": batch, "seed": args.seed, "strategy": summary,
            "model": list(spec.source[:2]), "options": list(spec.options),
            "precision": train.precision}
    flops = 3 * ev.costs.forward_flops_per_sample * batch  # forward and twice that backward
    peak = device_peak_flops(device, train.precision != "fp32")
    tokens = batch * _tokens_per_sample(spec)
    log(f"running {summary_line(summary)} on {args.gpus} {device} workers, {train.precision}"
        + (f", from {folder} (step {done})" if folder else ""))
    metrics = MetricsLog(args.log_dir, args.gpus, after=done) if args.log_dir else None
    stop = StopSignals()
    loop = StepLoop(args, train, device, info, stop, metrics, tokens, flops, peak, args.gpus,
                    predicted_of(args.strategy) if args.strategy else None, _progress)
    # the step this invocation trains from; the strategy's predicted step (elastic runs
    # say it beside each change)
    start, said_s = done, (predicted_step(spec, program, args.gpus, batch, device,
                                          args.gpus_per_node, train.precision)
                           if args.elastic else None)
    changes: list[Any] = []  # an elastic run's re-plans
    nodes: tuple[str, ...] = ()  # per rank of the job, its node
    try:
        with _one_ray(args, spec):
            while True:
                try:
                    # the handlers go in after the job: joining Ray installs its own for
                    # SIGTERM
                    with _job(args, spec, plan, batch, device, train, done,
                              torchrun) as job, stop:
                        nodes = job.nodes
                        if len(set(nodes)) > 1:
                            log(f"ranks on {len(set(nodes))} nodes: {describe_nodes(nodes)}")
                        if folder is not None:
                            job.restore(str(folder))
                        loop.run(job, done)
                        result = job.finish(orderly=stop.signum is None)
                    break
                except (RuntimeFailure, Grown) as e:
                    if not args.elastic or not (isinstance(e, Grown) or e.lost or e.hung):
                        raise
                    last = loop.trained[-1].step if loop.trained else done
                    again = replanned(args, spec, batch, device, train.precision, e,
                                      loop.gpus, summary, nodes, last, said_s)
                    program, plan, done, folder = again.program, again.plan, again.done, \
                        again.folder
                    said_s, summary = again.change.new_s, program.summary()
                    changes.append(again.change)
                    info["strategy"] = summary
                    loop.back_to(done, again.gpus)
                    if metrics:  # steps after the checkpoint are trained again
                        metrics.close()
                        metrics = loop.metrics = MetricsLog(args.log_dir, again.gpus,
                                                            after=done)
                        metrics.event(again.change.record(), again.change.line())
    except RuntimeFailure as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_RUNTIME
    finally:
        if metrics:
            metrics.close()
    if args.elastic:  # its steps may come from several jobs
        result = dataclasses.replace(result, steps=tuple(loop.trained))
    evals = loop.evals
    if args.trace:
        write_trace(result.spans, args.trace)
    out: dict[str, Any] = {
        "steps": [{"step": s.step, "loss": s.loss, "time_s": s.time_s,
                   "grad_norm": s.grad_norm, "lr": s.lr,
                   **({"eval_loss": evals[s.step]} if s.step in evals else {})}
                  for s in result.steps],
        "peak_memory_bytes": list(result.peak_memory_bytes),
        "summary": summary,
        "precision": train.precision,
        "nodes": list(result.nodes),  # per rank: its node's IP address
    }
    if args.elastic:
        out["replans"] = [c.record() for c in changes]
    if stop.signum is not None:  # a partial run: nothing to check against
        out["stopped"] = {"signal": signal.Signals(stop.signum).name,
                          "after_step": result.steps[-1].step if result.steps else done}
        if args.json:
            emit(out)
        return 128 + stop.signum
    passed = True
    if args.check:
        sh = plan.sharding
        # a capacity factor changes what the model computes: single-device training with it
        ref = reference_run(spec, batch_size=batch, steps=args.steps, seed=args.seed,
                            train=train, capacity=(sh.experts, sh.capacity, sh.capacity_group)
                            if sh.capacity else None)[start:]
        ours = [s.loss for s in result.steps] + [evals[k] for k in sorted(evals)]
        theirs = [r.loss for r in ref] + [r.eval_loss for k, r in enumerate(ref, start + 1)
                                          if k in evals]
        diff = max_rel_diff(ours, theirs)  # type: ignore[arg-type]
        passed = diff <= CHECK_RTOL[train.precision]
        out["check"] = {"passed": passed, "max_rel_diff": diff,
                        "rtol": CHECK_RTOL[train.precision]}
    if args.json:
        emit(out)
    elif args.check:
        print(f"check: {'passed' if passed else 'FAILED'} (max relative difference "
              f"{out['check']['max_rel_diff']:.2e} against single-device training, "
              f"rtol {CHECK_RTOL[train.precision]:g})")
    return EXIT_OK if passed else EXIT_FAILED


class StopSignals:
    """SIGTERM (a scheduler preempting the job) or a first SIGINT (Ctrl-C) while training:
    the step in flight finishes, a checkpoint is written, and the run exits 128 + the
    signal's number (143, 130) with a line saying how to go on, as Megatron-LM's
    `--exit-signal-handler` does. A second signal interrupts at once."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self) -> None:
        self.signum: int | None = None
        self._before: dict[int, Any] = {}

    def __enter__(self) -> Self:
        if threading.current_thread() is threading.main_thread():  # where handlers live
            for sig in self.SIGNALS:
                self._before[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *exc: object) -> None:
        for sig, handler in self._before.items():  # None: a handler set outside Python
            signal.signal(sig, signal.SIG_DFL if handler is None else handler)
        self._before.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum is not None:  # the second one: now
            raise KeyboardInterrupt
        self.signum = signum
        print(f"{signal.Signals(signum).name}: finishing the step in flight, then stopping "
              "(again to stop now)", file=sys.stderr, flush=True)

    def said(self, step: int, checkpoint_dir: str | None) -> str:
        name = signal.Signals(self.signum or 0).name
        if not checkpoint_dir:
            return (f"stopped by {name} after step {step}; nothing saved (no "
                    "--checkpoint-dir)")
        return (f"stopped by {name} after step {step}: the same command with --resume auto "
                "goes on from its checkpoint")


def _check_launch(args: argparse.Namespace, device: str, torchrun: Any) -> None:
    """Refuse ranks the launcher cannot start, before anything is built."""
    if args.launcher == "ray":
        from runtime.cluster.launcher import check_workers

        check_workers(args.gpus, device, args.address)
        return
    if args.address:
        raise PiperError(f"--address joins a Ray cluster; --launcher {args.launcher} runs "
                         "without Ray")
    if torchrun is not None:
        if torchrun.world != args.gpus:
            raise PiperError(f"--gpus {args.gpus}, but torchrun started {torchrun.world} "
                             "processes (--nnodes x --nproc-per-node must equal --gpus)")
        return
    from runtime.cluster.jobs import check_machine

    check_machine(args.gpus, device, "--launcher ray --address joins a cluster with more")


def _one_ray(args: argparse.Namespace, spec: Any) -> Any:
    """An elastic run's jobs share one connection to Ray, which it asks about the nodes
    between them."""
    if not args.elastic:
        return contextlib.nullcontext()
    from runtime.cluster.join import joined

    return joined(args.address, [spec.source[0]])


def _job(args: argparse.Namespace, spec: Any, plan: Any, batch: int, device: str,
         train: TrainConfig, done: int, torchrun: Any) -> Any:
    """The launcher's job (`runtime.cluster.jobs.Driver`): the same steps whatever started the ranks."""
    if args.launcher == "ray":
        from runtime.cluster.launcher import Job

        return Job(spec, plan, batch_size=batch, seed=args.seed, device=device,
                   address=args.address, timeout_s=args.timeout, train=train, done=done,
                   per_node=args.gpus_per_node,
                   shared=(args.checkpoint_dir,) if args.checkpoint_dir else (),
                   hang_timeout_s=args.hang_timeout)
    from runtime.cluster.process_job import ProcessJob

    return ProcessJob(spec, plan, batch_size=batch, seed=args.seed, device=device,
                      timeout_s=args.timeout, train=train, done=done, torchrun=torchrun)


def _resume_point(args: argparse.Namespace, spec: Any, batch: int) -> tuple[int, Any]:
    """(steps trained, folder) of the newest complete checkpoint, checked against this run
    on the driver: a mismatch is bad input (exit 2), not a worker failing to load."""
    from runtime.execute.rank_stages import full_model_names
    from runtime.train import checkpoint

    folder = checkpoint.latest(args.checkpoint_dir)
    if folder is None:
        if args.resume == "auto":
            return 0, None
        raise PiperError(f"--resume: no complete checkpoint in {args.checkpoint_dir} "
                         "(--resume auto starts at step 1 then)")
    saved = checkpoint.info(folder)
    for key, mine in (("batch_size", batch), ("seed", args.seed)):
        if saved.get(key, mine) != mine:
            raise PiperError(f"--resume: {folder} was trained with {key} {saved[key]}, "
                             f"this run has {mine}")
    checkpoint.check_compatible(folder, full_model_names(spec)[1])
    return int(saved["step"]), folder


def _tokens_per_sample(spec: Any) -> int:
    try:
        return spec.seq_len()
    except PiperError:
        return 1  # not a token model: samples


def _progress(row: dict[str, Any], steps: int, predicted: dict | None = None) -> str:
    """One step's line; beside the first, what the search predicted for the strategy."""
    from planner.report.tables import fmt_bytes

    mfu = f"  MFU {row['mfu'] * 100:.1f}%" if row["mfu"] is not None else ""
    said = (f"  (search predicted {predicted['step_time_s'] * 1e3:.1f} ms, "
            f"{fmt_bytes(predicted['peak_memory_bytes'])} on its cluster)" if predicted else "")
    return (f"step {row['step']}/{steps}  loss {row['loss']:.4f}  "
            f"grad-norm {row['grad_norm']:.3f}  lr {row['lr']:.2e}  "
            f"{row['tokens_per_s']:,.0f} tokens/s{mfu}  "
            f"memory {fmt_bytes(max(row['peak_memory_bytes']))}  "
            f"{row['time_s'] * 1e3:.1f} ms{said}"
            + (f"  eval-loss {row['eval_loss']:.4f}" if "eval_loss" in row else ""))

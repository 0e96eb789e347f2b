"""Lowering, without Ray: a model and a Program to the DAG of every rank and the Plan the
workers (and the simulator) run. Planning imports this, not the launcher."""

from __future__ import annotations

from piper.capture import Captured, capture
from piper.dag import TrainingDAG, single_device_dag
from piper.directives import Place
from piper.errors import DirectiveError, PiperError
from piper.model_file import ModelSpec
from piper.program import Program
from piper.sharding import ModelSharding
from runtime.lowering.plan import Plan
from runtime.lowering.scheduler import schedule


def microbatch_size(batch_size: int, dp: int, microbatches: int) -> int:
    """The per-microbatch sample count; a `PiperError` says which division fails."""
    if batch_size % dp:
        raise PiperError(f"batch size {batch_size} is not divisible by dp={dp}")
    per = batch_size // dp
    if per % microbatches:
        raise PiperError(f"--microbatches {microbatches} does not divide the per-replica batch "
                         f"{per} (batch {batch_size} / dp {dp})")
    return per // microbatches


def program_microbatch_size(program: Program, batch_size: int) -> int:
    s = program.summary()
    return microbatch_size(batch_size, s["dp"], s["microbatches"])


def apply_for(program: Program, dag: TrainingDAG, gpus: int) -> TrainingDAG:
    """Apply `program` to a single-device DAG and check it uses exactly `gpus` devices."""
    _check_devices(program, gpus)
    out = program.apply(dag)
    if out.world_size != gpus:
        cp = f" x cp={out.sharding.cp}" if out.sharding.cp > 1 else ""
        raise PiperError(f"strategy needs pp={out.pp} x dp={out.dp}{cp} x tp={out.sharding.tp}"
                         f" = {out.world_size} devices, but --gpus is {gpus}")
    return out


def _check_devices(program: Program, gpus: int) -> None:
    """A Place on a device beyond the cluster, named by its directive (before `verify` would
    only see a gap in the device numbers)."""
    s = program.summary()
    width = s["dp"] * s["tp"]
    if width < 1 or gpus % width:
        return  # the world-size check names every degree
    devices = gpus // width
    for i, d in enumerate(program.directives):
        if isinstance(d, Place) and d.device >= devices:
            raise DirectiveError(i, d, f"device {d.device} is out of range: --gpus {gpus} "
                                 f"with dp={s['dp']} x tp={s['tp']} has pipeline devices "
                                 f"0..{devices - 1}")


def lower(spec: ModelSpec, program: Program, gpus: int, batch_size: int) -> Plan:
    """Capture at the microbatch size, apply the Program, check the world size, schedule;
    with tensor/expert parallelism, check here that the model splits, and that saved weights
    fit the model (workers would fail)."""
    mb = program_microbatch_size(program, batch_size)
    if spec.weights:
        from runtime.train.weights import check_weights

        check_weights(spec)
    plan = schedule(apply_for(program, single_device_dag(capture(spec, mb).graph), gpus))
    if not plan.sharding.trivial:
        capture_sharded(spec, mb, plan.sharding, exact=True)
    return plan


def capture_sharded(spec: ModelSpec, batch: int, sharding: ModelSharding,
                    exact: bool = False) -> Captured:
    """One rank's tensor/expert/context-parallel slice of the model, captured on meta;
    `Infeasible` (a one-line input error) when the model's code does not run at the local
    shapes (`exact`: as the runtime captures it, see `piper.capture.capture`)."""
    from search_spaces.base import Infeasible

    try:
        return capture(spec, batch, sharding, exact=exact)
    except PiperError as e:
        raise Infeasible(split_failure(sharding, e)) from None


def split_failure(sharding: ModelSharding, e: Exception) -> str:
    """Why a sharded capture failed, as the capture said it, with what the split asks of
    the model's code (no guessed cause)."""
    asks = ("sequence parallelism runs the code between tensor-parallel layers on 1/tp of "
            "the sequence; attention that needs the whole sequence there cannot" if sharding.sp
            else "context parallelism runs every op on the rank's share of the sequence"
            if sharding.cp > 1 and sharding.tp == 1
            else "its code must run with 1/tp of the heads and features of each split layer")
    return f"{sharding.describe()}: the model does not run split this way ({asks}): {e}"

"""`piper-plan profile`: measure this machine with short real runs and write a ClusterSpec.

    piper-plan profile examples/gpt.py --model-arg size=tiny --gpus 2 --device cpu \
        --out mybox.toml
    piper-plan simulate examples/gpt.py --model-arg size=tiny --gpus 2 --dp 2 \
        --cluster mybox.toml

The model only supplies chunks to time; the figures written are the machine's (see
`cost_models.calibrate`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from cost_models import ClusterSpec, model_costs, to_toml
from cost_models.calibrate import FitReport, calibrate
from piper.capture import capture
from piper.errors import PiperError
from piper.model_file import ModelSpec


@dataclass(frozen=True)
class ProfileResult:
    cluster: ClusterSpec
    report: FitReport
    path: Path
    seconds: float


def microbatch_sizes(batch: int, gpus: int) -> tuple[int, ...]:
    """The size to time chunks at: a microbatch strategies on `gpus` ranks typically run
    (a quarter of a replica's batch). One size suffices: the matmul sweep gives the size
    dependence, chunks only the per-op costs (and each size costs a capture)."""
    return (max(1, batch // gpus // 4),)


def check_request(out: str, gpus: int) -> Path:
    """The output path, once it and the rank count can work; PiperError says why not."""
    path = Path(out)
    if path.suffix != ".toml":
        raise PiperError(f"--out {out}: a cluster spec file must end in .toml")
    if not path.parent.is_dir():
        raise PiperError(f"--out {out}: folder {path.parent} does not exist")
    if gpus < 2:
        raise PiperError(f"profile needs --gpus >= 2 to time communication, got {gpus}")
    return path


def profile(spec: ModelSpec, *, gpus: int, device: str, batch: int, out: str,
            address: str | None = None, launcher: str = "ray") -> ProfileResult:
    """Measure, fit, write `out`; PiperError for bad input, RuntimeFailure for a rank."""
    from planner.machine.profiling import ProbePlan, measure

    path = check_request(out, gpus)
    t0 = time.perf_counter()
    costs = model_costs(capture(spec, 1))
    m = measure(spec, gpus=gpus, device=device, address=address, launcher=launcher,
                plan=ProbePlan(microbatch_sizes=microbatch_sizes(batch, gpus)))
    cluster, report = calibrate(m, costs, name=path.stem)
    path.write_text(to_toml(cluster))
    return ProfileResult(cluster, report, path, time.perf_counter() - t0)

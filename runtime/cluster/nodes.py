"""Every node of a joined cluster runs what this driver runs: the same Python, torch and
Ray. piper-plan's own packages travel with the job (`runtime.cluster.join`), so a node needs
only those three; this checks them once, with one tiny task per node, before any worker
starts: a mismatch, or a node that cannot import the shipped code, is one `error:` line
naming the node (exit 2), not a worker that "exited unexpectedly"."""

from __future__ import annotations

import platform

import ray

from piper.errors import PiperError

PROBE_S = 120.0  # a node's first worker, runtime env unpacked, on a loaded machine
CHECKED = ("python", "torch", "ray")


def versions() -> dict[str, str]:
    """What this process runs (on a node: the task's worker, the shipped code imported)."""
    import torch

    import piper  # noqa: F401 - fails here, named, if the shipped code does not import

    return {"python": platform.python_version(), "torch": str(torch.__version__),
            "ray": ray.__version__}


def mismatch(driver: dict[str, str], node: dict[str, str]) -> str | None:
    """What a node runs differently from the driver, said as a person would; None if all
    of `CHECKED` agree (Python by major.minor: a patch release reads the same pickles)."""
    said = []
    for key in CHECKED:
        mine, theirs = driver.get(key, "?"), node.get(key, "?")
        if key == "python":
            mine, theirs = (".".join(v.split(".")[:2]) for v in (mine, theirs))
        if mine != theirs:
            said.append(f"{key} {node.get(key, '?')} where this driver has "
                        f"{driver.get(key, '?')}")
    return "; ".join(said) or None


def check_nodes(timeout_s: float = PROBE_S, driver: dict[str, str] | None = None) -> None:
    """One task on every alive node of the joined cluster; `PiperError` naming the first
    node that differs from this driver (`driver`: its versions, default what it runs),
    cannot start the shipped code, or does not answer."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    mine = driver or versions()
    probe = ray.remote(num_cpus=0)(versions)
    refs = {n["NodeManagerAddress"]: probe.options(
                scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)
            ).remote() for n in ray.nodes() if n.get("Alive")}
    for ip, ref in refs.items():
        try:
            theirs = ray.get(ref, timeout=timeout_s)
        except ray.exceptions.GetTimeoutError:
            raise PiperError(f"node {ip} did not run a task within {timeout_s:.0f} s: is "
                             "its raylet up, with CPUs or workers to spare?") from None
        except Exception as e:  # noqa: BLE001 - an import or start failure on the node
            raise PiperError(f"node {ip} cannot start piper-plan's workers: "
                             f"{_cause(e)}") from None
        problem = mismatch(mine, theirs)
        if problem:
            raise PiperError(f"node {ip} runs {problem}: install the driver's versions on "
                             "every node")


def _cause(e: BaseException) -> str:
    """The innermost error a task failure carries, on one line."""
    cause = getattr(e, "cause", None) or e
    lines = [ln.strip() for ln in str(cause).strip().splitlines() if ln.strip()]
    last = next((ln for ln in reversed(lines) if "Error" in ln), lines[-1] if lines else "")
    return last if "Error" in last else f"{type(cause).__name__}: {last}"

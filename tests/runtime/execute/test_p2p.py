"""P2P links on gloo: a communicator per direction and message kind, one I/O thread."""

from __future__ import annotations

import os
from pathlib import Path

import ray

from piper import schedules
from piper.capture import capture
from piper.model_file import load_model_file
from runtime.cluster.launcher import Job
from runtime.lowering.lower import lower
from runtime.train.reference import max_rel_diff, reference_losses
from tests.conftest import GPT

TINY = (("size", "tiny"),)


def test_links_share_one_gloo_device_and_train_like_one_device(ray_session):
    spec = load_model_file(GPT, TINY)
    regions = list(capture(spec, 2).graph.names)
    q = len(regions) // 4
    stages = [regions[:q], regions[q:2 * q], regions[2 * q:3 * q], regions[3 * q:]]
    plan = lower(spec, schedules.build("dualpipev", stages, microbatches=4, pp=2), 2, 8)
    assert len(plan.p2p_links()) == 4  # both directions, activations and gradients

    def gloo_io_threads(_worker: object) -> int:  # local: Ray ships it by value
        """Threads of the worker's process that are a gloo transport device's I/O loop."""
        names = (Path(f"/proc/self/task/{t}/comm").read_text().strip()
                 for t in os.listdir("/proc/self/task"))
        return sum(n == "gloo_tcp_loop" for n in names)

    with Job(spec, plan, batch_size=8, seed=0) as job:
        losses = [job.step().loss for _ in range(2)]
        threads = ray.get([a.__ray_call__.remote(gloo_io_threads) for a in job.actors])
    assert max_rel_diff(losses, reference_losses(spec, batch_size=8, steps=2, seed=0)) < 1e-4
    assert threads == [2, 2]  # the default group's device and the links' shared one

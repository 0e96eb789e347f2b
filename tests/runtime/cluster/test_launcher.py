"""A `Job` holds its workers and their state between steps, so two can be stepped in turn
(as benchmarks/vs_torch_pipelining.py steps ours and torch's) without touching each other."""

from __future__ import annotations

import re

import pytest

from piper import schedules
from piper.capture import capture
from piper.errors import PiperError
from piper.model_file import load_model_file
from runtime.cluster import join
from runtime.cluster.launcher import Job
from runtime.lowering.lower import lower
from runtime.train.reference import max_rel_diff, reference_losses
from tests.conftest import GPT, ROOT

TINY = (("size", "tiny"),)


def test_two_jobs_stepped_in_turn_each_train_like_one_device(ray_session):
    spec = load_model_file(GPT, TINY)
    regions = capture(spec, 2).graph.names
    plan = lower(spec, schedules.build("1f1b", [list(regions[:3]), list(regions[3:])],
                                       microbatches=4, pp=2), 2, 8)
    with Job(spec, plan, batch_size=8, seed=0) as a, Job(spec, plan, batch_size=8,
                                                        seed=0) as b:
        losses = [(a.step().loss, b.step().loss) for _ in range(3)]
        result = a.finish()
    ref = reference_losses(spec, batch_size=8, steps=3, seed=0)
    assert max_rel_diff([x for x, _ in losses], ref) < 1e-4
    assert max_rel_diff([y for _, y in losses], ref) < 1e-4
    assert [s.loss for s in result.steps] == [x for x, _ in losses]
    assert result.spans and len(result.model_state_bytes) == 2
    assert not a.actors and not b.actors  # closed: the workers are gone
    assert result.nodes == (result.nodes[0],) * 2  # one machine: both ranks on its node


def test_paths_the_ranks_read_are_checked_on_every_node_first(ray_session, tmp_path):
    """A `--data` file a node lacks is bad input naming the node, before any rank's setup;
    a shared folder is checked by a marker the driver wrote, which is removed again."""
    import pytest

    from piper.errors import PiperError
    from runtime.train.training import TrainConfig

    spec = load_model_file(GPT, TINY)
    plan = lower(spec, schedules.build("gpipe", [list(capture(spec, 2).graph.names)],
                                       microbatches=1, pp=1), 1, 8)
    missing = tmp_path / "tokens.bin"
    with pytest.raises(PiperError, match=rf"--data \({missing}\) is not on node \S+ \(rank 0\)"
                                         ": put it on storage every node mounts"):
        Job(spec, plan, batch_size=8, seed=0, train=TrainConfig(data=str(missing)))
    shared = tmp_path / "ckpt"
    with Job(spec, plan, batch_size=8, seed=0, shared=(str(shared),)) as job:
        assert job.actors
    assert shared.is_dir() and not list(shared.iterdir())


def test_every_node_answers_with_what_it_runs(ray_session):
    """The probe runs on each node for real: the same versions pass; a driver that runs
    another torch hears which node differs, and how."""
    from runtime.cluster.nodes import check_nodes, versions

    check_nodes(timeout_s=120)
    ip = ray_session.nodes()[0]["NodeManagerAddress"]
    said = re.escape(f"node {ip} runs torch {versions()['torch']} where this driver has "
                     "0.0.1: install the driver's versions on every node")
    with pytest.raises(PiperError, match=f"^{said}$"):
        check_nodes(timeout_s=120, driver={**versions(), "torch": "0.0.1"})
    assert join.own_packages() == [str(ROOT / p) for p in join.OWN_PACKAGES]

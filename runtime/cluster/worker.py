"""One rank in its own process: joins the process groups, builds its stages, runs steps.

Hosted by a Ray actor (`runtime.cluster.launcher`) or by a process of its own, spawned here or by
torchrun (`runtime.cluster.process_job`); nothing here needs Ray."""

from __future__ import annotations

import contextlib
import datetime
import os
from typing import Any

import torch
import torch.distributed as dist

from piper.capture import capture
from piper.collectives import CP_GROUP, EP_GROUP, TP_GROUP, bind_group
from piper.loading import load_model
from piper.shipped import local_path
from runtime.cluster.progress import Reporter
from runtime.execute.executor import RankExecutor, StepOutcome
from runtime.execute.p2p import make_links
from runtime.lowering.plan import PAIR_STREAM, Plan
from runtime.train.training import TrainConfig


class Worker:
    """One rank in its own process. Methods are called in order: node, missing (one rank
    per node), listen (rank 0), setup, step*, shutdown."""

    def __init__(self, rank: int, world: int, model: tuple, device: str, threads: int,
                 board: Any = None, ip: str = "127.0.0.1", gpu: int = 0) -> None:
        """`board`: a Ray progress board (`runtime.cluster.progress`), or None; `ip`: this node's
        address; `gpu`: the CUDA device index this rank uses."""
        self.rank, self.world = rank, world
        self.model = model  # `ModelSpec.source`, as `runtime.cluster.join.remote_source` names it
        self.device_type = device
        torch.set_num_threads(threads)
        with contextlib.suppress(OSError):  # a cluster started elsewhere: at its niceness
            os.setpriority(os.PRIO_PROCESS, 0, 0)  # (lowering it needs the privilege)
        self.ip, self.gpu = ip, gpu
        self.store: dist.Store | None = None  # the rendezvous, if this rank was given one
        self.ex: RankExecutor | None = None
        self.steps = 0
        # what this rank is doing, for the driver to name if the process dies (see progress)
        self.progress = Reporter(board, rank, self.ip)
        self.progress.phase("setup")

    def node(self) -> str:
        """The IP address of this rank's node."""
        return self.ip

    def missing(self, paths: list[str]) -> list[str]:
        """Those of `paths` this node does not have."""
        out = []
        for p in paths:
            try:
                there = os.path.exists(local_path(p))
            except FileNotFoundError:
                there = False
            if not there:
                out.append(p)
        return out

    def listen(self, timeout_s: float) -> tuple[str, int]:
        """Rank 0: open the rendezvous store on a free port of this node; every rank joins
        it at the address returned (no port is picked on one machine for use on another)."""
        self.store = dist.TCPStore(self.ip, 0, self.world, is_master=True,
                                   wait_for_workers=False,
                                   timeout=datetime.timedelta(seconds=timeout_s))
        return self.ip, self.store.port

    def setup(self, plan: Plan, batch_size: int, seed: int, timeout_s: float,
              train: TrainConfig | None = None, done: int = 0,
              master: tuple[str, int] = ("127.0.0.1", 0)) -> int:
        if self.device_type == "cuda":
            device = torch.device("cuda", self.gpu)  # under Ray 0: it sets CUDA_VISIBLE_DEVICES
            torch.cuda.set_device(device)
            backend = "nccl"
        else:
            device, backend = torch.device("cpu"), "gloo"
            use_interface_of(self.ip)
        timeout = datetime.timedelta(seconds=timeout_s)
        store = self.store if self.store is not None else dist.TCPStore(
            master[0], master[1], self.world, is_master=False, timeout=timeout)
        dist.init_process_group(backend, store=store, rank=self.rank, world_size=self.world,
                                timeout=timeout)
        mesh = plan.mesh
        groups = process_groups(plan, timeout, store)
        logical, i = mesh.split(self.rank)
        for lane in (0, 1) if plan.paired else (0,):
            def group(g: tuple[int, ...], lane: int = lane) -> Any:
                return groups[(PAIR_STREAM, g) if lane else g]

            if mesh.tp > 1:
                bind_group(TP_GROUP, group(mesh.tp_group(logical, i)), lane)
            if mesh.cp > 1:
                bind_group(CP_GROUP, group(mesh.cp_group(logical, i)), lane)
            if mesh.ep_size > 1:
                bind_group(EP_GROUP, group(mesh.ep_processes(logical, i)), lane)
        spec = load_model(*self.model)
        mb = batch_size // (plan.dp * plan.microbatches)
        sharding = None if plan.sharding.trivial else plan.sharding
        # pure bf16 trains a bf16 model: traced so, its own casts keep that dtype
        dtype = torch.bfloat16 if train is not None and train.precision == "bf16" else None
        cap = capture(spec, mb, sharding, exact=True, dtype=dtype)
        self.ex = RankExecutor(plan, self.rank, spec, cap, batch_size, seed, device, groups,
                               train, done)
        self.steps = done
        return os.getpid()

    def step(self) -> StepOutcome:
        assert self.ex is not None, "setup() first"
        self.progress.phase(f"step {self.steps + 1}")  # numbered from 1, as the driver does
        self.ex.report = self.progress.task
        out = self.ex.step()
        self.progress.phase(f"after step {self.steps + 1}")
        self.steps += 1
        return out

    def evaluate(self, batches: int) -> float | None:
        assert self.ex is not None, "setup() first"
        self.progress.phase(f"evaluating after step {self.steps}")
        return self.ex.evaluate(batches)

    def save(self, folder: str) -> None:
        assert self.ex is not None, "setup() first"
        self.progress.phase(f"saving a checkpoint after step {self.steps}")
        self.ex.save(folder)

    def load(self, folder: str) -> None:
        assert self.ex is not None, "setup() first"
        self.progress.phase(f"loading checkpoint {folder}")
        self.ex.load(folder)

    def shutdown(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
        self.progress.close()


def use_interface_of(ip: str) -> None:
    """Gloo binds the interface named by GLOO_SOCKET_IFNAME, else the address this host's
    name resolves to, often 127.0.0.1, which peers on other hosts cannot reach: name the
    interface that holds the node's own address (unless the user named one)."""
    if os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    try:
        import psutil  # Ray brings it; a machine without Ray may not have it
    except ImportError:
        return

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.address == ip for a in addrs):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


def process_groups(plan: Plan, timeout: datetime.timedelta | None = None,
                   store: dist.Store | None = None) -> dict[Any, Any]:
    """Every communicator `plan` needs, made in one order on all ranks: its collective
    groups by ranks, and one P2P link per direction and message kind, ("p2p", sender,
    receiver, grad), so opposite messages never queue on one link and the two lanes of an
    overlapped pair never post on the same one (`runtime.execute.p2p`; `store`: a client of the
    rendezvous store, which lets gloo links share one transport device)."""
    kw = {} if timeout is None else {"timeout": timeout}
    mesh = plan.mesh
    groups: dict[Any, Any] = {g: dist.new_group(list(g), **kw)
                              for g in mesh.groups(plan.groups)}
    links = make_links(mesh.p2p_links(plan.p2p_links()), store, timeout)
    groups.update({("p2p", *key): link for key, link in links.items()})
    if plan.paired:  # the pair lane's own in-graph communicators (piper.collectives.lane)
        groups.update({(PAIR_STREAM, g): dist.new_group(list(g), **kw)
                       for g in mesh.in_graph_groups()})
    return groups


"""Joining Ray, as users start it: a local instance, or a cluster of several hosts.

A cluster is named by `--address` or `RAY_ADDRESS`: `host:port` (the GCS, from a machine that
is itself a node: where `ray start` ran), `ray://host:10001` (Ray Client, from anywhere) or
`auto`. Ray 2.60 clusters start with token authentication; this machine's token comes from
`RAY_AUTH_TOKEN`, `RAY_AUTH_TOKEN_PATH` or `~/.ray/auth_token`, as for any Ray client.
Whatever goes wrong while joining is bad input (one `error:` line, exit 2) saying what to set:
Ray's own failures here are a 40 s retry loop, a 30 s client timeout, or a C++ abort.

Nothing on the driver's disk is assumed to be on the nodes: piper-plan's own packages, and the
model file (or a Hugging Face config, or a model folder that is small enough) travel in the
job's `runtime_env` (`py_modules`; the model as a package, `ship`), and workers find the model
by the name `remote_source` gives it. A node needs Python, torch and Ray alone, at the
driver's versions: `runtime.cluster.nodes` checks that once joined.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import shutil
import socket
import tempfile
import time
import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import ray

from piper.errors import PiperError
from piper.shipped import shipped_path
from runtime.cluster.nodes import check_nodes

CLIENT = "ray://"
OWN_PACKAGES = ("piper", "search_spaces", "runtime", "cost_models", "planner")
INIT_FAILURE = "Initialization failure from server"
"""Ray Client's proxy could not start this session's server in time (seen on a loaded
host, right after another session ended): transient, so `connect` tries again."""
CLIENT_TRIES = 3
CLIENT_RETRY_S = 3.0
REACH_S = 5.0  # how long a cluster's port gets to answer a TCP connect
SHIP_LIMIT_BYTES = 256 * 2**20  # a model folder up to this size travels with the job
TOKEN_HINT = ("set RAY_AUTH_TOKEN to the cluster's token, or RAY_AUTH_TOKEN_PATH to a file "
              "holding it (`ray get-auth-token` on the head node prints it)")

_shipped: dict[str, str] = {}  # driver path -> shipped name, for the Ray this process joined
_staging: list[str] = []


def cluster_address(address: str | None) -> str | None:
    """The cluster to join: `--address`, else `RAY_ADDRESS`; None for a Ray of our own."""
    return address or os.environ.get("RAY_ADDRESS") or None


def connect(address: str | None = None, ship: Iterable[str] = ()) -> bool:
    """Join the cluster at `address` (or `RAY_ADDRESS`), shipping the files `ship` names,
    or start a local Ray instance; True if this call connected (so the caller shuts it
    down), False if Ray was already up."""
    if ray.is_initialized():
        return False
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    # Ray starts workers at nice 15 so its own daemons stay responsive; our workers are the
    # job (torchrun's ranks run at 0), and at 15 any daemon or driver wake-up preempts them
    # (measured: 5-7% of a CPU pipeline step). Ray's job manager does the same for jobs.
    os.environ.setdefault("RAY_worker_niceness", "0")
    address = cluster_address(address)
    if not address:
        ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False,
                 logging_level="ERROR", log_to_driver=False)
        return True
    _use_token_if_any()
    if address != "auto":
        _reach(address)
        if not address.startswith(CLIENT):
            _check_gcs(address)
    env = _runtime_env(ship)
    try:
        for attempt in range(CLIENT_TRIES):
            try:
                _init(address, env)
                break
            except Exception as e:
                if INIT_FAILURE not in str(e) or attempt + 1 == CLIENT_TRIES:
                    raise
                ray.shutdown()  # whatever the failed attempt left half set up
                time.sleep(CLIENT_RETRY_S * (attempt + 1))
    except Exception as e:  # noqa: BLE001 - a refused, absent or mismatched cluster: bad input
        forget_shipped()
        if isinstance(e, _RefusedToken):
            raise PiperError(f"the Ray cluster at {address} refused this machine's "
                             f"token: {TOKEN_HINT}") from None
        if address == "auto":
            raise PiperError("--address auto: no Ray cluster runs on this machine (start one "
                             "with `ray start --head`, or name its address)") from None
        lines = str(e).strip().splitlines()
        raise PiperError(f"could not join the Ray cluster at {address}: "
                         f"{type(e).__name__}: {lines[0] if lines else ''}") from None
    try:
        check_nodes()
    except BaseException:
        disconnect()
        raise
    return True


def _init(address: str, env: dict[str, Any]) -> None:
    """`ray.init` at `address`; a refused token is `_RefusedToken` (Ray Client tells it only
    in the log of its connect loop)."""
    with _client_log() as said, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Ray Client's timeout advice: ours is below
        try:
            ray.init(address=address, logging_level="ERROR", log_to_driver=False,
                     runtime_env=env or None)
        except Exception:
            if any("authentication token" in m for m in said):
                raise _RefusedToken from None
            raise


class _RefusedToken(Exception):
    """The cluster refused this machine's token."""


@contextmanager
def joined(address: str | None, ship: Iterable[str] = ()) -> Iterator[None]:
    """One Ray for everything inside (a search and the measuring after it): each later
    `connect` finds it up; left at the end only if this call joined."""
    started = connect(address, ship)
    try:
        yield
    finally:
        if started:
            disconnect()


def disconnect() -> None:
    """Leave Ray and forget what was shipped to it."""
    ray.shutdown()
    forget_shipped()


def forget_shipped() -> None:
    _shipped.clear()
    for folder in _staging:
        shutil.rmtree(folder, ignore_errors=True)
    _staging.clear()


def remote_source(source: tuple) -> tuple:
    """`ModelSpec.source` as the workers of the joined cluster find it."""
    path, *rest = source
    return (_shipped.get(path, path), *rest)


def _use_token_if_any() -> None:
    """Token authentication when a token is at hand and the mode is not set: a client left
    in Ray's default mode sends no token, and a cluster that wants one refuses it."""
    if os.environ.get("RAY_AUTH_MODE"):
        return
    file = os.environ.get("RAY_AUTH_TOKEN_PATH") or str(Path.home() / ".ray" / "auth_token")
    if os.environ.get("RAY_AUTH_TOKEN") or os.path.isfile(file):
        os.environ["RAY_AUTH_MODE"] = "token"


def _host_port(address: str) -> tuple[str, int]:
    rest = address.removeprefix(CLIENT)
    host, sep, port = rest.rpartition(":")
    if not sep or not port.isdigit():
        default = 10001 if address.startswith(CLIENT) else 6379
        return rest, default
    return host.strip("[]"), int(port)


def _reach(address: str) -> None:
    host, port = _host_port(address)
    try:
        with socket.create_connection((host, port), timeout=REACH_S):
            pass
    except OSError as e:
        what = "Ray Client server" if address.startswith(CLIENT) else "Ray cluster (GCS)"
        raise PiperError(f"cannot reach the {what} at {host}:{port} "
                         f"({e.strerror or type(e).__name__}): is `ray start --head` running "
                         "there, and is the port open from this machine?") from None


def _check_gcs(address: str) -> None:
    """The GCS accepts our token, and this machine is one of its nodes (a driver joins
    through its own node's raylet; from elsewhere, Ray aborts the process)."""
    from ray._raylet import GcsClient
    from ray.exceptions import AuthenticationError

    try:
        nodes = GcsClient(address=address).get_all_node_info(timeout=REACH_S).values()
    except AuthenticationError:
        raise PiperError(f"the Ray cluster at {address} refused this machine's token: "
                         f"{TOKEN_HINT}") from None
    except Exception as e:  # noqa: BLE001 - an RPC failure of any kind: say it, exit 2
        raise PiperError(f"the Ray cluster at {address} did not answer: "
                         f"{type(e).__name__}: {e}") from None
    alive = sorted({n.node_manager_address for n in nodes if n.state == 0})
    if not set(alive) & _local_addresses():
        host, _ = _host_port(address)
        raise PiperError(f"this machine is not a node of the Ray cluster at {address} (its "
                         f"nodes: {', '.join(alive) or 'none'}): run on one of them, or "
                         f"join from here through Ray Client: --address ray://{host}:10001")


def _local_addresses() -> set[str]:
    import psutil

    return {a.address for addrs in psutil.net_if_addrs().values() for a in addrs
            if a.family in (socket.AF_INET, socket.AF_INET6)}


@contextmanager
def _client_log() -> Iterator[list[str]]:
    """What Ray Client's connect loop logs while it retries: it says a refused token only
    there, then times out with 'ray client connection timeout'."""
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    logger = logging.getLogger("ray.util.client.worker")
    level, propagate, handler = logger.level, logger.propagate, Keep(logging.DEBUG)
    logger.setLevel(logging.DEBUG)
    logger.propagate = False  # kept here, not printed
    logger.addHandler(handler)
    try:
        yield said
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def own_packages() -> list[str]:
    """The folders of piper-plan's own packages, as this driver imports them: they travel
    with every job that joins a cluster, so a node needs only Python, torch and Ray (and
    runs the driver's code, never an older copy of its own)."""
    out = []
    for name in OWN_PACKAGES:
        spec = importlib.util.find_spec(name)
        if spec is not None and spec.submodule_search_locations:
            out.append(str(Path(next(iter(spec.submodule_search_locations))).resolve()))
    return out


def _runtime_env(ship: Iterable[str]) -> dict[str, Any]:
    """piper-plan's packages, and a package of the files to ship (each file, or a small
    folder whole) named after their content, for `py_modules`; records each file's shipped
    name."""
    env: dict[str, Any] = {"py_modules": own_packages(), "excludes": ["__pycache__/"]}
    paths = [str(Path(p).resolve()) for p in ship if p]
    if not paths:
        return env
    digest = hashlib.sha256("\0".join(paths).encode()).hexdigest()[:12]
    package = f"piper_ship_{digest}"
    root = Path(tempfile.mkdtemp(prefix="piper-ship-"))
    _staging.append(str(root))
    folder = root / package
    folder.mkdir()
    (folder / "__init__.py").write_text("")
    for i, path in enumerate(paths):
        p = Path(path)
        name = f"{i}/{p.name}"  # its own name: a config.json is found by it
        if p.is_dir():
            if _size(p) > SHIP_LIMIT_BYTES:
                continue  # read where it is: `missing` checks every node sees it
            shutil.copytree(p, folder / name)
        elif p.is_file():
            (folder / str(i)).mkdir()
            shutil.copy2(p, folder / name)
        else:
            continue
        _shipped[path] = shipped_path(package, name)
    env["py_modules"].append(str(folder))
    return env


def _size(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())

"""Joining Ray (`runtime.cluster.join`): which address, what is shipped and how a node finds it,
and the one-line errors for an address that does not answer. Joining real clusters of
several hosts is `test_multihost.py`."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

from piper.errors import PiperError
from piper.shipped import local_path
from runtime.cluster import join as cluster


def test_the_flag_wins_then_ray_address(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    assert cluster.cluster_address(None) is None
    monkeypatch.setenv("RAY_ADDRESS", "ray://head:10001")
    assert cluster.cluster_address(None) == "ray://head:10001"
    assert cluster.cluster_address("10.0.0.1:6379") == "10.0.0.1:6379"


def test_host_and_port_with_defaults():
    assert cluster._host_port("ray://head:10002") == ("head", 10002)
    assert cluster._host_port("ray://head") == ("head", 10001)
    assert cluster._host_port("10.0.0.1:6390") == ("10.0.0.1", 6390)
    assert cluster._host_port("head") == ("head", 6379)
    assert cluster._host_port("[::1]:6379") == ("::1", 6379)


def test_an_address_that_does_not_answer_is_one_line():
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    for address, what in ((f"127.0.0.1:{port}", "Ray cluster (GCS)"),
                          (f"ray://127.0.0.1:{port}", "Ray Client server")):
        with pytest.raises(PiperError) as e:
            cluster._reach(address)
        msg = str(e.value)
        assert msg.startswith(f"cannot reach the {what} at 127.0.0.1:{port}") and "\n" not in msg


def test_token_mode_follows_a_token_at_hand(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for k in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.setenv(k, "")  # recorded, so what the test sets is undone after it
        monkeypatch.delenv(k)
    cluster._use_token_if_any()
    assert "RAY_AUTH_MODE" not in os.environ  # no token: Ray's default
    monkeypatch.setenv("RAY_AUTH_TOKEN", "x" * 64)
    cluster._use_token_if_any()
    assert os.environ["RAY_AUTH_MODE"] == "token"
    monkeypatch.setenv("RAY_AUTH_MODE", "disabled")  # said explicitly: kept
    cluster._use_token_if_any()
    assert os.environ["RAY_AUTH_MODE"] == "disabled"


def test_shipped_files_are_found_by_package_wherever_unpacked(tmp_path, monkeypatch):
    model = tmp_path / "mine" / "model.py"
    model.parent.mkdir()
    model.write_text("X = 1\n")
    config = tmp_path / "hf" / "config.json"
    config.parent.mkdir()
    config.write_text("{}")
    try:
        env = cluster._runtime_env([str(model), str(config)])
        *own, folder = env["py_modules"]
        assert own == cluster.own_packages()  # piper-plan's code travels too
        src = cluster.remote_source((str(model.resolve()), (), ()))
        assert src[0].startswith("shipped:") and src[1:] == ((), ())
        # a node: Ray unpacks the package somewhere and puts it on sys.path
        monkeypatch.syspath_prepend(str(Path(folder).parent))
        assert Path(local_path(src[0])).read_text() == "X = 1\n"
        hf = cluster.remote_source((str(config.resolve()),))[0]
        assert local_path(hf).endswith("/config.json")  # found by its own name
        assert cluster.remote_source(("/elsewhere/m.py",))[0] == "/elsewhere/m.py"
    finally:
        cluster.forget_shipped()
        for name in [m for m in sys.modules if m.startswith("piper_ship_")]:
            del sys.modules[name]
    assert cluster.remote_source((str(model.resolve()),))[0] == str(model.resolve())


def test_a_big_folder_is_read_where_it_is(tmp_path, monkeypatch):
    monkeypatch.setattr(cluster, "SHIP_LIMIT_BYTES", 10)
    big = tmp_path / "weights"
    big.mkdir()
    (big / "config.json").write_text("{" + " " * 100 + "}")
    try:
        cluster._runtime_env([str(big)])
        assert cluster.remote_source((str(big.resolve()),))[0] == str(big.resolve())
    finally:
        cluster.forget_shipped()


def test_a_proxy_that_fails_to_start_a_session_is_tried_again(monkeypatch):
    """Ray Client's 'Initialization failure from server' is transient (a loaded head): tried
    again, a bounded number of times; any other failure is said at once."""
    with socket.socket() as listening:  # an address that answers a TCP connect
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        address = f"ray://127.0.0.1:{listening.getsockname()[1]}"
        calls: list[str] = []

        def init(**kw):
            calls.append(kw["address"])
            if len(calls) < 3:
                raise ConnectionAbortedError(f"{cluster.INIT_FAILURE}:\nbusy")

        monkeypatch.setattr(cluster.ray, "is_initialized", lambda: False)
        monkeypatch.setattr(cluster.ray, "init", init)
        monkeypatch.setattr(cluster.ray, "shutdown", lambda: None)
        monkeypatch.setattr(cluster, "check_nodes", lambda: None)  # no nodes to ask here
        monkeypatch.delenv("RAY_AUTH_MODE", raising=False)  # connect sets it: put back after
        monkeypatch.setattr(cluster, "CLIENT_RETRY_S", 0.0)
        assert cluster.connect(address) is True
        assert calls == [address] * 3

        calls.clear()
        monkeypatch.setattr(cluster, "CLIENT_TRIES", 2)
        with pytest.raises(PiperError, match=f"could not join the Ray cluster at {address}: "
                                             f"ConnectionAbortedError: {cluster.INIT_FAILURE}"):
            cluster.connect(address)
        assert len(calls) == 2

        def refused(**kw):
            calls.append(kw["address"])
            raise ConnectionError("ray client connection timeout")

        calls.clear()
        monkeypatch.setattr(cluster.ray, "init", refused)
        with pytest.raises(PiperError, match="ConnectionError: ray client connection timeout"):
            cluster.connect(address)
        assert len(calls) == 1


def test_a_node_that_runs_other_versions_is_named():
    from runtime.cluster.nodes import mismatch

    mine = {"python": "3.11.7", "torch": "2.13.0", "ray": "2.60.0"}
    assert mismatch(mine, {**mine, "python": "3.11.9"}) is None  # a patch release
    assert mismatch(mine, {**mine, "torch": "2.11.0"}) == "torch 2.11.0 where this driver has 2.13.0"
    assert mismatch(mine, {"python": "3.12.1", "torch": "2.13.0", "ray": "2.59.0"}) == (
        "python 3.12.1 where this driver has 3.11.7; ray 2.59.0 where this driver has 2.60.0")


"""ClusterSpec catalog, TOML loading and the errors a bad spec gives."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path

import pytest

from cost_models import CATALOG, ClusterSpec, load_cluster, to_toml
from piper.errors import PiperError

GPUS = ("a100-40gb", "a100-80gb", "h100-80gb", "h100-96gb-500w", "h200")
OPTIONAL = ("name", "device", "source", "memory_bandwidth")
MINIMAL = "\n".join(line for line in to_toml(CATALOG["h100-80gb"]).splitlines()
                    if not line.startswith(OPTIONAL)) + "\n"
NO_FLOPS = "\n".join(line for line in MINIMAL.splitlines() if not line.startswith("flops")) + "\n"


def _write(tmp_path: Path, text: str, name: str = "c.toml") -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


def test_catalog_holds_the_documented_clusters() -> None:
    assert set(CATALOG) == {*GPUS, "cpu"}
    for name, spec in CATALOG.items():
        assert spec.name == name
        assert spec.source
        assert load_cluster(name) is spec


@pytest.mark.parametrize("name", GPUS)
def test_gpu_nodes_have_eight_gpus_and_nvlink_faster_than_the_network(name: str) -> None:
    spec = CATALOG[name]
    assert spec.gpus_per_node == 8
    assert spec.intra_node_bandwidth > spec.inter_node_bandwidth
    assert spec.inter_node_latency >= spec.intra_node_latency


def test_unknown_name_raises_one_line_listing_known_clusters() -> None:
    with pytest.raises(PiperError) as e:
        load_cluster("tpu-v9")
    msg = str(e.value)
    assert "tpu-v9" in msg and "\n" not in msg
    assert all(name in msg for name in CATALOG)


@pytest.mark.parametrize("name", sorted(CATALOG))
def test_toml_round_trips_to_an_equal_spec(name: str, tmp_path: Path) -> None:
    assert load_cluster(_write(tmp_path, to_toml(CATALOG[name]))) == CATALOG[name]


def test_toml_may_omit_name_device_source_and_memory_bandwidth(tmp_path: Path) -> None:
    spec = load_cluster(_write(tmp_path, MINIMAL, "mine.toml"))
    assert spec.name == "mine"
    assert spec.memory_bandwidth is None
    assert spec.flops == CATALOG["h100-80gb"].flops


def test_integer_figures_are_accepted_for_float_fields(tmp_path: Path) -> None:
    spec = load_cluster(_write(tmp_path, NO_FLOPS + "flops = 100000000000000\n"))
    assert spec.flops == 1e14 and isinstance(spec.flops, float)


@pytest.mark.parametrize(("text", "problem"), [
    ("gpus_per_node = [\n", "TOML"),
    ("gpus_per_node = 8\n", "missing"),
    (MINIMAL + "warp_speed = 9\n", "warp_speed"),
    (NO_FLOPS + 'flops = "fast"\n', "flops"),
    (NO_FLOPS + "flops = -1.0\n", "flops"),
    (MINIMAL + "name = 3\n", "name"),
])
def test_malformed_file_raises_one_line_naming_the_problem(text: str, problem: str,
                                                           tmp_path: Path) -> None:
    with pytest.raises(PiperError) as e:
        load_cluster(_write(tmp_path, text))
    msg = str(e.value)
    assert problem in msg and "\n" not in msg


def test_direct_construction_validates_figures() -> None:
    with pytest.raises(PiperError, match="compute_efficiency"):
        ClusterSpec(**(asdict(CATALOG["cpu"]) | {"compute_efficiency": 1.5}))


def test_node_of_fills_nodes_in_rank_order() -> None:
    spec = CATALOG["h200"]
    assert [spec.node_of(r) for r in (0, 7, 8, 15, 16)] == [0, 0, 1, 1, 2]


# ---- measured figures: per-kind alpha-beta tables and the extra fields round-trip ----------
def _measured() -> ClusterSpec:
    from cost_models.cluster import AlphaBeta

    return ClusterSpec(**(asdict(CATALOG["cpu"]) | {
        "name": "box", "cores_per_node": 1.5, "matmul_half_flops": 1.2e5,
        "op_overhead_s": 2e-5, "backward_op_overhead_s": 3e-5,
        "optimizer_tensor_overhead_s": 4e-5, "comm_compute_contention": 0.1,
        "all_reduce": AlphaBeta(latency=1e-4, bandwidth=9e8),
        "all_gather": AlphaBeta(latency=2e-4, bandwidth=5e8),
        "p2p": AlphaBeta(latency=5e-5, bandwidth=float("inf"))}))


def test_a_measured_spec_round_trips_with_its_alpha_beta_tables(tmp_path: Path) -> None:
    spec = _measured()
    text = to_toml(spec)
    assert "all_reduce = { latency = 0.0001, bandwidth = 900000000.0 }" in text
    assert "reduce_scatter" not in text  # None fields are left out
    assert load_cluster(_write(tmp_path, text, "box.toml")) == spec


@pytest.mark.parametrize("line", [
    "all_reduce = 3.0",
    "all_reduce = { latency = 1e-4 }",
    "all_reduce = { latency = -1.0, bandwidth = 1e9 }",
    "all_reduce = { latency = 1e-4, bandwidth = 0 }",
])
def test_a_malformed_alpha_beta_table_names_the_field(line: str, tmp_path: Path) -> None:
    with pytest.raises(PiperError) as e:
        load_cluster(_write(tmp_path, MINIMAL + line + "\n"))
    assert "all_reduce" in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize("field", ["cores_per_node", "op_overhead_s", "bf16_flops",
                                   "elementwise_bandwidth",
                                   "comm_compute_contention"])
def test_negative_measured_figures_are_refused(field: str) -> None:
    with pytest.raises(PiperError, match=field):
        ClusterSpec(**(asdict(CATALOG["cpu"]) | {field: -1.0}))


@pytest.mark.parametrize("name", GPUS)
def test_gpu_entries_say_which_figures_are_datasheet_and_which_assumed(name: str) -> None:
    src = CATALOG[name].source
    assert "datasheet" in src and "assumed" in src and "compute_efficiency" in src
    assert "mamf-finder" in src and "FlashAttention" in src  # measured, with their sources
    c = CATALOG[name]
    shares = [x for p in c.attention_curve for x in p[1:]] or [c.attention_efficiency]
    assert 0 < min(shares) <= max(shares) < c.compute_efficiency
    assert CATALOG[name].bf16_flops > CATALOG[name].flops


def test_the_cpu_entry_says_it_is_not_measured() -> None:
    assert "not measured" in CATALOG["cpu"].source and "profile" in CATALOG["cpu"].source


def test_a_bus_bandwidth_curve_out_of_order_is_refused_in_one_line(tmp_path: Path) -> None:
    text = "\n".join(line for line in MINIMAL.splitlines()
                     if not line.startswith("intra_node_busbw"))
    with pytest.raises(PiperError) as e:
        load_cluster(_write(tmp_path, text + "\nintra_node_busbw = [[2e6, 1e9], [1e6, 2e9]]\n"))
    assert "intra_node_busbw" in str(e.value) and "\n" not in str(e.value)
    spec = load_cluster(_write(tmp_path, text + "\nintra_node_busbw = [[1e6, 1e9], [2e6, 2e9]]\n"))
    assert spec.busbw(1.5e6, ring=False) == pytest.approx(1e9 * 2 ** (0.5849625007211562))

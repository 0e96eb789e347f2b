"""Found strategies as the frameworks' configs: each file parsed by the target's own
configuration code where it installs beside torch 2.13 (torchtitan 0.2's ConfigManager,
DeepSpeed's DeepSpeedConfig; `pip install --no-deps`), else checked against a schema from
its pinned source (Megatron-LM's options: tests/data/megatron_args.json); degrees, world
size and batch arithmetic agree with the strategy, and reading a config back (`simulate
--from`) gives the strategy again."""

from __future__ import annotations

import importlib.util
import itertools
import json
import shlex
import sys
import types
from pathlib import Path

import pytest

from piper import schedules
from piper.errors import PiperError
from piper.model_file import load_model_file
from planner.cli import main
from planner.report.frameworks import SUFFIX, TARGETS, layout
from planner.report.frameworks.readback import from_megatron, from_torchtitan
from planner.search.space import DEEPSPEED_PREFETCH_MB, DEEPSPEED_REDUCE_MB
from tests.conftest import ROOT

LLAMA = str(ROOT / "examples" / "llama.py")
GPUS, BATCH = 16, 32
MEGATRON = json.loads((ROOT / "tests" / "data" / "megatron_args.json").read_text())


@pytest.fixture(scope="module")
def spec():
    return load_model_file(LLAMA, (("size", "llama3-8b"),))


def _stages(n: int) -> list[list[str]]:
    """examples/llama.py's 34 regions in `n` stages: the embedding and head beside layers."""
    regions = ["embed", *(f"layer.{i}" for i in range(32)), "head"]
    cuts = [round(i * len(regions) / n) for i in range(n + 1)]
    return [regions[a:b] for a, b in itertools.pairwise(cuts)]


# name: (schedule, pp, virtual stages, dp, tp, zero, microbatches, recompute, cp)
STRATEGIES = {
    "fsdp": ("none", 1, 1, 16, 1, 3, 2, True, 1),
    "tp_sp_interleaved": ("interleaved-1f1b", 2, 2, 2, 4, 1, 4, "op", 1),
    "pp4_1f1b_ddp": ("1f1b", 4, 1, 4, 1, 0, 8, False, 1),
    "fsdp_cp4": ("none", 1, 1, 4, 1, 3, 2, True, 4),
}


def _strategy(name: str, spec):
    schedule, pp, v, dp, tp, zero, m, rc, cp = STRATEGIES[name]
    prog = schedules.build(schedule, _stages(pp * v), microbatches=m, dp=dp, pp=pp, zero=zero,
                           recompute=rc)
    prog = schedules.shard(prog, tp=tp, sp=tp > 1, cp=cp)
    return layout(prog, prog.summary(), BATCH, GPUS, spec, "bf16-mixed")


@pytest.fixture(scope="module")
def titan_manager():
    """torchtitan's ConfigManager, or None where torchtitan 0.2 is not installed. Its own
    config code, imported without the package's __init__ (which imports model kernels that
    need Triton, a GPU package)."""
    found = importlib.util.find_spec("torchtitan")
    if found is None or importlib.util.find_spec("tyro") is None:
        yield None
        return
    saved = {k: v for k, v in sys.modules.items() if k.startswith("torchtitan")}
    pkg = types.ModuleType("torchtitan")
    pkg.__path__ = list(found.submodule_search_locations)
    sys.modules["torchtitan"] = pkg
    try:
        from torchtitan.config import ConfigManager
        yield ConfigManager
    except ImportError:
        yield None
    finally:
        for k in [k for k in sys.modules if k.startswith("torchtitan")]:
            del sys.modules[k]
        sys.modules.update(saved)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_torchtitan_loads_the_config_with_the_strategys_degrees(name, spec, titan_manager,
                                                                tmp_path):
    lay = _strategy(name, spec)
    out = TARGETS["torchtitan"](lay)
    path = tmp_path / "job.toml"
    path.write_text(out.text)
    if titan_manager is None:
        pytest.skip("torchtitan 0.2 is not installed (pip install --no-deps torchtitan==0.2.2 "
                    "tyro): the TOML was not parsed by its loader")
    cfg = titan_manager().parse_args(["--job.config_file", str(path)])
    par, train = cfg.parallelism, cfg.training
    dp = par.data_parallel_replicate_degree * par.data_parallel_shard_degree
    assert (dp, par.tensor_parallel_degree, par.pipeline_parallel_degree,
            par.context_parallel_degree) == (lay.dp, lay.tp, lay.pp, lay.cp)
    assert (dp * par.tensor_parallel_degree * par.pipeline_parallel_degree
            * par.context_parallel_degree) == GPUS
    assert (cfg.model.name, cfg.model.flavor) == ("llama3", "8B")
    assert train.global_batch_size == BATCH
    if lay.pp > 1:  # one step: local batch in microbatches through the pipeline
        assert train.local_batch_size * dp == BATCH
        assert train.local_batch_size // par.pipeline_parallel_microbatch_size == lay.microbatches
        assert len(par.module_fqns_per_model_part) == lay.pp * lay.virtual_stages
        assert sum(len(p) for p in par.module_fqns_per_model_part) == 32 + 3
    else:  # gradient accumulation: global / (local x dp) steps
        assert BATCH // (train.local_batch_size * dp) == lay.microbatches
    mode = cfg.activation_checkpoint.mode
    assert mode == {True: "full", "op": "selective", False: "none"}[lay.recompute]


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_megatron_arguments_are_its_options_and_add_up(name, spec):
    lay = _strategy(name, spec)
    out = TARGETS["megatron"](lay)
    args = shlex.split(out.text)
    flags = [a for a in args if a.startswith("--")]
    unknown = set(flags) - set(MEGATRON["options"])
    assert not unknown, f"not options of Megatron-LM {MEGATRON['commit'][:10]}: {unknown}"
    value = {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}
    tp, pp = int(value["--tensor-model-parallel-size"]), int(
        value["--pipeline-model-parallel-size"])
    mbs, gbs = int(value["--micro-batch-size"]), int(value["--global-batch-size"])
    cp = int(value["--context-parallel-size"])
    assert (tp, pp, cp, gbs) == (lay.tp, lay.pp, lay.cp, BATCH)
    assert gbs == (GPUS // (tp * pp * cp)) * mbs * lay.microbatches
    assert ("--sequence-parallel" in flags) == lay.sp
    # TE's overlap of the TP collectives, which needs SP, as a Megatron pick is priced
    assert ("--tp-comm-overlap" in flags) == (lay.sp and tp > 1)
    if pp > 1:  # the stage split, as Megatron's layout string
        stages = value["--pipeline-model-parallel-layout"].split("|")
        assert len(stages) == pp * lay.virtual_stages
        assert stages[0].startswith("E") and stages[-1].endswith("L")
        assert [int(st.strip("EL").removeprefix("t*") or 0) for st in stages] == list(
            lay.stage_layers)


def test_gradient_buckets_are_written_as_each_framework_counts_them(spec, monkeypatch):
    """A bucket of 100 MiB of fp32 gradients is 26,214,400 elements: Megatron's
    --ddp-bucket-size (with --overlap-grad-reduce, which alone buckets) and DeepSpeed's
    reduce_bucket_size both count elements."""
    import dataclasses

    lay = dataclasses.replace(_strategy("pp4_1f1b_ddp", spec), comm_stream=True,
                              bucket_mb=100.0)
    args = shlex.split(TARGETS["megatron"](lay).text)
    value = {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}
    assert value["--ddp-bucket-size"] == "26214400" and "--overlap-grad-reduce" in args
    back = from_megatron(TARGETS["megatron"](lay).text, GPUS)[0]
    assert back["bucket_mb"] == 100.0 and not back["param_gather_overlap"]  # no ZeRO-1
    dist_opt = dataclasses.replace(lay, zero=1)
    assert "--overlap-param-gather" in TARGETS["megatron"](dist_opt).text
    assert from_megatron(TARGETS["megatron"](dist_opt).text, GPUS)[0]["param_gather_overlap"]
    in_line = dataclasses.replace(lay, comm_stream=False)  # Megatron: one bucket then
    assert "--ddp-bucket-size" not in TARGETS["megatron"](in_line).text
    assert any("one bucket" in n for n in TARGETS["megatron"](in_line).notes)
    one = dataclasses.replace(lay, zero=1, pp=1, stage_layers=(32,), dp=16, microbatches=2,
                              schedule="none")
    zero = json.loads(TARGETS["deepspeed"](one).text)["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["overlap_comm"]) == (26214400, True)


@pytest.mark.parametrize("name", ["fsdp", "pp4_1f1b_ddp"])
def test_deepspeed_accepts_the_config_and_its_batch(name, spec, monkeypatch):
    lay = _strategy(name, spec)
    config = json.loads(TARGETS["deepspeed"](lay).text)
    assert config["train_batch_size"] == (config["train_micro_batch_size_per_gpu"]
                                          * config["gradient_accumulation_steps"] * lay.dp)
    assert config["zero_optimization"]["stage"] == lay.zero
    try:
        from deepspeed.runtime.config import DeepSpeedConfig
    except ImportError:
        pytest.skip("deepspeed is not installed (pip install --no-deps deepspeed): its "
                    "DeepSpeedConfig did not check the file")

    class DataParallel:  # DeepSpeed's model-parallel unit interface: the replicas
        @staticmethod
        def get_data_parallel_world_size() -> int:
            return lay.dp

        @staticmethod
        def get_model_parallel_world_size() -> int:
            return lay.pp

    import deepspeed.runtime.config as ds_config

    # no process group here: rank 0 of a job whose replicas the mpu names
    monkeypatch.setattr(ds_config.dist, "get_rank", lambda *a, **k: 0)
    ds = DeepSpeedConfig(config, mpu=DataParallel())
    assert (ds.train_batch_size, ds.gradient_accumulation_steps, ds.zero_optimization_stage) \
        == (BATCH, lay.microbatches, lay.zero)


def test_what_a_target_cannot_run_is_named_or_refused(spec):
    lay = _strategy("tp_sp_interleaved", spec)
    with pytest.raises(PiperError, match="DeepSpeed's engine has no tensor"):
        TARGETS["deepspeed"](lay)
    with pytest.raises(PiperError, match="no context parallelism of its own"):
        TARGETS["deepspeed"](_strategy("fsdp_cp4", spec))
    notes = TARGETS["torchtitan"](lay).notes
    assert any(n.startswith("zero 1: torchtitan has no ZeRO-1") for n in notes)
    assert any(n.startswith("recompute op:") for n in notes)
    assert "no model of this family" not in " ".join(notes)


@pytest.mark.parametrize("name", sorted(STRATEGIES))
def test_reading_a_config_back_gives_the_strategy(name, spec, tmp_path):
    lay = _strategy(name, spec)
    path = tmp_path / "job.toml"
    path.write_text(TARGETS["torchtitan"](lay).text)
    titan, _ = from_torchtitan(str(path), GPUS)
    megatron, _ = from_megatron(TARGETS["megatron"](lay).text, GPUS)
    for got in (titan, megatron):
        assert (got["pp"], got["dp"], got["tp"], got["sp"], got["cp"], got["microbatches"],
                got["batch_size"]) == (lay.pp, lay.dp, lay.tp, lay.sp, lay.cp,
                                       lay.microbatches, BATCH)
        assert lay.cp == 1 or got["cp_attention"] == lay.cp_attention
        assert got["schedule"] == lay.schedule
        assert got["virtual_stages"] == lay.virtual_stages
    assert titan["zero"] == (2 if lay.zero == 1 else lay.zero), "torchtitan has no ZeRO-1"
    assert titan["recompute"] == lay.recompute


def test_search_writes_configs_and_simulate_reads_them_back(tmp_path, capsys):
    out = tmp_path / "out"
    argv = ["search", LLAMA, "--model-arg", "size=tiny", "--gpus", "4", "--batch-size", "8",
            "--cluster", "h100-80gb", "--trials", "6", "--seed", "1", "--out", str(out),
            "--to", "torchtitan", "--to", "megatron", "--json"]
    assert main(argv) == 0
    best = json.loads(capsys.readouterr().out)["best"]
    titan, megatron = out / "best_torchtitan.toml", out / "best_megatron.args"
    assert titan.is_file() and megatron.is_file()
    for source in ([str(titan)], [str(megatron)]):
        framework = "torchtitan" if source[0].endswith(".toml") else "megatron"
        rc = main(["simulate", LLAMA, "--model-arg", "size=tiny", "--gpus", "4",
                   "--cluster", "h100-80gb", "--from", framework, *source, "--json"])
        assert rc == 0
        got = json.loads(capsys.readouterr().out)["summary"]
        for k in ("dp", "pp", "tp"):
            assert got[k] == best["summary"][k], (framework, k)
    rc = main(["export", str(out), "--to", "deepspeed", "--out", str(tmp_path / "ds.json")])
    err = capsys.readouterr().err
    if best["summary"]["tp"] > 1:
        assert rc == 2 and "no tensor or expert parallelism" in err
    else:
        assert rc == 0 and json.loads(Path(tmp_path / "ds.json").read_text())[
            "train_batch_size"] == 8


def test_simulate_from_megatron_prices_the_overlaps_its_arguments_turn_on(capsys):
    """--overlap-param-gather hides the distributed optimizer's bucketed gather under the next
    forward and --tp-comm-overlap the TP collectives under the GEMMs: the same layout is
    predicted faster with them, as Megatron runs it."""
    layout = ("--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer "
              "--overlap-grad-reduce --ddp-bucket-size 2000 --micro-batch-size 1 "
              "--global-batch-size 8")
    steps = []
    for extra in ("", " --overlap-param-gather", " --overlap-param-gather --tp-comm-overlap"):
        rc = main(["simulate", LLAMA, "--model-arg", "size=tiny", "--gpus", "4", "--cluster",
                   "h100-80gb", "--from", "megatron", layout + extra, "--json"])
        assert rc == 0
        steps.append(json.loads(capsys.readouterr().out)["predicted"]["step_time_s"])
    assert steps[0] > steps[1] > steps[2]


@pytest.mark.parametrize("target", ["torchtitan", "megatron", "deepspeed"])
def test_a_targeted_search_tries_only_what_the_framework_runs(target, tmp_path, capsys):
    import csv

    out = tmp_path / target
    argv = ["search", LLAMA, "--model-arg", "size=tiny", "--gpus", "4", "--batch-size", "8",
            "--cluster", "h100-80gb", "--trials", "12", "--seed", "0", "--out", str(out),
            "--target", target, "--json"]
    assert main(argv) == 0
    said = json.loads(capsys.readouterr().out)
    default = said["target_default"]  # the framework's own recipe, in the same simulator
    assert default["predicted"]["step_time_s"] > 0 and default["speedup"] > 0
    rows = list(csv.DictReader((out / "trials.csv").open()))
    assert rows
    for r in rows:
        tp, pp, zero = int(r["tp"]), int(r["pp"]), int(r["zero"])
        if target == "torchtitan":
            assert zero != 1 and (tp == 1 or r["sp"] == "True")
            assert r["recompute"] in ("False", "True", "op")
            assert r["bucket_mb"] not in ("25", "100")  # its units: one block each
        elif target == "megatron":
            assert zero in (0, 1, 3) and not (pp > 1 and zero == 3)
            assert tp == 1 or r["sp"] == "True"  # with --tp-comm-overlap
            assert r["schedule"] in ("none", "1f1b", "interleaved-1f1b")
            # its DDP buckets only overlapped gradients (--overlap-grad-reduce); its FSDP2
            # path one unit per layer
            assert (r["bucket_mb"] in ("", "0") or r["comm_stream"] == "True"
                    or zero == 3), r
        else:
            assert tp == 1 and not (pp > 1 and zero > 1)
            assert r["schedule"] in ("none", "1f1b")
            # overlap_comm under the backward at ZeRO 1-3 only; always in its buckets
            assert zero > 0 or r["comm_stream"] != "True", r
            assert r["bucket_mb"] in ("", "0") or float(r["bucket_mb"]) in (
                25, DEEPSPEED_PREFETCH_MB, DEEPSPEED_REDUCE_MB), r
    assert (out / f"best_{target}{SUFFIX[target]}").is_file(), "--target writes its config"


def test_expert_degrees_are_exported_and_read_back(spec, titan_manager, tmp_path):
    """ep and expert tensor parallelism as Megatron's --expert-model-parallel-size /
    --expert-tensor-parallel-size and torchtitan's expert_(tensor_)parallel_degree."""
    import dataclasses

    lay = dataclasses.replace(_strategy("tp_sp_interleaved", spec), ep=2, etp=4)
    args = shlex.split(TARGETS["megatron"](lay).text)
    value = {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}
    assert {"--expert-model-parallel-size", "--expert-tensor-parallel-size"} <= set(
        MEGATRON["options"])
    assert (value["--expert-model-parallel-size"], value["--expert-tensor-parallel-size"]) == (
        "2", "4")
    path = tmp_path / "job.toml"
    path.write_text(TARGETS["torchtitan"](lay).text)
    for got in (from_torchtitan(str(path), GPUS)[0],
                from_megatron(TARGETS["megatron"](lay).text, GPUS)[0]):
        assert (got["ep"], got["etp"]) == (2, 4)
    if titan_manager is not None:
        par = titan_manager().parse_args(["--job.config_file", str(path)]).parallelism
        assert (par.expert_parallel_degree, par.expert_tensor_parallel_degree) == (2, 4)
    whole = dataclasses.replace(lay, etp=1)  # experts whole on each TP rank: said
    assert any("expert mesh" in n for n in TARGETS["megatron"](whole).notes)
    # a capacity factor: Megatron's, dropping the lowest-gated rows as piper-plan does
    capped = dataclasses.replace(lay, capacity=1.25)
    args = shlex.split(TARGETS["megatron"](capped).text)
    value = {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}
    assert not {a for a in args if a.startswith("--")} - set(MEGATRON["options"])
    assert (value["--moe-expert-capacity-factor"], value["--moe-token-drop-policy"]) == (
        "1.25", "probs")
    assert from_megatron(TARGETS["megatron"](capped).text, GPUS)[0]["capacity_factor"] == 1.25
    assert any("dropless" in n for n in TARGETS["torchtitan"](capped).notes)


def test_hugging_face_moe_models_map_to_the_targets_moe_models(titan_manager, tmp_path):
    """Qwen3-30B-A3B's published config: Megatron's MoE flags (experts, top-k, expert
    hidden size, grouped GEMMs, all-to-all dispatch) and torchtitan's qwen3 30B-A3B
    flavor; Mixtral: Megatron's GPTModel with experts, no torchtitan model (a port)."""
    pytest.importorskip("transformers")
    from piper.loading import load_model
    from tests.hf_models import write_config

    qwen = load_model(ROOT / "benchmarks" / "data" / "hf" / "qwen3_30b_a3b.json", (),
                      (("seq_len", 4096),))
    prog = schedules.shard(schedules.build("1f1b", _stages(2), microbatches=4, dp=8, pp=2),
                           ep=8, expert_regions=("layer.*",))
    lay = layout(prog, prog.summary(), 64, GPUS, qwen, "bf16-mixed")
    args = shlex.split(TARGETS["megatron"](lay).text)
    assert not {a for a in args if a.startswith("--")} - set(MEGATRON["options"])
    value = {a: b for a, b in itertools.pairwise(args) if a.startswith("--")}
    assert (value["--num-experts"], value["--moe-router-topk"],
            value["--moe-ffn-hidden-size"], value["--expert-model-parallel-size"]) == (
        "128", "8", "768", "8")
    assert "--moe-grouped-gemm" in args and "--qk-layernorm" in args
    path = tmp_path / "job.toml"
    out = TARGETS["torchtitan"](lay)
    path.write_text(out.text)
    if titan_manager is not None:
        cfg = titan_manager().parse_args(["--job.config_file", str(path)])
        assert (cfg.model.name, cfg.model.flavor) == ("qwen3", "30B-A3B")
        assert cfg.parallelism.expert_parallel_degree == 8
    mixtral = load_model(write_config(tmp_path / "mixtral", "mixtral"), (), (("seq_len", 16),))
    lay = layout(prog, prog.summary(), 64, GPUS, mixtral, "bf16-mixed")
    assert "--num-experts" in TARGETS["megatron"](lay).text
    assert any("needs a port" in n for n in TARGETS["torchtitan"](lay).notes)

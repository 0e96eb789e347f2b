"""Hugging Face models without a model file: config.json or folder in, regions and TP plan
read from the config as data, the model's own causal-LM loss."""

from __future__ import annotations

import json

import pytest
import torch

import piper
from piper.errors import PiperError
from piper.hf import is_hf_model, load_hf_model
from piper.loading import load_model
from tests.hf_models import FAMILIES, SEQ, write_config

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("hf")
    return {f: write_config(root / f, f) for f in FAMILIES}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_config_folder_captures_with_regions_from_the_model(folders, family) -> None:
    spec = load_model(folders[family], (), (("seq_len", SEQ),))
    cap = piper.capture(spec, 2)
    assert cap.graph.names == ("embed", "layer.0", "layer.1", "layer.2", "layer.3", "head")
    assert cap.auto is not None and cap.auto.describe().startswith(
        "regions: embed (")
    owner = {p: r.name for r in cap.graph.regions for p in r.params}
    assert any(p.endswith(("layers.2.self_attn.q_proj.weight", "h.2.attn.c_attn.weight"))
               for p, r in owner.items() if r == "layer.2")


def test_config_json_file_and_folder_are_the_same_model(folders) -> None:
    a = load_model(folders["llama"] / "config.json", (), (("seq_len", SEQ),))
    b = load_model(folders["llama"], (), (("seq_len", SEQ),))
    assert piper.capture(a, 1).graph == piper.capture(b, 1).graph
    assert is_hf_model(folders["llama"]) and not is_hf_model(folders["llama"].parent)


def test_tp_plan_is_read_from_the_config(folders) -> None:
    llama = load_hf_model(folders["llama"], seq_len=SEQ)
    assert ("model.layers.*.self_attn.q_proj", "colwise") in llama.tp_plan
    assert ("model.layers.*.mlp.down_proj", "rowwise") in llama.tp_plan
    qwen = load_hf_model(folders["qwen3"], seq_len=SEQ)
    assert ("model.layers.*.self_attn.q_norm", "replicate") in qwen.tp_plan
    gpt2 = load_hf_model(folders["gpt2"], seq_len=SEQ)
    assert gpt2.tp_plan == () and "no base_model_tp_plan" in gpt2.notes[0]
    # the causal LM's own plan splits the output layer's vocabulary, as transformers does;
    # not where it shares its weight with the (whole) embedding
    assert ("lm_head", "colwise_rep") in llama.tp_plan
    assert not any(k == "lm_head" for k, _ in qwen.tp_plan)


def test_unknown_tp_style_is_refused_by_name(tmp_path, folders) -> None:
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    import transformers

    old = transformers.LlamaConfig.base_model_tp_plan
    transformers.LlamaConfig.base_model_tp_plan = {**old, "layers.*.mlp.up_proj":
                                                   "local_colwise"}
    try:
        spec = load_hf_model(tmp_path, seq_len=SEQ)
    finally:
        transformers.LlamaConfig.base_model_tp_plan = old
    assert spec.tp_plan == ()
    assert "local_colwise" in spec.notes[0] and "up_proj" in spec.notes[0]


def test_gathered_column_and_split_row_styles_map_to_ours(tmp_path) -> None:
    """OLMo's plan (and GLM's, Phi-3's): q/k/v column-parallel with their output gathered
    whole (its q/k norms span every head), o_proj row-parallel taking its slice first."""
    from tests.hf_models import write_config

    spec = load_hf_model(write_config(tmp_path / "olmoe", "olmoe"), seq_len=SEQ)
    plan = dict(spec.tp_plan)
    assert plan["model.layers.*.self_attn.q_proj"] == "colwise_rep"
    assert plan["model.layers.*.self_attn.o_proj"] == "rowwise_split"


def test_a_misspelt_model_type_is_one_whole_sentence_and_the_nearest_type(tmp_path,
                                                                           folders) -> None:
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "model_type": "lama"}))
    with pytest.raises(PiperError) as e:
        load_hf_model(tmp_path, seq_len=SEQ)
    said = str(e.value)
    assert said.endswith("does not recognize this architecture; did you mean model_type "
                         "'llama'?"), said


def test_model_args_override_config_fields(folders) -> None:
    spec = load_model(folders["llama"], (("num_hidden_layers", 2),), (("seq_len", SEQ),))
    assert piper.capture(spec, 1).graph.names == ("embed", "layer.0", "layer.1", "head")
    with pytest.raises(PiperError, match="no field 'not_a_field'"):
        load_model(folders["llama"], (("not_a_field", 1),))


def test_batch_is_tokens_with_labels_and_the_loss_is_the_models(folders) -> None:
    spec = load_model(folders["llama"], (), (("seq_len", SEQ),))
    args, kwargs, targets = spec.example(3)
    assert args == () and targets is None
    assert set(kwargs) == {"input_ids", "labels", "shift_labels"}
    assert kwargs["input_ids"].shape == kwargs["shift_labels"].shape == (3, SEQ)
    # the targets are the next tokens, already shifted: every position has one
    assert torch.equal(kwargs["input_ids"][:, 1:], kwargs["shift_labels"][:, :-1])
    with pytest.raises(PiperError, match="longer than the model's context"):
        load_model(folders["llama"], (), (("seq_len", 65),))


def test_seq_len_is_only_for_hf_models() -> None:
    with pytest.raises(PiperError, match="--seq-len is for Hugging Face models"):
        load_model("examples/gpt.py", (), (("seq_len", 8),))


def test_folder_without_config_is_an_input_error(tmp_path) -> None:
    with pytest.raises(PiperError, match="folder without a config.json"):
        load_model(tmp_path)


def test_replicated_norms_sum_their_gradients_over_the_tp_group(folders) -> None:
    """Qwen3's per-head q/k norms see only this rank's heads: each weight enters through f,
    whose backward all-reduces its gradient (HF's replicated_with_grad_allreduce)."""
    from piper.sharding import ModelSharding

    spec = load_hf_model(folders["qwen3"], seq_len=SEQ)
    cap = piper.capture(spec, 1, ModelSharding(tp=2, tp_plan=spec.tp_plan))
    sig = {s.arg.name: s.target for s in cap.program.graph_signature.input_specs}
    for n in cap.program.graph.nodes:
        target = sig.get(n.name) or ""
        if n.op == "placeholder" and target.endswith(("q_norm.weight", "k_norm.weight")):
            assert [str(u.target) for u in n.users] == ["piper.tp_copy.default"], target
    assert any((t or "").endswith("layers.3.self_attn.k_norm.weight") for t in sig.values())


def test_tp_plan_entries_for_absent_layers_are_left_out(tmp_path) -> None:
    """An all-MoE Qwen3 has no dense MLP: its plan's mlp.*_proj entries match nothing and
    are dropped (as transformers drops them), attention stays split."""
    from tests.hf_models import write_config

    spec = load_hf_model(write_config(tmp_path / "moe", "qwen3_moe"), seq_len=SEQ)
    kept = dict(spec.tp_plan)
    assert "model.layers.*.self_attn.q_proj" in kept
    assert not any(".mlp." in k for k in kept)


def test_a_config_saved_in_bf16_builds_fp32_master_weights(tmp_path, folders) -> None:
    """Published configs say `"torch_dtype": "bfloat16"` (the checkpoint's dtype), which
    transformers builds in: the run's precision decides instead (bf16-mixed keeps fp32
    master weights), and the cost model counts fp32 tensors."""
    cfg = json.loads((folders["llama"] / "config.json").read_text())
    cfg["torch_dtype"] = "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    spec = load_model(tmp_path, (), (("seq_len", SEQ),))
    assert {p.dtype for p in spec.build().parameters()} == {torch.float32}

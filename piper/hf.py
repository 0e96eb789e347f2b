"""Hugging Face models without a model file: `MODEL` is a `config.json` or a model folder.

With `piper.hf_experts`, the only modules of piper-plan that import transformers (the `hf`
extra). The model is `AutoModelForCausalLM.from_config`; its parallel structure is read as data from its config,
as transformers declares it: regions from `base_model_pp_plan` (the entry that is a list of
blocks gives `layer.0..N-1`, what runs before them `embed`, after them `head`, lm_head with
it), tensor parallelism from `base_model_tp_plan`, experts for expert parallelism from
transformers' experts interface (`piper.hf_experts`). The batch is `--batch-size` sequences of
`--seq-len` random tokens, with the next tokens as `shift_labels` (and `labels`): the model
computes the causal-LM loss itself, so no loss function is needed.
"""

from __future__ import annotations

import difflib
import fnmatch
import itertools
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from piper.errors import PiperError
from piper.hf_experts import adopt_experts, experts_notes, stored_as_of
from piper.model_file import DEFAULT_BATCH_SIZE, ModelSpec, default_loss, default_optimizer

DEFAULT_SEQ_LEN = 2048
"""Tokens per sequence when `--seq-len` is not given (capped by the config's context)."""

# base_model_tp_plan styles -> ours (piper.tensor_parallel); any other style is refused by
# name, and the model plans without tensor parallelism
TP_STYLES = {"colwise": "colwise", "rowwise": "rowwise", "colwise_rep": "colwise_rep",
             "colwise_gather_output": "colwise_rep", "rowwise_split_input": "rowwise_split",
             "replicated_with_grad_allreduce": "replicate"}


def is_hf_model(path: str | Path) -> bool:
    """A `config.json` file, or a folder holding one (what `save_pretrained` writes)."""
    p = Path(path)
    return (p.is_file() and p.suffix == ".json") or (p.is_dir() and (p / "config.json").is_file())


def load_hf_model(path: str | Path, model_args: tuple[tuple[str, Any], ...] = (),
                  seq_len: int | None = None) -> ModelSpec:
    """A `ModelSpec` for the Hugging Face model at `path`; `model_args` override config
    fields (`--model-arg num_hidden_layers=2`)."""
    try:
        import transformers
    except ImportError:
        raise PiperError(f"{path}: a Hugging Face model needs transformers: "
                         "pip install 'piper-plan[hf]'") from None
    p = Path(path)
    folder = p if p.is_dir() else p.parent
    config = _config(transformers, p, model_args)
    limit = getattr(config, "max_position_embeddings", None) or DEFAULT_SEQ_LEN
    seq = seq_len or min(DEFAULT_SEQ_LEN, limit)
    if seq > limit:
        raise PiperError(f"{path}: --seq-len {seq} is longer than the model's context "
                         f"(max_position_embeddings {limit})")
    vocab = int(config.vocab_size)
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    prefix = getattr(cls, "base_model_prefix", "") or ""
    tp_plan, notes = _tp_plan(config, prefix)
    if tp_plan:
        tp_plan += _head_plan(config, cls)
    with torch.device("meta"):
        shape = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    names = [n for n, _ in shape.named_modules()]
    # entries for kinds of layer this model does not have (the dense MLP of an all-MoE
    # config) are left out, as transformers leaves them; then where sequence parallelism
    # gathers, from the layers that are split
    tp_plan = tuple((k, v) for k, v in tp_plan if any(fnmatch.fnmatchcase(n, k) for n in names))
    if tp_plan:
        tp_plan += _sequence_entries(config, f"{prefix}." if prefix else "", tp_plan)
    notes += experts_notes(shape)
    weights = sorted(folder.glob("*.safetensors")) if p.is_dir() else []

    def build_model(**_applied: Any) -> nn.Module:  # model_args are in the config already
        # fp32 whatever dtype the checkpoint was saved in (published configs say bfloat16,
        # which transformers builds in): the run's precision policy decides what trains in
        # bf16, and bf16-mixed keeps fp32 master weights
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        model.config.use_cache = False
        adopt_experts(model)  # routed by piper, so expert parallelism can shard them
        return _with_regions(model, config)

    def example_batch(batch_size: int) -> tuple[dict[str, torch.Tensor], None]:
        return from_tokens(torch.randint(0, vocab, (batch_size, seq + 1)))

    def from_tokens(windows: torch.Tensor) -> tuple[dict[str, torch.Tensor], None]:
        # each position's target is the next token, given already shifted (`shift_labels`,
        # which transformers' causal-LM loss takes instead of shifting `labels` itself):
        # every token is a target, and a rank holding part of a sequence (context
        # parallelism) holds its tokens' targets, with no shift across its chunks
        ids, nxt = windows[:, :-1].contiguous(), windows[:, 1:].contiguous()
        return {"input_ids": ids, "labels": nxt, "shift_labels": nxt}, None

    return ModelSpec(
        path=str(path), model_args=model_args, build_model=build_model,
        example_batch=example_batch, from_tokens=from_tokens, loss_fn=default_loss,
        make_optimizer=default_optimizer,
        batch_size=DEFAULT_BATCH_SIZE, tp_plan=tp_plan,
        options=(("seq_len", seq),), weights=str(folder) if weights else None,
        notes=tuple(notes), index_attrs=("layer_idx",),
        stored_as=stored_as_of(config.model_type) if weights else None)


def first_sentence(e: BaseException) -> str:
    """An error's first sentence on one line: a message is shortened, not cut mid-word."""
    text = " ".join(str(e).split())
    cut = text.find(". ")
    return text if cut < 0 else text[:cut + 1]


def _nearest_model_type(transformers: Any, p: Path) -> str:
    """'; did you mean model_type X?' when the config names a type transformers lacks."""
    try:
        wanted = json.loads((p / "config.json").read_text()).get("model_type")
        known = list(transformers.models.auto.configuration_auto.CONFIG_MAPPING_NAMES)
    except Exception:  # noqa: BLE001 - a hint only
        return ""
    if not isinstance(wanted, str) or wanted in known:
        return ""
    near = difflib.get_close_matches(wanted, known, n=1)
    return f"; did you mean model_type {near[0]!r}?" if near else ""


def _config(transformers: Any, p: Path, model_args: tuple[tuple[str, Any], ...]) -> Any:
    try:
        config = transformers.AutoConfig.from_pretrained(str(p), local_files_only=True)
    except Exception as e:  # noqa: BLE001 - a config transformers cannot read
        raise PiperError(f"{p}: not a Hugging Face config transformers can read: "
                         f"{type(e).__name__}: {first_sentence(e).rstrip('.')}"
                         f"{_nearest_model_type(transformers, p)}") from None
    for key, value in model_args:
        if not hasattr(config, key):
            raise PiperError(f"{p}: --model-arg {key}: {type(config).__name__} has no "
                             f"field {key!r}")
        setattr(config, key, value)
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise PiperError(f"{p}: {type(config).__name__} has no causal-LM model in "
                         f"transformers {transformers.__version__}")
    return config


def _head_plan(config: Any, cls: type) -> tuple[tuple[str, str], ...]:
    """The causal LM's own `_tp_plan` beside its base model's (Llama's and Qwen's:
    `lm_head` column-parallel, its logits gathered), as transformers applies it: the output
    layer's vocabulary split over the group. Not where the head shares its weight with the
    embedding (`tie_word_embeddings`): the embedding stays whole, so the head must too."""
    if getattr(config, "tie_word_embeddings", False):
        return ()
    plan = getattr(cls, "_tp_plan", None) or {}
    return tuple((k, TP_STYLES[v]) for k, v in plan.items() if v in TP_STYLES)


def _tp_plan(config: Any, prefix: str) -> tuple[tuple[tuple[str, str], ...], list[str]]:
    """`base_model_tp_plan` in our styles, under the causal LM's base-model prefix (without
    sequence parallelism's module entries: `_sequence_entries`); empty (and a note why)
    when it has a style we do not run."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not plan:
        return (), [(f"tensor parallelism: off ({type(config).__name__} has no "
                    "base_model_tp_plan)")]
    odd = {k: v for k, v in plan.items() if v not in TP_STYLES}
    if odd:
        k, v = next(iter(odd.items()))
        return (), [(f"tensor parallelism: off (base_model_tp_plan gives {k} style {v!r}; "
                    f"supported: {', '.join(TP_STYLES)})")]
    under = f"{prefix}." if prefix else ""
    return tuple((f"{under}{k}", TP_STYLES[v]) for k, v in plan.items()), []


def _sequence_entries(config: Any, under: str, plan: tuple[tuple[str, str], ...]
                      ) -> tuple[tuple[str, str], ...]:
    """Where sequence parallelism gathers and splits in a Hugging Face decoder
    (`piper.tensor_parallel`'s module styles): the modules holding split layers (attention,
    MLP) are `sequence_block`s, since their code views q by the input's length; the first
    layer of the list `base_model_pp_plan` names splits the sequence, and the module after
    the list (the final norm) gathers it whole, so the decoder's own code (causal mask,
    rotary angles, position ids) still sees the whole sequence. None without a layer list
    followed by a module in `base_model_pp_plan`."""
    order = list(getattr(config, "base_model_pp_plan", None) or {})
    after = dict(itertools.pairwise(order))
    split = [k for k, v in plan if v in ("colwise", "rowwise")]
    blocks = sorted({k.rpartition(".")[0] for k in split})
    lists = {b.split(".*", 1)[0] for b in blocks if ".*" in b}
    if len(lists) != 1:
        return ()
    layers = lists.pop()
    if layers.removeprefix(under) not in after:
        return ()
    return (*((b, "sequence_block") for b in blocks), (f"{layers}.0", "sequence_split"),
            (f"{under}{after[layers.removeprefix(under)]}", "sequence_gather"))


def _with_regions(model: nn.Module, config: Any) -> nn.Module:
    """Regions from `base_model_pp_plan`: its list of blocks is the layers (automatic
    regions find one when the config has no plan)."""
    from piper.regions import annotate_automatically

    prefix = getattr(model, "base_model_prefix", "") or ""
    base = getattr(model, prefix, model) if prefix else model
    blocks = None
    for key in getattr(config, "base_model_pp_plan", None) or {}:
        if isinstance(getattr(base, key, None), nn.ModuleList):
            blocks = f"{prefix}.{key}" if base is not model else key
    model._piper_regions = annotate_automatically(model, blocks)  # type: ignore[assignment]
    return model

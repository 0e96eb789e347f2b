"""Automatic regions for untagged models, shared tags of annotate_modules, and the inputs and
outputs a captured model may have (dicts in, ModelOutput-like structures out)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch import nn

import piper
from piper.errors import PiperError
from piper.model_file import ModelSpec, default_loss
from piper.regions import find_blocks
from runtime.execute.stage_module import build_stage


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.fc(x)) * scale


class Scale(nn.Module):
    """Registered after the norm but called before the blocks."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(dim))
        self.register_buffer("inv", torch.arange(1, dim + 1).float(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w / self.inv.to(x.dtype)


class Positions(nn.Module):
    """No parameters (like a rotary table): glue, recomputed where it is used."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.arange(x.shape[1], dtype=x.dtype).unsqueeze(-1) / 10.0


@dataclass
class Out:
    logits: torch.Tensor
    extra: torch.Tensor


class Plain(nn.Module):
    """No tags: an embedding, a short list of other modules, the blocks, a norm, a head."""

    def __init__(self, dim: int = 8, vocab: int = 11, layers: int = 3) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.aux = nn.ModuleList([nn.Identity(), nn.ReLU()])  # different classes: not blocks
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.scale = Scale(dim)
        self.pos = Positions()
        self.out = nn.Linear(dim, vocab)

    def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> Out:
        x = self.embed(input_ids) * mask.unsqueeze(-1)
        s = self.scale(x)
        p = self.pos(input_ids)
        for b in self.blocks:
            x = b(x + p, s)
        logits = self.out(self.norm(x))
        return Out(logits=logits, extra=logits.mean(-1))


def spec_of(cls: type[nn.Module]) -> ModelSpec:
    def batch(b: int):
        ids = torch.randint(0, 11, (b, 5))
        return {"input_ids": ids, "mask": torch.ones(b, 5)}, ids
    return ModelSpec(path="inline", build_model=cls, example_batch=batch)


def test_longest_list_of_one_class_is_the_blocks() -> None:
    assert find_blocks(Plain()) == "blocks"


def test_no_list_of_blocks_is_an_input_error() -> None:
    with pytest.raises(PiperError, match="no nn.ModuleList of repeated blocks"):
        find_blocks(nn.Sequential(nn.Linear(2, 2)))


def test_untagged_model_gets_embed_layers_head_by_call_order() -> None:
    cap = piper.capture(spec_of(Plain), 2)
    assert cap.graph.names == ("embed", "layer.0", "layer.1", "layer.2", "head")
    assert cap.auto is not None
    # the scale is registered after the norm but runs before the blocks: embed
    assert cap.auto.embed == ["embed", "scale"] and cap.auto.head == ["norm", "out"]
    # the positions depend on the batch alone: each layer recomputes them, none sends them
    assert cap.free and not any(v in cap.free for f in cap.graph.flows for v in f.values)
    assert [(f.src, f.dst) for f in cap.graph.flows] == [(0, 1), (0, 2), (0, 3), (1, 2),
                                                         (2, 3), (3, 4)]
    assert cap.auto.describe() == ("regions: embed (2 modules), layer.0-2, head (2 modules) "
                                   "[automatic: blocks of blocks]")
    owner = {p: r.name for r in cap.graph.regions for p in r.params}
    assert owner["embed.weight"] == "embed" and owner["out.weight"] == "head"
    assert owner["blocks.1.fc.weight"] == "layer.1"


def test_tagged_model_keeps_its_own_regions() -> None:
    class Tagged(Plain):
        def forward(self, input_ids: torch.Tensor, mask: torch.Tensor) -> Out:
            with piper.annotate("all"):
                return super().forward(input_ids, mask)

    cap = piper.capture(spec_of(Tagged), 2)
    assert cap.graph.names == ("all",) and cap.auto is None


def test_annotate_modules_one_region_per_name_of_single_matches() -> None:
    def build() -> nn.Module:
        return piper.annotate_modules(Plain(), {"embed": "embed", "scale": "embed",
                                                "blocks.*": "layer", "norm": "head",
                                                "out": "head"})
    cap = piper.capture(spec_of(build), 2)
    assert cap.graph.names == ("embed", "layer.0", "layer.1", "layer.2", "head")


def test_output_structure_is_rebuilt_for_the_loss() -> None:
    cap = piper.capture(spec_of(Plain), 2)
    sm = build_stage(cap, set(range(len(cap.graph.regions))), torch.device("cpu"))
    model = Plain()
    params = dict(model.named_parameters())
    buffers = dict(model.named_buffers())
    torch.manual_seed(0)
    args, kwargs, _ = spec_of(Plain).example(2)
    flat = (*args, *kwargs.values())
    feed = [params[k] if kind == "param" else buffers[k] if kind == "buffer" else flat[k]
            for kind, k in sm.inputs]
    outs = dict(zip(sm.outputs, sm.module(*feed)))
    rebuilt = sm.model_output(outs)
    assert isinstance(rebuilt, Out)
    eager = model(*args, **kwargs)
    torch.testing.assert_close(rebuilt.logits, eager.logits)
    torch.testing.assert_close(rebuilt.extra, eager.extra)


def test_default_loss_prefers_the_models_own_loss() -> None:
    own = torch.tensor(1.5)
    assert default_loss({"loss": own, "logits": torch.zeros(2, 3)}, None) is own
    logits = torch.randn(4, 3)
    t = torch.tensor([0, 1, 2, 1])
    torch.testing.assert_close(default_loss((logits,), t),
                               torch.nn.functional.cross_entropy(logits, t))
    with pytest.raises(PiperError, match="define loss_fn"):
        default_loss({"logits": logits}, None)


def test_dict_inputs_must_be_batched_tensors() -> None:
    spec = ModelSpec(path="inline", build_model=Plain,
                     example_batch=lambda b: ({"input_ids": torch.zeros(b, 5).long(),
                                               "mask": 1.0}, None))
    with pytest.raises(PiperError, match="input 'mask' must be a tensor"):
        spec.example(2)

"""Capture for context parallelism: one rank's tokens, attention and positions rewritten,
and models whose ops cannot be split along the sequence refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest

from piper import context_parallel
from piper.capture import capture
from piper.dag import single_device_dag
from piper.directives import Replicate, ShardSequence, Split
from piper.errors import DirectiveError, PiperError
from piper.model_file import load_model_file
from piper.sharding import ModelSharding
from tests.conftest import ROOT

LLAMA = str(ROOT / "examples" / "llama.py")

MODEL = '''
import torch
import torch.nn.functional as F
from torch import nn

import piper

class Attn(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(32, 16)
        self.qkv = nn.Linear(16, 48)
        self.out = nn.Linear(16, 32)

    def forward(self, idx, mask=None):
        with piper.annotate("embed"):
            x = self.emb(idx)
        q, k, v = self.qkv(x).unsqueeze(1).chunk(3, dim=-1)
        t = idx.shape[1]
        {attention}
        return self.out(y.squeeze(1))

def build_model():
    return Attn()

def example_batch(batch_size):
    idx = torch.randint(0, 32, (batch_size, 8))
    {inputs}
    return inputs, idx

def loss_fn(out, targets):
    return F.cross_entropy(out.flatten(0, 1), targets.flatten())
'''


def _model(tmp_path: Path, attention: str, inputs: str = "inputs = idx") -> str:
    path = tmp_path / "attn.py"
    path.write_text(MODEL.format(attention=attention, inputs=inputs))
    return str(path)


def _targets(cap) -> list[str]:
    return [getattr(n.target, "__name__", str(n.target))
            for n in cap.program.graph_module.graph.nodes if n.op == "call_function"]


def test_llama_is_traced_on_its_share_with_ring_attention_and_rank_positions():
    spec = load_model_file(LLAMA, (("size", "tiny"),))
    cap = capture(spec, 2, ModelSharding(cp=2), exact=True)
    ops = _targets(cap)
    assert ops.count("attention") == 4 and "aten.scaled_dot_product_attention.default" \
        not in ops
    assert ops.count("rank_positions") == 8, "q and k rotary angles of every layer"
    assert cap.graph.value(cap.graph.values[0].name).shape == (2, 8, 32), "8 of 16 tokens"


def test_a_causal_mask_the_model_builds_is_dropped_and_others_are_refused(tmp_path):
    causal = _model(tmp_path, "m = torch.ones(t, t, dtype=torch.bool).tril()\n        "
                    "y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)")
    ops = _targets(capture(load_model_file(causal), 2, ModelSharding(cp=2), exact=True))
    assert "attention" in ops and not any("tril" in o for o in ops)
    wrong = _model(tmp_path, "m = torch.ones(t, t, dtype=torch.bool).triu()\n        "
                   "y = F.scaled_dot_product_attention(q, k, v, attn_mask=m)")
    with pytest.raises(PiperError, match="not the causal mask"):
        capture(load_model_file(wrong), 2, ModelSharding(cp=2), exact=True)
    padded = _model(tmp_path, "y = F.scaled_dot_product_attention(q, k, v, "
                    "attn_mask=mask[:, None, None, :])",
                    "inputs = (idx, torch.ones(batch_size, 8, dtype=torch.bool))")
    with pytest.raises(PiperError, match="computed from the inputs"):
        capture(load_model_file(padded), 2, ModelSharding(cp=2), exact=True)


def test_attention_written_out_by_hand_is_refused_naming_the_op(tmp_path):
    eager = _model(tmp_path, "s = (q @ k.transpose(-1, -2)).softmax(-1)\n        y = s @ v")
    with pytest.raises(PiperError, match=r"op matmul.* 4 x 4 matrix .*hand"):
        capture(load_model_file(eager), 2, ModelSharding(cp=2))


def test_a_sequence_that_does_not_split_into_balanced_chunks_is_refused():
    spec = load_model_file(LLAMA, (("size", "tiny"), ("seq", 12)))
    with pytest.raises(PiperError, match="2 x 4 equal chunks"):
        capture(spec, 2, ModelSharding(cp=4))
    assert context_parallel.check_length(12, 3) is None


def test_shard_sequence_needs_replicate_first_and_a_known_attention():
    dag = single_device_dag(capture(load_model_file(LLAMA, (("size", "tiny"),)), 1).graph)
    dag = Split(2).apply(dag, 0)
    with pytest.raises(DirectiveError, match="needs Replicate before it"):
        ShardSequence(2).apply(dag, 1)
    replicated = Replicate(1).apply(dag, 1)
    with pytest.raises(DirectiveError, match="attention must be one of ring, all_gather"):
        ShardSequence(2, attention="ulysses").apply(replicated, 2)
    out = ShardSequence(2, attention="all_gather").apply(replicated, 2)
    assert (out.sharding.cp, out.sharding.cp_mode, out.world_size) == (2, "all_gather", 2)
    assert eval(repr(ShardSequence(2, attention="all_gather"))) == \
        ShardSequence(2, attention="all_gather")

"""piper: the Piper IR — region tags, capture, the Training DAG, directives and Programs."""

from piper.annotate import annotate, annotate_modules
from piper.capture import Captured, ModelGraph, capture
from piper.dag import Kind, Node, Stage, TrainingDAG, single_device_dag, verify
from piper.directives import (
    Directive,
    Order,
    Place,
    Recompute,
    Replicate,
    Shard,
    ShardTensor,
    Split,
    SplitBackward,
    Stream,
)
from piper.errors import DirectiveError, PiperError
from piper.moe import Experts
from piper.program import Program

__all__ = [
    "Captured", "Directive", "DirectiveError", "Experts", "Kind", "ModelGraph", "Node", "Order",
    "PiperError", "Place", "Program", "Recompute", "Replicate", "Shard", "ShardTensor",
    "Split", "SplitBackward", "Stage", "Stream",
    "TrainingDAG", "annotate", "annotate_modules", "capture", "single_device_dag", "verify",
]

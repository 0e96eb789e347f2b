"""Directives: small frozen values, each a DAG rewrite. One module per family."""

from piper.directives.base import Directive, from_dict
from piper.directives.order import Order
from piper.directives.place import Place
from piper.directives.recompute import Recompute
from piper.directives.replicate import Replicate
from piper.directives.shard import Shard
from piper.directives.shard_sequence import ShardSequence
from piper.directives.shard_tensor import ShardTensor
from piper.directives.split import Split
from piper.directives.split_backward import SplitBackward
from piper.directives.stream import Stream

__all__ = ["Directive", "Order", "Place", "Recompute", "Replicate", "Shard", "ShardSequence", "ShardTensor",
           "Split", "SplitBackward", "Stream", "from_dict"]

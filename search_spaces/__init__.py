"""search_spaces: spaces of directive Programs, each sampled by a trial or enumerated."""

from search_spaces.base import Infeasible, SearchSpace
from search_spaces.partition import balanced_stages
from search_spaces.pipeline import PipelineSpace

__all__ = ["Infeasible", "PipelineSpace", "SearchSpace", "balanced_stages"]

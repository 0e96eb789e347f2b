"""cost_models: cluster specs, analytical compute/comm/memory costs, and the Plan simulator."""

from cost_models.analytical import ModelCosts, model_costs
from cost_models.cluster import CATALOG, ClusterSpec, load_cluster, to_toml
from cost_models.simulator import Prediction, predicted_json, simulate
from cost_models.task_costs import TaskCosts, task_costs

__all__ = [
    "CATALOG", "ClusterSpec", "ModelCosts", "Prediction", "TaskCosts", "load_cluster",
    "model_costs", "predicted_json", "simulate", "task_costs", "to_toml",
]

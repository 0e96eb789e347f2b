"""planner: the search loop, the `piper-plan` CLI, reports and export."""

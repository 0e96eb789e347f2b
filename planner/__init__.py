"""planner: `search` (the space, samplers, the Optuna / Ray Tune loop, scoring, --measure),
`machine` (probing this machine for the cost model), `report` (what a person reads and the
written outputs), `commands` (one module per subcommand) and `cli` (the parser)."""

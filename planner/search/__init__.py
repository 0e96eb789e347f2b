"""The search: the space, samplers, the Optuna loop and its Ray Tune backend, scoring by
simulation (evaluate, cache, repeats, replicas, memory bound), --measure and strategy flags.
May import piper, search_spaces, runtime and cost_models; never the reports or commands."""

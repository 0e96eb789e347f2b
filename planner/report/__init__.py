"""What a person reads from a search: tables, summaries, advice, idle time, figures, traces,
the written outputs (best_strategy.py, trials.csv, ...) and studies read back.
May import planner.search and every package below the planner."""

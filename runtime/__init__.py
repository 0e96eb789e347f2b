"""runtime: from a Program to real training. `train` (what training is), `lowering` (the Plan
of every rank), `execute` (a rank running its Plan), `cluster` (where ranks run: Ray, local
processes, torchrun), each importing only those before it."""

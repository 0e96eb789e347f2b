"""Executing one rank's share of a Plan for real: stage modules, the task loop, P2P, streams,
ZeRO and gradient buckets, recompute, split backwards, the memory ledger, evaluation.
May import piper, runtime.train and runtime.lowering; never Ray or the cluster."""

"""Measuring this machine for the cost model: probes hosted on real worker processes and the
fit of a cluster file (`piper-plan profile`).
May import piper, runtime and cost_models."""

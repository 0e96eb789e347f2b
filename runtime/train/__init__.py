"""What training means whatever the strategy: the run's config, data and blends, the LR
schedule and clipping, checkpoints and weights files, metrics, the single-device reference.
May import piper only: every other runtime package builds on it."""

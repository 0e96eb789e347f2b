"""A hand-written 1F1B strategy for the tiny GPT on two pipeline ranks, four microbatches.

    piper-plan run examples/gpt.py --model-arg size=tiny --gpus 2 --device cpu \
        --strategy examples/strategies/gpt_tiny_1f1b.py --check

Stage 0 holds the embedding and the first two layers, stage 1 the rest. Device 0 warms up
with one forward, then alternates; device 1 runs each microbatch's forward and backward
back to back.
"""

from piper import Order, Place, Program, Split


def strategy() -> Program:
    return Program(
        [
            Place(("embed", "layer.0", "layer.1"), stage=0, device=0),
            Place(("layer.2", "layer.3", "head"), stage=1, device=1),
            Split(4),
            Order(0, "F0.0 F0.1 B0.0 F0.2 B0.1 F0.3 B0.2 B0.3"),
            Order(1, "F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3"),
        ],
        name="1f1b",
    )

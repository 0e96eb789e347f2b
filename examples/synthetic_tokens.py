"""Write a token file with structure a model can learn, for trying `piper-plan run --data`
without a corpus: flat uint16 ids (uint32 above 65,536 ids), as nanoGPT's `prepare.py` and
Megatron's preprocessing write real ones.

    python examples/synthetic_tokens.py tokens.bin --vocab 2048 [--tokens 2000000] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from runtime.train.data import write_synthetic_tokens


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--vocab", type=int, required=True, help="the model's vocabulary size")
    ap.add_argument("--tokens", type=int, default=2_000_000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    write_synthetic_tokens(args.out, args.tokens, args.vocab, args.seed)
    print(f"wrote {args.out}: {args.tokens:,} tokens, ids below {args.vocab}")


if __name__ == "__main__":
    main()

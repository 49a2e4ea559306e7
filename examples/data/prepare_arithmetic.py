"""Write a GSM8K-format synthetic arithmetic set, offline: ``{question, answer: "... #### N"}`` rows turned into
verl prompt rows (``prompt``, ``data_source``, ``reward_model.ground_truth``, ``extra_info``).

    python examples/data/prepare_arithmetic.py --out-dir data/arith [--num-train 512 --num-val 64 --seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'


def make_row(rng: random.Random, index: int, split: str) -> dict:
    a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
    question = f"Tom has {a} apples. He buys {b} more, then gives away a {c}th of {c * b} pears. How many apples?"
    answer = a + b
    solution = f"Tom starts with {a} apples and buys {b}, so {a} + {b} = {answer}. #### {answer}"
    return {
        "prompt": f"{question} {INSTRUCTION}",
        "data_source": "openai/gsm8k",
        "reward_model": {"ground_truth": str(answer), "style": "rule"},
        "extra_info": {"split": split, "index": index, "answer": solution},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out-dir", type=Path, required=True)
    p.add_argument("--num-train", type=int, default=512)
    p.add_argument("--num-val", type=int, default=64)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, n in (("train", args.num_train), ("val", args.num_val)):
        rows = [make_row(rng, i, split) for i in range(n)]
        (args.out_dir / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"wrote {args.num_train} train / {args.num_val} val rows to {args.out_dir}")


if __name__ == "__main__":
    main()

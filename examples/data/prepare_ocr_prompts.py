"""Write a small text-rendering prompt set for the OCR reward, in the verl / flow_grpo format.

Each prompt asks for a scene with a short quoted text; the ground truth is the quoted text, as in flow_grpo's
OCR task. Deterministic for a given --seed. Usage:

    python examples/data/prepare_ocr_prompts.py --out-dir data/ocr [--num-train 64 --num-val 16 --format jsonl]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = ["HELLO", "OPEN", "CAFE", "SALE", "EXIT", "STOP", "RL", "FLOW", "GRPO", "RAY", "TEXT", "SIGN",
         "PIZZA", "BOOKS", "TRAIN", "LUCKY", "NORTH", "SOUTH", "DREAM", "SHOP"]
SCENES = ["A wooden sign that says \"{t}\"", "A neon light reading \"{t}\" on a brick wall",
          "A chalkboard with the words \"{t}\"", "A street banner printed with \"{t}\"",
          "A coffee cup with \"{t}\" written on it", "A book cover titled \"{t}\""]


def make_rows(n: int, rng: random.Random, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        words = rng.sample(WORDS, k=rng.choice([1, 1, 2]))
        if rng.random() < 0.4:
            words.append(str(rng.randint(1, 99)))
        text = " ".join(words)
        rows.append({
            "prompt": rng.choice(SCENES).format(t=text),
            "data_source": "ocr",
            "reward_model": {"ground_truth": text, "style": "rule"},
            "extra_info": {"split": split, "index": i},
        })
    return rows


def write(rows: list[dict], path: Path, fmt: str) -> None:
    if fmt == "jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    else:
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.Table.from_pylist(rows), path)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out-dir", default="data/ocr")
    ap.add_argument("--num-train", type=int, default=64)
    ap.add_argument("--num-val", type=int, default=16)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--format", choices=["jsonl", "parquet"], default="jsonl")
    args = ap.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for split, n in (("train", args.num_train), ("val", args.num_val)):
        path = out / f"{split}.{args.format}"
        write(make_rows(n, rng, split), path, args.format)
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()

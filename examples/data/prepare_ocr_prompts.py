"""Write a small text-rendering prompt set for the OCR reward, in the verl / flow_grpo format.

Each prompt asks for a scene with a short quoted text; the ground truth is the quoted text, as in flow_grpo's
OCR task. Deterministic for a given --seed. Usage:

    python examples/data/prepare_ocr_prompts.py --out-dir data/ocr [--num-train 64 --num-val 16 --format jsonl]

``--vocab tiny_text_bimodal`` writes prompts in the vocabulary of ``tiny:qwen_image_text_bimodal`` instead (the CPU
default of the main job): its template (``Text "K4"``) over the 2-character words of its alphabet; train rows from
the words it was pre-trained on, validation rows from the words it never saw (``prompts.json``'s ``val``).
``--vocab tiny_text`` does the same for ``tiny:qwen_image_text`` (2- and 3-character words).
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
from pathlib import Path

_WEIGHTS = Path(__file__).resolve().parents[2] / "omni_async/models/weights"
# --vocab name -> the shipped renderer whose prompts.json (template, alphabet, word lengths, held-out words) it uses
TINY_VOCABS = {
    "tiny_text": _WEIGHTS / "tiny_qwen_image_text/prompts.json",
    "tiny_text_bimodal": _WEIGHTS / "tiny_qwen_image_text_bimodal/prompts.json",
}

WORDS = [
    "HELLO",
    "OPEN",
    "CAFE",
    "SALE",
    "EXIT",
    "STOP",
    "RL",
    "FLOW",
    "GRPO",
    "RAY",
    "TEXT",
    "SIGN",
    "PIZZA",
    "BOOKS",
    "TRAIN",
    "LUCKY",
    "NORTH",
    "SOUTH",
    "DREAM",
    "SHOP",
]
SCENES = [
    'A wooden sign that says "{t}"',
    'A neon light reading "{t}" on a brick wall',
    'A chalkboard with the words "{t}"',
    'A street banner printed with "{t}"',
    'A coffee cup with "{t}" written on it',
    'A book cover titled "{t}"',
]


def make_rows(n: int, rng: random.Random, split: str) -> list[dict]:
    rows = []
    for i in range(n):
        words = rng.sample(WORDS, k=rng.choice([1, 1, 2]))
        if rng.random() < 0.4:
            words.append(str(rng.randint(1, 99)))
        text = " ".join(words)
        rows.append(
            {
                "prompt": rng.choice(SCENES).format(t=text),
                "data_source": "ocr",
                "reward_model": {"ground_truth": text, "style": "rule"},
                "extra_info": {"split": split, "index": i},
            }
        )
    return rows


def make_tiny_text_rows(n: int, rng: random.Random, split: str, meta: dict) -> list[dict]:
    """Rows for a shipped tiny text renderer: its pre-training words for ``train``, its held-out words for ``val``."""
    held_out = set(meta["val"])
    if split == "val":
        pool = sorted(held_out)
    else:
        pool = ["".join(p) for k in meta["lengths"] for p in itertools.product(meta["alphabet"], repeat=k)]
        pool = [w for w in pool if w not in held_out]
    return [
        {
            "prompt": meta["template"].format(text=w),
            "data_source": "ocr",
            "reward_model": {"ground_truth": w, "style": "rule"},
            "extra_info": {"split": split, "index": i},
        }
        for i, w in enumerate(rng.sample(pool, k=min(n, len(pool))))
    ]


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
    ap.add_argument(
        "--vocab",
        choices=["scenes", *TINY_VOCABS],
        default="scenes",
        help="scenes: sign/banner scenes with words; tiny_text_bimodal / tiny_text: the strings of "
        "tiny:qwen_image_text_bimodal / tiny:qwen_image_text",
    )
    args = ap.parse_args(argv)

    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(args.seed)
    for split, n in (("train", args.num_train), ("val", args.num_val)):
        path = out / f"{split}.{args.format}"
        if args.vocab in TINY_VOCABS:
            rows = make_tiny_text_rows(n, rng, split, json.loads(TINY_VOCABS[args.vocab].read_text()))
        else:
            rows = make_rows(n, rng, split)
        write(rows, path, args.format)
        print(f"wrote {n} rows to {path}")


if __name__ == "__main__":
    main()

"""Write a tiny image-edit prompt set in verl-omni's columns (its ``examples/flowgrpo_trainer/qwen_image_edit/
prepare_data.py``): ``examples/data/qwen_image_edit/{train,test}.parquet`` is made by this script with the defaults.

Each row asks to edit one input image: a coloured shape on a plain background, drawn here (no download), letterboxed
onto a square canvas as verl-omni's converter does, stored as PNG bytes in ``images`` (``[{"bytes": ...}]``), the
instruction after ``Picture 1: <image>`` in the user turn, the pipeline's system prompt before it, the instruction
as ``reward_model.ground_truth``. Deterministic. Usage:

    python examples/data/prepare_qwen_image_edit.py [--out-dir examples/data/qwen_image_edit --size 32]

``--images-from DIR`` converts verl-omni's input layout instead (``DIR/{train,test}.jsonl`` lines
``{"prompt": ..., "image": <file under DIR/images>}``).
"""

from __future__ import annotations

import argparse
import io
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image, ImageDraw, ImageOps

# verl-omni's SYSTEM_PROMPT (the same words as the Qwen-Image-Edit pipelines' own template)
SYSTEM_PROMPT = (
    "Describe the key features of the input image "
    "(color, shape, size, texture, objects, background), then explain how the user's "
    "text instruction should alter or modify the image. Generate a new image that meets "
    "the user's requirements while maintaining consistency with the original input where "
    "appropriate."
)
SHAPES = [("red", "square"), ("blue", "circle"), ("green", "square"), ("yellow", "circle"), ("white", "square")]
EDITS = ["Change the background to blue", "Make the shape larger", "Turn it upside down", "Add a black border"]


def _letterboxed_png(image: Image.Image, size: int) -> bytes:
    """verl-omni's ``_load_image``: fit inside ``size``², centred on a white square canvas, PNG."""
    image = ImageOps.contain(image.convert("RGB"), (size, size), method=Image.Resampling.LANCZOS)
    canvas = Image.new("RGB", (size, size), color=(255, 255, 255))
    canvas.paste(image, ((size - image.width) // 2, (size - image.height) // 2))
    buffer = io.BytesIO()
    canvas.save(buffer, format="PNG")
    return buffer.getvalue()


def _drawn(color: str, shape: str, size: int) -> Image.Image:
    img = Image.new("RGB", (size, size + size // 4), "gray")  # not square: letterboxing applies
    draw = ImageDraw.Draw(img)
    box = (size // 4, size // 4, 3 * size // 4, 3 * size // 4)
    (draw.rectangle if shape == "square" else draw.ellipse)(box, fill=color)
    return img


def row(split: str, index: int, instruction: str, png: bytes, image_name: str) -> dict:
    return {
        "data_source": "image_edit",
        "prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": f"Picture 1: <image>{instruction}"},
        ],
        "negative_prompt": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": "Picture 1: <image> "},
        ],
        "ability": "image_edit",
        "images": [{"bytes": png}],
        "reward_model": {"style": "model", "ground_truth": instruction},
        "extra_info": {"split": split, "index": index, "instruction": instruction, "image": image_name},
    }


def drawn_rows(split: str, count: int, offset: int, size: int) -> list[dict]:
    out = []
    for i in range(count):
        color, shape = SHAPES[(offset + i) % len(SHAPES)]
        instruction = EDITS[(offset + i) % len(EDITS)]
        png = _letterboxed_png(_drawn(color, shape, size), size)
        out.append(row(split, i, instruction, png, f"{color}_{shape}.png"))
    return out


def converted_rows(input_dir: Path, split: str, size: int) -> list[dict]:
    out = []
    for i, line in enumerate((input_dir / f"{split}.jsonl").read_text().splitlines()):
        example = json.loads(line)
        with Image.open(input_dir / "images" / example["image"]) as img:
            png = _letterboxed_png(img, size)
        out.append(row(split, i, str(example["prompt"]), png, str(example["image"])))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "qwen_image_edit")
    parser.add_argument("--size", type=int, default=32, help="the square canvas, pixels (the output's size)")
    parser.add_argument("--num-train", type=int, default=4)
    parser.add_argument("--num-test", type=int, default=2)
    parser.add_argument("--images-from", type=Path, default=None)
    args = parser.parse_args()
    args.out_dir.mkdir(parents=True, exist_ok=True)
    for split, count, offset in (("train", args.num_train, 0), ("test", args.num_test, args.num_train)):
        if args.images_from is not None:
            rows = converted_rows(args.images_from, split, args.size)
        else:
            rows = drawn_rows(split, count, offset, args.size)
        pq.write_table(pa.Table.from_pylist(rows), args.out_dir / f"{split}.parquet")
        print(f"{args.out_dir / split}.parquet: {len(rows)} rows")


if __name__ == "__main__":
    main()

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from omni_async.trainer.dataset import DatasetError, PromptSampler, load_prompts

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("fmt", ["jsonl", "parquet"])
def test_prep_script_round_trip(tmp_path, fmt):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/data/prepare_ocr_prompts.py"),
            "--out-dir",
            str(tmp_path),
            "--num-train",
            "12",
            "--num-val",
            "4",
            "--format",
            fmt,
        ],
        check=True,
        capture_output=True,
    )
    train, val = load_prompts(str(tmp_path / f"train.{fmt}")), load_prompts([str(tmp_path / f"val.{fmt}")])
    assert (len(train), len(val)) == (12, 4)
    for row in train:
        # flow_grpo's OCR convention: the ground truth is the quoted text of the prompt.
        assert f'"{row.ground_truth}"' in row.prompt and row.data_source == "ocr"
        assert row.extra_info["split"] == "train"


def test_chat_form_prompt(tmp_path):
    p = tmp_path / "chat.jsonl"
    p.write_text(
        json.dumps(
            {
                "prompt": [{"role": "system", "content": "be nice"}, {"role": "user", "content": "hi"}],
                "data_source": "x",
                "reward_model": {"ground_truth": "1"},
            }
        )
        + "\n"
    )
    assert load_prompts(str(p))[0].prompt == "hi"


@pytest.mark.parametrize(
    "row,field",
    [
        ({"data_source": "ocr", "reward_model": {"ground_truth": "A"}}, "'prompt'"),
        ({"prompt": "", "data_source": "ocr", "reward_model": {"ground_truth": "A"}}, "'prompt'"),
        ({"prompt": "x", "reward_model": {"ground_truth": "A"}}, "'data_source'"),
        ({"prompt": "x", "data_source": "ocr", "reward_model": {}}, "'reward_model.ground_truth'"),
        (
            {"prompt": "x", "data_source": "ocr", "reward_model": {"ground_truth": "A"}, "extra_info": [1]},
            "'extra_info'",
        ),
    ],
)
def test_bad_row_names_file_row_field(tmp_path, row, field):
    good = {"prompt": "ok", "data_source": "ocr", "reward_model": {"ground_truth": "A"}}
    p = tmp_path / "bad.jsonl"
    p.write_text(json.dumps(good) + "\n" + json.dumps(good) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DatasetError) as exc:
        load_prompts(str(p))
    assert f"{p}:row 3" in str(exc.value) and field in str(exc.value)


def test_bad_json_and_missing_file(tmp_path):
    p = tmp_path / "broken.jsonl"
    p.write_text('{"prompt": "x"\n')
    with pytest.raises(DatasetError, match="row 1: not valid JSON"):
        load_prompts(str(p))
    with pytest.raises(DatasetError, match="file not found"):
        load_prompts(str(tmp_path / "nope.jsonl"))


def test_sampler_resumes_exactly(tmp_path):
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "examples/data/prepare_ocr_prompts.py"),
            "--out-dir",
            str(tmp_path),
            "--num-train",
            "10",
            "--num-val",
            "1",
        ],
        check=True,
        capture_output=True,
    )
    rows = load_prompts(str(tmp_path / "train.jsonl"))
    a = PromptSampler(rows, 4, seed=3)
    seen = [a.next_batch() for _ in range(3)]  # crosses an epoch boundary (10 rows, drop_last)
    assert seen[0] != seen[2]
    state = a.state_dict()
    expected = [a.next_batch() for _ in range(4)]
    b = PromptSampler(rows, 4, seed=3)
    b.load_state_dict(state)
    assert [b.next_batch() for _ in range(4)] == expected
    with pytest.raises(DatasetError, match="train_batch_size"):
        PromptSampler(rows, 11)

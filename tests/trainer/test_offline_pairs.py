"""Offline Diffusion-DPO's data (``trainer.offline_pairs``): verl-omni's OfflineDPODataset columns read with this
project's parquet reader, the shipped tiny dataset included; each pair a group of a chosen and a rejected scored
sample; bad rows named with their file, row and column; offline keys refused where they do not fit. No Ray."""

from __future__ import annotations

import io
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from helpers import SMALL_LORA

from omni_async.config.overrides import OverrideError
from omni_async.trainer.config import ConfigError, compose, validate
from omni_async.trainer.dataset import DatasetError
from omni_async.trainer.offline_pairs import load_pairs, pair_groups

SHIPPED = Path(__file__).resolve().parents[2] / "examples/data/offline_dpo"


def saved(t: torch.Tensor) -> bytes:
    buf = io.BytesIO()
    torch.save(t, buf)
    return buf.getvalue()


def row(**changes) -> dict:
    r = {
        "prompt": [{"role": "system", "content": "s"}, {"role": "user", "content": "a red circle"}],
        "img_win": "w.png",
        "img_lose": "l.png",
        "img_win_latents": saved(torch.ones(2, 2, 2)),
        "img_lose_latents": saved(torch.zeros(2, 2, 2)),
        "prompt_embeds": saved(torch.arange(12.0).reshape(4, 3)),
        "prompt_embeds_mask": saved(torch.tensor([1, 1, 1, 0], dtype=torch.int32)),  # one padding token
        "pooled_prompt_embeds": saved(torch.ones(5)),
        "win_score": 0.9,
        "lose_score": 0.2,
    }
    return {**r, **changes}


def write(tmp_path: Path, *rows: dict) -> Path:
    path = tmp_path / "pairs.parquet"
    pq.write_table(pa.Table.from_pylist(list(rows)), path)
    return path


def test_a_row_is_a_group_of_its_chosen_then_rejected_sample_scored_and_unpadded(tmp_path):
    (pair,) = load_pairs(str(write(tmp_path, row())))
    assert pair.row.prompt == "a red circle" and pair.row.data_source == "offline_dpo"  # the user turn; the default
    assert pair.conditioning["prompt_embeds"].shape == (3, 3)  # trimmed to its mask's tokens, as a rollout's
    (group,) = pair_groups([pair], draw=5, seed=0)
    chosen, rejected = group.samples
    assert chosen.uid == rejected.uid and group.done
    assert (chosen.outcome.score, rejected.outcome.score) == (0.9, 0.2)
    assert chosen.result.latents_clean.sum() == 8 and rejected.result.latents_clean.sum() == 0
    assert chosen.seed != rejected.seed and pair_groups([pair], draw=5, seed=0)[0].samples[0].seed == chosen.seed
    assert pair_groups([pair], draw=6, seed=0)[0].uid != group.uid  # drawn again in a later epoch: a new group


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"win_score": 0.1}, "win_score 0.1 < lose_score 0.2"),
        ({"img_win_latents": None}, "'img_win_latents' is empty"),
        ({"prompt_embeds": saved({"not": "a tensor"})}, "'prompt_embeds' holds dict"),
    ],
)
def test_a_bad_row_is_named_with_its_file_row_and_column(tmp_path, changes, words):
    path = write(tmp_path, row(), row(**changes))
    with pytest.raises(DatasetError, match=rf"pairs.parquet:row 2: .*{words}"):
        load_pairs(str(path))


def test_missing_columns_and_a_prompt_file_are_named(tmp_path):
    r = row()
    del r["pooled_prompt_embeds"]
    with pytest.raises(
        DatasetError, match=r"missing verl-omni OfflineDPODataset column\(s\) \['pooled_prompt_embeds'\]"
    ):
        load_pairs(str(write(tmp_path, r)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "p", "data_source": "x", "reward_model": {"ground_truth": ""}}\n')
    with pytest.raises(DatasetError, match="use a .parquet file"):
        load_pairs(str(prompts))


def test_the_shipped_pairs_are_tiny_sd3s_at_32px_with_cfg():
    pairs = load_pairs(str(SHIPPED / "train.parquet"))
    assert len(pairs) == 4 and len(load_pairs(str(SHIPPED / "test.parquet"))) == 2
    for p in pairs:
        assert p.scores == (1.0, 0.0) and all(i.exists() for i in p.images)
        assert p.latents[0].shape == p.latents[1].shape and not torch.equal(*p.latents)
        assert {"negative_prompt_embeds", "negative_pooled_prompt_embeds"} <= set(p.conditioning)  # CFG 4


def test_offline_keys_are_refused_where_they_do_not_fit():
    base = ["data.train_files=x.parquet", *SMALL_LORA]
    dpo = [
        "algorithm.trainer_type=direct_preference",
        "algorithm.paired_preference=true",
        "actor_rollout_ref.model.algorithm=dpo",
        "actor_rollout_ref.model.model_type=diffusion_dpo_model",
        "algorithm.sample_source=offline",
    ]
    cfg = validate(compose([*base, *dpo, "data.custom_cls.name=OfflineDPODataset"]))
    assert cfg.algorithm.sample_source == "offline"
    with pytest.raises(OverrideError, match=r"data.custom_cls.name.*sample_source=offline"):
        compose([*base, "data.custom_cls.name=OfflineDPODataset"])  # online: prompt rows
    with pytest.raises(ConfigError, match=r"async_reward.fully_async.*no rollout"):
        validate(compose([*base, *dpo, "async_reward.fully_async=true"]))
    # verl-omni's training-engine CFG scale is the one offline DPO trains with
    offline_cfg = validate(compose([*base, *dpo, "actor_rollout_ref.model.pipeline.guidance_scale=4.0"]))
    assert offline_cfg.actor_rollout_ref.rollout.pipeline.guidance_scale == 4.0

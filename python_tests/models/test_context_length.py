"""The model's context as the checks before loading read it from config.json: max_position_embeddings,
stretched by a YaRN / linear / dynamic RoPE scaling (Qwen3's model cards add YaRN with factor 4 over
32,768 positions for contexts past the trained one, keeping max_position_embeddings at 40,960)."""

import json

import pytest

from verl_fast.models.checks import check_folder, context_length

QWEN3_4B = {"model_type": "qwen3", "max_position_embeddings": 40960, "rope_theta": 1000000}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}


@pytest.mark.parametrize("config, expected", [
    (QWEN3_4B, 40960),
    ({**QWEN3_4B, "rope_scaling": YARN}, 131072),
    ({**QWEN3_4B, "rope_parameters": {**YARN, "rope_theta": 1e6}}, 131072),  # transformers 5's form
    ({**QWEN3_4B, "rope_scaling": {"type": "yarn", "factor": 2}}, 81920),  # older key, no original: the config's
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "linear", "factor": 2.0}}, 81920),
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "dynamic", "factor": 3.0}}, 122880),
    # llama3's and longrope's configs state the stretched length already
    ({"max_position_embeddings": 131072, "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                                           "original_max_position_embeddings": 8192}}, 131072),
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": 0.5}}, 40960),  # never shrinks
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": True}}, 40960),
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": "4"}}, 40960),
    ({**QWEN3_4B, "rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0}},
     163840),
    ({**QWEN3_4B, "rope_scaling": None}, 40960),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}, "max_position_embeddings": 4096}, 4096),
    ({"text_config": {"max_position_embeddings": 32768, "rope_scaling": YARN}}, 131072),
    ({"n_positions": 1024}, 1024),
    ({}, None),
])
def test_context_length(config, expected):
    assert context_length(config) == expected


def _folder(tmp_path, config):
    (tmp_path / "config.json").write_text(json.dumps(config))
    return tmp_path


def test_a_65k_rollout_fits_a_yarn_stretched_qwen3(tmp_path):
    check_folder(_folder(tmp_path, {**QWEN3_4B, "rope_scaling": YARN}), "actor.model_name", 65024)


@pytest.mark.parametrize("config, tokens, context", [
    (QWEN3_4B, 65024, 40960),
    ({**QWEN3_4B, "rope_scaling": YARN}, 131072, 131072),
])
def test_past_the_context_is_refused_in_one_line(tmp_path, config, tokens, context):
    with pytest.raises(ValueError, match=rf"^rollout\.max_new_tokens={tokens} does not fit actor\.model_name's "
                                         rf"context of {context} positions") as err:
        check_folder(_folder(tmp_path, config), "actor.model_name", tokens)
    assert "\n" not in str(err.value)

"""DPO pairs in TRL's conversational format (prompt / chosen / rejected as lists of {role, content})
go through the chat template: the prompt with its generation prompt, each response as the text the
template puts after it (with its end-of-turn tokens), then EOS; and such pairs train."""

import pytest
import torch

from tiny_models import build_tokenizer, save_tiny_model
from verl_fast.data import RLDataProcessor


def chat_pair(q, good, bad):
    return {"prompt": [{"role": "user", "content": q}], "chosen": [{"role": "assistant", "content": good}],
            "rejected": [{"role": "assistant", "content": bad}]}


@pytest.mark.parametrize("system", [None, "Answer with a number."])
def test_chat_pairs_are_the_template_of_the_whole_conversation(system):
    tok = build_tokenizer()
    proc = RLDataProcessor(tok, max_prompt_length=64, max_response_length=32, system_prompt=system)
    (pair,) = proc.build_dpo_dataset([chat_pair("What is 1 + 2?", "3", "the answer is 7")])
    head = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": "What is 1 + 2?"}]
    prompt_text = tok.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
    for response, text, ids in [("3", pair.chosen, pair.chosen_ids), ("the answer is 7", pair.rejected, pair.rejected_ids)]:
        whole = tok.apply_chat_template(head + [{"role": "assistant", "content": response}], tokenize=False)
        assert pair.prompt == prompt_text and prompt_text + text == whole
        assert text == f"{response}<|im_end|>\n"  # ChatML: the turn's content, then its end
        assert ids == tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        assert tok.decode(pair.prompt_ids + ids) == whole + tok.eos_token
    assert pair.prompt_ids == tok(prompt_text, add_special_tokens=False)["input_ids"]


def test_string_pairs_keep_their_text_and_mixed_forms_work():
    tok = build_tokenizer()
    proc = RLDataProcessor(tok, max_prompt_length=64, max_response_length=32)
    string, mixed = proc.build_dpo_dataset([
        {"prompt": "What is 1 + 2?", "chosen": "3", "rejected": "7"},
        {"prompt": "What is 1 + 2?", "chosen": [{"role": "assistant", "content": "3"}], "rejected": "7"}])
    assert (string.chosen, string.rejected) == ("3", "7")
    assert string.chosen_ids == tok("3", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert (mixed.chosen, mixed.rejected) == ("3<|im_end|>\n", "7") and mixed.prompt == string.prompt


@pytest.mark.parametrize("bad", [[], [{"role": "assistant"}], [{"content": 3}], 5, [["x"]]])
def test_malformed_chat_responses_name_the_key(bad):
    proc = RLDataProcessor(build_tokenizer(), max_prompt_length=64)
    with pytest.raises(ValueError, match="rejected must be a string or a non-empty list of chat messages"):
        proc.build_dpo_dataset([{"prompt": "q", "chosen": "a", "rejected": bad}])


def test_a_template_without_the_prompt_as_prefix_is_refused():
    tok = build_tokenizer()
    tok.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                         "{% if add_generation_prompt %}assistant (answer now):{% endif %}")
    proc = RLDataProcessor(tok, max_prompt_length=64)
    with pytest.raises(ValueError, match="chosen: the chat template does not render the prompt"):
        proc.build_dpo_dataset([chat_pair("q", "a", "b")])


def test_chat_pairs_train_with_dpo(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from verl_fast.trainer.rl_trainer import RLTrainer

    path = save_tiny_model(tmp_path / "m", family="qwen2")
    model, tok = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), AutoTokenizer.from_pretrained(path)
    before = torch.cat([p.detach().flatten().clone() for p in model.parameters()])
    trainer = RLTrainer(actor_model=model, tokenizer=tok, config={
        "actor": {"lr": 1e-3}, "algorithm": {"type": "dpo"}, "reward_fn": {"type": "pairwise_ranking"},
        "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path / "run"), "progress_bar": False,
                    "plot": False, "device": "cpu", "hf_export": "none"}})
    history = trainer.fit([chat_pair(f"What is {a} + {a}?", str(2 * a), "please minus") for a in range(4)])
    assert len(history) == 1 and "dpo/reward_margin" in history[0]
    assert not torch.equal(before, torch.cat([p.detach().flatten() for p in model.parameters()]))

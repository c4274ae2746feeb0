"""MoE routing replay (verl_fast/models/routing.py) on tiny random Qwen2-MoE / Qwen3-MoE models on the CPU:
the HF rollout records each token's experts, a replayed forward routes exactly to them, the fraction of
changed tokens is counted, and replayed log-probs (and the gate's gradients) equal a float64 reference
forward whose routers take the forced experts by the formula (softmax over the logits, the given k
gathered, renormalised when norm_topk_prob)."""

import pytest
import torch

from tiny_models import EOS, build_tokenizer
from verl_fast.data import PromptRow
from verl_fast.records.experience import build_experience, concat
from verl_fast.models import routing
from verl_fast.models.response_logprobs import response_logprobs
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.hf_engine import HFGenerateEngine

transformers = pytest.importorskip("transformers")

FAMILIES = {  # Qwen3-MoE renormalises its top-k weights, Qwen2-MoE does not (and has a shared expert)
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(**{"head_dim": 16, "norm_topk_prob": True, **kw}),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(shared_expert_intermediate_size=48, norm_topk_prob=False,
                                                          **kw),
}


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


def moe_model(family, tokenizer, seed=0, **overrides):
    eos = tokenizer.convert_tokens_to_ids(EOS)
    kw = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2,
              moe_intermediate_size=32, max_position_embeddings=128, eos_token_id=eos, pad_token_id=eos,
              bos_token_id=None, attn_implementation="eager")
    cfg = FAMILIES[family](**{**kw, **overrides})
    torch.manual_seed(seed)
    # eager experts: the float64 reference runs the same module code (grouped GEMMs take no float64)
    model = transformers.AutoModelForCausalLM.from_config(cfg, experts_implementation="eager")
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() == 1 else 0.15)
    model.generation_config.eos_token_id = model.generation_config.pad_token_id = eos
    return model.eval()


def rollout(model, tokenizer, texts, spec):
    rows = [PromptRow(prompt_ids=tokenizer(t)["input_ids"], prompt_text=t) for t in texts]
    engine = HFGenerateEngine(model, tokenizer, fast_decode="off", record_routing=True)
    gen = engine.generate([r.prompt_ids for r in rows], spec)
    return build_experience(rows, gen, engine.pad_token_id), gen


TEXTS = ["What is 3 + 4?", "the sum of 12 and 30", "x"]


def own_routing(model, exp):
    """[N, T, layers, k] the experts the model's own routers pick over the experience's tokens."""
    with routing.record(model) as rec, torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask)
    return rec.stacked(exp.num_sequences).long()


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("spec", [SamplingSpec(n=2, max_tokens=6, temperature=1.0, seed=3),
                                  SamplingSpec(n=3, max_tokens=5, temperature=0.0)], ids=["sampled", "greedy"])
def test_rollout_records_each_tokens_experts(tokenizer, family, spec):
    model = moe_model(family, tokenizer)
    exp, gen = rollout(model, tokenizer, TEXTS, spec)
    layers, k = model.config.num_hidden_layers, model.config.num_experts_per_tok
    assert exp.routed_experts.shape == exp.input_ids.shape + (layers, k)
    routed = exp.routed_experts.long()
    real = exp.attention_mask.bool()
    assert (routed[~real] == -1).all()  # padding: nothing recorded
    # every real token but each response's last one was run by the rollout, and its k experts are distinct
    P = exp.input_ids.shape[1] - exp.response_length
    last = P + exp.response_mask.sum(-1) - 1
    for row in range(exp.num_sequences):
        got = routed[row, real[row]]
        assert (got[:-1] >= 0).all() and (got[-1] == -1).all(), row
        assert (got[:-1].sort(-1).values.diff(dim=-1) > 0).all()
        assert int(real[row].nonzero()[-1]) == int(last[row])
    # the rollout ran the same weights: its experts are the full forward's on the recorded tokens
    # (decoding with a KV cache rounds differently only near a tie, which this draw has none of)
    own = own_routing(model, exp)
    seen = routed >= 0
    assert torch.equal(own.sort(-1).values[seen.all(-1)], routed.sort(-1).values[seen.all(-1)])


@pytest.mark.parametrize("family", list(FAMILIES))
def test_replay_routes_exactly_to_the_recorded_experts(tokenizer, family):
    model = moe_model(family, tokenizer)
    exp, _ = rollout(model, tokenizer, TEXTS, SamplingSpec(n=2, max_tokens=6, temperature=1.0, seed=5))
    own = own_routing(model, exp)
    # recorded routing that differs from the model's own on chosen tokens and layers: the others' experts
    rng = torch.Generator().manual_seed(0)
    forced = exp.routed_experts.long().clone()
    real = forced[..., 0, 0] >= 0
    flip = real & (torch.rand(real.shape, generator=rng) < 0.4)
    E = model.config.num_experts
    for row, t in flip.nonzero().tolist():
        layer = (row + t) % model.config.num_hidden_layers
        forced[row, t, layer] = torch.randperm(E, generator=rng)[:2]
    given = forced
    has = given >= 0
    with routing.follow(model, given.to(torch.int16), substitute=True), routing.record(model) as used, \
            torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask)
    taken = used.stacked(exp.num_sequences).long()
    assert torch.equal(taken[has], given[has])  # exactly the recorded experts, in their order
    # replay off: the model's own routing runs, and the tokens whose own experts (as a set) differ from
    # the recorded ones in any layer are counted
    with routing.follow(model, given.to(torch.int16), substitute=False) as seen, routing.record(model) as used, \
            torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask)
    assert torch.equal(used.stacked(exp.num_sequences).long(), own)
    differs = (own.sort(-1).values != given.sort(-1).values).any(-1).any(-1) & has.all(-1).all(-1)
    recorded = has.all(-1).all(-1)
    assert 0 < differs.sum() < recorded.sum()
    assert seen.fraction() == float(differs.sum()) / float(recorded.sum())
    mask = exp.attention_mask.clone()
    mask[:, : mask.shape[1] // 2] = 0
    want = float((differs & mask.bool()).sum()) / float((recorded & mask.bool()).sum())
    assert seen.fraction(mask) == want
    with routing.follow(model, exp.routed_experts, substitute=False) as seen, torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask)
    assert seen.fraction() == 0.0  # the rollout's own routing: nothing would change


def ref_router(router, forced_layer):
    """The formula, in float64: softmax over the router's logits, the forced k experts' probabilities,
    renormalised when norm_topk_prob; the router's own top-k where nothing is forced (-1)."""
    def forward(h):
        h = h.reshape(-1, router.hidden_dim)
        logits = h @ router.weight.t()
        probs = torch.exp(logits - logits.logsumexp(-1, keepdim=True))
        idx = forced_layer.reshape(-1, router.top_k).long()
        own = probs.topk(router.top_k, dim=-1).indices
        idx = torch.where((idx >= 0).all(-1, keepdim=True), idx, own)
        w = probs.gather(-1, idx)
        if router.norm_topk_prob:
            w = w / w.sum(-1, keepdim=True)
        return logits, w, idx
    return forward


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("seed", [0, 1])
def test_replayed_logprobs_match_a_float64_forced_routing_forward(tokenizer, family, seed):
    model = moe_model(family, tokenizer, seed)
    exp, _ = rollout(model, tokenizer, TEXTS[: 2 + seed], SamplingSpec(n=2, max_tokens=5, temperature=1.0,
                                                                        seed=seed))
    forced = exp.routed_experts.clone()
    rng = torch.Generator().manual_seed(seed)
    flip = (forced[..., 0, 0] >= 0) & (torch.rand(forced.shape[:2], generator=rng) < 0.5)
    forced[flip] = torch.stack([torch.randperm(model.config.num_experts, generator=rng)[:2]
                                for _ in range(int(flip.sum()) * model.config.num_hidden_layers)]
                               ).view(-1, model.config.num_hidden_layers, 2).to(torch.int16)
    L = exp.response_length
    model.zero_grad()
    with routing.follow(model, forced, substitute=True):
        logp, _ = response_logprobs(model, exp.input_ids, exp.attention_mask, L)
    (logp * exp.response_mask).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if n.endswith("gate.weight")}

    ref = moe_model(family, tokenizer, seed).double()
    routers = routing.routers(ref)
    ref_logp = torch.zeros(logp.shape, dtype=torch.float64)
    for row in range(exp.num_sequences):  # each sequence alone, without its padding
        keep = exp.attention_mask[row].bool()
        ids, n = exp.input_ids[row, keep][None], int(exp.response_mask[row].sum())
        for layer, r in enumerate(routers):
            r.forward = ref_router(r, forced[row, keep][None, :, layer])
        logits = ref(input_ids=ids).logits[0, -n - 1 : -1]
        ref_logp[row, :n] = torch.log_softmax(logits, -1).gather(-1, ids[0, -n:, None]).squeeze(-1)
    (ref_logp * exp.response_mask).sum().backward()
    mask = exp.response_mask.bool()
    worst = (logp.double() - ref_logp).abs()[mask].max()
    assert worst < 5e-6, float(worst)  # float32 against float64: measured <= 1e-6
    for name, g in grads.items():
        want = dict(ref.named_parameters())[name].grad
        assert want.abs().max() > 0, name  # the gate learns through the replayed experts' weights
        torch.testing.assert_close(g.double(), want, atol=2e-6, rtol=0, msg=lambda m: f"{name}: {m}")


def test_experience_select_and_concat_keep_the_routing_columns(tokenizer):
    model = moe_model("qwen3_moe", tokenizer)
    exp, _ = rollout(model, tokenizer, TEXTS, SamplingSpec(n=2, max_tokens=6, temperature=1.0, seed=2))
    for rows in ([0, 1], [4, 5], [5, 2, 0]):
        idx = torch.tensor(rows)
        sub = exp.select(idx)
        keep = exp.input_ids.shape[1] - sub.input_ids.shape[1]
        assert sub.routed_experts.shape[:2] == sub.input_ids.shape
        # the same tokens: where a column was kept, the routing beside it
        P, Ps = exp.input_ids.shape[1] - exp.response_length, sub.input_ids.shape[1] - sub.response_length
        assert torch.equal(sub.routed_experts[:, :Ps], exp.routed_experts[idx, P - Ps : P])
        assert torch.equal(sub.routed_experts[:, Ps:], exp.routed_experts[idx, P : P + sub.response_length])
        assert keep >= 0
    joined = concat([exp.select(torch.tensor([0, 1])), exp.select(torch.tensor([4, 5]))])
    assert joined.routed_experts.shape[:2] == joined.input_ids.shape
    assert ((joined.routed_experts[..., 0, 0] >= 0) <= joined.attention_mask.bool()).all()


def test_routers_refuse_other_moe_families():
    from tiny_models import tiny_model

    with pytest.raises(ValueError, match="supports Qwen2-MoE and Qwen3-MoE models, got model_type 'mixtral'"):
        routing.routers(tiny_model("mixtral"))
    assert routing.routers(tiny_model("qwen2")) == []
    with pytest.raises(ValueError, match="record_routing needs a mixture-of-experts model"):
        HFGenerateEngine(tiny_model("qwen2"), build_tokenizer(), record_routing=True)


@pytest.mark.parametrize("keys", [{"actor": {"routing_replay": True}}, {"rollout": {"record_routing": True}}],
                         ids=["replay", "measure"])
def test_trainer_step_with_routing(tokenizer, tmp_path, keys):
    from verl_fast.trainer.rl_trainer import RLTrainer

    model = moe_model("qwen3_moe", tokenizer)
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 2, "skip_zero_advantage": False, **keys.get("actor", {})},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4, **keys.get("rollout", {})},
           "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 2, "train_batch_size": 2, "output_dir": str(tmp_path), "device": "cpu",
                       "progress_bar": False, "plot": False, "save_freq": 0}}
    trainer = RLTrainer(actor_model=model, tokenizer=tokenizer, config=cfg,
                        reward_fn=lambda solution_str: float(len(solution_str) % 3))
    assert trainer.engine.record_routing
    history = trainer.fit([{"prompt": t} for t in TEXTS[:2]] * 2)
    assert len(history) == 2
    for h in history:
        assert 0.0 <= h["actor/routing_changed_frac"] <= 1.0
    if "actor" in keys:  # the old log-probs ran the rollout's routing as the update's first forward did
        assert history[0]["actor/approx_kl"] == pytest.approx(0.0, abs=1e-6)


def test_routing_replay_config():
    from verl_fast.config import from_dict

    assert from_dict({"actor": {"routing_replay": True}}).actor.routing_replay
    # the Megatron actor replays too (python_tests/megatron/test_megatron_routing.py)
    assert from_dict({"actor": {"strategy": "megatron", "routing_replay": True}}).actor.routing_replay
    with pytest.raises(ValueError, match="rollout.record_routing"):
        from_dict({"rollout": {"record_routing": "yes"}})


def test_vllm_routing_refused_or_recorded(tokenizer, tmp_path):
    """vLLM returns routed experts only through its Model Runner V2 (0.32): where that cannot run (no
    Triton: vLLM-CPU) or is off, or the version lacks the option, the engine refuses naming the version."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import importlib.util
    import os

    from verl_fast.rollout import vllm_compat
    from verl_fast.rollout.vllm_engine import VLLMInferenceEngine

    model = moe_model("qwen3_moe", tokenizer, head_dim=32)  # vLLM-CPU attention needs head_dim >= 32
    model.save_pretrained(tmp_path / "moe")
    tokenizer.save_pretrained(tmp_path / "moe")
    can = (vllm_compat.routed_experts_available() and importlib.util.find_spec("triton") is not None
           and os.environ.get("VLLM_USE_V2_MODEL_RUNNER") == "1")
    if not can:
        with pytest.raises(ValueError, match=rf"vLLM {vllm_compat.version()} cannot return each token's routed "
                                             "experts.*use rollout.type=hf"):
            VLLMInferenceEngine(str(tmp_path / "moe"), dtype="float32", max_model_len=64, record_routing=True)
        return
    engine = VLLMInferenceEngine(str(tmp_path / "moe"), dtype="float32", max_model_len=64, max_num_seqs=4,
                                 record_routing=True)
    try:
        ids = [tokenizer(t)["input_ids"] for t in TEXTS]
        out = engine.generate(ids, SamplingSpec(n=2, max_tokens=5, temperature=0.0))
        for row, routed in enumerate(out.routed_experts):
            prompt = ids[int(out.prompt_index[row])]
            assert routed.shape == (len(prompt) + int(out.response_mask[row].sum()), 3, 2)
            assert (routed[:-1] >= 0).all()
    finally:
        engine.close()


def test_recording_decodes_through_generate(tokenizer):
    """The static-cache loop (a replayed CUDA graph on a GPU) runs no hooks: recording takes generate."""
    model = moe_model("qwen2_moe", tokenizer)
    engine = HFGenerateEngine(model, tokenizer, fast_decode="on", record_routing=True)
    ids = [tokenizer(t)["input_ids"] for t in TEXTS]
    out = engine.generate(ids, SamplingSpec(n=2, max_tokens=4, temperature=0.0))
    assert engine.last_mode == "generate" and engine._fast_reason(SamplingSpec()) == "record_routing"
    assert [r.shape[0] for r in out.routed_experts] == [len(ids[int(i)]) + int(m.sum())
                                                        for i, m in zip(out.prompt_index, out.response_mask)]


def test_routing_replay_under_gradient_checkpointing(tokenizer, tmp_path):
    """examples/moe as its README runs it (gradient checkpointing on) with actor.routing_replay: the
    backward's recompute routes as the forward did (it used to recompute with the routers' own choice,
    after the replay had ended: torch's CheckpointError, 61 vs 59 tensors saved)."""
    from verl_fast.trainer.rl_trainer import RLTrainer

    model = moe_model("qwen3_moe", tokenizer)
    cfg = {"actor": {"lr": 1e-2, "micro_batch_size": 2, "skip_zero_advantage": False, "routing_replay": True,
                     "gradient_checkpointing": True},
           "rollout": {"type": "hf", "n": 2, "max_new_tokens": 4}, "algorithm": {"type": "grpo"},
           "trainer": {"total_steps": 1, "train_batch_size": 2, "output_dir": str(tmp_path), "device": "cpu",
                       "progress_bar": False, "plot": False, "save_freq": 0}}
    trainer = RLTrainer(actor_model=model, tokenizer=tokenizer, config=cfg,
                        reward_fn=lambda solution_str: float(len(solution_str) % 3))
    history = trainer.fit([{"prompt": t} for t in TEXTS[:2]])
    assert len(history) == 1 and history[0]["actor/grad_norm"] > 0

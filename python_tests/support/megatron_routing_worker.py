"""MoE routing replay with ``actor.strategy: megatron`` on CPU (gloo), run by test_megatron_routing.py
under torch.multiprocessing; ``run_replayed`` is also the single-process HF reference."""

import torch
import torch.distributed as dist

import megatron_trainer_worker as T


def own_routing(model, exp):
    """``[N, T, layers, k]`` the experts the HF model's own routers pick (positions from the mask)."""
    from verl_fast.models import routing

    positions = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with routing.record(model) as rec, torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=positions)
    return rec.stacked(exp.num_sequences).long()


def recorded_experiences(family: str):
    """``megatron_trainer_worker.experiences`` with recorded experts: about half of the real tokens the
    model's own (first step's weights), the others a random set of k experts in every layer, a few
    real tokens unrecorded (-1, as padding is): there the router's own choice runs."""
    model = T.actor_model(family)
    layers, k, experts = model.config.num_hidden_layers, model.config.num_experts_per_tok, model.config.num_experts
    g = torch.Generator().manual_seed(5)
    out = []
    for exp in T.experiences(T.VOCAB):
        n, width = exp.input_ids.shape
        draws = torch.rand(n, width, layers, experts, generator=g).argsort(-1)[..., :k]
        draws = torch.where((torch.rand(n, width, generator=g) < 0.5)[..., None, None], own_routing(model, exp), draws)
        keep = exp.attention_mask.bool() & (torch.rand(n, width, generator=g) > 0.15)
        exp.routed_experts = draws.masked_fill(~keep[..., None, None], -1).to(torch.int16)
        out.append(exp)
    return out


def config(strategy: str, replay: bool, pp: int = 1, ep: int = 1):
    cfg = T.config(strategy, 1, pp, ep=ep)
    cfg["actor"]["routing_replay"] = replay
    return cfg


def run_replayed(family: str, cfg: dict, probe=None):
    """Each step: old log-probs, then the update, on the recorded experiences. ``probe(trainer, exp)``
    runs first on the first batch. Returns (per-step metrics, old log-probs, the routers' gate weights
    after the updates)."""
    from verl_fast.trainer.rl_trainer import RLTrainer

    model = T.actor_model(family)
    trainer = RLTrainer(actor_model=model, tokenizer=T.build_tokenizer(vocab_size=320), config=cfg,
                        reward_fn=lambda solution_str: 0.0)
    metrics, old = [], []
    for step, exp in enumerate(recorded_experiences(family)):
        exp = exp.to(trainer.device)
        if probe is not None and step == 0:
            probe(trainer, exp)
        exp.old_logprobs = trainer._old_logprobs(exp)
        old.append(exp.old_logprobs.cpu())
        metrics.append(trainer.update_actor(exp))
    gates = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k.endswith("mlp.gate.weight")}
    return metrics, old, gates


def routed_by_megatron(trainer, exp):
    """Per router (by layer number), each forward's ``[tokens, k]`` experts, with the forward's tokens,
    over one replayed old-log-prob pass of the whole batch."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = trainer.strategy.megatron.model.chunks
    inputs, used = [], {}
    handles = [c.module.register_forward_pre_hook(lambda m, args: inputs.append(args[0].clone())) for c in chunks]
    for m in (m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)):
        def save(module, args, output):
            used.setdefault(module.layer_number - 1, []).append(output[1].nonzero()[:, 1].view(output[1].shape[0], -1))
        handles.append(m.register_forward_hook(save))
    trainer.strategy.actor_logprobs(exp, [torch.arange(exp.num_sequences)])
    for h in handles:
        h.remove()
    return inputs, used


def check_routed_experts(trainer, exp):
    """Every router took, on every recorded token, exactly the recorded experts: each forward row found
    back in the experience by its tokens (rows start at their first real token)."""
    inputs, used = routed_by_megatron(trainer, exp)
    assert used, "no router ran"
    real = exp.attention_mask.bool()
    checked = 0
    for layer, calls in used.items():
        for tokens, experts in zip(inputs, calls):
            b, s = tokens.shape
            experts = experts.view(s, b, -1).transpose(0, 1)  # the router's [s, b] order
            for j in range(b):
                row = next(r for r in range(exp.num_sequences)
                           if torch.equal(tokens[j][: min(int(real[r].sum()), s)], exp.input_ids[r][real[r]][:s]))
                given = exp.routed_experts[row][real[row]][:s, layer].long()  # the row's real tokens in order
                has = (given >= 0).all(-1)
                got = experts[j, : given.shape[0]]
                assert torch.equal(got[has].sort(-1).values, given[has].sort(-1).values), (layer, row)
                checked += int(has.sum())
    assert checked > 0


def changed_count(trainer, exp):
    """The changed-routing fraction over the whole batch with replay off (the routers' own experts),
    as Megatron counts it (the first step's weights)."""
    from verl_fast.strategies.megatron.routing_replay import Replay

    megatron = trainer.strategy.megatron
    replay = Replay(megatron.model.chunks, substitute=False)
    megatron.response_outputs(exp, [torch.arange(exp.num_sequences)], megatron._around(1.0), replay)
    return replay.fractions(1, megatron.pp_group if megatron.par.pp > 1 else None)[0]


def worker(rank, world, port, family, pp, ep, out_path):
    T.init_worker(rank, world, port, "cpu")
    found = {}

    def probe(trainer, exp):
        check_routed_experts(trainer, exp)
        found["fraction"] = changed_count(trainer, exp)

    metrics, old, gates = run_replayed(family, config("megatron", True, pp, ep), probe)
    if rank == 0:
        torch.save({"metrics": metrics, "old": old, "gates": gates, **found}, out_path)
    dist.barrier()
    dist.destroy_process_group()

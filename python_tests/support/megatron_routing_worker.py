"""MoE routing replay with ``actor.strategy: megatron`` on CPU (gloo), run by test_megatron_routing.py
under torch.multiprocessing; ``run_replayed`` is also the single-process HF reference."""

import torch
import torch.distributed as dist

import megatron_trainer_worker as T
from tiny_models import tiny_model


def actor_model(family: str, layers: int = 2):
    """``megatron_trainer_worker.actor_model`` with ``layers`` MoE layers."""
    return tiny_model(family, seed=3, vocab_size=T.VOCAB, num_hidden_layers=layers, **T.OVERRIDES.get(family, {}))


def own_routing(model, exp):
    """``[N, T, layers, k]`` the experts the HF model's own routers pick (positions from the mask)."""
    from verl_fast.models import routing

    positions = (exp.attention_mask.cumsum(-1) - 1).clamp(min=0)
    with routing.record(model) as rec, torch.no_grad():
        model(input_ids=exp.input_ids, attention_mask=exp.attention_mask, position_ids=positions)
    return rec.stacked(exp.num_sequences).long()


def recorded_experiences(family: str, layers: int = 2):
    """``megatron_trainer_worker.experiences`` with recorded experts: about half of the real tokens the
    model's own (first step's weights), the others a random set of k experts in every layer, a few
    real tokens unrecorded (-1, as padding is): there the router's own choice runs."""
    model = actor_model(family, layers)
    k, experts = model.config.num_experts_per_tok, model.config.num_experts
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


def config(strategy: str, replay: bool, pp: int = 1, ep: int = 1, vpp=None):
    cfg = T.config(strategy, 1, pp, ep=ep)
    cfg["actor"]["routing_replay"] = replay
    cfg["actor"]["virtual_pipeline_model_parallel_size"] = vpp
    return cfg


def run_replayed(family: str, cfg: dict, probe=None, layers: int = 2, updates: bool = True):
    """Each step: old log-probs, then the update, on the recorded experiences. ``probe(trainer, exp)``
    runs first on the first batch; without ``updates`` only it runs. Returns (per-step metrics, old
    log-probs, the routers' gate weights after the updates)."""
    from verl_fast.trainer.rl_trainer import RLTrainer

    model = actor_model(family, layers)
    trainer = RLTrainer(actor_model=model, tokenizer=T.build_tokenizer(vocab_size=320), config=cfg,
                        reward_fn=lambda solution_str: 0.0)
    metrics, old = [], []
    for step, exp in enumerate(recorded_experiences(family, layers)):
        exp = exp.to(trainer.device)
        if probe is not None and step == 0:
            probe(trainer, exp)
        if not updates:
            break
        exp.old_logprobs = trainer._old_logprobs(exp)
        old.append(exp.old_logprobs.cpu())
        metrics.append(trainer.update_actor(exp))
    gates = {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k.endswith("mlp.gate.weight")}
    return metrics, old, gates


HALVES = (torch.arange(0, 4), torch.arange(4, 8))  # two micro-batches: an interleaved schedule needs >= PP


def routed_by_megatron(trainer, exp):
    """Per router call (each layer, each micro-batch): the forward's rows ``[b, s]``, the router's layer
    and the ``[s * b, k]`` experts it took, over one replayed old-log-prob pass; and its log-probs."""
    from megatron.core.transformer.moe.router import TopKRouter

    chunks = trainer.strategy.megatron.model.chunks
    rows, used = [None], []
    handles = [c.module.register_forward_pre_hook(lambda m, args: rows.__setitem__(0, args[0].clone())) for c in chunks]
    for m in (m for c in chunks for m in c.modules() if isinstance(m, TopKRouter)):
        def save(module, args, output):
            used.append((rows[0], module.layer_number - 1, output[1].nonzero()[:, 1].view(output[1].shape[0], -1)))
        handles.append(m.register_forward_hook(save))
    logprobs = trainer.strategy.actor_logprobs(exp, list(HALVES))
    for h in handles:
        h.remove()
    return used, logprobs.cpu()


def check_routed_experts(trainer, exp):
    """Every router took, on every recorded token, exactly the recorded experts: each forward row found
    back in the experience by its tokens (rows start at their first real token). Returns the pass's
    log-probs."""
    used, logprobs = routed_by_megatron(trainer, exp)
    layers = {layer for _, layer, _ in used}
    assert layers, "no router ran"
    real = exp.attention_mask.bool()
    checked = 0
    for tokens, layer, experts in used:
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
    return logprobs


def changed_fractions(trainer, exp):
    """Per micro-batch (``HALVES``), the changed-routing fraction with replay off (the routers' own
    experts), as Megatron counts it (the first step's weights)."""
    from verl_fast.strategies.megatron.routing_replay import Replay

    megatron = trainer.strategy.megatron
    replay = Replay(megatron.model.chunks, substitute=False)
    megatron.response_outputs(exp, list(HALVES), megatron._around(1.0), replay)
    return replay.fractions(len(HALVES), megatron.pp_group if megatron.par.pp > 1 else None)


def worker(rank, world, port, family, pp, ep, vpp, layers, updates, out_path):
    T.init_worker(rank, world, port, "cpu")
    found = {}

    def probe(trainer, exp):
        found["first_old"] = check_routed_experts(trainer, exp)
        found["fractions"] = changed_fractions(trainer, exp)

    metrics, old, gates = run_replayed(family, config("megatron", True, pp, ep, vpp), probe, layers, updates)
    if rank == 0:
        torch.save({"metrics": metrics, "old": old, "gates": gates, **found}, out_path)
    dist.barrier()
    dist.destroy_process_group()

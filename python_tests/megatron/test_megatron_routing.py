"""MoE routing replay with actor.strategy=megatron (gloo on CPU): megatron-core's routers take exactly
the recorded experts; the replayed old log-probs, losses, actor/routing_changed_frac and updated gates
equal the HF actor's replayed run (whose forward test_routing.py checks against a float64
forced-routing reference); the changed-routing fraction equals a count over the HF model's own routing."""

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

import megatron_routing_worker as W  # noqa: E402
from ports import free_port  # noqa: E402

pytestmark = pytest.mark.slow


def own_changed_fractions(family, layers):
    """Per half of the first batch (``W.HALVES``): its recorded tokens whose own experts (HF model, first
    step's weights, positions from the attention mask) differ as a set from the recorded ones in any
    layer, over its recorded tokens."""
    exp = W.recorded_experiences(family, layers)[0]
    own = W.own_routing(W.actor_model(family, layers), exp).sort(-1).values
    given = exp.routed_experts.long()
    recorded = (given >= 0).all(-1).all(-1) & exp.attention_mask.bool()
    changed = (own != given.sort(-1).values).any(-1).any(-1) & recorded
    return [int(changed[rows].sum()) / int(recorded[rows].sum()) for rows in W.HALVES]


def check_megatron_replay(tmp_path, family, pp, ep, vpp=None, layers=2, updates=True):
    """The Megatron run's experts check (in the workers), its first replayed log-probs and its
    changed-routing fractions against the HF actor; returns the Megatron results and the HF run's."""
    out = tmp_path / "rank0.pt"
    world = pp * ep
    mp.spawn(W.worker, args=(world, free_port(), family, pp, ep, vpp, layers, updates, str(out)), nprocs=world,
             join=True)
    got = torch.load(out)
    metrics, old, gates = W.run_replayed(family, W.config("auto", True), layers=layers)
    mask = W.recorded_experiences(family, layers)[0].response_mask
    torch.testing.assert_close(got["first_old"] * mask, old[0] * mask, atol=2e-5, rtol=0)
    assert got["fractions"] == pytest.approx(own_changed_fractions(family, layers), abs=1e-12)
    assert all(0.1 < f < 0.9 for f in got["fractions"])  # half the tokens recorded with the model's own experts
    return got, metrics, old, gates


@pytest.mark.parametrize("family,pp,ep", [("qwen3_moe", 2, 1), ("qwen2_moe", 1, 2)])
def test_megatron_routing_replay_matches_hf(tmp_path, family, pp, ep):
    """PP=2 (one MoE layer per stage: the metric combines the stages) with Qwen3-MoE's renormalised
    weights; EP=2 (the all-gather dispatcher) with Qwen2-MoE's unnormalised ones and shared expert."""
    got, metrics, old, gates = check_megatron_replay(tmp_path, family, pp, ep)
    plain, _, plain_gates = W.run_replayed(family, W.config("auto", False))
    for step, (a, b, exp) in enumerate(zip(got["old"], old, W.recorded_experiences(family))):
        mask = exp.response_mask
        tol = 2e-5 if step == 0 else 2e-4  # later steps differ by the updates' rounding
        torch.testing.assert_close(a * mask, b * mask, atol=tol, rtol=0,
                                   msg=lambda m: f"old log-probs, step {step}: {m}")
    for step, (a, b) in enumerate(zip(got["metrics"], metrics)):
        assert a["actor/routing_changed_frac"] == pytest.approx(b["actor/routing_changed_frac"], abs=1e-6), step
        for key in ("actor/pg_loss", "actor/entropy", "actor/grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-3, abs=1e-4), (step, key)
    # the replay changed the forward: without it the HF actor's losses differ
    assert any(abs(a["actor/entropy"] - c["actor/entropy"]) > 1e-3 for a, c in zip(got["metrics"], plain))
    # the gates learn through the replayed experts' weights as the HF actor's do
    assert set(got["gates"]) == set(gates) and gates
    for name, ref in gates.items():
        torch.testing.assert_close(got["gates"][name], ref, atol=2e-4, rtol=0, msg=lambda m: f"{name}: {m}")
        assert (ref - plain_gates[name]).abs().max() > 1e-3, name  # the replay changed the update


def test_megatron_routing_replay_interleaved_pipeline(tmp_path):
    """PP=2 with two model chunks per stage (4 layers, interleaved schedule): each router finds its
    layer's recorded experts; the replayed log-probs and the changed-routing count as above (forward
    passes only: the updates at this layout are not run here)."""
    check_megatron_replay(tmp_path, "qwen3_moe", 2, 1, vpp=2, layers=4, updates=False)

"""MoE routing replay with actor.strategy=megatron (gloo on CPU): megatron-core's routers take exactly
the recorded experts; the replayed old log-probs, losses, actor/routing_changed_frac and updated gates
equal the HF actor's replayed run (whose forward test_routing.py checks against a float64
forced-routing reference); the changed-routing fraction equals a count over the HF model's own routing."""

import socket

import pytest
import torch

pytest.importorskip("megatron.core")

import torch.multiprocessing as mp  # noqa: E402

import megatron_routing_worker as W  # noqa: E402
import megatron_trainer_worker as T  # noqa: E402

pytestmark = pytest.mark.slow


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def own_changed_fraction(family):
    """Recorded tokens of the first batch whose own experts (HF model, first step's weights, positions
    from the attention mask) differ as a set from the recorded ones in any layer, over recorded tokens."""
    exp = W.recorded_experiences(family)[0]
    own = W.own_routing(T.actor_model(family), exp).sort(-1).values
    given = exp.routed_experts.long()
    recorded = (given >= 0).all(-1).all(-1) & exp.attention_mask.bool()
    changed = (own != given.sort(-1).values).any(-1).any(-1) & recorded
    return int(changed.sum()) / int(recorded.sum())


@pytest.mark.parametrize("family,pp,ep", [("qwen3_moe", 2, 1), ("qwen2_moe", 1, 2)])
def test_megatron_routing_replay_matches_hf(tmp_path, family, pp, ep):
    """PP=2 (one MoE layer per stage: the metric combines the stages) with Qwen3-MoE's renormalised
    weights; EP=2 (the all-gather dispatcher) with Qwen2-MoE's unnormalised ones and shared expert."""
    out = tmp_path / "rank0.pt"
    world = pp * ep
    mp.spawn(W.worker, args=(world, free_port(), family, pp, ep, str(out)), nprocs=world, join=True)
    got = torch.load(out)
    metrics, old, gates = W.run_replayed(family, W.config("auto", True))
    plain, _, plain_gates = W.run_replayed(family, W.config("auto", False))
    assert got["fraction"] == pytest.approx(own_changed_fraction(family), abs=1e-12)
    assert 0.2 < got["fraction"] < 0.8  # half the tokens recorded with the model's own experts
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

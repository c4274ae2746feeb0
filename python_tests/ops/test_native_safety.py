"""Hostile inputs to the compiled core and its wrappers: sizes and offsets that wrap int64,
destination layouts with overlaps or holes, objects posing as tensors, tensors whose memory moves
after they were bound, made-up CUDA streams, truthy strings as flags, empty batches. Each must
give a ValueError / TypeError naming what is wrong, never a crash or a silently wrong result."""

from collections import OrderedDict

import pytest
import torch
from transformers import Qwen2Config

import verl_fast as vf
from verl_fast import _C
from verl_fast import schedule as S
from verl_fast.ops.reshard import ModelSpec, plan
from verl_fast.ops.reshard.api import vllm_weights
from verl_fast.ops.reshard.layout import Layout, PhysTensor, Piece

F32 = torch.float32


def layouts(dst_pieces, dst_numel=16, src_pieces=None):
    """Logical w [4, 4]; source a holds it whole; destination x is tiled by ``dst_pieces``."""
    logical = OrderedDict(w=(4, 4))
    src = PhysTensor("a", 0, (16,), F32, src_pieces or [Piece("w", 0, 4, 0, 4, 0, 4)])
    dst = PhysTensor("x", 0, (dst_numel,), F32, dst_pieces)
    return Layout(logical, [src], 1), Layout(logical, [dst], 1)


# ---- 1. sizes and offsets -----------------------------------------------------------------------


def test_piece_whose_end_wraps_int64_is_refused():
    # offset + (nrows - 1) * pitch + ncols = 2^62 + 2 * 2^62 + 4 wraps to a negative int64
    bad = Piece("w", 0, 3, 0, 4, 2**62, 2**62)
    with pytest.raises(ValueError, match=r"source tensor a: piece 0 .*ends past its 16 elements"):
        plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)], src_pieces=[bad, Piece("w", 3, 1, 0, 4, 0, 4)]))
    with pytest.raises(ValueError, match=r"destination tensor x: piece 0 .*ends past"):
        plan(*layouts([bad, Piece("w", 3, 1, 0, 4, 0, 4)]))
    with pytest.raises(ValueError, match=r"piece 0 rows \[9223372036854775807, \+1\).* outside w"):
        plan(*layouts([Piece("w", 2**63 - 1, 1, 0, 4, 0, 4)]))


def test_destination_pieces_must_tile_without_overlap_or_holes():
    # rows 0-1 at elements [0, 8) and rows 2-3 at [4, 12): 16 elements in all, as many as x has,
    # but [4, 8) is written twice and [12, 16) never
    with pytest.raises(ValueError, match=r"destination tensor x: destination pieces 0 and 1 both write element 4"):
        plan(*layouts([Piece("w", 0, 2, 0, 4, 0, 4), Piece("w", 2, 2, 0, 4, 4, 4)]))
    with pytest.raises(ValueError, match=r"destination tensor x: elements \[16, 20\) are written by no piece"):
        plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)], dst_numel=20))
    with pytest.raises(ValueError, match=r"elements \[8, 10\) are written by no piece"):
        plan(*layouts([Piece("w", 0, 2, 0, 4, 0, 4), Piece("w", 2, 2, 0, 4, 10, 4)], dst_numel=18))
    # strided pieces interleaving exactly are fine: columns 0-1 and 2-3 of each row
    p = plan(*layouts([Piece("w", 0, 4, 0, 2, 0, 4), Piece("w", 0, 4, 2, 2, 2, 4)]))
    src = torch.arange(16, dtype=F32)
    assert torch.equal(p.execute({"a": src})["x"], src)


def test_tensor_bytes_beyond_int64_are_refused():
    a = _C.ReshardPlanArgs()
    a.logical_shapes = torch.tensor([[4, 4]])
    a.logical_names = ["w"]
    a.src_tensors = torch.tensor([[0, 2**62, 0, 0]])  # 2^62 float32 elements: 2^64 bytes
    a.src_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 0, 4]])
    a.dst_tensors = torch.tensor([[0, 16, 0, 0]])
    a.dst_pieces = torch.tensor([[0, 0, 4, 0, 4, 0, 0, 4]])
    a.src_names, a.dst_names = ["a"], ["x"]
    with pytest.raises(ValueError, match=r"source tensor a: numel 4611686018427387904 .*beyond 2\^62"):
        _C.ReshardPlan(a)


def test_workspace_size_cannot_wrap():
    assert _C.group_workspace_bytes(3) == 3 * 8 * 3 + (3 * 3 + 1) * 4
    with pytest.raises(ValueError, match=r"batch must be in \[0, 2\^31 - 1\], got 4611686018427387904"):
        _C.group_workspace_bytes(2**62)


def test_schedule_sizes_that_wrap_are_refused():
    with pytest.raises(ValueError, match=r"lengths\[0\] = 1099511627776 with linear=0, quadratic=4611686018427387904"):
        S.balance_partitions([2**40] * 2, 2, cost=(0, 2**62))
    L = torch.tensor([2**40] * 2)
    order, offsets, costs = (torch.empty(n, dtype=torch.int64) for n in (2, 3, 2))
    with pytest.raises(ValueError, match="beyond int64"):
        _C.balance_partitions(L, 2, False, 0, 2**62, order, offsets, costs)
    # 2 + (2^63 - 2) tokens: the wave's count used to come back negative
    with pytest.raises(ValueError, match=r"prompt_lens and max_new_tokens: 1 requests .* is beyond int64"):
        S.rollout_buckets([2], 2**63 - 2, 1, 2**63 - 1)
    with pytest.raises(ValueError, match=r"lengths: 3 sequences times the longest .* is beyond int64"):
        S.pack_micro_batches([1, 2, 2**62], 10)
    with pytest.raises(ValueError, match=r"max_tokens must fit in int64"):
        S.pack_micro_batches([1, 2, 3], 2**64)
    with pytest.raises(ValueError, match=r"k must be <= the number of sequences \(3\), got 1000000000000"):
        S.balance_partitions([1, 2, 3], 10**12, equal_size=False)
    with pytest.raises(TypeError, match=r"lengths must hold integers .*True \(bool\)"):
        S.balance_partitions([True, 2], 2)
    with pytest.raises(TypeError, match="prompt_lens must hold integers"):
        S.rollout_buckets([3, False], 2, 2, 100)
    with pytest.raises(TypeError, match="equal_size must be True or False, got 'no'"):
        S.balance_partitions([1, 2], 2, equal_size="no")


# ---- 2. what crosses into _C --------------------------------------------------------------------


class PosingAsTensor:
    """Every attribute the old duck-typed conversion read, pointing at memory nobody owns."""

    dtype = F32
    shape = (2, 3)
    is_cpu, is_cuda = True, False

    def data_ptr(self):
        return 0xDEAD0

    def stride(self):
        return (3, 1)

    def get_device(self):
        return -1


class OwnPointer(torch.Tensor):
    def data_ptr(self):
        return 0xDEAD0


def test_only_real_tensors_cross_into_C():
    a = _C.ScanArgs()
    with pytest.raises(TypeError, match="expected a torch.Tensor, got PosingAsTensor"):
        a.rewards = PosingAsTensor()
    with pytest.raises(TypeError, match="expected a plain torch.Tensor, got the subclass OwnPointer"):
        a.rewards = torch.zeros(2, 3).as_subclass(OwnPointer)
    with pytest.raises(TypeError, match="expected a torch.Tensor"):
        _C.pack_micro_batches(PosingAsTensor(), 10, 1, False, torch.empty(3, dtype=torch.int64),
                              torch.empty(4, dtype=torch.int64))
    a.rewards = torch.nn.Parameter(torch.zeros(2, 3))  # a Parameter is a plain tensor


def scan_args(r):
    a = _C.ScanArgs()
    a.kind = _C.ScanKind.gae
    a.rewards, a.values, a.mask = r, torch.zeros_like(r), torch.ones_like(r)
    a.advantages, a.returns = torch.empty_like(r), torch.empty_like(r)
    a.status = torch.empty(_C.status_words, dtype=torch.int32, device=r.device)
    a.whiten = False
    return a


def test_a_record_whose_tensor_moved_is_refused():
    r = torch.ones(2, 3)
    a = scan_args(r)
    _C.advantage_scan(a)
    r.set_(torch.full((2, 3), 5.0))  # the old storage would be freed but for the record's reference
    with pytest.raises(ValueError, match="rewards: the tensor's memory changed since it was assigned"):
        _C.advantage_scan(a)
    a.rewards = r  # assigned again: fine
    _C.advantage_scan(a)


def test_a_plan_whose_tensor_moved_is_refused():
    p = plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)]))
    src, dst = torch.arange(16, dtype=F32), torch.zeros(16)
    slots = [torch.empty(16, dtype=torch.uint8) for _ in range(4)]
    p._c.bind([src], [dst], slots[:2], slots[2:])
    p._c.run(0, _C.ReshardPhase.copy, None, 1)
    assert torch.equal(dst, src)
    dst.set_(torch.zeros(16))
    with pytest.raises(ValueError, match="destination x: the tensor's memory changed since bind"):
        p._c.run(0, _C.ReshardPhase.copy, None, 1)
    src.set_(torch.zeros(32)[16:])
    with pytest.raises(ValueError, match="source a: the tensor's memory changed"):
        p._c.run(0, _C.ReshardPhase.copy, None, 1)
    # the wrapper binds again when the memory moved, and writes where the tensor now points
    src = torch.arange(16, dtype=F32)
    dst = torch.zeros(16)
    p.execute({"a": src}, {"x": dst})
    dst.set_(torch.zeros(16))
    p.execute({"a": src}, {"x": dst})
    assert torch.equal(dst, src)


def test_streams_come_from_torch_never_as_integers():
    a = _C.ScanArgs()
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None, got int"):
        a.stream = 0x1234
    a.stream = None
    assert a.stream is None
    p = plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)]))
    p.execute({"a": torch.zeros(16)})
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None"):
        p._c.run(0, _C.ReshardPhase.copy, 0xBAD, 1)


@pytest.mark.gpu
def test_cuda_launches_use_the_stream_torch_gives():
    r, v = torch.randn(4, 7, dtype=torch.float64), torch.randn(4, 7, dtype=torch.float64)
    want_adv, want_ret = vf.compute_gae(r, v, torch.ones(4, 7), gamma=0.9, lam=0.8)
    rc, vc, mc = r.cuda(), v.cuda(), torch.ones(4, 7, device="cuda")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        adv, ret = vf.compute_gae(rc, vc, mc, gamma=0.9, lam=0.8)
    side.synchronize()
    torch.testing.assert_close(adv.cpu(), want_adv, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ret.cpu(), want_ret, atol=1e-5, rtol=1e-5)
    a = scan_args(rc.float())
    a.stream = side
    assert a.stream == side.cuda_stream
    _C.advantage_scan(a)
    side.synchronize()
    p = plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)]))
    src = torch.arange(16, dtype=F32, device="cuda")
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        out = p.execute({"a": src})
    side.synchronize()
    assert torch.equal(out["x"].cpu(), src.cpu())
    with pytest.raises(TypeError, match="stream must be a torch.cuda.Stream or None"):
        p._c.run(0, _C.ReshardPhase.copy, side.cuda_stream, 1)


# ---- 3. flags, empty batches, None ----------------------------------------------------------------


def test_flags_must_be_bools_and_numbers_finite():
    r, v, m = torch.randn(2, 3), torch.randn(2, 3), torch.ones(2, 3)
    with pytest.raises(TypeError, match="whiten must be True or False, got 'no'"):
        vf.compute_gae(r, v, m, whiten="no")
    with pytest.raises(TypeError, match="norm_by_std must be True or False"):
        vf.compute_grpo_advantage(r, m, [0, 0], norm_by_std="false")
    with pytest.raises(ValueError, match="gamma must be finite, got nan"):
        vf.compute_gae(r, v, m, gamma=float("nan"))
    with pytest.raises(TypeError, match="lam must be a number, got '1'"):
        vf.compute_gae(r, v, m, lam="1")


def test_empty_response_batches():
    """[B, 0]: no response tokens gives empty advantages (there is nothing to whiten)."""
    e = torch.zeros(3, 0)
    for whiten in (False, True):
        adv, ret = vf.compute_gae(e, e, e, whiten=whiten)
        assert adv.shape == ret.shape == (3, 0)
    adv, _ = vf.compute_grpo_advantage(e, e, [0, 0, 1])
    assert adv.shape == (3, 0)
    adv, _ = vf.compute_reinforce_pp_advantage(e, e, whiten=False)
    assert adv.shape == (3, 0)


def test_none_and_bad_model_configs_are_named():
    p = plan(*layouts([Piece("w", 0, 4, 0, 4, 0, 4)]))
    with pytest.raises(TypeError, match="sources must be a mapping of name -> tensor .*got NoneType"):
        p.execute(None)
    with pytest.raises(TypeError, match="destinations must be a mapping .*got int"):
        p.execute({"a": torch.zeros(16)}, 3)
    cfg = Qwen2Config(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=96, vocab_size=128)
    with pytest.raises(TypeError, match="model_or_state_dict must be a torch.nn.Module or a state dict .*got NoneType"):
        vllm_weights(None, cfg)
    cfg.num_attention_heads = 0
    with pytest.raises(ValueError, match="the model config: num_attention_heads must be an integer >= 1, got 0"):
        ModelSpec.from_hf_config(cfg)

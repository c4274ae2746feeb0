"""The one-shot calls (``vllm_weights(..., reuse=True)``, ``reshard``) called again and again, as a
training loop does: bit-exact against the plain per-parameter torch.cat reference of reshard_refs at every call,
the repeated call taking the short path (no signature, no binding), and every change that must
leave that path -- a tensor replaced, resized, given other memory, its storage freed, a key added,
an output tampered with -- seen. GPU: the same on CUDA, and a call whose pointers changed does not
wait for the GPU."""

import time

import pytest
import torch

import verl_fast
from verl_fast.ops.reshard import ModelSpec, api, hf_layout, oneshot, vllm_layout, vllm_weights

from reshard_refs import plain_config, random_state, ref_vllm

CFG = plain_config("qwen2", num_hidden_layers=3)
SPEC = ModelSpec.from_hf_config(CFG, dtype=torch.float32)


def exact(got: dict, want: dict) -> None:
    assert list(got) == list(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(got[k].view(torch.int32), v.contiguous().view(torch.int32)), k


@pytest.fixture
def signatures(monkeypatch):
    """Counts the calls that took the full path (the state dict's signature computed)."""
    count = [0]
    real = api._signature

    def counting(state):
        count[0] += 1
        return real(state)

    monkeypatch.setattr(api, "_signature", counting)
    return count


def test_repeated_calls_are_bit_exact_and_take_the_short_path(signatures):
    sd = random_state(SPEC)
    for step in range(4):
        with torch.no_grad():  # the trainer's update: in place, same tensors
            for v in sd.values():
                v.mul_(0.5).add_(step)
        for tp, t in ((1, 0), (2, 1)):
            exact(dict(vllm_weights(sd, SPEC, reuse=True, tensor_parallel_size=tp, tp_rank=t)), ref_vllm(sd, CFG, tp, t))
    assert signatures[0] == 2  # the first call of each shard; every later one repeated it


def test_every_change_leaves_the_short_path(signatures):
    sd = random_state(SPEC)
    name = "model.layers.1.mlp.down_proj.weight"
    vllm_name = "model.layers.1.mlp.down_proj.weight"
    first = dict(vllm_weights(sd, SPEC, reuse=True))
    keep = first[vllm_name]

    sd[name] = torch.randn_like(sd[name])  # replaced by another tensor
    exact(dict(vllm_weights(sd, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))

    sd[name].set_(torch.randn(sd[name].shape))  # the same tensor given other memory
    exact(dict(vllm_weights(sd, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))

    shape = sd[name].shape
    sd[name].resize_(shape[0] + 1, shape[1])  # resized (reallocated): refused, naming the tensor
    with pytest.raises(ValueError, match=f"{name}.*must have shape"):
        vllm_weights(sd, SPEC, reuse=True)
    sd[name] = torch.randn(shape)
    exact(dict(vllm_weights(sd, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))

    sd[name].untyped_storage().resize_(0)  # freed under the tensor, as FSDP frees unsharded parameters
    with pytest.raises(ValueError, match=f"{name}.*no memory behind it"):
        vllm_weights(sd, SPEC, reuse=True)
    sd[name] = torch.randn(shape)

    sd["model.layers.0.self_attn.rotary.weight"] = torch.zeros(3)  # a key added: refused as unknown
    with pytest.raises(ValueError, match="unknown source parameter 'model.layers.0.self_attn.rotary.weight'"):
        vllm_weights(sd, SPEC, reuse=True)
    del sd["model.layers.0.self_attn.rotary.weight"]

    out = dict(vllm_weights(sd, SPEC, reuse=True))
    exact(out, ref_vllm(sd, CFG, 1, 0))
    assert out[vllm_name] is keep  # the outputs are still the first call's tensors
    keep.set_(torch.zeros(3))  # an output tampered with: fresh outputs, still right
    exact(dict(vllm_weights(sd, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))
    assert signatures[0] == 9  # every one of the nine calls followed a change: each took the full path


def test_a_new_dict_of_the_same_tensors_and_a_module(signatures):
    sd = random_state(SPEC)
    a = dict(vllm_weights(sd, SPEC, reuse=True))
    b = dict(vllm_weights(dict(sd), SPEC, reuse=True))  # another dict of the same tensors: the short path
    assert all(a[k] is b[k] for k in a) and signatures[0] == 1
    model = torch.nn.Module()  # parameters under their HF names, as a module
    for k, v in sd.items():
        *path, leaf = k.split(".")
        mod = model
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        mod.register_parameter(leaf, torch.nn.Parameter(v.clone()))
    for _ in range(2):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        exact(dict(vllm_weights(model, SPEC, reuse=True)), ref_vllm(model.state_dict(), CFG, 1, 0))
    assert signatures[0] == 2  # the module's parameters are the same objects at every call


def test_new_views_of_the_same_memory_take_the_short_path(signatures):
    """model.state_dict() makes new detached tensors at every call: over the bound tensors' memory
    they repeat the bound plan (no signature), and stay bit-exact as the weights change; a view with
    another memory (a clone) takes the full path, also when the call copied before checking."""
    sd = random_state(SPEC)
    for step in range(3):
        with torch.no_grad():
            for v in sd.values():
                v.add_(step)
        views = {k: v.detach() for k, v in sd.items()}  # new objects, the same memory
        exact(dict(vllm_weights(views, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))
    assert signatures[0] == 1
    views = {k: v.detach() for k, v in sd.items()}
    views["model.norm.weight"] = views["model.norm.weight"].clone()  # other memory
    views["model.norm.weight"].add_(1)
    exact(dict(vllm_weights(views, SPEC, reuse=True)), ref_vllm(views, CFG, 1, 0))
    assert signatures[0] == 2
    for _ in range(2):  # views again: the second call copies first and checks while it copies
        views = {k: v.detach() for k, v in sd.items()}
        exact(dict(vllm_weights(views, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))
    assert signatures[0] == 3
    with torch.no_grad():  # a bound tensor given other memory: the early copy refuses to run
        sd["model.embed_tokens.weight"].set_(sd["model.embed_tokens.weight"].clone().neg_())
    views = {k: v.detach() for k, v in sd.items()}
    exact(dict(vllm_weights(views, SPEC, reuse=True)), ref_vllm(sd, CFG, 1, 0))
    assert signatures[0] == 4
    views = {k: v.detach() for k, v in sd.items()}
    views["model.norm.weight"] = views["model.norm.weight"][: views["model.norm.weight"].numel() // 2]
    with pytest.raises(ValueError, match="model.norm.weight.*must have shape"):  # a narrower view: refused
        vllm_weights(views, SPEC, reuse=True)


def test_only_exact_views_of_the_bound_memory_repeat_a_bound_plan():
    """The C++ check behind the short path: a new tensor object repeats the plan only if it views the
    bound tensor's very elements -- same address, dtype, device, shape and strides."""
    from verl_fast.ops.reshard import plan as make_plan

    sd = random_state(SPEC)
    p = make_plan(hf_layout(SPEC), vllm_layout(SPEC, 1))
    outs = p.allocate_destinations("cpu")
    srcs, dsts = [sd[n] for n in p.src_names], list(outs.values())
    p.execute(srcs, outs)
    assert p.run_bound(srcs, dsts)  # the very objects
    assert p.run_bound([t.detach() for t in srcs], dsts)  # new objects, the same elements
    assert p.run_bound(srcs, [torch.nn.Parameter(t, requires_grad=False) for t in dsts])
    i = next(i for i, t in enumerate(srcs) if t.dim() == 2)
    base = srcs[i]
    rows, cols = base.shape
    for other in (base.as_strided((rows, cols), (1, rows)),  # same address and shape, other strides
                  base.view(torch.int32),  # same address and shape, other dtype
                  base.clone(),  # other memory
                  base.as_subclass(type("Sub", (torch.Tensor,), {}))):  # not a plain tensor
        given = list(srcs)
        given[i] = other
        assert not p.run_bound(given, dsts)
    assert p.run_bound(srcs, dsts)


def test_out_is_written_and_returned():
    sd = random_state(SPEC)
    out = {t.name: torch.full(t.shape, 7.0) for t in vllm_layout(SPEC, 2, {0: 1}).tensors}
    for _ in range(2):
        got = dict(vllm_weights(sd, SPEC, reuse=True, tensor_parallel_size=2, tp_rank=1, out=out))
        assert all(got[k] is out[k] for k in out)
        exact(got, ref_vllm(sd, CFG, 2, 1))
        with torch.no_grad():
            sd["model.norm.weight"].add_(1.0)
    with pytest.raises(ValueError, match="missing destination parameter"):
        vllm_weights(sd, SPEC, reuse=True, tensor_parallel_size=2, tp_rank=1, out={})


def test_reshard_one_shot_repeats_and_sees_new_layouts():
    sd = random_state(SPEC)
    src, dst = hf_layout(SPEC), vllm_layout(SPEC, 2, {0: 0})
    first = verl_fast.reshard(sd, src, dst)
    with torch.no_grad():
        sd["model.embed_tokens.weight"].neg_()
    again = verl_fast.reshard(sd, src, dst)
    assert all(again[k] is first[k] for k in first)
    exact(dict(again), ref_vllm(sd, CFG, 2, 0))
    other = verl_fast.reshard(sd, src, vllm_layout(SPEC, 2, {0: 1}))  # a new layout: its own plan
    exact(dict(other), ref_vllm(sd, CFG, 2, 1))
    same = verl_fast.reshard(sd, hf_layout(SPEC), vllm_layout(SPEC, 2, {0: 0}))  # equal layouts, new objects
    assert all(same[k] is first[k] for k in first)


def test_the_call_cache_is_bounded():
    sd = random_state(SPEC)
    for i in range(oneshot.MAX_CACHED + 3):
        vllm_weights(sd, SPEC, reuse=True, bucket_bytes=(1 << 20) + i)  # other arguments, other plan: new entries
    assert len(oneshot._CALLS) <= oneshot.MAX_CACHED
    assert len(oneshot._PLANS) <= oneshot.MAX_CACHED and len(oneshot._BUFFERS) <= oneshot.MAX_CACHED


# ---- CUDA ----------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_cuda_repeated_calls_bit_exact_with_cpu(signatures):
    sd = random_state(SPEC)
    gpu = {k: v.cuda() for k, v in sd.items()}
    for step in range(3):
        with torch.no_grad():
            for k in sd:
                sd[k].add_(step)
                gpu[k].add_(step)
        for tp, t in ((1, 0), (2, 1)):
            got = {k: v.cpu() for k, v in vllm_weights(gpu, SPEC, reuse=True, tensor_parallel_size=tp, tp_rank=t, device="cuda")}
            exact(got, ref_vllm(sd, CFG, tp, t))
    assert signatures[0] == 2


@pytest.mark.gpu
def test_cuda_new_pointers_do_not_wait_for_the_gpu():
    """A call with other tensors uploads its pointer table on the stream: it returns while earlier
    work still runs, and its result is right once that work is done; likewise on another stream."""
    sd = random_state(SPEC)
    dict(vllm_weights({k: v.cuda() for k, v in sd.items()}, SPEC, reuse=True, device="cuda"))  # plan, outputs
    fresh = {k: (v + 1).cuda() for k, v in sd.items()}
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # a second or so of GPU time queued ahead of the call
    done = torch.cuda.Event()
    t0 = time.perf_counter()
    out = dict(vllm_weights(fresh, SPEC, reuse=True, device="cuda"))
    done.record()
    host = time.perf_counter() - t0
    assert not done.query(), f"the call waited for the GPU ({host * 1e3:.0f} ms)"
    exact({k: v.cpu() for k, v in out.items()}, ref_vllm({k: v + 1 for k, v in sd.items()}, CFG, 1, 0))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = {k: (v - 1).cuda() for k, v in sd.items()}
        out = {k: v.cpu() for k, v in vllm_weights(other, SPEC, reuse=True, device="cuda")}
    exact(out, ref_vllm({k: v - 1 for k, v in sd.items()}, CFG, 1, 0))


def test_the_extension_refuses_a_tensor_outside_its_storage():
    """Whatever the wrapper checks, _C itself never takes a tensor whose storage was freed or shrunk."""
    p = verl_fast.reshard.plan(hf_layout(SPEC), vllm_layout(SPEC, 1))
    sd = random_state(SPEC)
    srcs = [sd[n] for n in p.src_names]
    dsts = list(p.allocate_destinations().values())
    slots = [torch.empty(16, dtype=torch.uint8) for _ in range(4)]
    p._c.bind(srcs, dsts, slots[:2], slots[2:])
    for shrink in (0, 8):
        srcs[3] = torch.randn(sd[p.src_names[3]].shape)
        srcs[3].untyped_storage().resize_(shrink)
        with pytest.raises(ValueError, match="lies outside its storage"):
            p._c.bind(srcs, dsts, slots[:2], slots[2:])


def test_an_alias_swapped_for_an_unknown_name_is_refused():
    cfg = plain_config("qwen2", tie_word_embeddings=True)
    spec = ModelSpec.from_hf_config(cfg, dtype=torch.float32)
    sd = random_state(spec)
    sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # a tied model's state dict carries the alias
    exact(dict(vllm_weights(sd, spec, reuse=True)), ref_vllm(sd, cfg, 1, 0))
    sd["lm_head.bias"] = sd.pop("lm_head.weight")  # same count of keys, all the layout's names present
    with pytest.raises(ValueError, match="unknown source parameter 'lm_head.bias'"):
        vllm_weights(sd, spec, reuse=True)

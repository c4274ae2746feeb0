"""How the trainer sizes the vLLM engine it builds (rollout/factory.py, rollout/vllm_engine.py): the
KV cache for one step, the CUDA-graph batch sizes, the sleep level, and the placeholder folder named
by its contents. No engine is started here."""

import os

import pytest
import torch

from tiny_models import build_tokenizer, tiny_model
from verl_fast.rollout import factory
from verl_fast.rollout.vllm_engine import capture_sizes


def test_step_kv_cache_bytes_counts_k_and_v_of_every_layer():
    cfg = tiny_model("qwen2").config  # 2 layers, 2 KV heads, head_dim 16
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    # 5 sequences of 37 tokens: 3 blocks of 16 each; K and V; bf16; the 1.25 margin
    want = 1.25 * 5 * 48 * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 2
    assert factory.step_kv_cache_bytes(cfg, 5, 37, "bfloat16", 1) == int(want)
    assert factory.step_kv_cache_bytes(cfg, 5, 37, "float32", 1) == int(2 * want)
    assert factory.step_kv_cache_bytes(cfg, 5, 37, "bfloat16", 2) == int(want / 2)  # KV heads split over TP


def test_step_kv_cache_bytes_unknown_config():
    class Opaque:
        hidden_size = 64

    assert factory.step_kv_cache_bytes(Opaque(), 4, 32, "bfloat16", 1) is None


def test_engine_length_is_held_to_the_models_positions():
    """With rollout.max_model_len unset the engine's length is the longest prompt plus the new tokens, but never
    past the model's positions (vLLM refuses such a length: the GPU's FP8 engine test met it at 512 + 8)."""
    from verl_fast import config

    model = tiny_model("qwen2")
    positions = model.config.max_position_embeddings
    cfg = config.from_dict({"trainer": {"max_prompt_length": positions}, "rollout": {"max_new_tokens": 8}})
    assert factory.derived_max_len(cfg, model) == positions
    cfg = config.from_dict({"trainer": {"max_prompt_length": 64}, "rollout": {"max_new_tokens": 8}})
    assert factory.derived_max_len(cfg, model) == 72


def test_capture_sizes_follow_vllm_stride_up_to_the_batch():
    assert capture_sizes(1) == [1]
    assert capture_sizes(16) == [1, 2, 4, 8, 16]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(300)
    assert sizes[:4] == [1, 2, 4, 8] and 248 in sizes and 256 in sizes and 272 in sizes and sizes[-1] == 300
    assert sizes == sorted(set(sizes))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="cudagraph_batch"):
            capture_sizes(bad)


def test_sleep_level_auto(monkeypatch):
    assert factory.resolve_sleep_level(2, False, 1) == 2  # a set level is kept
    assert factory.resolve_sleep_level(None, True, 1) == 1  # LoRA: the base weights must survive
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: type("P", (), {"total_memory": 8 << 30})())
    assert factory.resolve_sleep_level(None, False, 1 << 30) == 0  # an eighth of the GPU: kept resident
    assert factory.resolve_sleep_level(None, False, (1 << 30) + 1) == 2


def test_engine_weight_bytes():
    model = tiny_model("qwen2")
    numel = sum(p.numel() for p in model.parameters())
    assert factory.engine_weight_bytes(model, "bfloat16") == 2 * numel
    assert factory.engine_weight_bytes(model, "float32") == 4 * numel


def test_engine_folder_named_by_its_contents(tmp_path, monkeypatch):
    monkeypatch.setenv("VERL_FAST_CACHE", str(tmp_path))
    tok = build_tokenizer(vocab_size=320)
    a = factory.engine_folder(tiny_model("qwen2", vocab_size=len(tok)), tok)
    b = factory.engine_folder(tiny_model("qwen2", vocab_size=len(tok), seed=1), tok)  # other weights, same config
    c = factory.engine_folder(tiny_model("qwen2", vocab_size=len(tok), num_hidden_layers=3), tok)
    assert a == b != c  # vLLM's compile cache, keyed on the path, is found again for the same model
    assert os.path.dirname(a) == str(tmp_path / "engine_models")
    assert sorted(os.listdir(a)) == sorted(os.listdir(c)) and "config.json" in os.listdir(a)
    assert not [f for f in os.listdir(tmp_path / "engine_models") if "." in f]  # no staging folder left


def test_shutdown_on_cuda_frees_the_model_before_the_engine_stops(monkeypatch):
    """vLLM 0.26 lets go of its sleep allocator's pools in the engine's shutdown; memory freed after
    that stays on the allocator's books and the next engine in the process is refused. So on CUDA the
    model's own finalizer runs, the worker drops the model and a collection runs, then the shutdown."""
    import weakref

    from verl_fast.rollout import vllm_compat

    order = []

    class Runner:
        def shutdown(self):
            order.append("runner dropped the model")

    class Worker:
        model_runner = Runner()

    class Wrapper:  # vLLM's WorkerWrapperBase, which collective_rpc calls with
        worker = Worker()

    class Core:
        def shutdown(self):
            order.append("engine shutdown")

    class Engine:
        engine_core = Core()

    class LLM:
        llm_engine = Engine()

        def collective_rpc(self, fn):
            return [fn(Wrapper())]

    llm = LLM()
    llm.llm_engine._finalizer = weakref.finalize(llm.llm_engine, order.append, "vLLM's model clean-up")
    monkeypatch.setattr(vllm_compat, "collect", lambda: order.append("collected"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    vllm_compat.shutdown(llm)
    assert order == ["vLLM's model clean-up", "runner dropped the model", "collected", "engine shutdown"]
    assert Wrapper.worker.model_runner is None  # the runner's own references go with it before the shutdown
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    order.clear()
    vllm_compat.shutdown(llm)  # the CPU engine has no sleep allocator: straight to the shutdown
    assert order == ["engine shutdown"]


def test_collect_frees_cycles_from_a_frozen_heap():
    """vLLM freezes the garbage collector's heap after an engine starts; the collection that frees a
    closed engine's model must reach the cycles made before the freeze."""
    import gc
    import weakref

    from verl_fast.rollout import vllm_compat

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a
    alive = weakref.ref(a)
    gc.freeze()
    try:
        del a, b
        vllm_compat.collect()
        assert alive() is None
    finally:
        gc.unfreeze()


def test_referrer_chain_names_what_holds_a_tensor():
    """The message for memory left on vLLM's sleep allocator names the chain of holders."""
    from verl_fast.rollout import vllm_compat

    class Holder:
        pass

    tensor = torch.zeros(2)
    holder = Holder()
    holder.table = {"kv": tensor}
    assert vllm_compat._referrer_chain(tensor, 3, ignore=set()).startswith("dict['kv'] <- ")
    assert "Holder" in vllm_compat._referrer_chain(tensor, 3, ignore=set())
    assert vllm_compat.sleep_allocator_holders() == []  # no sleep allocator on this machine

    def suspended():
        kept = torch.ones(3)
        yield
        del kept

    paused = suspended()
    next(paused)  # its frame now holds the tensor
    held = next(t for t in paused.gi_frame.f_locals.values() if isinstance(t, torch.Tensor))
    assert vllm_compat._referrer_chain(held, 1, ignore=set()).startswith("generator ")
    assert "suspended" in vllm_compat._referrer_chain(held, 1, ignore=set())

    import threading
    import weakref

    found, ready, done = [], threading.Event(), threading.Event()

    def running():
        kept = torch.ones(2)
        found.append(weakref.ref(kept))
        ready.set()
        done.wait()

    thread = threading.Thread(target=running)
    thread.start()
    ready.wait()
    try:  # a running thread's locals (here a cell of its frame) are out of the collector's sight: said so
        chain = vllm_compat._referrer_chain(found[0](), 3, ignore=set())
        assert chain.endswith("nothing the collector sees (a running thread's frame, or C++)"), chain
    finally:
        done.set()
        thread.join()


def test_holder_walk_passes_over_tensors_without_memory(monkeypatch):
    """torch.compile's fake tensors claim a device but have no memory to locate: the walk (run by an
    engine's close on the GPU) passed over none of them before and failed on their storage."""
    import types

    from verl_fast.rollout import vllm_compat

    class Memoryless(torch.Tensor):
        @property
        def is_cuda(self):
            return True

        def untyped_storage(self):
            raise RuntimeError("Cannot access data pointer of Tensor (e.g. FakeTensor, FunctionalTensor)")

    kept = torch.Tensor._make_subclass(Memoryless, torch.zeros(1))
    books = {7: types.SimpleNamespace(tag="weights", handle=(0, 2 << 20, 1 << 40, None))}
    monkeypatch.setattr(vllm_compat, "_sleep_allocator", lambda: types.SimpleNamespace(pointer_to_data=books))
    assert kept.is_cuda and vllm_compat.sleep_allocator_holders() == []


def test_set_aside_allocations_leave_the_books_and_are_still_found_when_freed(monkeypatch):
    """What a closed engine left on vLLM's sleep allocator is taken off its books (the next engine
    loads), and the allocator's free callback still finds it if its tensor is freed after all."""
    import types

    from verl_fast.rollout import vllm_compat

    cumem = pytest.importorskip("vllm.device_allocator.cumem", reason="a vLLM with the sleep allocator")

    def entry(tag, size, ptr):
        return types.SimpleNamespace(tag=tag, handle=(0, size, ptr, None))

    books = {10: entry("weights", 2 << 20, 10), 20: entry("kv_cache", 4096, 20)}
    allocator = types.SimpleNamespace(pointer_to_data=books)
    monkeypatch.setattr(cumem.CuMemAllocator, "instance", allocator, raising=False)
    assert vllm_compat.set_aside_sleep_allocations() == {"weights": 2 << 20, "kv_cache": 4096}
    assert vllm_compat.sleep_allocator_usage() == {} and vllm_compat.sleep_allocations_set_aside() == (2 << 20) + 4096
    allocator.pointer_to_data[30] = entry("weights", 512, 30)  # the next engine's allocation
    assert vllm_compat.sleep_allocator_usage() == {"weights": 512}
    assert allocator.pointer_to_data.pop(20).tag == "kv_cache"  # a late free of a set-aside allocation
    assert allocator.pointer_to_data.pop(30).handle[1] == 512
    assert vllm_compat.set_aside_sleep_allocations() == {}  # nothing left on the books
    assert vllm_compat.sleep_allocations_set_aside() == 2 << 20


def test_decode_responses_falls_back_to_the_tokenizer_protocols_decode():
    """vLLM's tokenizer protocol has only decode(ids, skip_special_tokens); its Mistral tokenizer's
    batch_decode takes no clean-up argument: both still give the texts."""
    from verl_fast.rollout import vllm_compat

    class Protocol:
        def decode(self, ids, skip_special_tokens=False):
            return "-".join(str(i) for i in ids if not (skip_special_tokens and i == 0))

    class Mistral(Protocol):
        def batch_decode(self, ids, skip_special_tokens=False):
            return [self.decode(x, skip_special_tokens) for x in ids]

    for tokenizer in (Protocol(), Mistral()):
        assert vllm_compat.decode_responses(tokenizer, [[0, 5, 6], [7]]) == ["5-6", "7"]


def test_rollout_type_auto(monkeypatch):
    """``auto``: the compiled HF decode for a whole actor on one GPU (the faster measured there),
    else vLLM where it is installed and runs in process, else HF."""
    import verl_fast.rollout as rollout
    from verl_fast.rollout import vllm_compat

    model = tiny_model("qwen2")
    assert not factory.compiles_decode(model)  # a CPU actor: eager decode steps
    assert factory.compiles_decode(model, True) and not factory.compiles_decode(model, False)  # as set
    monkeypatch.setattr(rollout, "vllm_available", lambda: True)
    monkeypatch.setattr(vllm_compat, "in_process_mode", lambda: True)
    assert factory.resolve_type("auto", model) == "vllm"  # not on a GPU
    monkeypatch.setattr(factory, "compiles_decode", lambda actor: True)  # as on a GPU
    assert factory.resolve_type("auto", model) == "hf"
    assert factory.resolve_type("vllm", model) == "vllm"  # a set type is kept
    assert factory.resolve_type("auto", None) == "vllm"  # no whole actor to decode with (Megatron's)
    model.peft_config = {"default": None}
    assert factory.resolve_type("auto", model) == "hf"  # a PEFT actor: adapters merged into the compiled decode
    del model.peft_config
    moe = tiny_model("qwen3_moe")
    assert factory.resolve_type("auto", moe) == "vllm"  # a mixture of experts: vLLM's fused expert kernels
    model.config._attn_implementation = "eager"  # a model the fast decode cannot run
    assert factory.resolve_type("auto", model) == "vllm"
    model.config._attn_implementation = "sdpa"
    monkeypatch.setattr(factory.distributed, "world_size", lambda: 2)
    assert factory.resolve_type("auto", model) == "vllm"  # several processes: vLLM's data-parallel engines
    monkeypatch.setattr(rollout, "vllm_available", lambda: False)
    assert factory.resolve_type("auto", model) == "hf"


@pytest.mark.gpu
def test_decode_compiles_for_a_whole_actor_on_the_gpu():
    assert factory.compiles_decode(tiny_model("qwen2").to("cuda"))

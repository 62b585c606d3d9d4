"""EngineConfig sources and precedence: defaults < file < environment < arguments; clear errors."""

from __future__ import annotations

import pytest

from turnout.config import EngineConfig
from turnout.errors import ConfigError


def test_defaults_are_documented():
    cfg = EngineConfig()
    assert (cfg.attention_backend, cfg.executor, cfg.block_size, cfg.enable_prefix_caching) == (
        "auto",
        "auto",
        None,  # fitted to the chosen backend: turnout.defaults
        True,
    )
    assert all(f.description or f.annotation is int for f in EngineConfig.model_fields.values())


@pytest.mark.parametrize("ext", ["toml", "yaml"])
def test_precedence(tmp_path, monkeypatch, ext):
    f = tmp_path / f"c.{ext}"
    body = {
        "toml": 'block_size = 32\nmax_num_seqs = 8\ntensor_parallel_size = 2\nattention_backend = "cpu"\n',
        "yaml": "block_size: 32\nmax_num_seqs: 8\ntensor_parallel_size: 2\nattention_backend: cpu\n",
    }[ext]
    f.write_text(body)
    monkeypatch.setenv("TURNOUT_MAX_NUM_SEQS", "16")
    monkeypatch.setenv("TURNOUT_TENSOR_PARALLEL_SIZE", "4")
    monkeypatch.setenv("TURNOUT_CUDAGRAPH_CAPTURE_SIZES", "[4, 1, 2]")
    cfg = EngineConfig.load(f, tensor_parallel_size=8)
    assert cfg.block_size == 32  # file over default
    assert cfg.max_num_seqs == 16  # env over file
    assert cfg.tensor_parallel_size == 8  # argument over env
    assert cfg.attention_backend == "cpu"
    assert cfg.cudagraph_capture_sizes == [1, 2, 4]
    assert cfg.max_num_batched_tokens == EngineConfig().max_num_batched_tokens  # default


def test_unknown_key_in_file_names_key_and_file(tmp_path):
    f = tmp_path / "bad.toml"
    f.write_text("blok_size = 32\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(f)
    msg = str(e.value)
    assert "'blok_size'" in msg and str(f) in msg and "block_size" in msg and "\n" not in msg


def test_bad_value_names_key_source_and_accepted_values(tmp_path, monkeypatch):
    f = tmp_path / "bad.yaml"
    f.write_text("dtype: float8\n")
    with pytest.raises(ConfigError) as e:
        EngineConfig.load(f)
    msg = str(e.value)
    assert "'dtype'" in msg and str(f) in msg and "'bfloat16'" in msg
    monkeypatch.setenv("TURNOUT_BLOCK_SIZE", "-3")
    with pytest.raises(ConfigError, match=r"'block_size' in environment.*greater than or equal to 1"):
        EngineConfig.load()
    monkeypatch.delenv("TURNOUT_BLOCK_SIZE")
    with pytest.raises(ConfigError, match="'gpu_memory_utilization' in arguments"):
        EngineConfig.load(gpu_memory_utilization=1.5)


def test_unknown_env_field_and_bad_files(tmp_path, monkeypatch):
    monkeypatch.setenv("TURNOUT_NOT_A_FIELD", "1")
    with pytest.raises(ConfigError, match="unknown key 'not_a_field' in environment"):
        EngineConfig.load()
    monkeypatch.delenv("TURNOUT_NOT_A_FIELD")
    with pytest.raises(ConfigError, match="not found"):
        EngineConfig.load(tmp_path / "missing.toml")
    (tmp_path / "c.ini").write_text("x=1")
    with pytest.raises(ConfigError, match="unknown extension"):
        EngineConfig.load(tmp_path / "c.ini")
    (tmp_path / "c.toml").write_text("x = = 1")
    with pytest.raises(ConfigError, match="does not parse"):
        EngineConfig.load(tmp_path / "c.toml")

"""The adaptive policy's start-up cost profile is kept on disk and reused by the next start."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from streamsd.config import EngineConfig, SpecConfig
from streamsd.engine.builder import build_runtime
from streamsd.policy.adaptive import CostTable
from streamsd.policy.adaptive.cost import StepTable
from streamsd.policy.adaptive.shape import ShapeTable
from streamsd.policy.profile_cache import cache_mode, load_or_profile, table_from_json, table_to_json

KEY = {"model": "m", "device": "cpu: test", "dtype": "torch.float32", "threads": 1}


def _table(scale: float = 1.0) -> CostTable:
    shape = ShapeTable.from_samples({(1, 1): 0.01 * scale, (1, 5): 0.02 * scale, (4, 1): 0.03 * scale},
                                    padded=False, batches=(1, 4), widths=(1, 2, 5))
    table = CostTable.from_samples({1: 0.01 * scale, 64: 0.05 * scale}, {1: 0.002 * scale}, shape=shape)
    table.catchup = table.draft
    table.tree = StepTable.from_samples({1: 0.015 * scale, 4: 0.04 * scale})
    return table


class Measure:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> CostTable:
        self.calls += 1
        return _table(self.calls)


def _same(a: CostTable, b: CostTable) -> bool:
    return table_to_json(a) == table_to_json(b)


def test_a_profile_round_trips_through_json():
    table = _table()
    back = table_from_json(json.loads(json.dumps(table_to_json(table))))
    assert _same(back, table) and back.tree.keys == (1, 4)  # a tree engine's whole tree steps too


def test_the_second_start_reads_the_profile_the_first_one_measured(tmp_path):
    measure = Measure()
    first, source = load_or_profile(KEY, measure, home=tmp_path)
    assert source is None and measure.calls == 1
    second, source = load_or_profile(KEY, measure, home=tmp_path)
    assert measure.calls == 1 and source is not None and source.parent == tmp_path / "profiles"
    assert _same(first, second)
    assert [p.suffix for p in (tmp_path / "profiles").iterdir()] == [".json"]  # no temporary file left


def test_another_setup_gets_a_profile_of_its_own(tmp_path):
    measure = Measure()
    load_or_profile(KEY, measure, home=tmp_path)
    other, source = load_or_profile({**KEY, "threads": 2}, measure, home=tmp_path)
    assert source is None and measure.calls == 2 and _same(other, _table(2))
    assert _same(load_or_profile(KEY, measure, home=tmp_path)[0], _table(1)) and measure.calls == 2


@pytest.mark.parametrize("content", ["{not json", '{"key": 1}', "", '{"key": {}, "table": {}}'])
def test_a_corrupt_profile_is_ignored_and_rewritten(tmp_path, content):
    measure = Measure()
    _, _ = load_or_profile(KEY, measure, home=tmp_path)
    (path,) = (tmp_path / "profiles").iterdir()
    path.write_text(content)
    table, source = load_or_profile(KEY, measure, home=tmp_path)
    assert source is None and measure.calls == 2 and _same(table, _table(2))
    assert _same(load_or_profile(KEY, measure, home=tmp_path)[0], _table(2)) and measure.calls == 2


def test_a_profile_stored_for_another_key_is_ignored_and_rewritten(tmp_path):
    measure = Measure()
    load_or_profile(KEY, measure, home=tmp_path)
    (path,) = (tmp_path / "profiles").iterdir()
    doc = json.loads(path.read_text())
    doc["key"]["threads"] = 7  # what a file written by another set-up under this name would hold
    path.write_text(json.dumps(doc))
    assert load_or_profile(KEY, measure, home=tmp_path)[1] is None and measure.calls == 2
    assert json.loads(path.read_text())["key"]["threads"] == 1


def test_refresh_measures_again_and_off_writes_nothing(tmp_path):
    measure = Measure()
    load_or_profile(KEY, measure, home=tmp_path)
    table, source = load_or_profile(KEY, measure, home=tmp_path, mode="refresh")
    assert source is None and measure.calls == 2
    assert _same(load_or_profile(KEY, measure, home=tmp_path)[0], _table(2))
    off = tmp_path / "off"
    load_or_profile(KEY, measure, home=off, mode="off")
    load_or_profile(KEY, measure, home=off, mode="off")
    assert measure.calls == 4 and not off.exists()


def test_the_mode_comes_from_the_environment_when_not_given(monkeypatch):
    monkeypatch.setenv("STREAMSD_PROFILE_CACHE", "refresh")
    assert cache_mode(None) == "refresh" and cache_mode("off") == "off"
    monkeypatch.delenv("STREAMSD_PROFILE_CACHE")
    assert cache_mode(None) == "reuse"
    with pytest.raises(ValueError, match="profile cache"):
        cache_mode("sometimes")


def test_an_engine_built_twice_reuses_its_start_up_profile(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path))
    cfg = EngineConfig(model=str(tiny_model_dir), spec=SpecConfig(method="ngram", num_tokens=3, policy="adaptive"),
                       device="cpu", dtype="float32", kv_cache_tokens=2048, max_num_seqs=4,
                       max_num_batched_tokens=64, profile_cache="reuse")
    first = build_runtime(cfg).policy.cost
    (saved,) = (tmp_path / "profiles").iterdir()
    second = build_runtime(cfg).policy.cost
    # Timings measured twice never agree to the last bit: equal tables mean the second was read back.
    assert first.shape is not None and _same(first, second)
    assert json.loads(saved.read_text())["key"]["max_batch"] == 4


def test_triton_keeps_its_kernels_under_the_streamsd_home_unless_told_otherwise(tmp_path, monkeypatch):
    from streamsd.engine.builder import use_triton_cache

    monkeypatch.setenv("STREAMSD_HOME", str(tmp_path))
    monkeypatch.delenv("TRITON_CACHE_DIR", raising=False)
    use_triton_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "triton")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "mine"))
    use_triton_cache()
    assert os.environ["TRITON_CACHE_DIR"] == str(tmp_path / "mine")


def _cpu_name(capability: str | None) -> str:
    env = {**os.environ, **({"ATEN_CPU_CAPABILITY": capability} if capability else {})}
    code = "import torch; from streamsd.worker.profile import device_name; print(device_name(torch.device('cpu')))"
    return subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True).stdout.strip()


def test_a_cpu_limited_to_other_vector_instructions_gets_a_profile_of_its_own():
    """A virtual machine may name its CPU alike on hosts with and without AVX-512: the key says which
    instructions torch's kernels use (here the same machine told to use none beyond the baseline)."""
    if torch.backends.cpu.get_cpu_capability() == "DEFAULT":
        pytest.skip("this CPU has no vector instructions beyond the baseline to turn off")
    full, baseline = _cpu_name(None), _cpu_name("default")
    assert full.endswith(torch.backends.cpu.get_cpu_capability()) and baseline.endswith("DEFAULT")
    assert full.rsplit(",", 1)[0] == baseline.rsplit(",", 1)[0]  # the same model and cores

"""The GPU runner's helpers that run on the development machine (`benchmarks/gpu/`): `host_split.py`
splits py-spy's collapsed stacks of a decoding loop (the `hostprof` job), the warm-up's and imports'
samples left out; `prepare_carry.py` gives the processor files the Qwen3.5 checkpoints' bounds, not
the tiny fixture's (a 1,024-pixel image must reach the 35B-A3B shape's vision tower whole)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

import pytest

from mlx_relay.testing.scripts import load_script

_GPU = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu"


def _script(name: str) -> ModuleType:
    return load_script(_GPU / f"{name}.py", name)


def test_host_split_counts_the_loops_samples_by_lane_frame_call_and_leaf(tmp_path: Path) -> None:
    main = "<module> (benchmarks/bench_speculation.py:400)"
    step = "DecodeBatch.step (mlx_relay/engine/lanes/decode_batch.py:109)"
    launch = "CompiledCohort._launch (mlx_relay/engine/lanes/mtp_compiled.py:144)"
    stacks = [
        (f"{main};{step};0x7f01 (core.so);mlx::core::async_eval (libmlx.so);mlx::core::eval_impl (libmlx.so)", 30),
        (f"{main};{step};mlx::core::async_eval (libmlx.so);pthread_cond_signal (libc.so.6)", 10),
        (f"{main};{launch};mlx::core::async_eval (libmlx.so);malloc (libc.so.6)", 5),
        (f"{main};PlainLane.warm (mlx_relay/engine/lanes/plain_lane.py:80);{step};x (libmlx.so)", 100),  # warm-up
        (f"{main};_find_and_load (<frozen importlib._bootstrap>:1176);{step}", 50),  # an import
        (f"{main};Tokenizer.decode (tokenizers.py:3)", 7),  # not the loop
    ]
    path = tmp_path / "hostprof_none.txt"
    path.write_text("\n".join(f"{frames} {n}" for frames, n in stacks) + "\n")
    hs = _script("host_split")
    parts = hs.split(hs.stacks(path))
    assert parts["lane frame"] == {step: 40, launch: 5}
    assert parts["below it"] == {"mlx::core::async_eval (libmlx.so)": 45}  # the binding's address skipped
    assert parts["leaf"] == {"mlx::core::eval_impl (libmlx.so)": 30, "pthread_cond_signal (libc.so.6)": 10,
                             "malloc (libc.so.6)": 5}


def test_the_carried_processor_files_have_the_checkpoints_bounds() -> None:
    pc = _script("prepare_carry")
    tiny = {"size": {"shortest_edge": 1024, "longest_edge": 65536}, "patch_size": 16, "max_frames": 8}
    image = pc.with_checkpoint_sizes("preprocessor_config.json", tiny)
    video = pc.with_checkpoint_sizes("video_preprocessor_config.json", tiny)
    assert image["size"]["longest_edge"] == 16777216 >= 1024 * 1024 and image["patch_size"] == 16
    assert video["size"] == {"shortest_edge": 4096, "longest_edge": 25165824} and video["max_frames"] == 768
    assert pc.with_checkpoint_sizes("generation_config.json", {"top_k": 20}) == {"top_k": 20}


def test_a_4bit_larger_shape_spilled_to_another_dir_loads_with_its_head(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """`build_random_model.py --shape 397b-a17b --bits 4 --spill-dir` (issue 46.2, at toy size): the
    config names the routers quantized at 8 bits (a 4-bit checkpoint without them did not load, its
    MTP head neither), and shards written to the spill dir, linked from the model's, load."""
    import json

    import mlx.core as mx

    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.engine.models.qwen3_5.mtp import load_mtp_drafter
    from mlx_relay.testing.qwen_vocab import qwen35_tokenizer_path

    brm = _script("build_random_model")
    monkeypatch.setattr(brm, "SPILL_RESERVE", 1 << 62)  # no filesystem has that much free: every shard spills
    cache_limit = mx.set_cache_limit(0)  # the build turns MLX's buffer cache off: given back after
    try:
        out = brm.build(tmp_path / "m", qwen35_tokenizer_path(), tiny=True, seed=0, shape="397b-a17b", bits=4,
                        layers=4, spill=tmp_path / "spill")
    finally:
        mx.set_cache_limit(cache_limit)
    shards = sorted(p.name for p in out.glob("*.safetensors"))
    assert shards == [*(f"model-layer-{i:03d}.safetensors" for i in range(4)), "model-mtp.safetensors",
                      "model-rest.safetensors"]
    assert all((out / n).is_symlink() and (tmp_path / "spill" / n).is_file() for n in shards)
    config = json.loads((out / "config.json").read_text())
    quantization = config["quantization"]
    assert quantization["bits"] == 4
    assert quantization["mtp.layers.0.mlp.gate"]["bits"] == 8
    assert all(quantization[f"language_model.model.layers.{i}.mlp.gate"]["bits"] == 8 for i in range(4))
    loaded = load_model(out)
    assert len(loaded.model.language_model.model.layers) == 4
    assert load_mtp_drafter(out, config) is not None

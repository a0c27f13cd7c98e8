"""The GPU runner's helpers that run on the development machine (`benchmarks/gpu/`): `host_split.py`
splits py-spy's collapsed stacks of a decoding loop (the `hostprof` job), the warm-up's and imports'
samples left out; `prepare_carry.py` gives the processor files the Qwen3.5 checkpoints' bounds, not
the tiny fixture's (a 1,024-pixel image must reach the 35B-A3B shape's vision tower whole)."""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

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

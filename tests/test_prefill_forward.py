"""The Qwen3.5 family's prefill over the library's caches (issue 43.2: `models/qwen3_5/prefill.py`)
is the library's forward, float32: a chunked prompt into a lone row's caches and a ragged batch
(left-padded keys, a right-padded chunk) give mlx-vlm's own hidden states and leave the same
caches, on the dense fixture and on a mixture-of-experts model; the attention in blocks of
queries equals one block; the grouped experts (`kernels.grouped_experts`, the GPU's path) equal
the library's `SwitchGLU` on float and 8-bit experts. On this CPU the recurrence and the conv are
the library's (`kernels.gated_delta_prefill.fallback`); `benchmarks/gpu/kernel_check.py` pins the
CUDA kernel against it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_decode_step import _positions
from tests.test_moe_decode import CONFIG as MOE_CONFIG
from tests.test_moe_decode import build_moe_lm

TOL = 2e-5
#: on the CPU our prefill runs the GatedDeltaNet recurrence in its own forms (`kernels/gated_delta_cpu.py`)
#: where the library's forward runs its chunked scan: the same arithmetic in another order, equal to
#: float32 rounding (~3e-5 at most on the fixture's states ~4)
FORMS_TOL = 1e-4


@pytest.fixture(scope="module")
def dense(gpu: Callable, fp32_model: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(fp32_model).model.language_model)


@pytest.fixture(scope="module")
def moe(gpu: Callable) -> Any:
    return gpu(lambda: build_moe_lm(5))


def _states(caches: list[Any]) -> list[Any]:
    import mlx.core as mx

    out = []
    for c in caches:
        state = c.state
        out.extend(x for x in (state if isinstance(state, (list, tuple)) else [state]) if isinstance(x, mx.array))
    return out


def _close(a: Any, b: Any, tol: float = TOL) -> bool:
    import mlx.core as mx

    return a.shape == b.shape and bool(mx.allclose(a, b, atol=tol, rtol=tol))


def _ours(lm: Any, ids: Any, caches: list[Any], positions: Any, options: Any = None) -> Any:
    from mlx_relay.engine.lanes.stage_forward import ModelForward
    from mlx_relay.engine.models.prefill_options import PrefillOptions

    return ModelForward(lm, options or PrefillOptions()).prefill(ids, None, caches, positions)


def _library(lm: Any, ids: Any, caches: list[Any], positions: Any) -> Any:
    from mlx_relay.engine.memory.batch_caches import batched

    return lm(ids, cache=caches, **batched(position_ids=positions, return_hidden=True,
                                           skip_logits=True)).hidden_states[-1]


@pytest.mark.parametrize("model", ["dense", "moe"])
@pytest.mark.parametrize("attention_bytes", [1 << 30, 1], ids=["one-block", "blocks"])
def test_a_chunked_prompt_prefills_as_the_library(gpu: Callable, request: pytest.FixtureRequest, model: str,
                                                  attention_bytes: int) -> None:
    """A lone row's prompt in four chunks into batch-1 caches: 70 tokens, a single token, 29 and 50
    (on the CPU our GatedDeltaNet recurrence: chunkwise, and for the single token sequential), within
    `FORMS_TOL` of the library's forward (its chunked scan)."""
    lm = request.getfixturevalue(model)

    def run() -> tuple[bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.models.prefill_options import PrefillOptions

        prompt = [(7 * i + 3) % 400 + 10 for i in range(150)]
        ours_cache, ref_cache = lm.make_cache(), lm.make_cache()
        hidden_ok = True
        for a, b in ((0, 70), (70, 71), (71, 100), (100, 150)):
            ids = mx.array([prompt[a:b]])
            ours = _ours(lm, ids, ours_cache, _positions(a, b), PrefillOptions(attention_bytes=attention_bytes))
            ref = _library(lm, ids, ref_cache, _positions(a, b))
            mx.eval(ours, ref, _states(ours_cache), _states(ref_cache))
            hidden_ok = hidden_ok and _close(ours, ref, FORMS_TOL)
        caches_ok = all(_close(x, y, FORMS_TOL) for x, y in zip(_states(ours_cache), _states(ref_cache), strict=True))
        return hidden_ok, caches_ok

    assert gpu(run) == (True, True)


@pytest.mark.parametrize("model", ["dense", "moe"])
def test_a_ragged_batch_prefills_as_the_library(gpu: Callable, request: pytest.FixtureRequest, model: str) -> None:
    """Two rows in one chunk as the plain lane's `PrefillBatch` runs them: one restored at 24
    tokens (the other's keys left-padded), the other from scratch and right-padded in the chunk."""
    lm = request.getfixturevalue(model)

    def run() -> tuple[bool, bool]:
        import mlx.core as mx

        from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches

        first = [(5 * i + 1) % 300 + 20 for i in range(40)]
        second = [(11 * i + 2) % 300 + 20 for i in range(10)]

        def batch() -> list[Any]:
            row = lm.make_cache()
            _library(lm, mx.array([first[:24]]), row, _positions(0, 24))
            caches = as_batch_caches(row)
            extend_caches(caches, as_batch_caches(lm.make_cache()))
            for c in caches:
                c.prepare(lengths=[16, 10], right_padding=[0, 6])
            return caches

        ids = mx.array([first[24:40], second + [0] * 6])
        positions = mx.concatenate([_positions(24, 40), _positions(0, 16)], axis=1)
        ours_cache, ref_cache = batch(), batch()
        ours = _ours(lm, ids, ours_cache, positions)
        ref = _library(lm, ids, ref_cache, positions)
        for c in (*ours_cache, *ref_cache):
            c.finalize()
        mx.eval(ours, ref, _states(ours_cache), _states(ref_cache))
        hidden_ok = _close(ours[0], ref[0]) and _close(ours[1, :10], ref[1, :10])
        caches_ok = all(_close(x, y) for x, y in zip(_states(ours_cache), _states(ref_cache), strict=True))
        return hidden_ok, caches_ok

    assert gpu(run) == (True, True)


def test_attention_in_blocks_equals_one_block(gpu: Callable) -> None:
    def run() -> list[bool]:
        import mlx.core as mx

        from mlx_relay.engine.models.attention import blocked_attention

        mx.random.seed(1)
        q = mx.random.normal((2, 4, 100, 32))
        k, v = mx.random.normal((2, 2, 300, 32)), mx.random.normal((2, 2, 300, 32))
        mask = mx.broadcast_to((mx.arange(300)[None, :] <= mx.arange(200, 300)[:, None])[None, None],
                               (2, 1, 100, 300))
        mask = mask & (mx.arange(300) >= mx.array([0, 37])[:, None])[:, None, None, :]  # a left-padded row
        out = []
        for m in ("causal", mask):
            whole = blocked_attention(q, k, v, 0.2, m, 1000)
            out.append(_close(blocked_attention(q, k, v, 0.2, m, 32), whole))
        return out

    assert gpu(run) == [True, True]


def test_the_attention_block_bound() -> None:
    from mlx_relay.engine.models.prefill_options import PrefillOptions

    options = PrefillOptions(attention_bytes=1 << 30)
    rows = options.attention_rows(1, 16, 32768, 2)  # 35B-A3B's 16 query heads over 32K bf16 keys
    assert rows % 64 == 0 and rows * 16 * 32768 * 2 * 3 <= 1 << 30 < (rows + 64) * 16 * 32768 * 2 * 3
    assert options.attention_rows(1, 16, 1 << 24, 2) == 64  # never fewer than one tile


@pytest.mark.parametrize("bits", [None, 8], ids=["float", "8-bit"])
def test_grouped_experts_are_the_librarys(gpu: Callable, moe: Any, bits: int | None) -> None:
    def run() -> bool:
        import mlx.core as mx
        import mlx.nn as nn

        from mlx_relay.engine.models.qwen3_5.kernels.grouped_experts import grouped_switch_glu

        switch = moe.model.layers[0].mlp.switch_mlp
        if bits is not None:
            from mlx_vlm.models.switch_layers import SwitchGLU

            switch = SwitchGLU(64, MOE_CONFIG["moe_intermediate_size"], MOE_CONFIG["num_experts"])
            switch.update(moe.model.layers[0].mlp.switch_mlp.parameters())
            nn.quantize(switch, group_size=32, bits=bits)
            assert "scales" in switch.up_proj
        mx.random.seed(2)
        x = mx.random.normal((1, 50, 64))
        inds = mx.random.randint(0, MOE_CONFIG["num_experts"], (1, 50, MOE_CONFIG["num_experts_per_tok"]))
        inds = inds.astype(mx.uint32)
        ours, ref = grouped_switch_glu(switch, x, inds), switch(x, inds)
        mx.eval(ours, ref)
        return _close(ours, ref)

    assert gpu(run)


def test_a_cuda_prefill_chunk_routes_at_most_65535_rows() -> None:
    """MLX's CUDA backend fails a forward routing more than 65,535 (token, expert) rows (8,192
    tokens x 8 experts did, the library's forward too): the lanes' chunks stay under it there."""
    from types import SimpleNamespace

    from mlx_relay.config import EngineConfig
    from mlx_relay.engine.lane_set import prefill_step_size

    moe = SimpleNamespace(args=SimpleNamespace(num_experts_per_tok=8))
    dense = SimpleNamespace(args=SimpleNamespace())
    assert prefill_step_size(moe, EngineConfig(model_path="m", prefill_step_size=8192), "cuda") == 8191
    assert prefill_step_size(moe, EngineConfig(model_path="m", prefill_step_size=4096), "cuda") == 4096
    assert prefill_step_size(moe, EngineConfig(model_path="m"), "cuda") == 4096  # the default on CUDA
    assert prefill_step_size(moe, EngineConfig(model_path="m"), "cpu") == 2048
    assert prefill_step_size(moe, EngineConfig(model_path="m", prefill_step_size=8192), "cpu") == 8192
    assert prefill_step_size(dense, EngineConfig(model_path="m", prefill_step_size=16384), "cuda") == 16384


def test_the_grouped_qmm_tiles_cover_every_row_once(gpu: Callable) -> None:
    """The grouped 8-bit kernel's schedule (`kernels/grouped_qmm.py`), emulated: each block finds its
    expert by binary search over the tile prefix sums `expert_tiles.tiles` makes; together the blocks' row
    ranges cover every sorted row exactly once, each within one expert."""

    def run() -> list[tuple[int, list[int]]]:
        import mlx.core as mx

        from mlx_relay.engine.models.qwen3_5.kernels.expert_tiles import tiles
        from mlx_relay.engine.models.qwen3_5.kernels.grouped_qmm import TILE_ROWS

        out = []
        for seed, rows, experts in ((0, 1000, 16), (1, 64, 8), (2, 5000, 256)):
            mx.random.seed(seed)
            e = mx.sort(mx.random.randint(0, experts // 2, (rows,)) * 2).astype(mx.uint32)  # odd experts empty
            at = tiles(e, experts, TILE_ROWS)
            row_off, tile_off, max_tiles = at.row_off.tolist(), at.tile_off.tolist(), at.max_tiles
            seen = [0] * rows
            for tile in range(max_tiles):
                if tile >= tile_off[experts]:
                    continue
                lo, hi = 0, experts
                while hi - lo > 1:
                    mid = (lo + hi) // 2
                    lo, hi = (mid, hi) if tile_off[mid] <= tile else (lo, mid)
                r0 = row_off[lo] + (tile - tile_off[lo]) * TILE_ROWS
                r1 = min(r0 + TILE_ROWS, row_off[lo + 1])
                assert r0 < r1 and all(v == lo for v in e[r0:r1].tolist())
                for r in range(r0, r1):
                    seen[r] += 1
            out.append((max_tiles, seen))
        return out

    for max_tiles, seen in gpu(run):
        assert set(seen) == {1}
        assert max_tiles >= 1


def test_the_grouped_qmm_dequantizes_as_mlx(gpu: Callable) -> None:
    """The kernel reads an 8-bit weight as MLX stores it (four bytes a uint32, little-endian;
    scale x byte + bias per group of 64), emulated on this CPU against `mx.dequantize`.
    (`benchmarks/gpu/kernel_check.py` runs the kernel itself against the library on a GPU.)"""

    def run() -> bool:
        import mlx.core as mx
        import numpy as np

        mx.random.seed(4)
        w = mx.random.normal((2, 8, 128)).astype(mx.bfloat16)
        q, scales, biases = mx.quantize(w, group_size=64, bits=8)
        ref = np.array(mx.dequantize(q, scales, biases, group_size=64, bits=8).astype(mx.float32))
        words = np.array(q).astype(np.uint32)  # [E, N, K / 4]
        s, b = np.array(scales.astype(mx.float32)), np.array(biases.astype(mx.float32))
        ours = np.zeros((2, 8, 128), dtype=np.float32)
        for k in range(128):
            byte = (words[:, :, k // 4] >> (8 * (k % 4))) & 0xFF
            ours[:, :, k] = s[:, :, k // 64] * byte + b[:, :, k // 64]
        # MLX rounds scale x byte to bf16 before adding the bias, the kernel rounds once: within a
        # bf16 rounding of the weights' scale (a wrong byte or group would be off by whole steps)
        return bool(np.abs(ours - ref).max() <= 2 ** -7 * np.abs(ref).max())

    assert gpu(run)


def test_queries_and_keys_normalized_side_by_side_are_the_library_s_norms(gpu: Callable) -> None:
    """The chunk's mixer normalizes its queries and keys in one norm over both
    (`kernels.gated_delta.normalize_joined_qk`): bit for bit the two norms the library's mixer
    runs (`normalize_qk`), in float32 and in bfloat16."""
    import mlx.core as mx

    from mlx_relay.engine.models.qwen3_5.kernels.gated_delta import normalize_joined_qk, normalize_qk

    def run() -> list[bool]:
        same = []
        for dtype in (mx.float32, mx.bfloat16):
            qk = mx.random.normal((2, 5, 2 * 4, 16), key=mx.random.key(3)).astype(dtype)
            for ours, theirs in zip(normalize_joined_qk(qk, 4), normalize_qk(qk[:, :, :4], qk[:, :, 4:]), strict=True):
                same.append(ours.dtype == theirs.dtype and bool(mx.array_equal(ours, theirs).item()))
        return same

    assert gpu(run) == [True] * 4

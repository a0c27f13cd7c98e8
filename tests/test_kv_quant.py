"""Quantized attention keys and values (issue 47.2: `models/kv_quant.py`) on the float32 fixture: our
prefill into the library's `QuantizedKVCache`s gives the library's own forward over them; our
compiled decode step over quantized buffers (`DecodeState` built from those caches) gives the library's
decode through its `QuantizedKVCache` (its quantized attention), logits to float32 rounding and
greedy tokens, at 8 and 4 bits, for a lone row and a ragged batch that rows join and leave; a row's
quantized state handed back as the library's `QuantizedKVCache` continues exactly; the attention in
blocks of queries equals one block over quantized keys."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.test_decode_step import PROMPTS, _positions, ragged_decode

STEPS = 10
#: our prefill runs the GatedDeltaNet recurrence on this CPU in its own forms (~1e-5 from the library's,
#: `test_prefill_forward.FORMS_TOL`); a value that close to a quantization step's boundary rounds to the
#: neighbouring step, so a quantized prefill may differ by a step's share of one value (seen 1.7e-4 at 8 bits
#: on hidden states ~3.4, 1.3e-5 at 4)
QUANT_TOL = 1e-3


@pytest.fixture(scope="module")
def lm(gpu: Callable, fp32_model: Path) -> Any:
    from mlx_relay.engine.models.loader import load_model

    return gpu(lambda: load_model(fp32_model).model.language_model)


def _quantized_caches(lm: Any, bits: int) -> list[Any]:
    """The library's fresh caches with each attention layer's a `QuantizedKVCache`."""
    from mlx_vlm.models.cache import KVCache, QuantizedKVCache

    from mlx_relay.engine.models.kv_format import KVQuant

    group = KVQuant.group_for(lm.args.head_dim)
    return [QuantizedKVCache(group_size=group, bits=bits) if isinstance(c, KVCache) else c for c in lm.make_cache()]


def _library_prefill(lm: Any, prompt: list[int], bits: int) -> tuple[list[Any], Any]:
    import mlx.core as mx

    cache = _quantized_caches(lm, bits)
    out = lm(mx.array([prompt]), cache=cache, position_ids=_positions(0, len(prompt)))
    first = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
    mx.eval(first, [c.state for c in cache])
    return cache, first


class _LibraryRow:
    def __init__(self, lm: Any, prompt: list[int], bits: int) -> None:
        self.lm, self.at = lm, len(prompt)
        self.cache, self.first = _library_prefill(lm, prompt, bits)

    def feed(self, token: int) -> Any:
        import mlx.core as mx

        out = self.lm(mx.array([[token]]), cache=self.cache, position_ids=_positions(self.at, self.at + 1))
        self.at += 1
        return out.logits[0, -1, :]


def _state(lm: Any, prompt: list[int], bits: int) -> tuple[Any, Any]:
    from mlx_relay.engine.lanes.decode_state import DecodeState
    from mlx_relay.engine.memory.batch_caches import as_batch_caches

    cache, first = _library_prefill(lm, prompt, bits)
    return DecodeState.from_batch_caches(as_batch_caches(cache), [0]), first


@pytest.mark.parametrize("bits", [8, 4])
def test_our_prefill_into_quantized_caches_is_the_librarys(gpu: Callable, lm: Any, bits: int) -> None:
    def run() -> tuple[float, bool]:
        import mlx.core as mx

        from mlx_relay.engine.models import family_of
        from mlx_relay.engine.models.prefill_options import PrefillOptions

        prompt = PROMPTS[2]
        ours_caches, ref_caches = _quantized_caches(lm, bits), _quantized_caches(lm, bits)
        family = family_of(lm)
        hidden = family.prefill_forward(lm, mx.array([prompt]), None, ours_caches, _positions(0, len(prompt)),
                                        PrefillOptions())
        ref = lm(mx.array([prompt]), cache=ref_caches, position_ids=_positions(0, len(prompt)),
                 return_hidden=True, skip_logits=True).hidden_states[-1]
        quantized = [c for c in ours_caches if hasattr(c, "bits")]
        return float(mx.abs(hidden - ref).max()), bool(quantized) and all(c.bits == bits for c in quantized)

    worst, kept_quantized = gpu(run)
    assert worst < QUANT_TOL and kept_quantized


@pytest.mark.parametrize("bits", [8, 4])
def test_a_lone_row_decodes_over_quantized_buffers_as_the_library(gpu: Callable, lm: Any, bits: int) -> None:
    def run() -> tuple[list[int], list[int], float, Any]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.decode_step import DecodeStep

        step = DecodeStep(lm)
        state, token = _state(lm, PROMPTS[0], bits)
        library = _LibraryRow(lm, PROMPTS[0], bits)
        ours, ref, worst = [], [], 0.0
        ref_token = library.first
        for _ in range(STEPS):
            ours.append(int(token.item()))
            ref.append(int(ref_token.item()))
            logits = step(token, state)
            ref_logits = library.feed(int(ref_token.item()))
            worst = max(worst, float(mx.abs(logits[0] - ref_logits).max()))
            token = mx.argmax(logits, axis=-1).astype(mx.int32)
            ref_token = mx.argmax(ref_logits)[None].astype(mx.int32)
        return ours, ref, worst, state.quant

    ours, ref, worst, quant = gpu(run)
    assert quant == (32, bits)  # the fixture's heads of 32 values: groups of 32
    assert ours == ref and worst < 1e-4


def test_a_quantized_ragged_batch_that_rows_join_and_leave_decodes_exactly(gpu: Callable, lm: Any) -> None:
    """As the float batch's test (`test_decode_step.ragged_decode`): rows of other lengths join after 3
    steps with an idle row, two leave after 7; each row's logits equal its lone library decode's, 8-bit."""
    _, worst, _ = gpu(lambda: ragged_decode(lm, lambda p: _state(lm, p, 8), lambda p: _LibraryRow(lm, p, 8),
                                            STEPS + 4))
    assert worst < 1e-4


def test_a_quantized_row_hands_back_its_state_as_the_librarys_cache(gpu: Callable, lm: Any) -> None:
    def run() -> tuple[list[int], list[int], str]:
        import mlx.core as mx

        from mlx_relay.engine.lanes.decode_step import DecodeStep

        step = DecodeStep(lm)
        state, token = _state(lm, PROMPTS[1], 8)
        state.extend(_state(lm, PROMPTS[0], 8)[0])
        tokens = mx.concatenate([token, token])
        handed: list[int] = []
        for _ in range(5):
            handed.append(int(tokens[0].item()))
            tokens = mx.argmax(step(tokens, state), axis=-1).astype(mx.int32)
        cache = state.row_caches(0)
        token = tokens[:1]
        for i in range(4):
            handed.append(int(token.item()))
            at = len(PROMPTS[1]) + 5 + i
            out = lm(token[:, None], cache=cache, position_ids=_positions(at, at + 1))
            token = mx.argmax(out.logits[:, -1, :], axis=-1).astype(mx.int32)
        library = _LibraryRow(lm, PROMPTS[1], 8)
        ref, tok = [], int(library.first.item())
        for _ in range(9):
            ref.append(tok)
            tok = int(mx.argmax(library.feed(tok)).item())
        kinds = {type(c).__name__ for c in cache}
        return handed, ref, ",".join(sorted(kinds))

    handed, ref, kinds = gpu(run)
    assert handed == ref
    assert kinds == "ArraysCache,QuantizedKVCache"


def test_blocked_attention_over_quantized_keys_is_one_block(gpu: Callable) -> None:
    def run() -> tuple[float, bool]:
        import mlx.core as mx

        from mlx_relay.engine.models.attention import blocked_attention
        from mlx_relay.engine.models.kv_quant import quantize

        mx.random.seed(1)
        q = mx.random.normal((1, 4, 40, 32))
        k = quantize(mx.random.normal((1, 2, 100, 32)), 32, 8)
        v = quantize(mx.random.normal((1, 2, 100, 32)), 32, 8)
        kept = mx.array(q)
        whole = blocked_attention(q, k, v, 0.2, "causal", 64)
        blocks = blocked_attention(q, k, v, 0.2, "causal", 16)
        # (mlx-vlm's quantized attention scales its queries argument in place: ours are left alone)
        return float(mx.abs(whole - blocks).max()), bool(mx.array_equal(q, kept))

    worst, queries_kept = gpu(run)
    assert worst < 1e-5 and queries_kept


@pytest.mark.parametrize("bits", [8, 4])
def test_the_dequantized_attention_of_a_cuda_gpu_is_the_quantized_one(gpu: Callable, bits: int) -> None:
    """On a CUDA GPU quantized keys and values are dequantized for MLX's attention (its quantized
    matmul has no kernel for most context lengths there): the same output as the library's
    quantized path, at context lengths no tile divides (1, 16 and 63 keys: the H200's failures)."""
    def run() -> float:
        import mlx.core as mx

        from mlx_relay.engine.models.kv_quant import attend, quantize

        mx.random.seed(2)
        worst = 0.0
        for keys, mask in ((1, None), (16, "causal"), (63, "causal")):
            q = mx.random.normal((1, 4, min(keys, 16), 32))
            k = quantize(mx.random.normal((1, 2, keys, 32)), 32, bits)
            v = quantize(mx.random.normal((1, 2, keys, 32)), 32, bits)
            library = attend(q, k, v, 0.2, mask, dequantize=False)
            ours = attend(q, k, v, 0.2, mask, dequantize=True)
            worst = max(worst, float(mx.abs(library - ours).max()))
        return worst

    assert gpu(run) < 1e-4


@pytest.mark.parametrize("bits", [8, 4])
def test_a_long_context_attends_block_by_block_as_over_the_whole_dequantized_copy(gpu: Callable, bits: int) -> None:
    """Past `DEQUANTIZED_BLOCK_BYTES` a dequantized attention runs block by block (the softmax merged
    across blocks): float32, the same output as MLX's attention over the whole dequantized keys and
    values, for one query, a causal block of queries, a boolean and an additive mask, grouped heads,
    and a last block shorter than the others."""
    def run() -> float:
        import mlx.core as mx

        from mlx_relay.engine.models.kv_quant import blockwise_attention, quantize

        mx.random.seed(5)
        worst = 0.0
        S, D = 700, 32
        k = quantize(mx.random.normal((2, 2, S, D)), 32, bits)
        v = quantize(mx.random.normal((2, 2, S, D)), 32, bits)
        kf, vf = (mx.dequantize(*b, group_size=32, bits=bits) for b in (k, v))
        keep = mx.random.uniform(shape=(2, 1, 3, S)) > 0.3
        for T, mask in ((1, None), (5, "causal"), (3, keep), (3, mx.where(keep, 0.0, -1e9))):
            q = mx.random.normal((2, 4, T, D))
            whole = mx.fast.scaled_dot_product_attention(q, kf, vf, scale=0.2, mask=mask)
            for block in (256, 512):
                ours = blockwise_attention(q, k, v, 0.2, mask, 32, bits, block)
                worst = max(worst, float(mx.abs(whole - ours).max()))
        return worst

    assert gpu(run) < 1e-4


def test_a_dequantized_attention_holds_one_blocks_float_copy(gpu: Callable) -> None:
    """The block is what fits `DEQUANTIZED_BLOCK_BYTES` (whole multiples of 256 keys), and the memory
    attending block by block adds grows far slower than the context (4x the keys: under 2.5x, where
    the whole dequantized copy's grows 4x) and stays under half the whole copy's."""
    from mlx_relay.engine.models.kv_quant import DEQUANTIZED_BLOCK_BYTES, dequantized_block

    assert dequantized_block(1, 2, 256, 2) == DEQUANTIZED_BLOCK_BYTES // (2 * 2 * 256 * 2)
    assert dequantized_block(16, 2, 256, 2) == 16384  # the 35B-A3B shape's 16 rows: 8 blocks at 128K
    assert dequantized_block(4096, 64, 256, 4) == 256
    # where the products read the quantized keys in place (a CUDA GPU), a block holds only the scores'
    # float32 copies: the 35B-A3B shape's 16 rows of 16 query heads at 128K tokens in one block
    from mlx_relay.engine.models.kv_quant import scores_block
    assert scores_block(16, 16, 1) >= 131072 and scores_block(16, 16, 1) % 256 == 0
    assert scores_block(64, 64, 64) == 256

    def run() -> dict[tuple[str, int], int]:
        import mlx.core as mx

        from mlx_relay.engine.models.kv_quant import attend, blockwise_attention, quantize

        D, added = 64, {}
        for S in (8192, 32768):
            k, v = (quantize(mx.random.normal((4, 2, S, D)), 32, 8) for _ in range(2))
            q = mx.random.normal((4, 4, 1, D))
            mx.eval(k, v, q)
            for way in ("whole", "blocks"):
                mx.reset_peak_memory()
                before = mx.get_active_memory()
                mx.eval(attend(q, k, v, 0.1, None, dequantize=True) if way == "whole"
                        else blockwise_attention(q, k, v, 0.1, None, 32, 8, 2048))
                added[(way, S)] = mx.get_peak_memory() - before
        return added

    added = gpu(run)
    assert added[("whole", 32768)] > 3 * added[("whole", 8192)]
    assert added[("blocks", 32768)] < 2.5 * added[("blocks", 8192)]
    assert added[("blocks", 32768)] < added[("whole", 32768)] / 2


def _library_greedy(lm: Any, prompt: list[int], n: int, bits: int) -> list[int]:
    import mlx.core as mx

    row = _LibraryRow(lm, prompt, bits)
    out, tok = [], int(row.first.item())
    for _ in range(n):
        out.append(tok)
        tok = int(mx.argmax(row.feed(tok)).item())
    return out


@pytest.mark.parametrize("speculation", ["none", "mtp"])
def test_the_engine_serves_quantized_kv_and_a_turn_restores_from_its_quantized_snapshot(
        gpu: Callable, fp32_model: Path, speculation: str) -> None:
    """`kv_bits=8` through the engine (the plain lane, and the MTP lane with the head's drafts): the
    greedy reply is the library's own decode through `QuantizedKVCache`s; the turn snapshot holds
    the quantized keys ("qkv" entries) and the next turn, restored from it, decodes as the library's
    quantized decode of the whole conversation."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.messages.prefix_cache import PrefixPlan
    from mlx_relay.testing.engine_driver import Driver

    prompt = PROMPTS[0]

    def run() -> tuple[Any, ...]:
        loaded = load_model(fp32_model)
        lm = loaded.model.language_model
        d = Driver(loaded, kv_bits=8, speculation=speculation, mtp_policy="always", mtp_max_batch=4)
        a = d.add(Generate("a", prompt, SamplingParams(max_tokens=STEPS), prefix=PrefixPlan(snapshot_turn=True)))
        d.run()
        (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
        kinds = {kind for kind, _ in d.engine.snapshots.get(turn.handle).target}
        turn2 = prompt + turn.generated + [400, 401, 402]
        b = d.add(Generate("b", turn2, SamplingParams(max_tokens=6), prefix=PrefixPlan(turn.handle, turn.length)))
        d.run()
        stats = d.engine.stats()
        d.engine.close()
        return (d.tokens[a], _library_greedy(lm, prompt, STEPS, 8), kinds, d.finished[b].cached_tokens, turn.length,
                d.tokens[b], _library_greedy(lm, turn2, 6, 8), stats.mtp_rounds)

    tokens, ref, kinds, cached, turn_length, tokens2, ref2, rounds = gpu(run)
    assert tokens == ref
    assert kinds == {"qkv", "arrays"}
    assert cached == turn_length and tokens2 == ref2
    assert (rounds > 0) == (speculation == "mtp")


def test_a_quantized_snapshot_goes_to_disk_and_back(gpu: Callable, lm: Any) -> None:
    """The disk tier's codec keeps a quantized snapshot's triples as they are (a layout of their own,
    named in the file's identity by their bits), and a file of another layout is refused."""
    def run() -> tuple[bool, str, str, bool]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from mlx_relay.cache.snapshot_files import SnapshotLayoutError
        from mlx_relay.engine.memory.snapshot_codec import decode, encode, probe_layout
        from mlx_relay.engine.memory.snapshots import Snapshot, snapshot_caches
        from mlx_relay.engine.models.kv_format import KVQuant

        cache, _ = _library_prefill(lm, PROMPTS[1], 8)
        entries, nbytes = snapshot_caches(cache, len(PROMPTS[1]))
        snap = Snapshot(length=len(PROMPTS[1]), target=entries, nbytes=nbytes)
        layout = probe_layout(lm, quant=KVQuant(8))
        back = decode(bytes(encode(snap, {})), snap.length, layout)
        same = all(kind == k2 and all(a == b if not isinstance(a, mx.array) else bool(mx.array_equal(a, b))
                                      for (_, a), (_, b) in zip(tree_flatten(value), tree_flatten(v2), strict=True))
            for (kind, value), (k2, v2) in zip(snap.target, back.target, strict=True))
        refused = False
        try:
            decode(bytes(encode(snap, {})), snap.length, probe_layout(lm))
        except SnapshotLayoutError:
            refused = True
        return same, layout.dtype, probe_layout(lm).dtype, refused

    same, quant_dtype, plain_dtype, refused = gpu(run)
    assert same and refused
    assert quant_dtype == "float32-q8" and plain_dtype == "float32"


def test_quantized_keys_and_values_are_counted_at_their_bits() -> None:
    from mlx_relay.engine.models.footprint import CacheShape, with_kv_bits

    # the 35B-A3B shape's 10 attention layers, 2 KV heads of 256 values, bf16: 20,480 bytes a token
    config = {"text_config": {"dtype": "bfloat16", "num_attention_heads": 16, "num_key_value_heads": 2,
                              "head_dim": 256}}
    shape = CacheShape(per_token=10 * 2 * 2 * 256 * 2, per_row=7)
    assert with_kv_bits(shape, config, None) == shape
    assert with_kv_bits(shape, config, 8) == CacheShape(per_token=10 * 2 * 2 * 256 * (1 + 4 / 64), per_row=7)
    assert with_kv_bits(shape, config, 4) == CacheShape(per_token=10 * 2 * 2 * 256 * (0.5 + 4 / 64), per_row=7)


def test_kv_bits_are_8_or_4() -> None:
    from mlx_relay.config import EngineConfig, PipelineConfig

    assert EngineConfig(model_path="x", kv_bits=4).kv_bits == 4
    assert EngineConfig(model_path="x", kv_bits=8, pipeline=PipelineConfig(enabled=True)).kv_bits == 8
    with pytest.raises(ValueError, match="8 or 4"):
        EngineConfig(model_path="x", kv_bits=3)


def test_a_quantized_kv_cache_is_refused_where_no_quantized_attention_of_ours_runs() -> None:
    from mlx_relay.engine.lane_set import quantized_kv_refusal

    assert quantized_kv_refusal("qwen3_5_moe", "cuda", library_forward=False, staged=False) is None
    assert quantized_kv_refusal("qwen3_5_moe", "cpu", library_forward=False, staged=True) is None
    assert "pipeline on a CUDA GPU" in (quantized_kv_refusal("qwen3_5_moe", "cuda", False, True) or "")
    assert "library's forward" in (quantized_kv_refusal("gemma3", "cpu", True, False) or "")


def test_a_quantized_kv_cache_on_a_cuda_gpu_decodes_in_the_plain_lane(gpu: Callable, fp32_model: Path) -> None:
    """On a CUDA GPU the MTP lane (its sampled rows' eager rounds, its warm-up) would run the library's
    quantized attention, which MLX's CUDA backend lacks at most lengths: with `--kv-bits` the lanes
    built for a CUDA backend are the plain lane alone; unquantized, or off a CUDA GPU, the MTP lane too."""
    import dataclasses

    import msgspec

    from mlx_relay.config import EngineConfig
    from mlx_relay.engine.lane_set import build_lanes, speculation_refusal
    from mlx_relay.engine.models.loader import load_model

    assert speculation_refusal("cpu") is None and speculation_refusal("metal") is None
    assert "plain lane" in (speculation_refusal("cuda") or "")

    def lanes(backend: str, kv_bits: int | None) -> list[str]:
        def build() -> list[str]:
            loaded = load_model(fp32_model)
            loaded = dataclasses.replace(loaded, info=msgspec.structs.replace(loaded.info, backend=backend))
            config = EngineConfig(model_path=str(fp32_model), kv_bits=kv_bits)
            return sorted(build_lanes(loaded, config, token_budget=512, stage=None, step=512))
        out: list[str] = gpu(build)
        return out

    assert lanes("cuda", 8) == ["plain"]
    assert lanes("cuda", None) == ["mtp", "plain"]
    assert lanes("cpu", 8) == ["mtp", "plain"]


def test_a_sampled_row_speculates_over_quantized_caches(gpu: Callable, fp32_model: Path) -> None:
    """A sampling row's MTP rounds run eagerly, through mlx-vlm's speculative cache transaction over
    its `QuantizedKVCache`s (4-bit here), beside a greedy row in the compiled rounds: both finish."""
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.messages.gpu import Generate, SamplingParams
    from mlx_relay.testing.engine_driver import Driver

    def run() -> tuple[int, int, str, int]:
        d = Driver(load_model(fp32_model), kv_bits=4, speculation="mtp", mtp_policy="always", mtp_max_batch=4)
        a = d.add(Generate("a", list(range(10, 60)), SamplingParams(max_tokens=20, temperature=0.8, seed=3)))
        b = d.add(Generate("b", list(range(10, 40)), SamplingParams(max_tokens=20)))
        d.run()
        eager = d.engine.stats().mtp_fallback_rounds
        d.engine.close()
        return len(d.tokens[a]), len(d.tokens[b]), d.finished[a].reason, eager

    sampled, greedy, reason, eager = gpu(run)
    assert (sampled, greedy, reason) == (20, 20, "length") and eager > 0


def test_the_kv_bits_flag_and_the_models_file_key_reach_the_engine_config(tmp_path: Path) -> None:
    from mlx_relay.cli import build_parser, config_from_args
    from mlx_relay.pool.models_file import read_models_file

    assert config_from_args(build_parser().parse_args(["serve", "m", "--kv-bits", "4"])).engine.kv_bits == 4
    assert config_from_args(build_parser().parse_args(["serve", "m"])).engine.kv_bits is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "m", "--kv-bits", "6"])
    file = tmp_path / "models.toml"
    file.write_text('[models.a]\npath = "/x"\nkv_bits = 8\n')
    (entry,) = read_models_file(file)
    assert entry.entry.overrides()["kv_bits"] == 8


def test_quantized_caches_move_between_batches_and_cut_for_a_prompt_as_long_as_the_snapshot(
        gpu: Callable, lm: Any) -> None:
    """`batch_caches.take_rows` keeps a quantized batch's rows as they were (padding dropped), and an
    all-attention snapshot restored for a prompt as long as itself (`snapshots.restore_for`) holds its
    quantized keys up to the last prompt token, as a `QuantizedKVCache` of that offset."""
    def run() -> tuple[bool, int, bool]:
        import mlx.core as mx
        from mlx_vlm.models.cache import BatchQuantizedKVCache, QuantizedKVCache

        from mlx_relay.engine.memory.batch_caches import as_batch_caches, extend_caches, take_rows
        from mlx_relay.engine.memory.snapshots import Snapshot, restore_for, snapshot_caches

        rows = [as_batch_caches(_library_prefill(lm, p, 8)[0]) for p in PROMPTS]
        batch = rows[0]
        for other in rows[1:]:
            extend_caches(batch, other)
        taken = take_rows(batch, [1])
        same = True
        for t, lone in zip(taken, rows[1], strict=True):
            if isinstance(t, BatchQuantizedKVCache):
                keys, _, _, left = t.state
                lone_keys = lone.state[0]
                start = int(left[0].item())
                same = same and all(bool(mx.array_equal(a[:, :, start:, :], b)) for a, b in zip(keys, lone_keys,
                                                                                             strict=True))
        cache, _ = _library_prefill(lm, PROMPTS[1], 8)
        entries, nbytes = snapshot_caches(cache, len(PROMPTS[1]))
        # an all-attention model's snapshot (a recurrent state cannot be cut): the attention layers' alone
        attention = [e for e in entries if e[0] == "qkv"]
        restored, held = restore_for(Snapshot(length=len(PROMPTS[1]), target=attention, nbytes=nbytes),
                                     len(PROMPTS[1]))
        quantized = [c for c in restored if isinstance(c, QuantizedKVCache)]
        return same, held, bool(quantized) and all(c.offset == held == len(PROMPTS[1]) - 1 for c in quantized)

    same, held, cut = gpu(run)
    assert same and cut and held == len(PROMPTS[1]) - 1


def test_a_model_whose_heads_cannot_be_quantized_is_refused_at_start(gpu: Callable) -> None:
    """MLX quantizes in groups of 32 or more: the tiny Qwen3 fixture's heads of 16 values cannot be, and
    an engine asked to quantize its KV cache refuses to start, saying so."""
    from mlx_relay.engine.models import UnsupportedModel
    from mlx_relay.engine.models.loader import load_model
    from mlx_relay.testing.engine_driver import Driver
    from mlx_relay.testing.family_fixtures import family_fixture_path

    def run() -> str:
        try:
            Driver(load_model(family_fixture_path("qwen3")), kv_bits=8)
        except UnsupportedModel as exc:
            return str(exc)
        return ""

    assert "cannot be quantized in groups of 32 or 64" in gpu(run)

"""Projections of one input merged into one weight (`engine/models/merged_projections.py`): on a
float32 qwen3_5_moe language model quantized to 8 bits, merging each layer's GatedDeltaNet input
projections, attention q/k/v, shared expert gate/up and router with the shared expert's gate keeps
the model's bytes (the parts are views of the merged arrays; the merged ones padded to whole
tiles), leaves the library's own forward exactly where it was, and makes our decode step run fewer
quantized matmuls with the same logits and greedy tokens; through the engine (both lanes, a restored
turn) the merged model replies as the unmerged one; a model loaded unquantized has nothing to merge,
and a pipeline stage's lazily loaded layers merge at boot."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.test_decode_step import _library_greedy, _positions, _state
from tests.test_dense_copies import _quantized_lm

PROMPT = list(range(20, 60))


def _matmuls(outs: list[Any]) -> int:
    """The quantized matmuls in the graph behind `outs` (MLX's own export)."""
    import re
    import tempfile
    from pathlib import Path

    import mlx.core as mx

    with tempfile.NamedTemporaryFile(suffix=".dot") as f:
        mx.export_to_dot(f.name, *outs)
        labels = re.findall(r'label ="([^"]+)", shape=rectangle', Path(f.name).read_text())
    return sum(label == "QuantizedMatmul" for label in labels)


def test_merging_keeps_the_bytes_and_the_library_forward_and_our_step_runs_fewer_matmuls(gpu: Callable) -> None:
    def run() -> dict[str, Any]:
        import mlx.core as mx
        from mlx.utils import tree_flatten

        from mlx_relay.engine.lanes.decode_step import DecodeStep
        from mlx_relay.engine.models import family_of
        from mlx_relay.engine.models.merged_projections import ProjectionPart, merge_projections

        plain, merged = _quantized_lm(), _quantized_lm()
        family = family_of(merged)

        def nbytes(lm: Any) -> int:
            return sum(a.nbytes for _, a in tree_flatten(lm.parameters()))

        def prompt_logits(lm: Any) -> mx.array:
            return lm(mx.array([PROMPT]), cache=lm.make_cache(), position_ids=_positions(0, len(PROMPT))).logits

        def step_logits(lm: Any) -> tuple[list[mx.array], int]:
            step = DecodeStep(lm, compiled=False)
            state, token = _state(lm, PROMPT)
            logits, matmuls = [], 0
            for i in range(6):
                out = step(token, state)
                if i == 0:
                    matmuls = _matmuls([out])
                logits.append(out)
                token = mx.argmax(out, axis=-1).astype(mx.int32)
            return logits, matmuls

        bytes_before = nbytes(merged)
        mx.clear_cache()
        active_before = mx.get_active_memory()
        groups = merge_projections(family.layers(merged), family.merged_groups)
        mx.clear_cache()
        active_after = mx.get_active_memory()
        again = merge_projections(family.layers(merged), family.merged_groups)  # already merged: nothing
        layer = next(lay for lay in merged.model.layers if lay.is_linear)
        ours_plain, ops_plain = step_logits(plain)
        ours_merged, ops_merged = step_logits(merged)
        return {
            "groups": groups, "again": again, "layers": len(merged.model.layers),
            "part": type(layer.linear_attn.in_proj_z).__name__,
            "is_part": isinstance(layer.linear_attn.in_proj_z, ProjectionPart),
            "bytes": (bytes_before, nbytes(merged)), "active_grew": active_after - active_before,
            "prompt_diff": mx.abs(prompt_logits(plain) - prompt_logits(merged)).max().item(),
            "greedy": (_library_greedy(plain, PROMPT, 8), _library_greedy(merged, PROMPT, 8)),
            "step_diff": max(mx.abs(a - b).max().item() for a, b in zip(ours_plain, ours_merged, strict=True)),
            "ops": (ops_plain, ops_merged),
        }

    got = gpu(run)
    # every layer: its mixer's group (four GatedDeltaNet inputs or q/k/v), its shared expert's gate/up,
    # its router with the shared expert's gate
    assert got["groups"] == 3 * got["layers"] and got["again"] == 0
    assert got["part"] == "ProjectionPart" and got["is_part"]
    assert got["bytes"][0] == got["bytes"][1] and got["active_grew"] <= got["bytes"][0] // 50  # the padding
    assert got["prompt_diff"] == 0.0 and got["greedy"][0] == got["greedy"][1]
    assert got["step_diff"] <= 1e-6
    # per GatedDeltaNet layer 4 -> 1, per attention layer 3 -> 1, per mixture of experts 4 -> 2
    assert got["ops"][0] - got["ops"][1] > 2 * got["layers"]


def test_a_model_loads_merged_and_a_lazy_stage_merges_at_boot(gpu: Callable, fp32_model: Any) -> None:
    """`load_model` merges what its family names (an unquantized fixture: nothing); a lazy load
    (a pipeline stage's) leaves it to `add_copies`, which merges after any 16-bit copies."""
    def run() -> tuple[int, int, int]:
        import mlx.nn as nn

        from mlx_relay.config import EngineConfig
        from mlx_relay.engine.models.loader import add_copies, load_model, merge_family_projections

        loaded = load_model(fp32_model)
        unquantized = merge_family_projections(loaded)
        lazy = load_model(fp32_model, lazy=True)
        nn.quantize(lazy.model.language_model, group_size=64, bits=8)
        add_copies(lazy, EngineConfig(model_path=str(fp32_model)))
        lm = lazy.model.language_model
        parts = sum(type(m).__name__ == "ProjectionPart" for layer in lm.model.layers for _, m in layer.named_modules())
        return unquantized, parts, merge_family_projections(lazy)

    unquantized, parts, again = gpu(run)
    assert unquantized == 0 and parts > 0 and again == 0


def test_a_cuda_gpu_runs_a_wider_merged_product_only_where_its_parts_are_read_in_place() -> None:
    """The parts of a product over more rows are strided views: on a CUDA GPU they run merged where
    the caller reads them in place (the GatedDeltaNet mixer, router and combine kernels, MLX's
    elementwise `swiglu`), one by one where MLX's fused norms would copy each (attention's q/k/v)."""
    from mlx_relay.engine.models.qwen3_5.kernels.dense import runs_merged

    assert runs_merged(1, cuda=True) and not runs_merged(2, cuda=True) and not runs_merged(8, cuda=True)
    assert runs_merged(8, cuda=True, views=True)  # parts read in place: our kernels, MLX elementwise
    assert runs_merged(1, cuda=False) and runs_merged(8, cuda=False)


def test_the_engine_decodes_a_merged_8bit_model_as_the_unmerged_one(gpu: Callable, fp32_model: Any) -> None:
    """Through the engine (prefill, the compiled decode step, the MTP lane's rounds, a turn restored
    from its snapshot), greedy: the fixture quantized to 8 bits replies the same merged and unmerged."""
    def run() -> dict[bool, tuple[list[int], list[int]]]:
        import mlx.nn as nn

        from mlx_relay.engine.models.loader import load_model, merge_family_projections
        from mlx_relay.messages.gpu import Generate, SamplingParams
        from mlx_relay.messages.prefix_cache import PrefixPlan
        from mlx_relay.testing.engine_driver import Driver

        out = {}
        for merged in (False, True):
            loaded = load_model(fp32_model)
            nn.quantize(loaded.model.language_model, group_size=64, bits=8)
            assert (merge_family_projections(loaded) > 0) if merged else True
            replies = []
            for speculation in ("none", "mtp"):
                d = Driver(loaded, speculation=speculation, mtp_policy="always", mtp_max_batch=4)
                a = d.add(Generate("a", PROMPT, SamplingParams(max_tokens=12), prefix=PrefixPlan(snapshot_turn=True)))
                d.run()
                (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
                nxt = PROMPT + turn.generated + [400, 401, 402]
                b = d.add(Generate("b", nxt, SamplingParams(max_tokens=6), prefix=PrefixPlan(turn.handle, turn.length)))
                d.run()
                replies.append(d.tokens[a] + d.tokens[b])
            out[merged] = (replies[0], replies[1])
        return out

    got = gpu(run)
    assert got[True] == got[False]  # each lane's reply (8-bit weights: the two lanes' may differ at a near-tie)
    assert all(len(reply) == 18 for reply in got[True])

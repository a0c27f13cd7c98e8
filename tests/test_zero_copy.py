"""Issue 4.4: the text (MTP) path and the vision path decode with the very same language-model
weight arrays: building the text path over the loaded model allocates 0 bytes; the MTP head it
drafts with costs its own weights only (loaded once from the checkpoint's mtp.* tensors)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import mlx.core as mx
from mlx.utils import tree_flatten

from mlx_relay.config import EngineConfig
from mlx_relay.engine.lanes.mtp_head import MTPHead
from mlx_relay.engine.lanes.mtp_lane import MTPLane
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.step.core import EngineCore


def test_text_and_vision_paths_share_the_language_model_weights(gpu: Callable, fp32_model: Path) -> None:
    def run() -> dict[str, Any]:
        loaded = load_model(fp32_model)
        lm = loaded.model.language_model
        mx.eval(loaded.model.parameters())
        mx.synchronize()
        mx.clear_cache()
        # the MTP head (its own weights: fc, norms, one decoder layer) ...
        before_head = mx.get_active_memory()
        head0 = MTPHead.load(fp32_model, lm)
        mx.eval(head0.drafter.parameters())
        mx.synchronize()
        head_grew = mx.get_active_memory() - before_head
        # ... then the text path over the loaded language model: not one byte more
        before = mx.get_active_memory()
        lane = MTPLane(lm, head0, block_size=2, prefill_step_size=64, eos_token_ids=[0])
        mx.synchronize()
        grew = mx.get_active_memory() - before
        # and the engine that serves both paths
        engine = EngineCore(loaded, EngineConfig(str(fp32_model), max_num_seqs=4, prefill_batch_size=2,
                                                 prefill_step_size=64), prefix_cache=True)
        mtp_lane = engine.lanes["mtp"]
        assert isinstance(mtp_lane, MTPLane)
        head = mtp_lane.head
        plain_lm, text_lm = engine.lanes["plain"].lm, mtp_lane.lm  # type: ignore[attr-defined]
        ids = {name: id(v) for name, v in tree_flatten(lm.parameters())}
        out = {
            "grew": grew,
            "head_grew": head_grew,
            "head_bytes": sum(v.nbytes for _, v in tree_flatten(lane.head.drafter.parameters())),
            "same_module": plain_lm is lm and text_lm is lm and loaded.model.language_model is lm,
            "same_arrays": all(ids[n] == id(v) for n, v in tree_flatten(text_lm.parameters()))
            and all(ids[n] == id(v) for n, v in tree_flatten(plain_lm.parameters())),
            "lm_bytes": sum(v.nbytes for _, v in tree_flatten(lm.parameters())),
            "head_shares_lm": {id(v) for _, v in tree_flatten(head.drafter.parameters())} & set(ids.values()),
        }
        engine.close()
        return out

    r = gpu(run)
    assert r["same_module"] and r["same_arrays"]
    assert not r["head_shares_lm"]  # the head's own weights are its own (one decoder layer, fc, norms)
    assert r["grew"] == 0, r  # the text path over the loaded language model: 0 bytes
    # the head costs its own parameters (plus allocator rounding), a fraction of the model
    assert r["head_bytes"] <= r["head_grew"] < r["head_bytes"] + 4096, r
    assert r["head_bytes"] < r["lm_bytes"] / 4

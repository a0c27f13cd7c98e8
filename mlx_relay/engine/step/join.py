"""A row's start in its lane (GPU thread only; the engine core's execute stage, `core.py`): the
`RowSpec` its lane takes, from its request, its prefix plan's snapshot, its logits chain (`logits.py`)
and its media (the image features, `memory/features.py`; a sparse prompt, `lanes/row_prefill.py`).
"""

from __future__ import annotations

from typing import Any

from mlx_relay.engine.lane import RowSpec, sparse_row
from mlx_relay.engine.memory.features import FeatureStore
from mlx_relay.engine.memory.snapshots import Snapshot
from mlx_relay.engine.step.logits import LogitsChains
from mlx_relay.engine.step.rows import Row
from mlx_relay.messages.vision import FeaturesEncoded


def row_spec(row: Row, restore: Snapshot | None, snapshot_at: list[int], chains: LogitsChains,
             features: FeatureStore, model: Any) -> tuple[RowSpec, FeaturesEncoded | None]:
    """What `row`'s lane (`row.lane`) starts it from, and the image features it encoded, if any.
    Sets the row's grammar and recorder from its logits chain."""
    req = row.req
    spec = RowSpec(rid=row.rid, prompt=list(req.prompt_tokens), max_tokens=req.sampling.max_tokens,
                   restore=restore, snapshot_at=snapshot_at)
    encoded = None
    chain = chains.build(req.sampling)
    row.recorder, row.grammar = chain.recorder, chain.grammar
    if row.lane == "mtp":
        # the MTP lane samples and applies the grammar inside its round; its rows have no
        # other processor (the TextMTPExecutor plans the others into the plain lane)
        assert req.speculate is not None and chain.recorder is None
        spec.sampler, spec.grammar = chain.sampler, chain.grammar
        spec.block_size, spec.use_head = req.speculate.block_size, req.speculate.head
        spec.context_drafts = req.speculate.context
        spec.draft_model, spec.copy_drafts = req.speculate.draft, req.speculate.copy
    else:
        spec.processors = chain.processors
    if req.vision is not None:
        kwargs, hashes = features.prompt_kwargs(model, spec.prompt, req.vision)
        if hashes:
            encoded = FeaturesEncoded(req.request_id, hashes)
        deltas = kwargs.get("rope_deltas")
        spec.embeds, spec.positions = kwargs["inputs_embeds"], kwargs.get("position_ids")
        spec.rope_delta = int(deltas.reshape(-1)[0].item()) if deltas is not None else 0
    elif row.sparse is not None:
        spec.prompt, kw, spec.snapshot_at = sparse_row(spec.prompt, row.sparse,
                                                       restore.length if restore else 0, snapshot_at)
        spec.positions, spec.rope_delta = kw["positions"], kw["rope_delta"]
    return spec, encoded

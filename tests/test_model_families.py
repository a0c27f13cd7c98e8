"""The model-family seam (issue 31.3, `mlx_relay/engine/models/`): `family_for` answers the family
of each model type it serves and a typed load error, saying why, for one it does not; the engine's
steps refuse a language model of another family at construction (never a wrong token); the
registry imports no MLX. The Qwen3.5 family's numerics are pinned by tests/test_decode_step.py and
tests/test_mtp_step.py (greedy exactness, float32), its split by tests/test_pipeline.py; the dense
Qwen3 family's by tests/test_qwen3_family.py."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from mlx_relay.engine.models import UnsupportedModel, family_for
from mlx_relay.engine.models.qwen3_5 import MODEL_TYPES
from mlx_relay.errors import ModelLoadError


def test_the_qwen3_5_family_serves_its_model_types() -> None:
    assert {"qwen3_5", "qwen3_5_moe", "qwen3_5_text", "qwen3_5_moe_text"} <= MODEL_TYPES
    assert {family_for(t).name for t in MODEL_TYPES} == {"qwen3_5"}


def test_the_qwen3_family_serves_mlx_lms_dense_qwen3() -> None:
    """Declared without MLX: loaded by mlx-lm, text only, every layer's keys and values per token;
    its rows never go to the MTP lane (which calls mlx-vlm's model API), a Qwen3.5's may."""
    from mlx_relay.engine.models import declared, served_by_family, served_by_mtp_lane
    from mlx_relay.engine.models.footprint import cache_shape
    from mlx_relay.engine.models.library_kv import loads_with_mlx_lm
    from mlx_relay.engine.models.qwen3 import MODEL_TYPES as QWEN3_TYPES
    from mlx_relay.media.served import MEDIA_PROCESSORS

    assert QWEN3_TYPES == {"qwen3"} and family_for("qwen3").name == "qwen3"
    family = declared("qwen3")
    assert family is not None and family.library == "mlx-lm" and family.media_processor is None
    assert loads_with_mlx_lm({"model_type": "qwen3"}) and not loads_with_mlx_lm({"model_type": "qwen3_5"})
    assert "qwen3" not in MEDIA_PROCESSORS
    assert served_by_family("qwen3") and not served_by_mtp_lane("qwen3") and served_by_mtp_lane("qwen3_5")
    config = {"model_type": "qwen3", "num_hidden_layers": 28, "num_attention_heads": 16, "num_key_value_heads": 8,
              "head_dim": 128, "hidden_size": 2048, "torch_dtype": "bfloat16"}
    assert cache_shape(config).per_token == 28 * 2 * 8 * 128 * 2 and cache_shape(config).per_row == 0


def test_the_qwen3_family_refuses_a_head_and_a_model_not_of_its_shape_saying_why() -> None:
    """No MTP head (a load error, as the protocol says); a language model not of its shape is
    refused by its layers and by its pipeline split."""
    from mlx_lm.models import llama

    family = family_for("qwen3")
    lm = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                     num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=32))
    with pytest.raises(ModelLoadError, match="no MTP head"):
        family.load_mtp_drafter(Path("/nowhere"), {"model_type": "qwen3"})
    with pytest.raises(UnsupportedModel, match="no MTP head"):
        family.check_mtp_head(object())
    with pytest.raises(UnsupportedModel, match="not a dense Qwen3"):
        family.pipeline_split(lm, 0, 2, None)
    with pytest.raises(UnsupportedModel, match="not a dense Qwen3"):
        family.layers(lm)


def test_a_model_type_no_family_serves_is_a_load_error_that_says_why() -> None:
    with pytest.raises(UnsupportedModel, match="'llama' is not served") as caught:
        family_for("llama")
    assert isinstance(caught.value, ModelLoadError)  # reported as the server's load failure
    assert "qwen3_5" in str(caught.value)  # and names what is served


def test_the_steps_refuse_a_language_model_of_another_family() -> None:
    """mlx-lm's own Llama (random weights: only its type and shape are read)."""
    from mlx_lm.models import llama

    from mlx_relay.engine.lanes.decode_step import DecodeStep

    lm = llama.Model(llama.ModelArgs(model_type="llama", hidden_size=16, num_hidden_layers=1, intermediate_size=32,
                                     num_attention_heads=2, rms_norm_eps=1e-6, vocab_size=32))
    with pytest.raises(UnsupportedModel, match="'llama'"):
        DecodeStep(lm)


def test_the_registry_imports_no_mlx() -> None:
    code = ("import sys, mlx_relay.engine.models as m; "
            "import mlx_relay.engine.models.qwen3_5, mlx_relay.engine.models.qwen3; m.declarations(); "
            "m.declared('qwen3_5'); m.declared('qwen3'); m.served_by_mtp_lane('qwen3'); "
            "import mlx_relay.media.served; print('mlx.core' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_a_family_declares_its_loader_and_media_processor() -> None:
    """What the loader, the media router and SpecPrefill's draft read of a family, from its package."""
    from mlx_relay.engine.models import declared
    from mlx_relay.engine.models.library_kv import loads_with_mlx_lm
    from mlx_relay.engine.scoring.draft_library import draft_library
    from mlx_relay.media.preprocess import load_vision_processor
    from mlx_relay.media.served import MEDIA_PROCESSORS

    family = declared("qwen3_5_moe_text")
    assert family is not None and family.library == "mlx-vlm" and family.media_processor == "qwen-vl"
    assert declared("llama") is None
    assert all(MEDIA_PROCESSORS[t] is load_vision_processor for t in MODEL_TYPES)
    assert not loads_with_mlx_lm({"model_type": "qwen3_5_text"}) and loads_with_mlx_lm({"model_type": "llama"})
    assert draft_library({"model_type": "qwen3_5", "text_config": {"model_type": "qwen3_5_text"}}) == "mlx-vlm"
    assert draft_library({"model_type": "qwen3"}) == "mlx-lm"

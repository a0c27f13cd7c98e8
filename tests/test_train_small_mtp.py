"""Smoke test of ``tools/train_small_mtp.py``: a few steps on a tiny config lower the loss,
and the written checkpoint loads strictly with ``mlx_vlm.load`` and ``load_drafter(kind="mtp")``."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path
from types import ModuleType

import pytest

from mlx_relay.testing.scripts import load_script

_SCRIPT = Path(__file__).resolve().parent.parent / "tools" / "train_small_mtp.py"


def _load_script() -> ModuleType:
    return load_script(_SCRIPT, "train_small_mtp")


def test_corpus_selection_is_deterministic_and_skips_data_tables() -> None:
    tool = _load_script()
    root = Path(sysconfig.get_paths()["stdlib"])
    rels = [f.relative_to(root).as_posix() for f in tool.corpus_files(root)]
    assert rels, "the stdlib corpus is empty"
    assert rels == [f.relative_to(root).as_posix() for f in tool.corpus_files(root)]
    assert rels != sorted(rels), "files are sampled across the library, not a sorted prefix"
    assert not [r for r in rels if r.startswith(("encodings/", "pydoc_data/", "site-packages/"))]
    held = [r for r in rels if tool.is_held_out(r)]
    assert 0 < len(held) < len(rels) // 10
    entities = root / "html" / "entities.py"
    if entities.is_file():
        assert tool.rejection(entities.read_text(encoding="utf-8"), "html/entities.py") == "table"
    assert tool.rejection((root / "argparse.py").read_text(encoding="utf-8"), "argparse.py") is None
    assert tool.rejection("def f(:\n    pass\n", "bad.py") == "syntax"


def test_learning_rate_warms_up_then_decays_by_steps_or_time() -> None:
    tool = _load_script()
    args = tool.parse_args(["--out", "x", "--steps", "1000", "--warmup", "100", "--lr", "1e-3"])
    assert tool.learning_rate(args, 0) == pytest.approx(1e-5)
    assert tool.learning_rate(args, 99) == pytest.approx(1e-3)
    assert tool.learning_rate(args, 550) == pytest.approx(0.525e-3)
    assert tool.learning_rate(args, 1000) == pytest.approx(0.05e-3)
    assert tool.learning_rate(args, 200, time_progress=1.0) == pytest.approx(0.05e-3)


@pytest.mark.timeout(120)
def test_few_steps_lower_loss_and_checkpoint_loads(tmp_path: Path) -> None:
    tool = _load_script()
    out = tmp_path / "small"
    argv = [
        "--out", str(out), "--steps", "24", "--seed", "0", "--hidden", "64", "--intermediate", "128", "--layers", "4",
        "--linear-head-dim", "16", "--seq-len", "32", "--batch", "4", "--lr", "3e-3", "--warmup", "4",
        "--corpus-bytes", "200000", "--log-every", "8", "--save-every", "24", "--no-eval", "--no-compile",
    ]  # fmt: skip
    result = tool.main(argv)
    history = result["history"]
    assert len(history) == 3
    (_, first_main, first_mtp), (_, last_main, last_mtp) = history[0], history[-1]
    assert last_main < first_main
    assert last_mtp < first_mtp

    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    model, processor = mlx_vlm.load(str(out), strict=True)
    drafter, kind = load_drafter(str(out), kind="mtp")
    assert kind == "mtp"
    text = "".join(
        r.text
        for r in mlx_vlm.stream_generate(
            model,
            processor,
            "def main():\n",
            max_tokens=8,
            temperature=0.0,
            draft_model=drafter,
            draft_kind="mtp",
            draft_block_size=2,
        )
    )
    assert isinstance(text, str)
    assert drafter.accept_lens, "no MTP rounds ran"


def test_checkpoint_round_trip_is_exact(tmp_path: Path) -> None:
    """Saved HF names/layouts load back to the same function: both losses match exactly."""
    import mlx.core as mx
    import mlx_vlm
    from mlx_vlm.speculative.drafters import load_drafter

    from mlx_relay.testing.fixtures import FixtureSpec, build_fixture

    tool = _load_script()
    spec = FixtureSpec("fp32", 0, 64, 128, 4)
    config = tool.small_config(spec, 16)
    build_fixture(tmp_path, spec)
    (tmp_path / "mlx_relay_fixture.json").unlink()
    (tmp_path / "config.json").write_text(json.dumps(config), encoding="utf-8")
    mx.random.seed(3)
    trained = tool.TargetWithMTP(config)
    tool.save_checkpoint(trained, tmp_path)
    tokens = mx.random.randint(0, 1000, (2, 40))
    loaded = tool.TargetWithMTP(config)
    loaded.vlm, _ = mlx_vlm.load(str(tmp_path), strict=True)
    loaded.mtp, _ = load_drafter(str(tmp_path), kind="mtp")
    for a, b in zip(trained.losses(tokens), loaded.losses(tokens), strict=True):
        assert abs(a.item() - b.item()) < 1e-5

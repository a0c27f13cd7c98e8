"""The tiny fixture checkpoints load in mlx_vlm and mlx_lm, are deterministic, and behave."""

from __future__ import annotations

import filecmp
import itertools
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import jinja2
import mlx.core as mx
import mlx_lm
import mlx_vlm
import numpy as np
import pytest
from mlx.utils import tree_flatten
from mlx_lm.tokenizer_utils import _infer_tool_parser
from mlx_vlm.speculative.drafters import load_drafter
from transformers import AutoTokenizer

from mlx_relay.default_model import default_model_path as embedded_model_path
from mlx_relay.testing.fixtures import (
    MANIFEST_NAME,
    RECIPE_VERSION,
    FixtureSpec,
    build_fixture,
    default_model_path,
    fixture_path,
)
from mlx_relay.testing.tokenizer_builder import SPECIAL_TOKENS, token_id

VARIANTS = ("bf16", "fp32", "bigram")
VOCAB = 1026
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module", autouse=True)
def _offline() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("TRANSFORMERS_OFFLINE", "1")
        yield


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mlx-relay-cache")


@pytest.fixture(scope="module")
def paths(cache_dir: Path) -> dict[str, Path]:
    """Each variant built once (seed 0) into the module's cache dir."""
    return {variant: fixture_path(FixtureSpec(variant, 0), cache_dir) for variant in VARIANTS}


@pytest.fixture(scope="module")
def hf_tokenizer(paths: dict[str, Path]):
    return AutoTokenizer.from_pretrained(str(paths["fp32"]))


def _chat_prompt(tokenizer, text: str) -> str:
    messages = [{"role": "user", "content": text}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


# --------------------------------------------------------------------------- layout + loading


def test_cache_layout_and_config(paths: dict[str, Path], cache_dir: Path) -> None:
    for variant, path in paths.items():
        assert path == cache_dir / "fixtures" / f"{variant}-s0-r{RECIPE_VERSION}"
        names = {p.name for p in path.iterdir()}
        assert names >= {
            "config.json",
            "model.safetensors",
            "tokenizer.json",
            "vocab.json",
            "merges.txt",
            "tokenizer_config.json",
            "special_tokens_map.json",
            "chat_template.jinja",
            "generation_config.json",
            "preprocessor_config.json",
            "video_preprocessor_config.json",
            "processor_config.json",
            MANIFEST_NAME,
        }
        assert not [n for n in os.listdir(cache_dir / "fixtures") if ".tmp-" in n]
        config = json.loads((path / "config.json").read_text())
        text = config["text_config"]
        assert config["model_type"] == "qwen3_5" and text["model_type"] == "qwen3_5_text"
        assert text["vocab_size"] == VOCAB  # == len(tokenizer), not padded
        assert text["head_dim"] == 32 and text["num_hidden_layers"] == 4 and text["full_attention_interval"] == 4
        assert text["max_position_embeddings"] == 4096 and text["mtp_num_hidden_layers"] == 1
        rope = text["rope_parameters"]
        assert sum(rope["mrope_section"]) == text["head_dim"] * rope["partial_rotary_factor"] / 2
        assert config["tie_word_embeddings"] is False and text["tie_word_embeddings"] is False
        assert config["eos_token_id"] == [1002, 1000]
        assert config["image_token_id"] == 1012 and config["video_token_id"] == 1013
        assert config["vision_config"]["out_hidden_size"] == text["hidden_size"]
        tok_config = json.loads((path / "tokenizer_config.json").read_text())
        assert tok_config["model_max_length"] == text["max_position_embeddings"]
        assert tok_config["eos_token"] == "<|im_end|>" and tok_config["pad_token"] == "<|endoftext|>"


@pytest.mark.parametrize("variant", VARIANTS)
def test_loads_strict_in_both_libraries(paths: dict[str, Path], variant: str) -> None:
    path = paths[variant]
    vmodel, processor = mlx_vlm.load(str(path))  # strict=True is the default
    lmodel, tokenizer = mlx_lm.load(str(path))
    assert len(processor.tokenizer) == len(tokenizer.get_vocab()) == VOCAB
    assert vmodel.language_model.model.embed_tokens.weight.shape == (VOCAB, 64)
    assert lmodel.language_model.lm_head.weight.shape == (VOCAB, 64)
    want = mx.bfloat16 if variant == "bf16" else mx.float32
    assert vmodel.language_model.model.embed_tokens.weight.dtype == want
    assert vmodel.vision_tower.patch_embed.proj.weight.dtype == want
    assert vmodel.language_model.model.layers[0].linear_attn.A_log.dtype == mx.float32

    # Both loaders must undo the HF layout identically (conv1d axis, +1 on zero-centred norms).
    vparams = dict(tree_flatten(vmodel.language_model.parameters()))
    lparams = dict(tree_flatten(lmodel.language_model.parameters()))
    assert vparams.keys() == lparams.keys()
    for name, value in vparams.items():
        assert mx.array_equal(value, lparams[name]).item(), name
    layer = vmodel.language_model.model.layers[3]
    assert mx.array_equal(layer.input_layernorm.weight, mx.ones(64)).item()  # stored as 0
    assert mx.array_equal(layer.self_attn.q_norm.weight, mx.ones(32)).item()

    drafter, kind = load_drafter(str(path), kind="mtp")
    assert kind == "mtp" and type(drafter).__name__ == "Qwen3_5MTPDraftModel"
    assert drafter.fc.weight.shape == (64, 128)
    assert mx.array_equal(drafter.pre_fc_norm_hidden.weight, mx.ones(64)).item()
    if variant == "bigram":
        eye = mx.concatenate([mx.eye(64), mx.zeros((64, 64))], axis=1)
        assert mx.array_equal(drafter.fc.weight, eye).item()
        assert not mx.any(drafter.layers[0].self_attn.o_proj.weight).item()
        assert not mx.any(drafter.layers[0].mlp.down_proj.weight).item()


# --------------------------------------------------------------------------- determinism + cache


def test_build_is_deterministic(paths: dict[str, Path], tmp_path: Path) -> None:
    again = build_fixture(tmp_path / "again", FixtureSpec("bf16", 0))
    for name in sorted(p.name for p in paths["bf16"].iterdir()):
        assert filecmp.cmp(paths["bf16"] / name, again / name, shallow=False), name
    other = build_fixture(tmp_path / "seed1", FixtureSpec("bf16", 1))
    assert (other / "model.safetensors").read_bytes() != (again / "model.safetensors").read_bytes()
    assert (other / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()


def test_fixture_path_reuses_cache(paths: dict[str, Path], cache_dir: Path, monkeypatch) -> None:
    path = paths["fp32"]
    before = {p.name: p.stat().st_mtime_ns for p in path.iterdir()}
    assert fixture_path(FixtureSpec("fp32", 0), cache_dir) == path
    assert {p.name: p.stat().st_mtime_ns for p in path.iterdir()} == before
    monkeypatch.setenv("MLX_RELAY_CACHE", str(cache_dir))
    assert fixture_path() == paths["bf16"] == fixture_path(cache_dir=cache_dir)
    assert default_model_path().name == "relay-tiny-agent"  # the trained agent checkpoint in the package
    assert default_model_path() == embedded_model_path()  # the one `mlx-relay serve` serves without a MODEL


def test_fixture_path_replaces_partial_leftovers(tmp_path: Path) -> None:
    spec = FixtureSpec("fp32", 3)
    root = tmp_path / "fixtures"
    partial = root / spec.dirname
    partial.mkdir(parents=True)
    (partial / "config.json").write_text("{}")  # no manifest: a half-written leftover
    stale_tmp = root / f".{spec.dirname}.tmp-dead"
    stale_tmp.mkdir()
    path = fixture_path(spec, tmp_path)
    assert path == partial and (path / MANIFEST_NAME).is_file()
    assert json.loads((path / "config.json").read_text())["model_type"] == "qwen3_5"
    assert not stale_tmp.exists()


def test_fixture_path_concurrent_processes(tmp_path: Path) -> None:
    code = (
        "import sys; from pathlib import Path;"
        "from mlx_relay.testing.fixtures import FixtureSpec, fixture_path;"
        "print(fixture_path(FixtureSpec('bigram', 7), Path(sys.argv[1])))"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    procs = [
        subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdout=subprocess.PIPE, env=env, text=True)
        for _ in range(2)
    ]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1] == str(tmp_path / "fixtures" / FixtureSpec("bigram", 7).dirname)
    name = FixtureSpec("bigram", 7).dirname
    assert sorted(os.listdir(tmp_path / "fixtures")) == [f".{name}.lock", name]


# --------------------------------------------------------------------------- tokenizer + template


def test_tokenizer_round_trips_and_special_ids(hf_tokenizer) -> None:
    tok = hf_tokenizer
    assert len(tok) == VOCAB
    for text in (
        "Hello, world! The quick brown fox jumps over the lazy dog.",
        "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\t# done {}[]",
        "你好，世界！日本語のテキスト、한국어 텍스트。",
        "mixed: naïve café — emoji 🚀 and tabs\t\tend\n\n",
    ):
        ids = tok.encode(text, add_special_tokens=False)
        assert max(ids) < 1000 and tok.decode(ids) == text
    expected = {
        "<|endoftext|>": 1000,
        "<|im_start|>": 1001,
        "<|im_end|>": 1002,
        "<|vision_start|>": 1009,
        "<|vision_end|>": 1010,
        "<|image_pad|>": 1012,
        "<|video_pad|>": 1013,
        "<tool_call>": 1014,
        "</tool_call>": 1015,
        "<tool_response>": 1022,
        "</tool_response>": 1023,
        "<think>": 1024,
        "</think>": 1025,
    }
    for content, want in expected.items():
        assert tok.convert_tokens_to_ids(content) == want == token_id(content)
        assert tok.encode(content, add_special_tokens=False) == [want]
    assert [token_id(c) for c, _ in SPECIAL_TOKENS] == list(range(1000, 1026))
    decoder = tok.added_tokens_decoder
    assert decoder[1002].special and not decoder[1014].special and not decoder[1024].special
    assert tok.eos_token_id == 1002 and tok.pad_token_id == 1000


def test_chat_template_conversation(hf_tokenizer) -> None:
    messages = [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {
            "role": "user",
            "content": [
                {"type": "text", "text": "Look: "},
                {"type": "image"},
                {"type": "image_url", "image_url": {"url": "data:x"}},
                {"type": "video"},
                {"type": "text", "text": " ok?"},
            ],
        },
    ]
    rendered = hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    img, vid = "<|vision_start|><|image_pad|><|vision_end|>", "<|vision_start|><|video_pad|><|vision_end|>"
    assert rendered == (
        "<|im_start|>system\nYou are terse.<|im_end|>\n"
        "<|im_start|>user\nHi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
        f"<|im_start|>user\nLook: {img}{img}{vid} ok?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"  # enable_thinking defaults to false
    )
    thinking = hf_tokenizer.apply_chat_template(
        messages[:2], add_generation_prompt=True, tokenize=False, enable_thinking=True
    )
    assert thinking.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert not hf_tokenizer.apply_chat_template(messages[:2], tokenize=False).endswith("assistant\n")


def test_chat_template_tools(hf_tokenizer) -> None:
    tools = [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Weather",
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
            },
        }
    ]
    messages = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "reasoning_content": "Two calls.",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
                {
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": {"city": "Rome", "days": [1, 2]}},
                },
            ],
        },
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    rendered = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
    assert rendered.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    )
    assert json.dumps(tools[0]) in rendered and "\n</tools>" in rendered
    assert rendered.endswith(
        "<|im_start|>user\nWeather in Paris and Rome?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>\n"
        "<tool_call>\n<function=get_weather>\n<parameter=city>\nRome\n</parameter>\n"
        "<parameter=days>\n[1, 2]\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        "<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    assert _infer_tool_parser(hf_tokenizer) == "qwen3_coder"


def test_chat_template_rejects_late_system_message(hf_tokenizer) -> None:
    messages = [{"role": "user", "content": "Hi"}, {"role": "system", "content": "late"}]
    with pytest.raises(jinja2.exceptions.TemplateError, match="System message must be at the beginning"):
        hf_tokenizer.apply_chat_template(messages, tokenize=False)


# --------------------------------------------------------------------------- generation


@pytest.mark.parametrize("variant", ["fp32", "bf16"])
def test_greedy_generation_is_varied(paths: dict[str, Path], variant: str) -> None:
    model, tokenizer = mlx_lm.load(str(paths[variant]))
    outputs = []
    for text in ("Hello, how are you?", "Write a poem about the sea.", "def fib(n):"):
        prompt = _chat_prompt(tokenizer, text)
        tokens = [r.token for r in mlx_lm.stream_generate(model, tokenizer, prompt, max_tokens=32)]
        assert len(tokens) == 32  # greedy never picks an added token, so no early EOS
        assert len(set(tokens)) >= 4, tokens
        assert max(tokens) < 1000
        assert mlx_lm.generate(model, tokenizer, prompt, max_tokens=32) == tokenizer.decode(tokens)
        outputs.append(tuple(tokens))
    assert len(set(outputs)) == len(outputs)  # the continuation depends on the prompt


def test_bigram_mtp_drafts_are_accepted(paths: dict[str, Path]) -> None:
    path = paths["bigram"]
    model, processor = mlx_vlm.load(str(path))
    prompt = mlx_vlm.apply_chat_template(processor, model.config, "Tell me a story.", num_images=0)

    def run(**kwargs) -> list[int]:
        return [
            r.token for r in mlx_vlm.stream_generate(model, processor, prompt, max_tokens=32, temperature=0.0, **kwargs)
        ]

    baseline = run()
    drafter, _ = load_drafter(str(path), kind="mtp")
    with_mtp = run(draft_model=drafter, draft_kind="mtp", draft_block_size=3)
    assert with_mtp == baseline
    assert drafter.accept_lens
    assert float(np.mean(drafter.accept_lens)) >= 1.0, drafter.accept_lens


def test_different_seeds_differ_and_variants_share_tokenizer(paths: dict[str, Path]) -> None:
    for a, b in itertools.combinations(VARIANTS, 2):
        assert (paths[a] / "tokenizer.json").read_bytes() == (paths[b] / "tokenizer.json").read_bytes()
        assert (paths[a] / "model.safetensors").read_bytes() != (paths[b] / "model.safetensors").read_bytes()

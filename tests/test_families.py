"""Two more model families through the engine (issue 31.4): a dense attention-only Qwen3 text model
loaded by mlx-lm, served by the engine's own Qwen3 family in the plain lane (`engine/models/qwen3/`:
our prefill, the compiled decode step), and a Gemma 3 VLM loaded by mlx-vlm, and that VLM's language
model as a text-only Gemma 3 loaded by mlx-lm, served by the KV lane (`engine/lanes/kv_lane.py`) over
the library's own forward (`mlx_relay/testing/family_fixtures.py`).

Greedy exactness on float32: every request's tokens equal the library's plain decoding of the same
prompt, whether it ran alone, in a batch that rows join and leave at different steps, restored from
a system-prompt snapshot or from the previous turn's snapshot (Gemma 3's prompts and replies run
past its sliding window). Image rows on the Gemma 3 VLM equal mlx-vlm's own generate on the same chat
and image. A model of neither kind of family is refused at load, saying why.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import pytest

from mlx_relay.engine.models import UnsupportedModel
from mlx_relay.engine.models.loader import load_model
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.messages.prefix_cache import PrefixPlan
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.family_fixtures import Family, family_fixture_path
from mlx_relay.testing.reference import greedy_reference

FAMILIES: list[Family] = ["qwen3", "gemma3", "gemma3_text"]
SYSTEM = [(37 * i + 11) % 997 + 1 for i in range(21)]
SUFFIXES = [[(53 * i + 7 * k) % 991 + 3 for i in range(5 + 4 * k)] for k in range(3)]
OTHER = [(29 * i + 5) % 983 + 2 for i in range(9)]
MAX_TOKENS = 12


def library_greedy(path: Path, family: Family, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Plain greedy decoding, one prompt at a time, by the library that loads the family."""
    if family == "gemma3":
        return greedy_reference(path, prompts, max_tokens)  # mlx-vlm's generate_step
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.utils import load_model as lm_load

    model, _config = lm_load(path)
    return [[int(t) for t, _ in generate_step(mx.array(p), model, max_tokens=max_tokens)] for p in prompts]


@pytest.mark.parametrize("family", FAMILIES)
def test_batched_and_cached_decoding_equal_the_librarys_plain_decoding(gpu: Callable, family: Family) -> None:
    path = family_fixture_path(family)

    def run() -> tuple[Any, ...]:
        loaded = load_model(path)
        d = Driver(loaded, prefill_step_size=16)
        sp = SamplingParams(max_tokens=MAX_TOKENS)
        first = SYSTEM + SUFFIXES[0]
        a = d.add(Generate("a", first, sp, prefix=PrefixPlan(snapshot_at=[len(SYSTEM)], snapshot_turn=True)))
        d.run()
        (system,) = [s for s in d.snapshots[a] if s.kind == "system"]
        (turn,) = [s for s in d.snapshots[a] if s.kind == "turn"]
        # three rows at once: two restored from the system prompt, one from scratch; their prefills
        # end at different steps (16 tokens a step), so they join the decode batch one by one
        b = d.add(Generate("b", SYSTEM + SUFFIXES[1], sp, prefix=PrefixPlan(system.handle, system.length)))
        c = d.add(Generate("c", SYSTEM + SUFFIXES[2], sp, prefix=PrefixPlan(system.handle, system.length)))
        o = d.add(Generate("o", OTHER, SamplingParams(max_tokens=5)))
        x = d.add(Generate("x", OTHER[::-1], sp))  # cancelled while the others decode
        for _ in range(4):
            d.step()
        d.engine.cancel(x)
        d.run()
        turn2 = first + turn.generated + [400, 401, 402]
        e = d.add(Generate("e", turn2, sp, prefix=PrefixPlan(turn.handle, turn.length)))
        # a snapshot as long as the prompt: its last token runs again, for the first token's logits
        again = first + turn.generated
        f = d.add(Generate("f", again, sp, prefix=PrefixPlan(turn.handle, turn.length)))
        d.run()
        prompts = [first, SYSTEM + SUFFIXES[1], SYSTEM + SUFFIXES[2], OTHER, turn2, again]
        ref = library_greedy(path, family, prompts, MAX_TOKENS)
        ref[3] = ref[3][:5]
        stats = d.engine.stats()
        d.engine.close()
        return loaded.info, d, (a, b, c, o, e, f), x, turn, ref, stats

    info, d, sids, x, turn, ref, stats = gpu(run)
    assert info.model_type == family and not info.has_mtp
    assert [d.tokens[s] for s in sids] == ref
    assert x not in d.finished and d.tokens[x]  # it had started decoding beside them
    assert turn.length == len(SYSTEM + SUFFIXES[0]) + len(turn.generated) and len(turn.generated) == MAX_TOKENS
    assert [d.finished[s].cached_tokens for s in sids] == [0, len(SYSTEM), len(SYSTEM), 0, turn.length,
                                                           turn.length - 1]
    assert [d.finished[s].reason for s in sids] == ["length"] * 6
    assert stats.snapshots >= 2 and stats.snapshot_bytes > 0 and stats.mtp_rounds == 0


async def test_a_model_no_path_serves_is_refused_at_load_saying_why(tmp_path: Path) -> None:
    """A Qwen3-Next checkpoint (mlx-lm loads it; hybrid: its linear-attention layers keep a recurrent
    state the KV lane cannot snapshot or batch) with the Qwen3 fixture's tokenizer: the server's
    load fails, naming the type, the layer and what it keeps; it never serves a token."""
    import numpy as np
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_next

    from mlx_relay.relay import Relay
    from mlx_relay.testing.fixtures import save_safetensors

    source = family_fixture_path("qwen3")
    for f in source.iterdir():
        if f.name not in ("config.json", "model.safetensors"):
            (tmp_path / f.name).write_bytes(f.read_bytes())
    config = json.loads((source / "config.json").read_text()) | {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "linear_num_value_heads": 2,
        "linear_num_key_heads": 1, "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_conv_kernel_dim": 4,
        "num_experts": 0, "num_experts_per_tok": 0, "decoder_sparse_step": 1, "shared_expert_intermediate_size": 0,
        "mlp_only_layers": [], "moe_intermediate_size": 0, "partial_rotary_factor": 0.5, "full_attention_interval": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    shapes = qwen3_next.Model(qwen3_next.ModelArgs.from_dict(config)).parameters()  # lazy: never evaluated
    save_safetensors(tmp_path / "model.safetensors",
                     {k: ("F32", np.zeros(v.shape, np.float32)) for k, v in tree_flatten(shapes)})
    with pytest.raises(UnsupportedModel) as caught:
        async with Relay.start(tmp_path, warmup=False):
            pass
    message = str(caught.value)
    assert "'qwen3_next' is not served" in message and "layer 0's state in ArraysCache" in message


@pytest.mark.parametrize("family", FAMILIES)
def test_each_familys_template_decides_its_tool_and_reasoning_format(family: Family) -> None:
    """No MLX: what the front end reads from each family's own chat template. Qwen3's teaches
    Hermes-style JSON calls and thinking blocks, and renders the tools; Gemma 3's renders neither,
    so the tools are written into its prompt (`chat/tool_prompt.py`) and its calls read as JSON; a
    reply in the family's format parses into reasoning, content and a call."""
    from transformers import AutoTokenizer

    from mlx_relay.chat.output import ContentDelta, ReasoningDelta, ToolCallArguments, ToolCallStart
    from mlx_relay.chat.prompt_render import template_renders_tools
    from mlx_relay.chat.reply_parser import ReplyParser, reasoning_in_template, tool_format_for_template
    from mlx_relay.chat.tool_prompt import fold_tools
    from mlx_relay.chat.types import ToolDef

    tokenizer = AutoTokenizer.from_pretrained(str(family_fixture_path(family)))
    template = tokenizer.chat_template
    assert template_renders_tools(tokenizer) is (family == "qwen3")
    assert tool_format_for_template(template) == ("json" if family == "qwen3" else None)
    assert reasoning_in_template(template) is (family == "qwen3")
    tools = [{"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}}]
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "list it"},
               {"role": "assistant", "content": "", "reasoning_content": "use ls",
                "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "ls", "arguments": {"p": "."}}}]},
               {"role": "tool", "tool_call_id": "c1", "content": "a.py"}]
    if family != "qwen3":
        history, tools = fold_tools(history, tools), None
    text = tokenizer.apply_chat_template(history, tools=tools, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "ls", "arguments": {"p": "."}}\n</tool_call>' in text
    assert "<tool_response>\na.py\n</tool_response>" in text and '"name": "ls"' in text.split("list it")[0]
    assert text.endswith("<|im_start|>assistant\n" if family == "qwen3" else "<start_of_turn>model\n")
    reply = '<think>plan</think>Sure.\n<tool_call>\n{"name": "ls", "arguments": {"p": "src"}}\n</tool_call>'
    declared = [msgspec.convert({"type": "function", "function": {"name": "ls", "parameters": {"type": "object"}}},
                                ToolDef)]
    parser = ReplyParser(tools=declared, tool_format="json")
    events = parser.feed(reply) + parser.finish("stop")
    assert "".join(e.text for e in events if isinstance(e, ReasoningDelta)) == "plan"
    assert "".join(e.text for e in events if isinstance(e, ContentDelta)).strip() == "Sure."
    assert [e.name for e in events if isinstance(e, ToolCallStart)] == ["ls"]
    assert json.loads("".join(e.fragment for e in events if isinstance(e, ToolCallArguments))) == {"p": "src"}


def test_the_text_only_gemma3_is_the_vlms_language_model(gpu: Callable) -> None:
    """The same weights in both libraries decode the same tokens: the fixtures are one model."""
    prompts = [SYSTEM + SUFFIXES[1], OTHER]
    vlm, text = gpu(lambda: [library_greedy(family_fixture_path(f), f, prompts, MAX_TOKENS)
                             for f in ("gemma3", "gemma3_text")])
    assert vlm == text


@pytest.mark.parametrize("family", FAMILIES)
async def test_a_new_server_restores_the_familys_snapshots_from_disk(family: Family, tmp_path: Path) -> None:
    """The prefix cache's disk tier: a server writes a system-prompt snapshot through; a new server on
    the same directory restores it (checked against the engine's cache layout) and answers exactly
    what the cold prefill answered."""
    from mlx_relay.relay import Relay

    path = family_fixture_path(family)
    conv = [{"role": "system", "content": "Keep every change small and run the tests first. " * 3},
            {"role": "user", "content": "Fix the failing test"}]
    opts: dict[str, Any] = {"prefix_min_snapshot_tokens": 8, "max_num_seqs": 4, "warmup": False,
                            "prefix_cache_dir": str(tmp_path)}
    async with Relay.start(path, **opts) as relay:
        cold = await relay.chat(conv, max_tokens=6, temperature=0)
        assert (await relay.persist_prefix_cache()).pending == 0
    async with Relay.start(path, prefix_cache_preload=0, **opts) as relay:
        warm = await relay.chat(conv, max_tokens=6, temperature=0)
        disk = (await relay.prefix_cache_stats())["prefix_cache"]["disk"]
    assert cold.cached_tokens == 0 and warm.cached_tokens > 0
    assert warm.token_ids == cold.token_ids
    assert disk["loads"] == 1 and disk["rejected"]["layout"] == 0


def _gemma3_image_prompts(path: Path) -> tuple[list[str], list[Any], list[tuple[list[int], Any]]]:
    """Three image chats rendered and expanded by the front end (no MLX): A; B, A's text and image
    with another question after it; C, another image. Their texts, the images (H, W, 3) and our
    (tokens, VisionInputs)."""
    import numpy as np

    from mlx_relay.actors.normalizer import load_tokenizer
    from mlx_relay.media.hashing import pixels_hash
    from mlx_relay.media.items import DecodedImage
    from mlx_relay.media.served import load_media_processor

    processor = load_media_processor(path)
    assert processor is not None
    tokenizer = load_tokenizer(path)
    rng = np.random.default_rng(3)
    first, other = (rng.integers(0, 256, shape, dtype=np.uint8) for shape in ((40, 56, 3), (32, 32, 3)))
    system = {"role": "system", "content": "Look closely, then answer in one short line."}
    chats = [([system, {"role": "user", "content": [{"type": "text", "text": "Here:"}, {"type": "image"},
                                                    {"type": "text", "text": q}]}], image)
             for q, image in (("What is it?", first), ("Which colour is most of it?", first),
                              ("What is it?", other))]
    texts, out = [], []
    for messages, image in chats:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompt = list(tokenizer.encode(text, add_special_tokens=False))
        processor.check_placeholders(prompt, ["image"])
        texts.append(text)
        out.append(processor.process([DecodedImage(image, pixels_hash("image", image))], ["image"], prompt))
    return texts, [image for _, image in chats], out


def test_gemma3_image_rows_equal_mlx_vlms_generate(gpu: Callable) -> None:
    """Images on the Gemma 3 VLM, greedy, float32: the front end's ids and pixels through the KV lane
    give the tokens mlx-vlm's own generate gives from its processor's output on the same chat and
    image. The lane's prefill runs 3 tokens a chunk, so chunks end inside the image's tokens; A is
    snapshotted inside its image and at its end; B (A's text and image, another question) restores
    from the snapshot inside the image and prefills the rest of it from its embeddings, batched
    with C (another image) from scratch."""
    path = family_fixture_path("gemma3")
    texts, images, prompts = _gemma3_image_prompts(path)
    (a_tokens, a_vision), (b_tokens, b_vision), (c_tokens, c_vision) = prompts
    (start, end), = a_vision.spans
    inside = start + 2
    assert a_tokens[:end] == b_tokens[:end] and a_vision.content_hashes == b_vision.content_hashes

    def run() -> tuple[Any, ...]:
        import mlx.core as mx
        import mlx_vlm
        import numpy as np
        from mlx_vlm.generate.ar import generate_step

        loaded = load_model(path)
        assert loaded.info.has_vision
        d = Driver(loaded, prefill_step_size=3)
        sp = SamplingParams(max_tokens=MAX_TOKENS)
        a = d.add(Generate("a", a_tokens, sp, vision=a_vision, prefix=PrefixPlan(snapshot_at=[inside, end])))
        d.run()
        snaps = {s.length: s for s in d.snapshots[a]}
        b = d.add(Generate("b", b_tokens, sp, vision=b_vision,
                           prefix=PrefixPlan(snaps[inside].handle, snaps[inside].length)))
        c = d.add(Generate("c", c_tokens, sp, vision=c_vision, prefix=PrefixPlan()))
        d.run()
        d.engine.close()
        model, processor = mlx_vlm.load(str(path))
        eos = set(loaded.info.eos_token_ids)
        ref, ref_ids = [], []
        for text, image in zip(texts, images, strict=True):
            inputs = processor(text=[text], images=[np.ascontiguousarray(image.transpose(2, 0, 1))])
            ref_ids.append(inputs["input_ids"][0].tolist())
            tokens: list[int] = []
            for token, _ in generate_step(inputs["input_ids"], model, inputs["pixel_values"], inputs["attention_mask"],
                                          max_tokens=MAX_TOKENS, temperature=0.0):
                tokens.append(int(token))
                if tokens[-1] in eos:
                    break
            ref.append(tokens)
        mx.clear_cache()
        return d, (a, b, c), sorted(snaps), ref, ref_ids

    d, sids, snapshot_lengths, ref, ref_ids = gpu(run)
    assert ref_ids == [a_tokens, b_tokens, c_tokens]  # the front end's expansion is the processor's
    assert [d.tokens[s] for s in sids] == ref
    assert snapshot_lengths == [inside, end]
    assert [d.finished[s].cached_tokens for s in sids] == [0, inside, 0]
    assert len(set(map(tuple, ref))) == 3  # the image and the question each change the reply

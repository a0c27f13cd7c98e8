"""The agent curriculum (``tools/agent_curriculum.py``), the evaluation's scorers
(``tools/eval_agent_model.py``) and the trainer's pieces (``tools/train_agent_model.py``),
on the fp32 fixture's tokenizer and chat template (the same as relay-tiny-coder's)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import pytest

from mlx_relay.chat.types import FunctionDef, ToolDef
from mlx_relay.testing.scripts import load_script

_TOOLS = Path(__file__).resolve().parent.parent / "tools"


def _script(name: str) -> ModuleType:
    return load_script(_TOOLS / f"{name}.py", name)


@pytest.fixture(scope="module")
def cur(fp32_model: Path) -> Any:
    tool = _script("agent_curriculum")
    return tool.Curriculum(fp32_model, seed=0)


def _segments(enc: Any) -> list[tuple[int, int]]:
    """[start, end) of each run of masked tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], enc.mask.astype(np.int8), [0]])))
    return list(zip(edges[::2].tolist(), edges[1::2].tolist(), strict=True))


def _replies(cur: Any, enc: Any) -> list[str]:
    return [cur.tokenizer.decode(enc.ids[a:b].tolist()) for a, b in _segments(enc)]


def test_examples_are_deterministic_by_seed_and_split(cur: Any, fp32_model: Path) -> None:
    tool = _script("agent_curriculum")
    for i in range(6):
        a, b = cur.encode(cur.example(tool.TRAIN, i)), cur.encode(cur.example(tool.TRAIN, i))
        assert np.array_equal(a.ids, b.ids) and np.array_equal(a.mask, b.mask)
    train = [cur.encode(cur.example(tool.TRAIN, i, "needle", 256)).ids.tolist() for i in range(3)]
    held = [cur.encode(cur.example(tool.HELD_OUT, i, "needle", 256)).ids.tolist() for i in range(3)]
    assert not set(map(tuple, train)) & set(map(tuple, held))
    other = tool.Curriculum(fp32_model, seed=1)
    assert other.encode(other.example(tool.TRAIN, 0, "needle", 256)).ids.tolist() != train[0]


@pytest.mark.parametrize("family", ["needle", "copy", "tool", "json", "chat"])
def test_masks_cover_exactly_the_assistant_turns(cur: Any, family: str) -> None:
    tool = _script("agent_curriculum")
    im_end = cur.tokenizer.convert_tokens_to_ids("<|im_end|>")
    for i in range(4):
        ex = cur.example(tool.TRAIN, i, family, 512)
        enc = cur.encode(ex)  # also checks every turn's server prompt is a prefix of the conversation
        turns = [m for m in ex.messages if m.role == "assistant"]
        segments = _segments(enc)
        assert len(segments) == len(turns)
        for (a, b), message, reply in zip(segments, turns, _replies(cur, enc), strict=True):
            assert enc.ids[b - 1] == im_end and im_end not in enc.ids[a:b - 1].tolist()
            assert cur.tokenizer.decode(enc.ids[:a].tolist()).endswith("<|im_start|>assistant\n" + (
                "<think>\n" if ex.thinking else "<think>\n\n</think>\n\n"))
            assert "<|im_start|>" not in reply and "<tool_response>" not in reply
            assert (message.content or "") in reply


def test_every_thinking_block_closes(cur: Any) -> None:
    tool = _script("agent_curriculum")
    for i in range(30):
        ex = cur.example(tool.TRAIN, i, length=512)
        text = cur.tokenizer.decode(cur.encode(ex).ids.tolist())
        assert text.count("<think>") == text.count("</think>") >= 1
        for reply in _replies(cur, cur.encode(ex)):
            assert reply.count("</think>") == (1 if ex.thinking else 0)


def test_tool_example_round_trips_through_the_server_parser(cur: Any) -> None:
    tool, ev = _script("agent_curriculum"), _script("eval_agent_model")
    for i in range(8):
        ex = cur.example(tool.TRAIN, i, "tool")
        first = _replies(cur, cur.encode(ex))[0].removesuffix("<|im_end|>")
        assert "<tool_call>\n<function=" + ex.call["name"] + ">" in first
        score = ev.score_tool(first, ex.tools, ex.thinking, ex.call)
        assert score.well_formed and score.exact, (score.error, first)


def test_json_example_answer_parses_with_the_requested_keys(cur: Any) -> None:
    tool, ev = _script("agent_curriculum"), _script("eval_agent_model")
    for i in range(8):
        ex = cur.example(tool.TRAIN, i, "json")
        reply = _replies(cur, cur.encode(ex))[0].removesuffix("<|im_end|>")
        assert ev.score_json(reply, ex.thinking, ex.json_keys) == (True, True)
        assert json.loads(ex.answer) == json.loads(reply.split("</think>")[-1])


def test_json_budget_lets_every_held_out_reference_reply_finish_with_room(cur: Any) -> None:
    """The evaluation's JSON budget is at least 3x each held-out reference reply (thinking and
    answer): a reply the model would end is not cut by max_tokens and scored as invalid JSON."""
    tool, ev = _script("agent_curriculum"), _script("eval_agent_model")
    for i in range(40):
        ex = cur.example(tool.HELD_OUT, i, "json")
        reply = _replies(cur, cur.encode(ex))[0]
        tokens = len(cur.tokenizer.encode(reply, add_special_tokens=False))
        assert 3 * tokens <= ev.JSON_MAX_TOKENS, (tokens, reply)


def test_needle_prompt_has_the_asked_length_and_answer(cur: Any) -> None:
    tool = _script("agent_curriculum")
    ex = cur.example(tool.HELD_OUT, 0, "needle", 2048)
    prompt = cur.prompt_ids(ex)
    assert 1600 < len(prompt) <= 2048
    assert f"is {ex.answer}." in cur.tokenizer.decode(prompt)


def test_rows_are_packed_to_length_and_padding_is_masked(cur: Any) -> None:
    tool = _script("agent_curriculum")
    pad = cur.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    for i in range(24):  # 256: shorter than a tool example's prompt, so rows retry other families
        length = 256 if i % 2 else 384
        row = cur.row(tool.TRAIN, i, length, pad)
        assert row.ids.shape == row.mask.shape == (length,)
        assert row.mask.any()
        assert not row.mask[row.ids == pad].any()


# --------------------------------------------------------------------------- the scorers


def _tools() -> list[ToolDef]:
    params = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"]}
    return [ToolDef(FunctionDef("get_weather", "Get a weather.", params))]


def _call(name: str, days: str) -> str:
    return (f"I will call it.\n</think>\n\n<tool_call>\n<function={name}>\n<parameter=city>\nOslo\n</parameter>\n"
            f"<parameter=days>\n{days}\n</parameter>\n</function>\n</tool_call>")


def test_tool_scorer_on_hand_made_replies() -> None:
    ev = _script("eval_agent_model")
    expected = {"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}
    right = ev.score_tool(_call("get_weather", "3"), _tools(), True, expected)
    assert right.well_formed and right.exact
    other_args = ev.score_tool(_call("get_weather", "4"), _tools(), True, expected)
    assert other_args.well_formed and not other_args.exact
    undeclared = ev.score_tool(_call("get_time", "3"), _tools(), True, expected)
    assert not undeclared.well_formed and "not a declared tool" in (undeclared.error or "")
    assert not ev.score_tool(_call("get_weather", "soon"), _tools(), True, expected).well_formed
    assert ev.score_tool("It is sunny.", _tools(), False).error == "no tool call"
    assert not ev.score_tool(_call("get_weather", "3").removesuffix("</tool_call>"), _tools(), True).well_formed


def test_think_json_and_needle_scorers_on_hand_made_replies() -> None:
    ev = _script("eval_agent_model")
    assert ev.think_closed("ok\n</think>\n\nhi", True)
    assert not ev.think_closed("still thinking about it", True)
    assert ev.think_closed("plain answer", False) and not ev.think_closed("<think>\nhmm", False)
    assert ev.score_json('x\n</think>\n\n{"a": 1, "b": "c"}', True, ["b", "a"]) == (True, True)
    assert ev.score_json('x\n</think>\n\n{"a": 1}', True, ["a", "b"]) == (True, False)
    assert ev.score_json('x\n</think>\n\n{"a": 1,', True) == (False, False)
    assert ev.score_json("x\n</think>\n\n[1, 2]", True) == (False, False)
    assert ev.score_json('{"a": 1}', True) == (False, False)  # thinking never closed
    cut = ev.score_json_reply('x\n</think>{"a": "P", "a": "P", "a', "length", True, ["a"])
    assert (cut.valid, cut.keys, cut.cut) == (False, False, True)
    done = ev.score_json_reply('x\n</think>{"a": "P"}', "stop", True, ["a"])
    assert (done.valid, done.keys, done.cut) == (True, True, False)
    assert ev.score_needle("The code is 123.\n</think>\n\n123456", "123456", True)
    assert not ev.score_needle("</think>\n\n123457", "123456", True)
    assert not ev.score_needle("123456", "123456", True)


def test_schedule_and_step_plan() -> None:
    tr = _script("train_agent_model")
    args = tr.parse_args(["--out", "x", "--schedule", "1024:3,16384:2", "--tokens-per-step", "65536"])
    assert args.stages == [(1024, 3, 0), (16384, 2, 0)] and args.steps == 5
    assert tr.stage_plans(args, 0) == [[(0, 1024, 64), (1, 1024, 64), (2, 1024, 64)],
                                       [(3, 16384, 4), (4, 16384, 4)]]
    assert tr.stage_plans(args, 4) == [[], [(4, 16384, 4)]]
    rows = tr.parse_args(["--out", "x", "--schedule", "1024:1,8192:1:3", "--tokens-per-step", "65536"])
    assert tr.stage_plans(rows, 0) == [[(0, 1024, 64)], [(1, 8192, 3)]]  # a stage's own row count
    assert tr.stage_deadlines(args) == [math.inf, math.inf]
    timed = tr.parse_args(["--out", "x", "--schedule", "1024:3,16384:2", "--max-seconds", "100",
                           "--stage-time-shares", "3,1"])
    assert timed.shares == [0.75, 0.25] and tr.stage_deadlines(timed) == [75.0, 100.0]
    assert timed.steps > 10**9  # the learning rate follows the time
    with pytest.raises(SystemExit):
        tr.parse_args(["--out", "x", "--schedule", "1024:3", "--stage-time-shares", "1"])  # no --max-seconds
    with pytest.raises(ValueError):
        tr.parse_schedule("16:0")
    with pytest.raises(ValueError):
        tr.parse_schedule("1024:2:1:1")


def test_masked_losses_split_the_plain_losses_by_token_kind() -> None:
    import mlx.core as mx

    from mlx_relay.testing.fixtures import FixtureSpec

    tr, small = _script("train_agent_model"), _script("train_small_mtp")
    mx.random.seed(0)
    model = small.TargetWithMTP(small.small_config(FixtureSpec("fp32", 0, 64, 128, 4), 16))
    tokens = mx.array(np.random.default_rng(0).integers(0, 1000, (2, 24)), dtype=mx.int32)
    plain = small.joint_losses(model.vlm, model.mtp, tokens)

    def losses(kind: int) -> dict[str, float]:
        out = tr.masked_losses(model.vlm, model.mtp, tokens, mx.full(tokens.shape, kind, dtype=mx.int8))
        return {k: v.item() for k, v in out.items()}

    every = losses(tr.ASSISTANT)  # every token an assistant turn's: the plain losses
    assert [every["main"], every["mtp"]] == pytest.approx([a.item() for a in plain], rel=1e-5)
    assert every["context"] == every["mtp_context"] == 0.0
    text = losses(tr.CONTEXT)  # every token the prompt's: the same numbers on the context side
    assert [text["context"], text["mtp_context"]] == pytest.approx([a.item() for a in plain], rel=1e-5)
    assert set(losses(tr.PAD).values()) == {0.0}
    parts = {k: mx.array(v) for k, v in every.items()}
    assert tr.total_loss(parts, 0.3, 0.5).item() == pytest.approx(every["main"] + 0.5 * every["mtp"], rel=1e-6)


def test_token_kinds_mark_padding_apart_from_the_prompts(cur: Any) -> None:
    tool, tr = _script("agent_curriculum"), _script("train_agent_model")
    pad = cur.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    row = cur.row(tool.TRAIN, 5, 384, pad)
    kinds = tr.token_kinds(row.ids, row.mask, pad)
    assert (kinds == tr.ASSISTANT).sum() == row.mask.sum()
    assert ((kinds == tr.PAD) == (row.ids == pad)).all()
    assert (kinds == tr.CONTEXT).sum() > (kinds == tr.ASSISTANT).sum()


def test_training_needles_may_ask_every_code_and_held_out_ones_ask_one(cur: Any) -> None:
    tool = _script("agent_curriculum")
    multi = [ex for ex in (cur.example(tool.TRAIN, i, "needle", 512) for i in range(24)) if "\n" in (ex.answer or "")]
    assert multi, "no training needle asked for several codes"
    for ex in multi[:3]:
        prompt = cur.tokenizer.decode(cur.prompt_ids(ex))
        assert all(f"is {v}." in prompt for v in ex.answer.split("\n"))
        cur.encode(ex)
    held = [cur.example(tool.HELD_OUT, i, "needle", 512) for i in range(24)]
    assert all(ex.answer is not None and ex.answer.isdigit() for ex in held)


@pytest.mark.timeout(120)
def test_a_few_masked_steps_write_a_checkpoint_that_loads(tmp_path: Path) -> None:
    import mlx_vlm

    tr = _script("train_agent_model")
    out = tmp_path / "agent"
    result = tr.main(["--out", str(out), "--hidden", "64", "--intermediate", "128", "--layers", "4",
                      "--linear-head-dim", "16", "--schedule", "256:2,384:1", "--tokens-per-step", "512",
                      "--warmup", "1", "--log-every", "1", "--no-compile"])
    assert [h["length"] for h in result["history"]] == [256, 256, 384]
    assert all(np.isfinite(h["loss"]) and np.isfinite(h["mtp_loss"]) for h in result["history"])
    assert result["trained_tokens"] > 0
    assert json.loads((out / "config.json").read_text())["text_config"]["max_position_embeddings"] == 32768
    mlx_vlm.load(str(out), strict=True)


def test_memory_limit_options() -> None:
    tr = _script("train_agent_model")
    assert tr.memory_limits(tr.parse_args(["--out", "x"])) == (4 * tr.GiB, None)  # cache bounded by default
    assert tr.memory_limits(tr.parse_args(["--out", "x", "--cache-limit-gb", "-1", "--memory-limit-gb", "70"])) == (
        None, 70 * tr.GiB)
    assert tr.memory_limits(tr.parse_args(["--out", "x", "--cache-limit-gb", "0.5"])) == (tr.GiB // 2, None)


def test_last_good_step_puts_back_the_state_before_an_unevaluated_update() -> None:
    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from mlx.utils import tree_flatten

    tr = _script("train_agent_model")
    model = nn.Linear(4, 2)
    opt = optim.AdamW(learning_rate=0.1)
    x = mx.ones((3, 4))
    grad_fn = nn.value_and_grad(model, lambda m, v: (m(v) ** 2).sum())
    _, grads = grad_fn(model, x)
    opt.update(model, grads)  # one evaluated step: the state to come back to
    mx.eval(model.parameters(), opt.state)
    before = {k: np.array(v) for k, v in tree_flatten((model.parameters(), opt.state))}
    guard = tr.LastGoodStep(model, opt)
    guard.hold()
    _, grads = grad_fn(model, x)
    opt.update(model, grads)  # a step whose evaluation would fail: assigned, never evaluated
    assert guard.restore() and not guard.restore()
    after = {k: np.array(v) for k, v in tree_flatten((model.parameters(), opt.state))}
    assert after.keys() == before.keys()
    assert all(np.array_equal(after[k], before[k]) for k in before)
    guard.hold()
    guard.release()
    assert not guard.restore()  # an evaluated step is kept


@pytest.mark.timeout(120)
def test_a_failed_step_saves_the_last_step_and_resume_goes_on_from_it(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    import mlx.core as mx

    tr = _script("train_agent_model")
    out = tmp_path / "agent"
    argv = ["--out", str(out), "--hidden", "64", "--intermediate", "128", "--layers", "4", "--linear-head-dim",
            "16", "--schedule", "256:2,384:2", "--tokens-per-step", "512", "--warmup", "1", "--log-every", "1",
            "--save-every", "100", "--no-compile", "--cache-limit-gb", "0.25"]
    real, calls = tr.masked_losses, []

    def failing_third_step(*a: Any) -> Any:  # stands for an out-of-memory in the third step
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("out of memory (injected)")
        return real(*a)

    monkeypatch.setattr(tr, "masked_losses", failing_third_step)
    with pytest.raises(RuntimeError, match="injected"):
        tr.main(argv)
    state = mx.load(str(tr.train_state_path(out)))
    assert int(state["__step__"].item()) == 2  # saved at once (no --save-every boundary was reached)
    assert (out / "model.safetensors").is_file()
    monkeypatch.setattr(tr, "masked_losses", real)
    resumed = tr.main([*argv, "--resume"])
    assert [(h["step"], h["length"]) for h in resumed["history"]] == [(3, 384), (4, 384)]
    assert resumed["steps"] == 4

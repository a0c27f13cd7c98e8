"""Output grammars inside the MTP round (issue 30.2): a row with a grammar keeps MTP, exactly.

Greedy: MTP with the grammar gives the plain lane's tokens with it, token for token (float32
fixtures; the lazy tool grammar of `tool_choice` "auto" and a forced call), beside rows without a
grammar in the same steps. A forced call through MTP is a valid call. Sampling: the walk on the
grammar's masked distributions keeps the target's masked distribution (counted). Over HTTP an
agent-shaped request with tools reports its drafts in `usage.mtp`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from mlx_relay.chat.grammar import OutputConstraint, build_grammar, lazy_tool_grammar
from mlx_relay.chat.output import ToolCallEnd
from mlx_relay.chat.reply_parser import ReplyParser
from mlx_relay.chat.types import FunctionDef, NamedToolChoice, ToolDef
from mlx_relay.engine.models.loader import load_model
from mlx_relay.messages.gpu import Finished, Generate, SamplingParams
from mlx_relay.testing import local_http
from mlx_relay.testing.engine_driver import Driver
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.live_server import LiveServer
from tests.test_mtp import _exact_two_token_distribution, assert_two_tokens_fit

SCHEMA = {"type": "object", "properties": {"path": {"type": "string"}, "limit": {"type": "integer"}},
          "required": ["path"]}
TOOLS = [ToolDef(FunctionDef("read_file", "Read a file.", SCHEMA)),
         ToolDef(FunctionDef("run_shell", "Run a command.", {
             "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}))]
# tools whose calls are bounded (an enum, a boolean): a random model's forced call ends
BOUNDED = [ToolDef(FunctionDef("set_mode", "Set the mode.", {
               "type": "object", "properties": {"mode": {"type": "string", "enum": ["safe", "full"]}},
               "required": ["mode"]})),
           ToolDef(FunctionDef("toggle", "Toggle it.", {
               "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"]}))]
PROMPTS = [list(range(5, 5 + n)) for n in (7, 20, 12)]


def _grammar(path: Path, choice: str, tools: list[ToolDef] = TOOLS) -> str:
    tok = AutoTokenizer.from_pretrained(str(path))
    special = frozenset(tok.get_added_vocab())
    if choice == "auto":
        llg = llguidance.hf.from_tokenizer(tok, eos_token=tok.convert_tokens_to_ids("<|im_end|>"))
        grammar, _ = lazy_tool_grammar(OutputConstraint(tools=tools), special, llg)
    else:
        tool_choice: Any = "required" if choice == "required" else NamedToolChoice(tools[0].function.name)
        grammar = build_grammar(OutputConstraint(tools=tools, tool_choice=tool_choice), special)
    assert grammar is not None
    return grammar


def _run(path: Path, reqs: list[Generate], **engine_kw: Any) -> tuple[dict[int, list[int]], dict[int, Finished], Any]:
    d = Driver(load_model(path), prefix_cache=False, **engine_kw)
    for req in reqs:
        d.add(req)
    d.run()
    stats = d.engine.stats()
    d.engine.close()
    return d.tokens, d.finished, stats


@pytest.mark.parametrize(("variant", "block", "verify", "choice"), [
    ("bigram", 3, "batched", "auto"), ("bigram", 3, "batched", "required"), ("fp32", 2, "batched", "named"),
    ("bigram", 2, "exact", "required"),
])
def test_mtp_with_a_grammar_equals_the_plain_lane_with_it(gpu: Callable, variant: str, block: int, verify: str,
                                                          choice: str) -> None:
    """Two grammar rows and one without, MTP on and off: the same greedy tokens; the grammar rows
    drafted (they kept MTP) and, on the bigram head, had drafts accepted."""
    path = fixture_path(FixtureSpec(variant=variant, seed=0))
    grammar = _grammar(path, choice)
    reqs = [Generate("g0", PROMPTS[0], SamplingParams(max_tokens=40, grammar=grammar)),
            Generate("free", PROMPTS[1], SamplingParams(max_tokens=24)),
            Generate("g1", PROMPTS[2], SamplingParams(max_tokens=40, grammar=grammar))]

    def run() -> tuple[Any, ...]:
        return (_run(path, reqs, mtp_block_size=block, mtp_verify=verify, mtp_policy="always"),
                _run(path, reqs, mtp=False, max_draft_tokens=0))

    (tokens, finished, stats), (plain, plain_finished, plain_stats) = gpu(run)
    assert plain_stats.mtp_rounds == 0
    for sid in range(3):
        assert tokens[sid] == plain[sid], sid
        assert finished[sid].reason == plain_finished[sid].reason
    for sid in (0, 2):
        assert finished[sid].drafts.mtp.drafted > 0, sid
    if variant == "bigram":
        assert finished[0].drafts.mtp.accepted + finished[2].drafts.mtp.accepted > 0
    assert stats.mtp_rounds > 0


@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_call_through_mtp_is_a_valid_call(gpu: Callable, choice: str) -> None:
    path = fixture_path(FixtureSpec(variant="bigram", seed=0))
    grammar = _grammar(path, choice, BOUNDED)
    tokens, finished, _stats = gpu(lambda: _run(path, [Generate("c", PROMPTS[1], SamplingParams(
        max_tokens=200, grammar=grammar))], mtp_policy="always", mtp_block_size=3))
    assert finished[0].drafts.mtp.drafted > 0 and finished[0].reason == "stop"
    tok = AutoTokenizer.from_pretrained(str(path))
    text = tok.decode(tokens[0], skip_special_tokens=False).removesuffix("<|im_end|>")
    parser = ReplyParser(tools=BOUNDED, tool_format="qwen3_coder")
    ends = [e for e in parser.feed(text) + parser.finish() if isinstance(e, ToolCallEnd)]
    assert ends, text
    for end in ends:
        tool = next(t for t in BOUNDED if t.function.name == end.name)
        jsonschema.validate(json.loads(end.arguments), tool.function.parameters)
    if choice == "named":
        assert {e.name for e in ends} == {"set_mode"}


def _exact_masked_two_tokens(path: Path, prompt: list[int], grammar: str,
                             params: SamplingParams) -> dict[tuple[int, int], float]:
    """p'(t1) p'(t2 | t1): the model's logits masked by the grammar, then the request's processing."""
    from mlx_relay.engine.sampling.processors import GrammarMask

    tok = AutoTokenizer.from_pretrained(str(path))
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    llg = llguidance.hf.from_tokenizer(tok, eos_token=eos)

    def mask(tokens: list[int], logits: Any) -> Any:
        grammar_mask = GrammarMask(llguidance.LLMatcher(llg, grammar), eos, logits.shape[-1])
        for t in tokens[len(prompt):]:
            grammar_mask.feed(t)
        return grammar_mask.masked(logits)

    return _exact_two_token_distribution(path, prompt, params, mask)


def test_mtp_sampling_with_a_grammar_keeps_the_masked_distribution(gpu: Callable) -> None:
    """The second token is decided by the walk on masked distributions: over many seeds the
    first two tokens fit p'(t1) p'(t2 | t1) (a G-test at p = 0.001), and nothing the grammar
    forbids is ever drawn."""
    path = fixture_path(FixtureSpec(variant="bigram", seed=0))
    grammar = llguidance.LLMatcher.grammar_from_regex(r"[a-m ]+")
    params = SamplingParams(temperature=1.5, top_k=4, max_tokens=2, grammar=grammar)
    prompt = PROMPTS[1]
    n = 200

    def run() -> tuple[Any, ...]:
        reqs = [Generate(f"s{i}", prompt, SamplingParams(temperature=1.5, top_k=4, max_tokens=2, seed=i,
                                                           grammar=grammar)) for i in range(n)]
        d = Driver(load_model(path), prefix_cache=False, max_num_seqs=16, mtp_max_batch=16, mtp_block_size=2,
                   mtp_policy="always")
        for i, req in enumerate(reqs):
            d.add(req)
            if i % 16 == 15:
                d.step()
        d.run()
        stats = d.engine.stats()
        d.engine.close()
        return d.tokens, stats, _exact_masked_two_tokens(path, prompt, grammar, params)

    tokens, stats, exact = gpu(run)
    assert stats.mtp_drafted == n
    assert_two_tokens_fit(tokens, exact, n)


def test_an_agent_request_with_tools_keeps_mtp_over_http(server: LiveServer) -> None:
    """`tool_choice` "auto" with tools (every coding agent's request) runs under the lazy tool
    grammar and still decodes with MTP: `usage.mtp` counts its drafts."""
    tools = [{"type": "function", "function": {"name": t.function.name, "description": t.function.description,
                                               "parameters": t.function.parameters}} for t in TOOLS]
    r = local_http.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "max_tokens": 12, "temperature": 0, "tools": tools, "tool_choice": "auto",
        "messages": [{"role": "system", "content": "You are a coding agent."},
                     {"role": "user", "content": "Read README.md and run the tests."}]})
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    assert usage["mtp"]["draft_tokens"] > 0, usage
    assert 0 <= usage["mtp"]["accepted_tokens"] <= usage["mtp"]["draft_tokens"]

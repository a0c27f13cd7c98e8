"""Output grammars (`mlx_relay/chat/grammar.py`) walked token by token with llguidance on the
embedded model's tokenizer: what each admits first, and whole replies they accept or refuse."""

from __future__ import annotations

from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import pytest
from transformers import AutoTokenizer

from mlx_relay.chat.grammar import OutputConstraint, build_grammar, check_grammar
from mlx_relay.chat.types import FunctionDef, ResponseFormat, ToolDef
from mlx_relay.default_model import default_model_path

TOOLS = [ToolDef(FunctionDef("delete_stock", "Delete a stock.", {
    "type": "object", "properties": {"path": {"type": "integer"}}, "required": ["path"]}))]
JSON = OutputConstraint(response_format=ResponseFormat("json_object"))
FORCED = OutputConstraint(tools=TOOLS, tool_choice="required")
CALL = "<tool_call>\n<function=delete_stock>\n<parameter=path>\n423\n</parameter>\n</function>\n</tool_call>"


@pytest.fixture(scope="module")
def tok() -> Any:
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def llg(tok: Any) -> Any:
    return llguidance.hf.from_tokenizer(tok, eos_token=tok.convert_tokens_to_ids("<|im_end|>"))


def first_tokens(grammar: str, tok: Any, llg: Any) -> set[str]:
    matcher = llguidance.LLMatcher(llg, grammar)
    mask = llguidance.numpy.allocate_token_bitmask(1, llg.vocab_size)
    llguidance.numpy.fill_next_token_bitmask(matcher, mask, 0)
    allowed = np.flatnonzero(np.unpackbits(mask.view(np.uint8), bitorder="little")[:llg.vocab_size])
    return {tok.decode([int(t)]) for t in allowed}


def accepts(grammar: str, text: str, tok: Any, llg: Any) -> bool:
    matcher = llguidance.LLMatcher(llg, grammar)
    for t in tok.encode(text, add_special_tokens=False):
        if not matcher.consume_token(t):
            return False
    return matcher.is_accepting()


@pytest.mark.parametrize(("constraint", "body", "first"), [(JSON, '{"path": 423}', "{"), (FORCED, CALL, "<tool_call>")],
                         ids=["json_object", "forced_call"])
def test_a_grammar_after_thinking_admits_the_separator_and_no_other_text(
        constraint: OutputConstraint, body: str, first: str, tok: Any, llg: Any) -> None:
    """After `</think>` a model writes "\\n\\n" before its answer (Qwen's templates): a grammar that
    follows a thinking block admits that whitespace first, then only its own body."""
    special = frozenset(tok.get_added_vocab())
    plain, after = build_grammar(constraint, special), build_grammar(constraint, special, after_thinking=True)
    assert plain is not None and after is not None
    check_grammar(after, llg)
    assert first_tokens(plain, tok, llg) == {first}  # without a thinking block: the body at once
    opening = first_tokens(after, tok, llg)
    assert first in opening and "\n\n" in opening, opening
    assert all(t.strip() in ("", first) for t in opening), opening  # whitespace, or whitespace and the body's start
    assert accepts(after, "\n\n" + body, tok, llg) and accepts(after, body, tok, llg)
    assert not accepts(plain, "\n\n" + body, tok, llg)
    assert not accepts(after, "\n\nSure: " + body, tok, llg) and not accepts(after, "\n\n", tok, llg)

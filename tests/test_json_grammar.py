"""`response_format`'s grammar (`mlx_relay/chat/grammar.py`): the JSON value may follow a little
whitespace (a Qwen-style model writes "\\n\\n" after `</think>`), and nothing else is let through."""

from __future__ import annotations

from pathlib import Path

import llguidance
import llguidance.hf
import pytest

from mlx_relay.actors.normalizer import load_tokenizer
from mlx_relay.chat.grammar import json_grammar
from mlx_relay.chat.types import ResponseFormat


def _accepts(grammar: str, tok: object, lt: object, text: str) -> bool:
    matcher = llguidance.LLMatcher(lt, grammar)
    ids = tok.encode(text, add_special_tokens=False)  # type: ignore[attr-defined]
    return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()


@pytest.mark.parametrize("fmt", [ResponseFormat("json_object"),
                                 ResponseFormat("json_schema", schema={"type": "object", "required": ["a"],
                                                                       "properties": {"a": {"type": "integer"}}})])
def test_json_reply_may_start_with_whitespace_and_nothing_else(fp32_model: Path, fmt: ResponseFormat) -> None:
    tok = load_tokenizer(fp32_model)
    lt = llguidance.hf.from_tokenizer(tok)
    grammar = json_grammar(fmt)
    for text in ('{"a": 1}', '\n\n{"a": 1}', ' {"a": 1}'):
        assert _accepts(grammar, tok, lt, text), repr(text)
    for text in ('\n\nhello', '\n\n\n\n\n{"a": 1}', '[1]', '{"a": 1} and more'):
        assert not _accepts(grammar, tok, lt, text), repr(text)

"""Builds a row's logits-processor chain (GPU thread only; the processors are `processors.py`).

In order: the logprob recorder (it sees the model's raw distribution), penalties, the thinking
budget, the grammar mask (from the end of the thinking block when the prompt opened one), and
last the `RowSampler` when the row samples. A greedy row without any of these has an empty
chain and decodes exactly as plain greedy decoding. The llguidance tokenizer is built once, on
the first row with a grammar; each grammar text is compiled once (a few kept) and rows get copies.
"""

from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import llguidance
import llguidance.hf

from mlx_relay.engine.sampling.processors import GrammarMask, LogprobRecorder, Penalties, ThinkingBudget
from mlx_relay.engine.sampling.row_sampler import RowSampler, needs_sampler
from mlx_relay.messages.gpu import SamplingParams


@dataclass
class Chain:
    processors: list[Any]
    sampler: RowSampler | None
    recorder: LogprobRecorder | None
    grammar: GrammarMask | None


class LogitsChains:
    #: compiled grammars kept (by text; each row gets a copy)
    matcher_cache_entries = 16

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: list[int], seed: int) -> None:
        self._tokenizer = tokenizer
        self._vocab_size = vocab_size
        self._eos = eos_token_ids[0]
        self._seeds = random.Random(seed)  # per-request seeds for requests that give none
        self._llg_tokenizer: Any = None
        self._matchers: OrderedDict[str, Any] = OrderedDict()  # grammar text -> an unused matcher
        vocab = tokenizer.get_vocab()  # the thinking block's tags, if the tokenizer has them
        self._think: tuple[int | None, int | None] = (vocab.get("<think>"), vocab.get("</think>"))

    def sampler(self, params: SamplingParams) -> RowSampler | None:
        if not needs_sampler(params):
            return None
        return RowSampler(params, params.seed if params.seed is not None else self._seeds.getrandbits(63))

    def build(self, p: SamplingParams) -> Chain:
        chain: list[Any] = []
        recorder = grammar = None
        if p.logprobs >= 0:
            recorder = LogprobRecorder(p.logprobs, self._token_text)
            chain.append(recorder)
        if p.presence_penalty or p.frequency_penalty or p.repetition_penalty not in (None, 1.0):
            chain.append(Penalties(p.presence_penalty, p.frequency_penalty, p.repetition_penalty))
        think_start, think_end = self._think
        if p.thinking_budget is not None and think_end is not None:
            # a grammar that follows the thinking starts right after `</think>`
            close = "\n</think>" if p.grammar is not None else "\n</think>\n\n"
            ids = list(self._tokenizer.encode(close, add_special_tokens=False))
            chain.append(ThinkingBudget(p.thinking_budget, ids, think_end, think_start, p.think_open))
        if p.grammar is not None:
            if self._llg_tokenizer is None:
                self._llg_tokenizer = llguidance.hf.from_tokenizer(self._tokenizer, eos_token=self._eos)
            matcher = self._matcher(p.grammar)
            after = think_end if p.grammar_after_thinking else None
            grammar = GrammarMask(matcher, self._eos, self._vocab_size, after)
            chain.append(grammar)
        sampler = self.sampler(p)
        if sampler is not None:
            chain.append(sampler)
        return Chain(chain, sampler, recorder, grammar)

    def _matcher(self, grammar: str) -> Any:
        """A fresh matcher: a copy of the one compiled for this grammar text before (an agent's
        requests repeat their tools' grammar: a copy with its first mask takes about 2 ms on
        Qwen3.5's vocabulary, compiling about 9 ms, on this thread, between decode steps)."""
        proto = self._matchers.get(grammar)
        if proto is None:
            proto = llguidance.LLMatcher(self._llg_tokenizer, grammar)
            self._matchers[grammar] = proto
            while len(self._matchers) > self.matcher_cache_entries:
                self._matchers.popitem(last=False)
        else:
            self._matchers.move_to_end(grammar)
        return proto.deep_copy()

    def _token_text(self, token: int) -> str:
        return self._tokenizer.decode([token]) if 0 <= token < self._vocab_size else ""

"""PromptRenderer: one chat request into prompt tokens (the Normalizer's work, done in its worker
threads; no MLX, no event loop).

Messages are normalized (`chat.normalize`), rendered by the checkpoint's chat template (or, only
when the operator allows it, the request's own template in `TemplateSandbox`) and tokenized; the
output grammar (`chat.grammar`) is built and validated. Bad input is an `InvalidRequest` here,
never an exception the actor does not expect: template kwargs that collide with the template
call's own parameters are refused before rendering, anything the template raises while
rendering the client's data is the client's 400, and a prompt that cannot fit the context is
refused as early as its length tells: by a character count before anything is rendered, then by
the tokenizer's count before token lists are built.

The prefix cache's boundaries are found here too, by rendering what comes next and counting the
tokens both renderings share: the system prompt's end; how much of the prompt the conversation's
next user turn repeats (`reply_start`); with tools declared, how much of it the agent's next tool
round repeats (`round_start`: this prompt, a reply calling a tool, its result). Counted token by
token, so a boundary is a length the next prompt really starts with.
"""

from __future__ import annotations

import bisect
import contextlib
import inspect
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any, NamedTuple

import jinja2
import msgspec

from mlx_relay.chat.grammar import (
    GrammarError,
    OutputConstraint,
    build_grammar,
    check_grammar,
    check_schema,
    lazy_tool_grammar,
    lazy_tools,
)
from mlx_relay.chat.normalize import (
    NormalizationError,
    media_parts,
    normalize_messages,
    system_prefixes,
    to_template_messages,
)
from mlx_relay.chat.template_sandbox import TemplateFailed, TemplateSandbox
from mlx_relay.chat.tool_prompt import fold_tools, renders_tools
from mlx_relay.chat.types import ChatMessage, TextPart
from mlx_relay.errors import InvalidRequest, PromptTooLong
from mlx_relay.messages.prompt import Boundaries, Render, RenderedPrompt

# what a template raises on data it cannot render (a missing key, a wrong type, its own
# raise_exception): the client's input is at fault
_TEMPLATE_INPUT_ERRORS = (jinja2.TemplateError, TypeError, ValueError, KeyError, IndexError, AttributeError,
                          RecursionError)


def template_renders_tools(tokenizer: Any) -> bool:
    """Whether the model's own chat template renders the tools it is given (Gemma 3's renders none)."""
    return renders_tools(lambda messages, tools: str(tokenizer.apply_chat_template(
        messages, tools=tools, add_generation_prompt=True, tokenize=False)), _TEMPLATE_INPUT_ERRORS)


def thinking_left_open(text: str, start: str = "<think>", end: str = "</think>") -> bool:
    """Whether `text` ends inside a thinking block (its last `<think>` is not closed)."""
    opened = text.rfind(start)
    return opened >= 0 and text.rfind(end) < opened


def common_prefix(a: Sequence[Any], b: Sequence[Any], chunk: int = 4096) -> int:
    """The length of the longest common prefix; compares chunks at C speed (12 MB in ms)."""
    n = min(len(a), len(b))
    i = 0
    while i + chunk <= n and a[i:i + chunk] == b[i:i + chunk]:
        i += chunk
    end = min(n, i + chunk)
    while i < end and a[i] == b[i]:
        i += 1
    return i


def prompt_chars(messages: Sequence[ChatMessage], raw: str | None = None) -> int:
    """Characters of the text a prompt carries (its messages' texts and tool-call arguments)."""
    total = len(raw or "")
    for m in messages:
        if isinstance(m.content, str):
            total += len(m.content)
        elif m.content is not None:
            total += sum(len(p.text) for p in m.content if isinstance(p, TextPart))
        total += len(m.reasoning_content or "")
        total += sum(len(c.function.arguments) + len(c.function.name) for c in m.tool_calls or ())
    return total


class PromptRenderer:
    """Owns the tokenizer; renders `Render`s (thread-safe: tokenizers encode concurrently, the
    caches below are small and tolerate races)."""

    #: rendered system prompts whose tokens are kept (an agent resends the same one every turn)
    system_cache_entries = 64
    system_parts = 3  # the system prompt's boundaries before its end, at most (each a snapshot)
    #: built output grammars kept (by constraint): refused ones are built again each time
    grammar_cache_entries = 32
    #: text normalizers may compose characters (NFC: up to 3 into 1): the character bound's slack
    normalizer_slack = 4
    #: a boundary's last tokens are checked against the next prompt's own tokenization from the last
    #: added token at most this many tokens before it, through this many characters past it
    boundary_tokens = 64
    boundary_chars = 256

    def __init__(self, tokenizer: Any, tool_format: str | None, sandbox: TemplateSandbox | None = None,
                 fold_tools: bool = False) -> None:
        self.tokenizer = tokenizer
        self.tool_format = tool_format
        self.sandbox = sandbox
        self.fold_tools = fold_tools  # the template renders no tools: `chat.tool_prompt` writes them in
        self._backend = tokenizer.backend_tokenizer
        added = tokenizer.get_added_vocab()
        self._special = frozenset(added)
        self._added_ids = frozenset(added.values())
        # the most characters one token can stand for (byte-level vocab strings have one character per byte)
        self.max_token_chars = max(len(k) for k in tokenizer.get_vocab())
        own = inspect.signature(tokenizer.apply_chat_template).parameters
        self.reserved_kwargs = frozenset(n for n, p in own.items() if p.kind is not p.VAR_KEYWORD) | {"messages"}
        self._llg_tokenizer: Any = None
        self._system_ids: OrderedDict[str, list[int]] = OrderedDict()
        self._grammars: OrderedDict[bytes, tuple[str | None, list[str]]] = OrderedDict()

    # -- cheap checks (on the event loop, before a worker is taken) ---------------------------------
    def check(self, msg: Render) -> None:
        for key in msg.template_kwargs:
            if key in self.reserved_kwargs or key.startswith("_") or not key.isidentifier():
                raise InvalidRequest(f"chat_template_kwargs may not set '{key}'", param="chat_template_kwargs")
        if msg.chat_template is not None and self.sandbox is None:
            raise InvalidRequest("this server does not accept a request's own chat template "
                                 "(--allow-request-chat-template)", param="chat_template")
        if msg.max_prompt_tokens is None:
            return
        if isinstance(msg.raw_prompt, list):
            at_least = len(msg.raw_prompt)
        else:
            chars = prompt_chars(msg.messages, msg.raw_prompt)
            at_least = chars // (self.max_token_chars * self.normalizer_slack)
        if at_least > msg.max_prompt_tokens:
            raise PromptTooLong(f"the prompt has at least {at_least} tokens; this server's context allows "
                                f"{msg.max_prompt_tokens}", prompt_tokens=at_least, limit=msg.max_prompt_tokens)

    # -- rendering (worker threads) ---------------------------------------------------------------------
    def render(self, msg: Render) -> RenderedPrompt:
        for tool in msg.tools or ():  # the template and the reply parser read these schemas
            try:
                check_schema(tool.function.parameters or {}, f"the parameters of tool '{tool.function.name}'")
            except GrammarError as exc:
                raise InvalidRequest(str(exc), param="tools") from None
        rendered = self._raw(msg) if msg.raw_prompt is not None else self._chat(msg)
        grammar, loose = self._grammar(msg.constraint, rendered.think_open) if msg.constraint is not None \
            else (None, [])
        return msgspec.structs.replace(rendered, grammar=grammar, tool_format=self.tool_format, loose_tools=loose)

    def _encode(self, text: str, limit: int | None) -> Any:
        """The tokenizer's Encoding (ids and offsets); PromptTooLong before it is built
        for a text the limit cannot hold. `encode_batch*` release the GIL while they work
        (`encode` holds it: a 10 MB prompt would stop the event loop and the GPU thread for
        seconds); a text longer than the limit in characters is first counted without offsets,
        because a full Encoding of millions of tokens takes most of a second to free, holding
        the GIL."""
        if limit is not None and len(text) > limit:
            count = len(self._backend.encode_batch_fast([text], add_special_tokens=False)[0])
            if count > limit:
                raise self._too_long(count, limit)
        encoding = self._backend.encode_batch([text], add_special_tokens=False)[0]
        if limit is not None and len(encoding) > limit:
            count = len(encoding)
            del encoding  # not kept alive by the traceback
            raise self._too_long(count, limit)
        return encoding

    @staticmethod
    def _too_long(count: int, limit: int) -> PromptTooLong:
        return PromptTooLong(f"this model's maximum context length is {limit} tokens for the prompt; "
                             f"the prompt has {count} tokens", prompt_tokens=count, limit=limit)

    def _grammar(self, constraint: OutputConstraint, after_thinking: bool) -> tuple[str | None, list[str]]:
        """The grammar and the tools whose calls it holds only to being well-formed (`auto`). An
        agent declares the same tools every turn: built grammars are kept (building and checking one
        for a coding agent's tools takes 0.1-0.2 s on Qwen3.5's vocabulary)."""
        c = msgspec.structs.replace(constraint, tool_format=self.tool_format)
        key = msgspec.json.encode((c, after_thinking))
        cached = self._grammars.get(key)
        if cached is not None:
            with contextlib.suppress(KeyError):  # another thread may have just dropped it
                self._grammars.move_to_end(key)
            return cached
        built = self._build_grammar(c, after_thinking)
        self._grammars[key] = built
        while len(self._grammars) > self.grammar_cache_entries:
            self._grammars.popitem(last=False)
        return built

    def _build_grammar(self, c: OutputConstraint, after_thinking: bool) -> tuple[str | None, list[str]]:
        if lazy_tools(c):
            return lazy_tool_grammar(c, self._special, self._llg())
        param = "response_format" if c.tool_choice in ("auto", "none") else "tool_choice"
        try:
            grammar = build_grammar(c, self._special, after_thinking)
            if grammar is not None:
                check_grammar(grammar, self._llg())
        except GrammarError as exc:
            raise InvalidRequest(f"cannot enforce {param}: {exc}", param=param) from exc
        return grammar, []

    def _llg(self) -> Any:
        if self._llg_tokenizer is None:
            import llguidance.hf

            self._llg_tokenizer = llguidance.hf.from_tokenizer(self.tokenizer)
        return self._llg_tokenizer

    def _template(self, messages: list[dict[str, Any]], tools: Any, kwargs: dict[str, Any],
                  generation: bool = True) -> str:
        return str(self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=generation,
                                                      tokenize=False, **kwargs))

    def _chat(self, msg: Render) -> RenderedPrompt:
        try:
            messages = normalize_messages(msg.messages)
            template_messages = to_template_messages(messages)
        except NormalizationError as exc:
            raise InvalidRequest(str(exc), param="messages") from exc
        media = media_parts(messages)
        declared = [msgspec.to_builtins(t) for t in msg.tools] if msg.tools else None
        conversation = _Conversation(template_messages, declared,
                                     self.fold_tools and msg.chat_template is None, msg.template_kwargs)
        try:
            if msg.chat_template is not None:
                assert self.sandbox is not None
                text = self.sandbox.render(msg.chat_template, template_messages, declared, conversation.kwargs)
            else:
                text = self._render_conversation(conversation)
        except TemplateFailed as exc:
            raise InvalidRequest(str(exc), param="chat_template") from exc
        except _TEMPLATE_INPUT_ERRORS as exc:
            raise InvalidRequest(f"the chat template rejected the conversation: {str(exc)[:300]}",
                                 param="messages") from exc
        encoding = self._encode(text, msg.max_prompt_tokens)
        ids = list(encoding.ids)
        think_open = thinking_left_open(text)
        boundaries = Boundaries()
        if msg.chat_template is None:  # the boundaries need more renders: not of a client's template
            rendered = conversation.rendered()
            system: list[int] = []
            if len(rendered) > 1 and rendered[0].get("role") == "system":
                system = self._system_ends(rendered[0], system_prefixes(msg.messages)[:-1], conversation, ids)
            prompt = _Rendered(ids, encoding, text)
            boundaries = Boundaries(system, self._reply_start(conversation, prompt),
                                    self._round_start(conversation, prompt, messages, think_open) if declared else 0)
        return RenderedPrompt(token_ids=ids, num_media=len(media), messages=messages, boundaries=boundaries,
                              think_open=think_open)

    def _render_conversation(self, conversation: _Conversation, then: Sequence[dict[str, Any]] = ()) -> str:
        """The conversation (and the messages `then`) through the checkpoint's template: with the
        generation prompt when nothing follows, as history otherwise."""
        return self._template(conversation.rendered(then), conversation.tools, conversation.kwargs,
                              generation=not then)

    def _raw(self, msg: Render) -> RenderedPrompt:
        prompt = msg.raw_prompt
        if isinstance(prompt, str):
            ids = list(self._encode(prompt, msg.max_prompt_tokens).ids)
            return RenderedPrompt(token_ids=ids, num_media=0, messages=[], think_open=thinking_left_open(prompt))
        assert prompt is not None  # token ids: checked against the model's vocabulary by the GPUExecutor
        return RenderedPrompt(token_ids=list(prompt), num_media=0, messages=[])

    def _reply_start(self, conversation: _Conversation, prompt: _Rendered) -> int:
        """How much of this prompt the next user turn's prompt will repeat: the conversation with a
        reply and a next user turn appended is rendered (templates render a reply after the last
        user turn differently from one before it), and the tokens both share are counted. Templates
        that render history differently from the generation prompt (Qwen's drop the `<think>` block
        of past replies) stop it at the reply's header; others reach the prompt's end."""
        probe = [{"role": "assistant", "content": "\u2063"}, {"role": "user", "content": "\u2063"}]
        try:
            history = self._render_conversation(conversation, probe)
        except _TEMPLATE_INPUT_ERRORS:
            return 0
        return self._repeated(prompt, history)

    def _round_start(self, conversation: _Conversation, prompt: _Rendered, messages: Sequence[ChatMessage],
                     think_open: bool) -> int:
        """How much of this prompt the agent's next tool round will repeat: the conversation with a
        reply calling a declared tool and that call's result appended is rendered, and the tokens
        both share are counted. In a tool loop the last user query stays where it is, so a
        template that keeps the reasoning of the replies after it (Qwen3.5's, Qwen3's) repeats the
        whole prompt, and the reply too where it renders the reply as generated; one that drops
        past reasoning stops at the reply's header when the prompt opened a thinking block.

        The probe's reply carries reasoning when the prompt leaves a thinking block open and this
        client sends reasoning back (an earlier reply of the conversation carries some, or there is
        none yet): a client that drops it gets the template's empty thinking block instead, whose
        first token is not the prompt's last (`<think>\\n` against `<think>\\n\\n</think>`)."""
        name = str(conversation.tools_declared[0].get("function", {}).get("name", "")) \
            if conversation.tools_declared else ""
        call: dict[str, Any] = {"role": "assistant", "content": "", "tool_calls": [
            {"id": "relay_probe", "type": "function", "function": {"name": name, "arguments": {}}}]}
        replies = [m for m in messages if m.role == "assistant"]
        if think_open and (not replies or any(m.reasoning_content for m in replies)):
            call["reasoning_content"] = "x"
        result = {"role": "tool", "content": "\u2063", "tool_call_id": "relay_probe", "name": name}
        try:
            history = self._render_conversation(conversation, [call, result])
        except _TEMPLATE_INPUT_ERRORS:
            return 0
        return self._repeated(prompt, history)

    def _repeated(self, prompt: _Rendered, history: str) -> int:
        """How many of the prompt's tokens the prompt rendered as `history` starts with: the tokens
        wholly inside the text both share, less any the next prompt tokenizes otherwise (a token
        at the edge may merge with what follows it there: the prompt's `\\n` and the next one's
        `\\n\\n`). Tokenization starts afresh at an added token, so `history` is tokenized from the
        last one before the edge, and only through a little past it."""
        shared = common_prefix(prompt.text, history)
        offsets = prompt.encoding.offsets
        n = bisect.bisect_right(offsets, shared, key=lambda span: span[1])
        anchor = next((i for i in range(n - 1, max(n - self.boundary_tokens, 0) - 1, -1)
                       if prompt.ids[i] in self._added_ids), None)
        if anchor is None:
            return n
        start = offsets[anchor][0]
        tail = self._backend.encode_batch([history[start:shared + self.boundary_chars]],
                                          add_special_tokens=False)[0].ids
        return anchor + common_prefix(prompt.ids[anchor:n], tail)

    def _system_ends(self, system: dict[str, Any], partial: list[str], conversation: _Conversation,
                     ids: list[int]) -> list[int]:
        """Where the system prompt ends in `ids`, and before that where each of its `partial` forms
        (`normalize.system_prefixes`: the client sent several system texts; the first
        `system_parts` of them) would: ascending. An agent's own instructions come before its
        session's environment, which a new session of the agent does not share."""
        ends = [self._system_end(dict(system, content=text), conversation.tools, conversation.kwargs, ids)
                for text in partial[:self.system_parts]]
        whole = self._system_end(system, conversation.tools, conversation.kwargs, ids)
        return sorted({e for e in ends if 0 < e < whole} | ({whole} if whole else set()))

    def _system_end(self, system: dict[str, Any], tools: Any, kwargs: dict[str, Any], ids: list[int]) -> int:
        """Where the system prompt's tokens end, whatever the template puts around it: the system
        message followed by two different probe user turns is rendered twice, and where the two
        renderings part is where a user turn's content starts (many templates refuse a system
        message alone). Both renderings are kept for the next request with this system prompt."""
        probes: list[list[int]] = []
        for probe in ("x", "y"):
            try:
                text = self._template([system, {"role": "user", "content": probe}], tools, kwargs, generation=False)
            except _TEMPLATE_INPUT_ERRORS:  # a template that cannot render it: no boundary
                return 0
            cached = self._system_ids.get(text)
            if cached is None:
                cached = list(self._backend.encode_batch([text], add_special_tokens=False)[0].ids)
                self._system_ids[text] = cached
                while len(self._system_ids) > self.system_cache_entries:
                    self._system_ids.popitem(last=False)
            else:
                self._system_ids.move_to_end(text)
            probes.append(cached)
        return min(common_prefix(probes[0], probes[1]), common_prefix(probes[0], ids))


class _Rendered(NamedTuple):
    """A rendered prompt: its token ids, the tokenizer's Encoding (offsets), its text."""

    ids: list[int]
    encoding: Any
    text: str


class _Conversation:
    """A request's template messages and what its template is called with; `rendered` gives the
    messages as the template gets them, with more appended (a template that renders no tools gets
    them written in, `chat.tool_prompt`, probes included)."""

    def __init__(self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, fold: bool,
                 kwargs: dict[str, Any]) -> None:
        self.messages = messages
        self.tools_declared = tools or []
        self.fold = fold
        self.kwargs = kwargs
        self.tools = None if fold else tools
        self._base = fold_tools(messages, tools) if fold else messages

    def rendered(self, then: Sequence[dict[str, Any]] = ()) -> list[dict[str, Any]]:
        if not then:
            return self._base
        if self.fold:
            return fold_tools([*self.messages, *then], self.tools_declared or None)
        return [*self.messages, *then]

"""A seeded curriculum of agent conversations for training ``relay-tiny-agent`` (issue 19, point 1).

Offline tooling beside the server (no actor, no MLX): it builds chat conversations as the
server's own types (:class:`mlx_relay.chat.types.ChatMessage`, :class:`ToolDef`), renders each
assistant turn's prompt with the server's renderer (:class:`mlx_relay.chat.prompt_render.PromptRenderer`,
the Normalizer's code path, so training prompts are token for token what the server feeds the
model) and the whole conversation with the checkpoint's chat template, and returns token ids
with a loss mask that covers exactly the assistant turns (what follows each generation prompt,
up to and including its ``<|im_end|>``).

Task families (mixed by :class:`Mix` weights):

* ``needle``: key-value retrieval. Filler text of a chosen token length with one or more
  ``The code for <key> is <value>.`` lines at random depths; the user asks for one key's value.
* ``copy``: the user gives a passage and asks for it back verbatim.
* ``tool``: 1-4 random tools (names ``verb_object``, typed parameters: string, integer, number,
  boolean, enum) declared in the system prompt; the user asks for what one of them does,
  naming the argument values; the assistant thinks briefly, closes ``</think>``, and calls the
  tool in Qwen3-Coder XML inside ``<tool_call>``; a tool turn returns a JSON result; the
  assistant answers with it.
* ``json``: the system prompt or the user asks for a JSON object with given keys and values.
* ``chat``: short synthetic questions (arithmetic, counting, reversing, sorting) answered after
  a closed thinking block.

Every assistant turn carries a closed thinking block (``enable_thinking=True``: the prompt ends
in ``<think>\\n``); a share of the conversations (``Mix.no_think``) render with thinking off, as
the template's default does (``<think>\\n\\n</think>\\n\\n`` in the prompt).

Filler: ``synthetic`` (sentences from a fixed word list, written here: no licence question) or
``stdlib`` (the CPython standard library's source, PSF-2.0, the corpus relay-tiny-coder was
trained on, split into training and held-out files by the same path hash as
``tools/train_small_mtp.py``).

Vocabulary: the fixtures' 1026-token byte-level BPE is kept. It holds every special token the
template writes (``<|im_start|>``, ``<|im_end|>``, ``<think>``, ``</think>``, ``<tool_call>``,
``</tool_call>``, ``<tool_response>``, ``</tool_response>``; ``<function=`` and ``<parameter=`` are
plain text in Qwen's vocabulary too), it encodes any text (byte-level), contexts are measured in
tokens (1.9 characters a token on the synthetic filler, 2.3 on the stdlib: 16K tokens are 30-38 KB
of text), its embedding and ``lm_head`` cost 0.5 M parameters at hidden 256 (a 32K vocabulary
would cost 16 M, over the 30 MB budget in float32), and SpecPrefill needs the draft and the
target to share one tokenizer: the fixtures, relay-tiny-coder and this model can draft for each
other (issue 19, point 4).

Held-out split by seed: example ``i`` of split ``s`` draws from ``numpy.random.default_rng((seed,
split, i))`` with split 0 = train, 1 = held-out; the evaluation uses split 1 only.

CLI::

    python tools/agent_curriculum.py show --model models/relay-tiny-coder --family tool
    python tools/agent_curriculum.py stats --model DIR --count 200 --length 4096
"""

from __future__ import annotations

import argparse
import json
import string
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np

from mlx_relay.chat.normalize import normalize_messages, to_template_messages
from mlx_relay.chat.prompt_render import PromptRenderer
from mlx_relay.chat.types import ChatMessage, FunctionCall, FunctionDef, ToolCall, ToolDef
from mlx_relay.messages.prompt import Render

Family = Literal["needle", "copy", "tool", "json", "chat"]
FAMILIES: tuple[Family, ...] = ("needle", "copy", "tool", "json", "chat")
TRAIN, HELD_OUT = 0, 1

_WORDS = tuple((
    "the a river stone light window paper garden morning quiet bright small green old house road "
    "city market table letter bridge winter summer cloud music story friend village forest field "
    "train station evening coffee north south east west slowly often never always under over near "
    "across between behind walks reads writes builds opens closes carries finds keeps brings sees "
    "blue red yellow white black long short warm cold soft heavy empty full early late simple"
).split())
_VERBS = ("get", "set", "find", "list", "create", "delete", "update", "send", "read", "write", "search",
          "count", "convert", "check", "book", "cancel", "fetch", "open", "close", "move")
_OBJECTS = ("weather", "file", "user", "order", "ticket", "email", "invoice", "note", "event", "price",
            "route", "stock", "report", "task", "image", "account", "flight", "room", "song", "recipe")
_PARAMS = ("city", "name", "path", "id", "count", "limit", "query", "date", "amount", "unit", "color",
           "priority", "title", "email", "days", "size", "mode", "label", "level", "target")
_ENUMS = (("low", "medium", "high"), ("celsius", "fahrenheit"), ("asc", "desc"), ("draft", "final"),
          ("small", "large"), ("red", "green", "blue"))
_NAMES = ("Alice", "Bruno", "Chen", "Dana", "Emil", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kira", "Lena")
_CITIES = ("Paris", "Oslo", "Lima", "Cairo", "Tokyo", "Quito", "Perth", "Accra", "Riga", "Hanoi", "Porto")


@dataclass(frozen=True)
class Mix:
    """Family weights (normalized when sampling) and the share of thinking-off conversations."""

    needle: float = 0.3
    copy: float = 0.15
    tool: float = 0.3
    json: float = 0.15
    chat: float = 0.1
    no_think: float = 0.1
    multi_needle: float = 0.5  # training needles that ask for every code at once

    def weights(self) -> np.ndarray:
        w = np.array([getattr(self, f) for f in FAMILIES], dtype=np.float64)
        return w / w.sum()


@dataclass
class Example:
    """One conversation and what a correct reply to its last prompt contains (for the evaluation)."""

    family: Family
    messages: list[ChatMessage]
    tools: list[ToolDef] | None = None
    thinking: bool = True
    answer: str | None = None  # needle / copy / chat: the final content; json: its JSON text
    call: dict[str, Any] | None = None  # tool: {"name": ..., "arguments": {...}}
    json_keys: list[str] = field(default_factory=list)

    def template_kwargs(self) -> dict[str, Any]:
        return {"enable_thinking": True} if self.thinking else {}

    def prompt_messages(self) -> list[ChatMessage]:
        """The conversation up to the first assistant turn (what the evaluation sends)."""
        first = next(i for i, m in enumerate(self.messages) if m.role == "assistant")
        return self.messages[:first]


@dataclass
class Encoded:
    ids: np.ndarray  # int32
    mask: np.ndarray  # bool: train on this token (an assistant turn's)


class CurriculumError(Exception):
    """The chat template renders a conversation so that a prompt is not a prefix of it."""


# --------------------------------------------------------------------------- filler


class SyntheticFiller:
    """Sentences of random words (nothing copied from anywhere)."""

    name = "synthetic"

    def text(self, rng: np.random.Generator, split: int, chars: int) -> str:
        out: list[str] = []
        size = 0
        while size < chars:
            words = [str(_WORDS[i]) for i in rng.integers(0, len(_WORDS), int(rng.integers(5, 14)))]
            sentence = " ".join(words).capitalize() + "."
            out.append(sentence)
            size += len(sentence) + 1
        return " ".join(out)


class StdlibFiller:
    """Slices of the CPython standard library's source (PSF-2.0), train / held-out files split
    by ``tools/train_small_mtp.py``'s path hash."""

    name = "stdlib"

    def __init__(self, root: Path | None = None, max_bytes: int = 4_000_000) -> None:
        sys.path.insert(0, str(Path(__file__).parent))
        from train_small_mtp import corpus_texts

        train, held = corpus_texts(root, max_bytes)
        self.texts = ("\n".join(train), "\n".join(held))

    def text(self, rng: np.random.Generator, split: int, chars: int) -> str:
        pool = self.texts[split]
        chars = min(chars, len(pool) - 1)
        start = int(rng.integers(0, len(pool) - chars))
        return pool[start:start + chars]


# --------------------------------------------------------------------------- the generator


def _word(rng: np.random.Generator, pool: tuple[str, ...] | list[str]) -> str:
    return str(pool[int(rng.integers(0, len(pool)))])


def _key(rng: np.random.Generator) -> str:
    return "".join(rng.choice(list(string.ascii_uppercase), 3)) + "-" + str(int(rng.integers(10, 100)))


def _value(rng: np.random.Generator) -> str:
    return str(int(rng.integers(10_000, 1_000_000)))


class Curriculum:
    """Makes and encodes examples for one checkpoint's tokenizer and chat template."""

    def __init__(self, model_dir: Path, filler: SyntheticFiller | StdlibFiller | None = None,
                 mix: Mix | None = None, seed: int = 0) -> None:
        from mlx_relay.actors.normalizer import load_tokenizer

        self.tokenizer = load_tokenizer(model_dir)
        self.renderer = PromptRenderer(self.tokenizer, "qwen3_coder")
        self.filler = filler or SyntheticFiller()
        self.mix = mix or Mix()
        self.seed = seed
        self.im_end = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.chars_per_token = 6  # filler characters drawn per token asked for (then cut to the count)

    # -- examples ------------------------------------------------------------------------------
    def rng(self, split: int, index: int) -> np.random.Generator:
        return np.random.default_rng((self.seed, split, index))

    def example(self, split: int, index: int, family: Family | None = None, length: int = 1024,
                depth: float | None = None) -> Example:
        """Example ``index`` of ``split``; ``length`` is the token budget long families fill. The
        held-out split's needles ask one question each (the evaluation's measure); ``depth`` (0 to 1)
        puts the asked needle at that share of the filler (else every needle's place is random)."""
        rng = self.rng(split, index)
        if family is None:
            family = FAMILIES[int(rng.choice(len(FAMILIES), p=self.mix.weights()))]
        thinking = bool(rng.random() >= self.mix.no_think)
        make = {"needle": self._needle, "copy": self._copy, "tool": self._tool, "json": self._json,
                "chat": self._chat}[family]
        ex = self._needle(rng, split, length, depth) if family == "needle" else make(rng, split, length)
        ex.thinking = thinking
        if not thinking:  # the template's thinking-off turns carry an empty block
            ex.messages = [msgspec.structs.replace(m, reasoning_content="") if m.role == "assistant" else m
                           for m in ex.messages]
        return ex

    def _filler(self, rng: np.random.Generator, split: int, tokens: int) -> str:
        """Filler text of at most ``tokens`` tokens (cut at a token boundary; stateless, so an
        example depends only on its seed)."""
        text = self.filler.text(rng, split, max(tokens * self.chars_per_token, 1))
        offsets = self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0].offsets
        return text[: offsets[tokens - 1][1]] if len(offsets) > tokens else text

    def _needle(self, rng: np.random.Generator, split: int, length: int, depth: float | None = None) -> Example:
        """One question on the held-out split (what the evaluation asks); on the training split,
        with ``Mix.multi_needle``'s probability, the user asks for every code at once (more
        retrievals per long prompt to learn from; the answer lists the codes in the order asked)."""
        pairs = [(_key(rng), _value(rng)) for _ in range(int(rng.integers(1, 7)))]
        body = self._filler(rng, split, max(length - 120 - 30 * len(pairs), 16))
        cuts = sorted(int(c) for c in rng.integers(0, len(body) + 1, len(pairs)))
        asked_index = int(rng.integers(0, len(pairs)))
        if depth is not None:
            cuts[asked_index] = round(min(max(depth, 0.0), 1.0) * len(body))
        placed = sorted(zip(cuts, range(len(pairs)), strict=True))
        parts, last = [], 0
        for cut, i in placed:
            k, v = pairs[i]
            parts += [body[last:cut], f"\nThe code for {k} is {v}.\n"]
            last = cut
        parts.append(body[last:])
        multi = split == TRAIN and len(pairs) > 1 and bool(rng.random() < self.mix.multi_needle)
        if multi:
            asked = [pairs[int(i)] for i in rng.permutation(len(pairs))]
            keys = ", ".join(k for k, _ in asked)
            user = "".join(parts) + f"\n\nWhat are the codes for {keys}? Answer with the codes only, one per line."
            think = " ".join(f"The text says the code for {k} is {v}." for k, v in asked)
            value = "\n".join(v for _, v in asked)
        else:
            key, value = pairs[asked_index]
            user = "".join(parts) + f"\n\nWhat is the code for {key}? Answer with the code only."
            think = f"The text says the code for {key} is {value}."
        return Example("needle", [ChatMessage("user", user), ChatMessage("assistant", value, reasoning_content=think)],
                       answer=value)

    def _copy(self, rng: np.random.Generator, split: int, length: int) -> Example:
        passage = self._filler(rng, split, int(rng.integers(8, max(min(length // 2 - 40, 400), 9)))).strip()
        user = f"Repeat the following text exactly.\n\n{passage}"
        return Example("copy", [ChatMessage("user", user),
                                ChatMessage("assistant", passage, reasoning_content="I will repeat the text.")],
                       answer=passage)

    def _tool_def(self, rng: np.random.Generator, name: str) -> tuple[ToolDef, dict[str, Any]]:
        names = list(dict.fromkeys(_word(rng, _PARAMS) for _ in range(int(rng.integers(1, 4)))))
        props: dict[str, Any] = {}
        args: dict[str, Any] = {}
        for p in names:
            kind = _word(rng, ("string", "integer", "number", "boolean", "enum"))
            if kind == "enum":
                options = list(_ENUMS[int(rng.integers(0, len(_ENUMS)))])
                props[p] = {"type": "string", "enum": options}
                args[p] = _word(rng, options)
            elif kind == "string":
                props[p] = {"type": "string"}
                args[p] = _word(rng, _CITIES + _NAMES)
            elif kind == "integer":
                props[p] = {"type": "integer"}
                args[p] = int(rng.integers(1, 500))
            elif kind == "number":
                props[p] = {"type": "number"}
                args[p] = round(float(rng.uniform(0, 100)), 1)
            else:
                props[p] = {"type": "boolean"}
                args[p] = bool(rng.random() < 0.5)
        verb, obj = name.split("_")
        params = {"type": "object", "properties": props, "required": names}
        return ToolDef(FunctionDef(name, f"{verb.capitalize()} a {obj}.", params)), args

    def _tool(self, rng: np.random.Generator, split: int, length: int) -> Example:
        names: list[str] = []
        while len(names) < int(rng.integers(1, 5)):
            name = f"{_word(rng, _VERBS)}_{_word(rng, _OBJECTS)}"
            if name not in names:
                names.append(name)
        defs = [self._tool_def(rng, n) for n in names]
        tools = [d for d, _ in defs]
        pick = int(rng.integers(0, len(defs)))
        tool, args = defs[pick]
        name = tool.function.name
        verb, obj = name.split("_")
        said = " and ".join(f"{k} {json.dumps(v)}" for k, v in args.items())
        user = f"Please {verb} the {obj} with {said}."
        call_id = f"call_{int(rng.integers(0, 1 << 30)):08x}"
        arguments = json.dumps(args)
        result = {"status": "ok", "value": _value(rng)}
        answer = f"Done: {name} returned {result['value']}."
        messages = [
            ChatMessage("system", "You are a helpful assistant."),
            ChatMessage("user", user),
            ChatMessage("assistant", "", reasoning_content=f"The user wants to {verb} the {obj}. I will call {name}.",
                        tool_calls=[ToolCall(call_id, FunctionCall(name, arguments))]),
            ChatMessage("tool", json.dumps(result), tool_call_id=call_id),
            ChatMessage("assistant", answer, reasoning_content=f"The tool returned {result['value']}."),
        ]
        return Example("tool", messages, tools=tools, call={"name": name, "arguments": args}, answer=answer)

    def _json(self, rng: np.random.Generator, split: int, length: int) -> Example:
        keys = list(dict.fromkeys(_word(rng, _PARAMS) for _ in range(int(rng.integers(1, 5)))))
        obj: dict[str, Any] = {}
        for k in keys:
            obj[k] = int(rng.integers(0, 1000)) if rng.random() < 0.4 else _word(rng, _CITIES + _NAMES)
        facts = ", ".join(f"{k} is {json.dumps(v)}" for k, v in obj.items())
        ask = f"Reply with a JSON object with the keys {', '.join(keys)}."
        answer = json.dumps(obj)
        think = "I will write the JSON object."
        if rng.random() < 0.5:
            messages = [ChatMessage("system", ask), ChatMessage("user", f"The facts: {facts}.")]
        else:
            messages = [ChatMessage("user", f"{ask} The facts: {facts}.")]
        messages.append(ChatMessage("assistant", answer, reasoning_content=think))
        return Example("json", messages, answer=answer, json_keys=keys)

    def _chat(self, rng: np.random.Generator, split: int, length: int) -> Example:
        kind = int(rng.integers(0, 4))
        if kind == 0:
            a, b = (int(x) for x in rng.integers(0, 100, 2))
            q, think, ans = f"What is {a} + {b}?", f"{a} + {b} = {a + b}.", str(a + b)
        elif kind == 1:
            w = [_word(rng, _WORDS) for _ in range(int(rng.integers(2, 8)))]
            q, think, ans = f"How many words are in: {' '.join(w)}?", f"I count {len(w)} words.", str(len(w))
        elif kind == 2:
            w = _word(rng, _WORDS + _NAMES)
            q, think, ans = f"Reverse the word {w}.", f"{w} backwards is {w[::-1]}.", w[::-1]
        else:
            w = [_word(rng, _NAMES) for _ in range(int(rng.integers(2, 6)))]
            s = ", ".join(sorted(w))
            q, think, ans = f"Sort these names: {', '.join(w)}.", "I sort them alphabetically.", s
        return Example("chat", [ChatMessage("user", q), ChatMessage("assistant", ans, reasoning_content=think)],
                       answer=ans)

    # -- encoding ------------------------------------------------------------------------------
    def prompt_ids(self, ex: Example, messages: list[ChatMessage] | None = None) -> list[int]:
        """The server's prompt for ``messages`` (default: the example's first prompt)."""
        msgs = ex.prompt_messages() if messages is None else messages
        return self.renderer.render(Render(msgs, ex.tools, ex.template_kwargs())).token_ids

    def encode(self, ex: Example) -> Encoded:
        """Token ids of the whole conversation and the mask of its assistant turns."""
        template = to_template_messages(normalize_messages(ex.messages))
        tools = [msgspec.to_builtins(t) for t in ex.tools] if ex.tools else None
        text = self.tokenizer.apply_chat_template(template, tools=tools, add_generation_prompt=False,
                                                  tokenize=False, **ex.template_kwargs())
        encoding = self.tokenizer.backend_tokenizer.encode_batch([text], add_special_tokens=False)[0]
        ids = np.asarray(encoding.ids, np.int32)
        mask = np.zeros(len(ids), dtype=bool)
        for i, m in enumerate(ex.messages):
            if m.role != "assistant":
                continue
            prompt = self.prompt_ids(ex, ex.messages[:i])
            if list(ids[: len(prompt)]) != prompt:
                raise CurriculumError(f"the prompt of assistant turn {i} is not a prefix of the conversation")
            ends = np.flatnonzero(ids[len(prompt):] == self.im_end)
            if len(ends) == 0:
                raise CurriculumError(f"assistant turn {i} has no <|im_end|>")
            mask[len(prompt): len(prompt) + int(ends[0]) + 1] = True
        return Encoded(ids, mask)

    def row(self, split: int, index: int, length: int, pad_id: int) -> Encoded:
        """A training row of exactly ``length`` tokens: examples packed until the next would not
        fit (the first one's long families fill most of the row), then padding (masked out)."""
        ids: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        used, k = 0, 0
        while True:
            room = length - used
            if room < 16:
                break
            budget = room if used == 0 else int(self.rng(split, index * 1000 + k).integers(room // 8 + 1, room + 1))
            ex = self.example(split, index * 1000 + k, length=max(budget, 64))
            enc = self.encode(ex)
            k += 1
            if len(enc.ids) > room:
                if used > 0 or k >= 64:  # a row is never left empty while a short family can fill it
                    break
                continue
            ids.append(enc.ids)
            masks.append(enc.mask)
            used += len(enc.ids)
        pad = length - used
        if pad:
            ids.append(np.full(pad, pad_id, np.int32))
            masks.append(np.zeros(pad, bool))
        if not ids or used == 0:
            raise CurriculumError(f"no example fits in {length} tokens")
        return Encoded(np.concatenate(ids), np.concatenate(masks))


# --------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("command", choices=("show", "stats"))
    p.add_argument("--model", type=Path, required=True, help="a checkpoint folder (tokenizer + chat template)")
    p.add_argument("--family", choices=FAMILIES, default=None)
    p.add_argument("--split", type=int, default=TRAIN, choices=(TRAIN, HELD_OUT))
    p.add_argument("--index", type=int, default=0)
    p.add_argument("--count", type=int, default=100)
    p.add_argument("--length", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--filler", choices=("synthetic", "stdlib"), default="synthetic")
    args = p.parse_args(argv)
    filler = StdlibFiller() if args.filler == "stdlib" else SyntheticFiller()
    cur = Curriculum(args.model, filler, seed=args.seed)
    if args.command == "show":
        ex = cur.example(args.split, args.index, args.family, args.length)
        enc = cur.encode(ex)
        text = cur.tokenizer.decode(enc.ids.tolist())
        trained = cur.tokenizer.decode(enc.ids[enc.mask].tolist())
        print(f"family {ex.family}, {len(enc.ids)} tokens, {int(enc.mask.sum())} trained\n{text}\n"
              f"--- trained tokens:\n{trained}")
        return
    counts: dict[str, list[int]] = {f: [] for f in FAMILIES}
    for i in range(args.count):
        ex = cur.example(args.split, i, args.family, args.length)
        counts[ex.family].append(len(cur.encode(ex).ids))
    for fam, lens in counts.items():
        if lens:
            print(f"{fam:7s} n={len(lens):4d} tokens mean {np.mean(lens):8.1f} max {max(lens)}")


if __name__ == "__main__":
    main()

"""Agent sessions turn by turn: the messages of turn k, given the replies the server gave so far.

Turn 0 is the shared system prompt and a user message. Every later turn resends the whole
history plus the previous reply (the text the server actually returned): as a plain assistant
message followed by the next user message, or, on a tool turn, as an assistant message carrying
a tool call followed by the `tool` message with its result.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from mlx_relay.bench.workload import BenchRequest, SessionJob


def session_messages(job: SessionJob, turn: int, replies: Sequence[str]) -> list[dict[str, Any]]:
    """The messages of turn `turn`; `replies[j]` is the server's reply to turn j (j < turn)."""
    if len(replies) < turn:
        raise ValueError(f"turn {turn} needs the {turn} previous replies, got {len(replies)}")
    first = job.turns[0]
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": job.system},
        {"role": "user", "content": first.user or ""},
    ]
    for j in range(1, turn + 1):
        step, previous = job.turns[j], replies[j - 1]
        if step.tool_call is not None:
            call = step.tool_call
            messages.append({
                "role": "assistant",
                "content": previous,
                "tool_calls": [{"id": call.id, "type": "function",
                                "function": {"name": call.name, "arguments": call.arguments}}],
            })
            messages.append({"role": "tool", "tool_call_id": call.id, "content": call.result})
        else:
            messages.append({"role": "assistant", "content": previous})
            messages.append({"role": "user", "content": step.user or ""})
    return messages


def session_request(job: SessionJob, turn: int, replies: Sequence[str]) -> BenchRequest:
    return BenchRequest(
        id=f"{job.id}.t{turn}",
        scenario=job.scenario,
        messages=session_messages(job, turn, replies),
        max_tokens=job.turns[turn].max_tokens,
        temperature=job.temperature,
        seed=None if job.seed is None else job.seed + turn,
        tools=job.tools or None,
    )

"""The engine protocol (`engine/protocol.py`), without a model: every command crosses the process
host's pipe as it is (one tagged union, no per-command code), answers are read back with the
command's answer type (a step's output with its errors as their classes), and the core applies
every command a host does not run itself."""

from __future__ import annotations

import ast
import typing
from pathlib import Path

import msgspec

import mlx_relay
from mlx_relay import errors
from mlx_relay.config import EngineConfig, SpecPrefillConfig
from mlx_relay.engine import protocol
from mlx_relay.engine.hosting.wire import Answer, Ask, Tell, ToEngine, ToServer, decode_answer, encode_answer
from mlx_relay.engine.protocol import (
    AddRow,
    Asked,
    BootEngine,
    CloseEngine,
    Command,
    FreeSnapshotHandles,
    ReadStats,
    StepOutput,
    Told,
    answer_type,
)
from mlx_relay.messages.gpu import EngineStats, Finished, Generate, ModelInfo, SamplingParams, TokenDelta

COMMANDS = typing.get_args(Command)


def test_every_command_is_told_or_asked_and_named_once() -> None:
    assert len({c.__name__ for c in COMMANDS}) == len(COMMANDS)
    defined = {v for v in vars(protocol).values() if isinstance(v, type) and issubclass(v, Told | Asked)
               and v not in (Told, Asked)}
    assert defined == set(COMMANDS)  # none left out of the union the hosts decode
    for command in COMMANDS:
        assert (answer_type(command) is None) == issubclass(command, Told), command
        assert command.lockstep in ("kept", "now", "local", "refused")
    assert answer_type(ReadStats) is EngineStats and answer_type(CloseEngine) is StepOutput


def test_commands_cross_the_pipe_as_they_are() -> None:
    decoder = msgspec.msgpack.Decoder(ToEngine)
    sent = [Tell(AddRow(3, Generate("r", [1, 2, 3], SamplingParams(max_tokens=4, stop=("x",))))),
            Tell(FreeSnapshotHandles([1, 2], release_memory=True)), Ask(7, ReadStats()),
            Ask(1, BootEngine(EngineConfig("/models/m", max_num_seqs=4), SpecPrefillConfig()))]
    assert [decoder.decode(msgspec.msgpack.encode(frame)) for frame in sent] == sent


def test_answers_are_read_with_the_commands_answer_type() -> None:
    decoder = msgspec.msgpack.Decoder(ToServer)
    info = ModelInfo("/models/m", "qwen3_5", "cpu", 4096, 100, [1], False, True, 0.5)
    out = StepOutput([(1, TokenDelta("a", [5])), (1, Finished("stop", 3, 1)),
                      (2, errors.GenerationFailed("could not start the generation"))])
    for command, value in ((BootEngine, info), (CloseEngine, out)):
        frame = decoder.decode(msgspec.msgpack.encode(Answer(4, msgspec.Raw(msgspec.msgpack.encode(
            encode_answer(value))))))
        assert isinstance(frame, Answer) and frame.cid == 4
        back = decode_answer(frame.result, command)
        if command is BootEngine:
            assert back == info
        else:
            assert back.events[:2] == out.events[:2]
            sid, error = back.events[2]
            assert sid == 2 and type(error) is errors.GenerationFailed
            assert error.message == "could not start the generation"


def test_the_core_applies_every_command_a_host_does_not_run() -> None:
    source = (Path(mlx_relay.__file__).parent / "engine" / "step" / "core.py").read_text()
    apply = next(node for node in ast.walk(ast.parse(source))
                 if isinstance(node, ast.FunctionDef) and node.name == "apply")
    cases = {case.pattern.cls.id for node in ast.walk(apply) if isinstance(node, ast.Match) for case in node.cases
             if isinstance(case.pattern, ast.MatchClass) and isinstance(case.pattern.cls, ast.Name)}
    assert cases == {c.__name__ for c in COMMANDS if not c.host}

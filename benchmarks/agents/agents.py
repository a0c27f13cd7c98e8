"""How `make agents` sets up each coding agent for mlx-relay: the configuration files, environment
and command line each agent's own docs give for a custom endpoint and a headless turn.

This is the source of truth for docs/agents.md ("Using it with coding agents") (its snippets are these
files and commands with the harness's paths and port replaced by the defaults). Each setup gets a
fresh HOME and working directory (`Sandbox`), an API key that means nothing (the server runs
without `--api-key`; agents insist on sending one) and the variables that turn off each agent's
telemetry, update checks and other traffic (the harness also runs them in a network namespace
with loopback only, where it can).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from held_out_tools import SCENE_VALUE, scene_tool

MODEL = "relay-tiny-agent"  # the embedded model's served name (`mlx-relay serve` without flags)
API_KEY = "relay-local-key"  # any string: the server checks keys only with --api-key
# the bound on a turn the toy model cannot finish, where an agent has one of its own: Claude Code's
# --max-turns, Qwen Code's --max-session-turns, Cline's --timeout (Codex and OpenCode have none: the
# harness stops them at its own timeout, reported as such)
MAX_TURNS = 8
CLINE_TIMEOUT_S = 900


@dataclass(frozen=True)
class Task:
    """What one headless turn asks for: a tool of an MCP server (stdio, `script` in this folder) and
    the prompt that asks for it; `value` is what the tool returns, found in a later request when the
    result went back to the model."""

    name: str  # stock (the scene the embedded model was trained on) | held-out (a tool it never saw)
    server: str
    tool: str
    prompt: str
    value: str
    script: str


STOCK = Task("stock", "stock", "get_stock", "Please get the stock with path 423.", "123456", "mcp_stock.py")
_HELD = scene_tool()
HELD_OUT = Task("held-out", _HELD.server, _HELD.tool, _HELD.sentence, SCENE_VALUE, "mcp_held_out.py")
TASKS: tuple[Task, ...] = (STOCK, HELD_OUT)


@dataclass
class Sandbox:
    """One run's world: a temp HOME, a temp working directory, the proxy's URL, the task and its MCP
    server's command."""

    task: Task
    home: Path
    work: Path
    base_url: str  # http://127.0.0.1:PORT, no /v1
    mcp_command: list[str]
    bin_dir: Path  # node_modules/.bin of the pinned agents


@dataclass
class Run:
    argv: list[str]
    env: dict[str, str]
    files: dict[str, str] = field(default_factory=dict)  # what was written (path relative to the sandbox) -> text
    expect_refusal: bool = False  # the agent's prompt cannot fit the model: a 400 is the right answer
    pre: list[list[str]] = field(default_factory=list)  # setup commands run before the turn, same env


@dataclass(frozen=True)
class Agent:
    name: str  # the folder of its recordings and fixtures
    package: str
    api: str  # messages | responses | chat
    setup: Callable[[Sandbox], Run]


def _write(sb: Sandbox, rel: str, text: str, files: dict[str, str]) -> Path:
    path = sb.home / rel if not rel.startswith("work/") else sb.work / rel.removeprefix("work/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    files[rel] = text
    return path


def _json(obj: object) -> str:
    return json.dumps(obj, indent=2) + "\n"


# -- Claude Code: ANTHROPIC_BASE_URL + ANTHROPIC_AUTH_TOKEN (its LLM-gateway docs), `-p`, `--mcp-config`

def claude_code(sb: Sandbox) -> Run:
    files: dict[str, str] = {}
    mcp = _write(sb, "mcp.json", _json({"mcpServers": {sb.task.server: {
        "type": "stdio", "command": sb.mcp_command[0], "args": sb.mcp_command[1:]}}}), files)
    env = {
        "ANTHROPIC_BASE_URL": sb.base_url,
        "ANTHROPIC_AUTH_TOKEN": API_KEY,
        "ANTHROPIC_MODEL": MODEL,
        "ANTHROPIC_DEFAULT_HAIKU_MODEL": MODEL,  # its side requests (titles, summaries) use the haiku tier
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_ERROR_REPORTING": "1",
        "DISABLE_AUTOUPDATER": "1",
    }
    argv = [str(sb.bin_dir / "claude"), "-p", sb.task.prompt, "--model", MODEL, "--mcp-config", str(mcp),
            "--strict-mcp-config", "--allowedTools", f"mcp__{sb.task.server}__{sb.task.tool}",
            "--output-format", "json", "--max-turns", str(MAX_TURNS)]
    return Run(argv, env, files)


# -- Codex: a model provider in config.toml with wire_api = "responses", MCP in config.toml, `codex exec`
# (default_tools_approval_mode: with approval_policy "never", Codex 0.171 refuses every MCP call
# whose tools are not approved in config: "MCP tool call requires approval, but approval policy is never")
# (stream_idle_timeout_ms: Codex gives up on a stream after 5 minutes without an event, SSE comments
# not counted, and a long prompt's prefill on a CPU takes longer; it then retries from scratch)

def codex(sb: Sandbox) -> Run:
    files: dict[str, str] = {}
    args = ", ".join(json.dumps(a) for a in sb.mcp_command[1:])
    _write(sb, ".codex/config.toml", f"""model = "{MODEL}"
model_provider = "mlx-relay"
approval_policy = "never"
sandbox_mode = "read-only"
check_for_update_on_startup = false

[model_providers.mlx-relay]
name = "mlx-relay"
base_url = "{sb.base_url}/v1"
env_key = "MLX_RELAY_API_KEY"
wire_api = "responses"
stream_idle_timeout_ms = 1800000

[mcp_servers.{sb.task.server}]
command = {json.dumps(sb.mcp_command[0])}
args = [{args}]
default_tools_approval_mode = "approve"

[analytics]
enabled = false
""", files)
    env = {"CODEX_HOME": str(sb.home / ".codex"), "MLX_RELAY_API_KEY": API_KEY}
    argv = [str(sb.bin_dir / "codex"), "exec", "--skip-git-repo-check", sb.task.prompt]
    return Run(argv, env, files)


# -- Qwen Code: OPENAI_BASE_URL / OPENAI_API_KEY / OPENAI_MODEL, `-p`, mcpServers in settings.json

QWEN_SYSTEM = "You are a helpful assistant. Use the tools you are given when the user asks for what they do."
# the tools Qwen Code 0.24.4 declares besides its core tools and the MCP ones
QWEN_EXTRA_TOOLS = ["agent", "get_goal", "update_goal", "list_agents", "skill", "enter_worktree", "exit_worktree",
                    "record_artifact", "report_findings", "send_message", "task_stop"]


def _qwen(sb: Sandbox, slim: bool) -> Run:
    files: dict[str, str] = {}
    mcp: dict[str, object] = {"command": sb.mcp_command[0], "args": sb.mcp_command[1:], "trust": True}
    settings: dict[str, object] = {
        "security": {"auth": {"selectedType": "openai"}},
        "mcpServers": {sb.task.server: mcp},
        "privacy": {"usageStatisticsEnabled": False},
        "telemetry": {"enabled": False},
        "general": {"disableAutoUpdate": True, "disableUpdateNag": True},
    }
    env = {"OPENAI_BASE_URL": f"{sb.base_url}/v1", "OPENAI_API_KEY": API_KEY, "OPENAI_MODEL": MODEL}
    argv = [str(sb.bin_dir / "qwen"), "-p", sb.task.prompt, "--output-format", "json",
            "--max-session-turns", str(MAX_TURNS)]
    if slim:
        # Qwen Code's own prompt is 31.7K tokens (its system prompt, skills, memory and tool declarations),
        # the MCP tools behind its tool_search bridge: for a small model, a short system prompt, no built-in
        # tools, and the MCP tools declared up front (7.7K tokens, most of them its skills and memory notes)
        mcp["alwaysLoadTools"] = True
        settings["tools"] = {"core": ["__none__"], "exclude": QWEN_EXTRA_TOOLS, "toolSearch": {"enabled": False}}
        argv += ["--system-prompt", QWEN_SYSTEM]
    _write(sb, ".qwen/settings.json", _json(settings), files)
    return Run(argv, env, files)


def qwen_code(sb: Sandbox) -> Run:
    return _qwen(sb, slim=False)


def qwen_code_slim(sb: Sandbox) -> Run:
    return _qwen(sb, slim=True)


# -- OpenCode: a provider in opencode.json through @ai-sdk/openai-compatible, `opencode run`

def opencode(sb: Sandbox) -> Run:
    files: dict[str, str] = {}
    _write(sb, "work/opencode.json", _json({
        "$schema": "https://opencode.ai/config.json",
        "provider": {"mlx-relay": {
            "npm": "@ai-sdk/openai-compatible",
            "name": "mlx-relay",
            "options": {"baseURL": f"{sb.base_url}/v1", "apiKey": "{env:MLX_RELAY_API_KEY}"},
            "models": {MODEL: {"name": MODEL}},
        }},
        "model": f"mlx-relay/{MODEL}",
        "mcp": {sb.task.server: {"type": "local", "command": sb.mcp_command, "enabled": True}},
        "autoupdate": False,
        "share": "disabled",
    }), files)
    env = {"MLX_RELAY_API_KEY": API_KEY, "OPENCODE_DISABLE_AUTOUPDATE": "1", "OPENCODE_DISABLE_MODELS_FETCH": "1",
           "OPENCODE_DISABLE_LSP_DOWNLOAD": "1", "OPENCODE_DISABLE_DEFAULT_PLUGINS": "1"}
    argv = [str(sb.bin_dir / "opencode"), "run", "--model", f"mlx-relay/{MODEL}", sb.task.prompt]
    return Run(argv, env, files)


# -- Cline: `cline auth` with the OpenAI-compatible provider, `cline mcp add`, a prompt (headless when piped)

def cline(sb: Sandbox) -> Run:
    exe = str(sb.bin_dir / "cline")
    pre = [
        [exe, "auth", "--provider", "openai", "--apikey", API_KEY, "--modelid", MODEL,
         "--baseurl", f"{sb.base_url}/v1"],
        [exe, "mcp", "add", sb.task.server, "--yes", "--", *sb.mcp_command],
    ]
    env = {"CLINE_NO_AUTO_UPDATE": "1"}
    return Run([exe, "--json", "--timeout", str(CLINE_TIMEOUT_S), sb.task.prompt], env, pre=pre)


AGENTS: tuple[Agent, ...] = (
    Agent("claude-code", "@anthropic-ai/claude-code", "messages", claude_code),
    Agent("codex", "@openai/codex", "responses", codex),
    Agent("qwen-code", "@qwen-code/qwen-code", "chat", qwen_code),
    Agent("qwen-code-slim", "@qwen-code/qwen-code", "chat", qwen_code_slim),
    Agent("opencode", "opencode-ai", "chat", opencode),
    Agent("cline", "cline", "chat", cline),
)

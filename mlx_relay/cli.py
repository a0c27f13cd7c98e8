"""Command line: `mlx-relay serve [MODEL] ...`, `mlx-relay bench ...` and `mlx-relay cluster ...`.

Parses flags into a typed `ServerConfig` and hands it to the HTTP server. While the model
loads and warms, a progress line shows what is happening and for how long.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import stat
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, get_args

from mlx_relay.bench.cli import add_parser as add_bench_parser
from mlx_relay.bench.cli import run_from_args as run_bench
from mlx_relay.chat.types import TOOL_FORMATS
from mlx_relay.cluster.cli import add_parser as add_cluster_parser
from mlx_relay.cluster.cli import run_from_args as run_cluster
from mlx_relay.cluster.cli import split_args
from mlx_relay.config import PipelineConfig, ServerConfig, SpeculationMethod, build_config
from mlx_relay.default_model import DEFAULT_MODEL_NAME, default_model_path
from mlx_relay.http.served import one_model
from mlx_relay.http.server import serve
from mlx_relay.log_format import configure_logging
from mlx_relay.pool.build import pool_config
from mlx_relay.pool.config import PoolConfig
from mlx_relay.pool.models_file import ModelsConfigError, parse_model_flag, read_models_file
from mlx_relay.pool.pool import ModelPool
from mlx_relay.relay import Relay


def _progress_printer() -> Callable[[str], None]:
    """Prints each boot phase with a live elapsed-time counter on a terminal."""
    state = {"phase": "", "since": time.monotonic(), "done": False}
    tty = sys.stderr.isatty()

    def tick() -> None:
        frames = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
        i = 0
        while not state["done"]:
            elapsed = time.monotonic() - float(state["since"])  # type: ignore[arg-type]
            sys.stderr.write(f"\r{frames[i % len(frames)]} {state['phase']} ({elapsed:4.1f}s)\033[K")
            sys.stderr.flush()
            i += 1
            time.sleep(0.1)

    if tty:
        threading.Thread(target=tick, daemon=True).start()

    def report(phase: str) -> None:
        now = time.monotonic()
        if tty:
            sys.stderr.write(f"\r✓ {state['phase']} ({now - float(state['since']):.1f}s)\033[K\n" if state["phase"]
                             else "")
        else:
            print(f"mlx-relay: {phase}", file=sys.stderr, flush=True)
        state["phase"], state["since"] = phase, now
        if phase == "ready":
            state["done"] = True

    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlx-relay", description="Serve MLX vision-language models.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve a model over OpenAI-compatible HTTP")
    serve.add_argument("model", nargs="?", default=None,
                       help="Hugging Face repo id or local checkpoint dir (default: the embedded tiny model)")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--served-model-name", default=None, help="the model name clients use (default: MODEL)")
    serve.add_argument("--model-alias", action="append", default=None, metavar="NAME",
                       help="another model name requests may use (repeatable; '*' accepts any name, "
                            "e.g. for Claude Code's claude-* names)")
    serve.add_argument("--tool-parser", choices=TOOL_FORMATS, default=None,
                       help="the model's tool-call syntax (default: inferred from the chat template)")
    serve.add_argument("--tool-grammar", choices=("lazy", "off"), default="lazy",
                       help="tool_choice auto with tools declared: hold every call the model opens to a declared "
                            "tool and its schema (lazy, the default; those requests decode without MTP) or leave "
                            "the calls free and keep MTP (off; a malformed call reaches the client as written)")
    serve.add_argument("--max-num-seqs", type=int, default=16, help="sequences decoded together (default 16)")
    serve.add_argument("--max-queue", type=int, default=64,
                       help="requests waiting for a slot before new ones get 429 (default 64)")
    serve.add_argument("--prefill-step-size", type=int, default=None,
                       help="the longest prefill chunk in tokens, its rows together (default 4096 on a CUDA GPU, "
                            "2048 elsewhere)")
    serve.add_argument("--max-num-batched-tokens", type=int, default=None,
                       help="tokens one engine step runs: decoding rows first, prefill chunks in the rest, "
                            "shared equally by the prompts prefilling, so a running stream waits on at most "
                            "this much of others' prefill and a short prompt passes long ones (default: "
                            "256 on CPU; on a GPU no limit beyond --prefill-step-size)")
    serve.add_argument("--decode-stall-factor", type=float, default=None,
                       help="while streams decode, prefill beside them takes at most (factor - 1) times their "
                            "decode steps' time, measured by the engine, so their inter-token latency stays "
                            "within about this factor of alone; prompts alone get the whole budget (default: 2.5 "
                            "on CPU, off on a GPU; 0: off)")
    serve.add_argument("--mixed-steps", choices=("on", "off"), default="on",
                       help="a step's decode rows and its prefill chunk in one forward (on, the default) or two (off)")
    serve.add_argument("--prefill-experts", choices=("auto", "dequantize", "kernel", "narrow", "library"),
                       default="auto",
                       help="a prefill chunk's routed experts on a CUDA GPU: dequantized for MLX's grouped GEMM, our "
                            "grouped 8-bit kernel (narrow: also few rows an expert on the tensor cores), "
                            "or the library's SwitchGLU (default auto: narrow on a CUDA GPU)")
    serve.add_argument("--embedding-model", default=None, metavar="PATH",
                       help="an embedding checkpoint (a sentence-transformers layout, e.g. Qwen3-Embedding) served "
                            "beside the model at /v1/embeddings")
    serve.add_argument("--embedding-model-name", default=None,
                       help="the name /v1/embeddings requests give it (default: its directory's name)")
    serve.add_argument("--dense-16bit", action="store_true",
                       help="keep a 16-bit copy of each dense 8-bit projection for steps of 8 rows and more "
                            "(faster on a CUDA GPU; costs the copies' memory)")
    serve.add_argument("--compiled-chunk-tokens", type=int, default=None,
                       help="the largest prefill chunk whose recurrent mixers and MLPs run compiled per layer "
                            "(default: 512 on a CUDA GPU, 0 = never elsewhere)")
    serve.add_argument("--kv-bits", type=int, choices=(8, 4), default=None,
                       help="keep the attention layers' keys and values quantized at 8 or 4 bits (default: 16-bit)")
    serve.add_argument("--prefill-batch-size", type=int, default=8, help="prompts prefilled together (default 8)")
    serve.add_argument("--default-max-tokens", type=int, default=4096,
                       help="max_tokens when a request gives none (default 4096)")
    serve.add_argument("--api-key", action="append", default=None,
                       help="require this API key (repeatable; also MLX_RELAY_API_KEY)")
    serve.add_argument("--max-model-len", type=int, default=None,
                       help="cap the context length (default: the checkpoint's)")
    lim = serve.add_argument_group("limits per request (bad or slow clients get a 4xx, never the server's time)")
    lim.add_argument("--max-request-bytes", type=int, default=64 * 1024 * 1024,
                     help="request body size; larger is a 413 (default 64 MiB)")
    lim.add_argument("--request-read-timeout", type=float, default=30.0,
                     help="seconds a client may take to send a request's headers and body (default 30)")
    lim.add_argument("--client-stall-timeout", type=float, default=60.0,
                     help="seconds a response write may wait for a client that does not read (default 60)")
    lim.add_argument("--max-tokens-policy", choices=("error", "clamp"), default="clamp",
                     help="max_tokens beyond what the context leaves after the prompt: cut the reply at the "
                          "context's end, finishing 'length' / 'max_tokens' there (clamp, the default: agents "
                          "such as Claude Code ask for 32000 whatever the context), or refuse with a 400 as "
                          "OpenAI and Anthropic do (error; /v1/messages then words it as Anthropic does, which "
                          "Claude Code parses to lower max_tokens and retry)")
    lim.add_argument("--render-timeout", type=float, default=60.0,
                     help="seconds to template and tokenize one prompt before it is refused (default 60)")
    lim.add_argument("--allow-request-chat-template", action="store_true",
                     help="accept a request's own chat_template (rendered in a sandboxed process, time-limited)")
    serve.add_argument("--drain-timeout", type=float, default=30.0,
                       help="on SIGTERM/SIGINT: seconds running requests may finish before they are ended "
                            "(a second signal exits at once; default 30)")
    serve.add_argument("--exit-on-stdin-eof", action="store_true",
                       help="drain and exit, as on SIGTERM, when stdin (a pipe) reaches its end: the process "
                            "holding its other end has exited, however it died (`mlx-relay cluster` sets this "
                            "on its replicas)")
    media = serve.add_argument_group("image and video inputs (data: URLs are always accepted)")
    media.add_argument("--allowed-local-media-dir", default=None, metavar="DIR",
                       help="accept local file paths / file:// URLs, only under DIR")
    media.add_argument("--allow-remote-media", action="store_true",
                       help="fetch http(s) image/video URLs (public addresses only)")
    media.add_argument("--allow-private-media-hosts", action="store_true",
                       help="with --allow-remote-media: also loopback/private addresses (trusted networks only)")
    media.add_argument("--max-media-bytes", type=int, default=20 * 1024 * 1024, help="per image/video (20 MiB)")
    media.add_argument("--max-image-pixels", type=int, default=4096 * 4096, help="decompression-bomb guard")
    media.add_argument("--max-video-frames", type=int, default=32)
    spec = serve.add_argument_group("speculative decoding (text requests): the checkpoint's MTP head, drafts copied "
                                    "from the context")
    spec.add_argument("--speculation", choices=get_args(SpeculationMethod), default="auto",
                      help="where drafts come from for a request that does not say (its `speculation.method`): "
                           "auto (the head where it pays, context drafts where they are expected to beat it, "
                           "per request and round), mtp, context, draft (--draft-model's: what agents' CLIs, "
                           "which cannot send the extension, then get), none (default auto)")
    spec.add_argument("--max-draft-tokens", type=int, default=8,
                      help="context drafts verified per round at most; 0: no context drafts (default 8)")
    spec.add_argument("--draft-model", default=None, metavar="MODEL",
                      help="a draft checkpoint with the served model's vocabulary (dir or Hub id): requests with "
                           "speculation.method \"draft\" (or --speculation draft) take its drafts (default: none)")
    spec.add_argument("--draft-tokens", type=int, default=4,
                      help="a draft model's drafts per round at most (default 4)")
    spec.add_argument("--context-policy", choices=("auto", "always"), default="auto",
                      help="auto: a row's context proposal is verified where it is expected to yield more tokens "
                           "per second (its acceptance so far, the measured round times); always: whenever it has one")
    spec.add_argument("--no-mtp", action="store_true", help="decode every request without MTP")
    spec.add_argument("--mtp-block-size", type=int, default=2,
                      help="tokens per verify round at most: the bonus token and BLOCK-1 drafts; the compiled "
                           "round runs blocks 2..BLOCK by the measured acceptance (default 2)")
    spec.add_argument("--mtp-max-batch", type=int, default=2,
                      help="a text request decodes with MTP only if fewer rows are running when it starts "
                           "(default 2: rounds cost more than plain steps as the batch grows)")
    spec.add_argument("--mtp-verify", choices=("auto", "exact", "batched"), default="auto",
                      help="exact: mlx-vlm's batch-invariant verifier (bit-identical to plain decode; fast "
                           "kernels on Metal only); batched: one forward over the block (fast everywhere); "
                           "auto: exact on Metal, batched elsewhere")
    spec.add_argument("--mtp-policy", choices=("auto", "always"), default="auto",
                      help="auto: MTP only where it pays (a round's cost in plain steps is measured at warm-up "
                           "and weighed against the acceptance seen so far); always: wherever it can run")
    pc = serve.add_argument_group("prefix cache (exact snapshots at system-prompt ends and finished turns)")
    pc.add_argument("--no-prefix-cache", action="store_true", help="prefill every prompt in full")
    pc.add_argument("--prefix-cache-gb", type=float, default=None,
                    help="byte budget (default: 20%% of the GPU's memory or working set, 10%% of RAM on CPU)")
    pc.add_argument("--prefix-min-snapshot-tokens", type=int, default=256,
                    help="system prompts shorter than this are not snapshotted (default 256)")
    pc.add_argument("--prefix-cache-dir", default=None, metavar="DIR",
                    help="keep snapshots on disk too (safetensors, a directory per model under DIR): system "
                         "prompts as soon as they are snapshotted, others when memory evicts them or the server "
                         "drains; a later request, also after a restart, restores from disk instead of prefilling")
    pc.add_argument("--prefix-cache-disk-gb", type=float, default=20.0,
                    help="disk budget of --prefix-cache-dir, least recently used files go first (default 20)")
    pc.add_argument("--prefix-cache-preload", type=_fraction, default=0.5, metavar="FRACTION",
                    help="once the server is ready, load --prefix-cache-dir's files into memory, most recently "
                         "used first, up to this share of the memory budget (default 0.5; 0: off)")
    sp = serve.add_argument_group("SpecPrefill (a small draft model picks which tokens of a long prompt are prefilled)")
    sp.add_argument("--specprefill-draft-model", default=None, metavar="MODEL",
                    help="draft checkpoint with the served model's tokenizer (dir or Hub id); turns SpecPrefill on")
    sp.add_argument("--specprefill-threshold", type=int, default=8192,
                    help="uncached prompt tokens from which a request is prefilled sparsely (default 8192)")
    sp.add_argument("--specprefill-keep", type=float, default=0.3,
                    help="share of the scored prompt chunks kept (default 0.3; requests may set specprefill_keep)")
    sp.add_argument("--specprefill-chunk-size", type=int, default=64, help="tokens per selection chunk (default 64)")
    sp.add_argument("--specprefill-query-window", type=int, default=16,
                    help="last prompt positions whose attention scores the tokens (default 16)")
    sp.add_argument("--specprefill-anchor-ngram", type=int, default=2, metavar="N",
                    help="keep first, within the budget, the chunks holding a run of N tokens that the query (the "
                         "prompt's last tokens) repeats: what a question names (default 2, for Qwen3.5's vocabulary; "
                         "4 for a 1K-token one; 0: off; requests may set specprefill_anchor_ngram)")
    sp.add_argument("--specprefill-anchor-query-tokens", type=int, default=64,
                    help="the prompt's last tokens that are the query for the anchors (default 64)")
    sp.add_argument("--specprefill-anchor-max-occurrences", type=int, default=4,
                    help="a run found more often than this before the query anchors nothing: boilerplate (default 4)")
    sp.add_argument("--specprefill-anchor-follow", type=int, default=16,
                    help="tokens after a run that it anchors too, e.g. the value after a key (default 16)")
    sp.add_argument("--specprefill-anchor-max-share", type=_fraction, default=0.5, metavar="FRACTION",
                    help="the most of the keep budget anchors may take; the best-scored chunks keep the rest "
                         "(default 0.5)")
    serve.add_argument("--memory-limit-gb", type=float, default=None,
                       help="MLX memory limit for this process (lets two servers share one GPU)")
    serve.add_argument("--cache-limit-gb", type=float, default=None,
                       help="freed buffers MLX keeps for reuse (default: 8 GiB on CUDA, or a tenth of the "
                            "device if less; else MLX's own: up to the memory limit)")
    serve.add_argument("--no-warmup", action="store_true", help="skip kernel warm-up before taking traffic")
    serve.add_argument("--no-compile", action="store_true",
                       help="run the decode step eagerly instead of as one compiled function (same tokens, slower)")
    serve.add_argument("--no-compile-mtp", action="store_true",
                       help="run greedy MTP rounds eagerly (mlx-vlm's speculative cache transaction) instead of as "
                            "one compiled function (same tokens, slower)")
    serve.add_argument("--prefill-shapes", default="auto", choices=["auto", "fixed", "exact"],
                       help="prefill chunks at a few fixed lengths, all run at warm-up (no first-shape "
                            "stalls on a GPU), or at the prompts' own lengths; auto: fixed on a GPU")
    pp = serve.add_argument_group("pipeline (one model over several processes, started by mlx.launch)")
    pp.add_argument("--pipeline", action="store_true",
                    help="split the model's layers over the processes of an mlx.launch group (each rank runs this "
                         "command; rank 0 serves HTTP, the others run their layers in lockstep; docs/pipeline.md)")
    pp.add_argument("--pipeline-backend", default="any", choices=["any", "ring", "mpi", "nccl", "jaccl"],
                    help="mx.distributed's backend (default any: the first available)")
    pp.add_argument("--pipeline-split", default=None, metavar="N,N,...",
                    help="layers per rank, rank 0 first (rank 0 runs the last layers; default: an even split)")
    pp.add_argument("--pipeline-transfer", default="auto", choices=["auto", "p2p", "collective"],
                    help="how a stage's hidden states reach the next: send/recv (p2p) or one all_sum per stage "
                         "boundary (collective; MLX's CUDA backend has no send/recv); auto: collective on CUDA")
    serve.add_argument("--engine-process", default="auto", choices=["auto", "on", "off"],
                       help="run the engine (model, batching, decode steps) in a process of its own, so that "
                            "no Python of the HTTP server delays a step; auto: on where MLX has a GPU "
                            "(Metal or CUDA), off on the CPU backend")
    logs = serve.add_argument_group("logs (one line per request, on the mlx_relay.requests logger)")
    logs.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    logs.add_argument("--log-format", default="text", choices=["text", "json"],
                      help="text: 'LEVEL logger: message key=value ...'; json: one JSON object per line")
    logs.add_argument("--log-name", default=None, metavar="NAME",
                      help="a name every log line carries (text: first; json: 'server'); the cluster names its "
                           "replicas replica-1, replica-2, ...")
    logs.add_argument("--log-prompts", action="store_true",
                      help="put each request's prompt and reply text in its log line (off: counts and timings only)")
    pool = serve.add_argument_group("several models (loaded on demand, unloaded under a memory budget)")
    pool.add_argument("--model", dest="models", action="append", default=None, metavar="NAME=PATH",
                      help="serve this model too, by this name (repeatable; the first is the one a request without "
                           "a model gets); each is loaded when a request names it and served with the other flags")
    pool.add_argument("--models-config", default=None, metavar="FILE",
                      help="a TOML file of [models.NAME] tables: path, aliases, pinned, idle_ttl_s, max_num_seqs, "
                           "max_model_len, mtp, speculation, max_draft_tokens, specprefill_draft_model, "
                           "prefix_cache, prefix_cache_gb, tool_parser, warmup (docs/serving.md)")
    pool.add_argument("--memory-budget-gb", type=float, default=None,
                      help="the loaded models' weights and caches together: a model is loaded only where its "
                           "reservation fits, idle unpinned models are unloaded (least recently used first) to make "
                           "room (default: no budget)")
    pool.add_argument("--load-wait-s", type=float, default=120.0,
                      help="how long a request waits for its model to load before a 503 + Retry-After (default 120)")
    pool.add_argument("--contention", choices=("wait", "fail"), default="wait",
                      help="a model that does not fit beside the models in use: wait for one to become idle "
                           "(within --load-wait-s) or answer 503 + Retry-After at once (default wait)")
    pool.add_argument("--idle-ttl-s", type=float, default=None,
                      help="unload a model after this many seconds without a request (default: never; a model's "
                           "own idle_ttl_s wins)")
    add_bench_parser(sub)
    add_cluster_parser(sub)
    return parser


def _fraction(text: str) -> float:
    """An argparse type: a number in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be between 0 and 1: {text}")
    return value


def _gib(value: float | None) -> int | None:
    return None if value is None else int(value * (1 << 30))


def _split(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(n) for n in text.split(","))
    except ValueError:
        raise SystemExit(f"mlx-relay: --pipeline-split: not a list of layer counts: {text!r}") from None


def _launcher_rank() -> int:
    """This process's rank as the launcher set it (mlx.launch: MLX_RANK; mpirun: its own)."""
    for name in ("MLX_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        if (value := os.environ.get(name)) is not None:
            return int(value)
    raise SystemExit("mlx-relay: --pipeline: no rank in the environment (MLX_RANK); start every rank with "
                     "mlx.launch, e.g. mlx.launch -n 2 --backend ring -- mlx-relay serve MODEL --pipeline")


def _launcher_leader_host() -> str | None:
    """Rank 0's address as the launcher gave it (the ring hostfile's first rank, NCCL_HOST_IP or
    MLX_JACCL_COORDINATOR's host); None where it gave none (mpirun)."""
    if (host := os.environ.get("NCCL_HOST_IP")) is not None:
        return host
    if (coordinator := os.environ.get("MLX_JACCL_COORDINATOR")) is not None:
        return coordinator.rsplit(":", 1)[0]
    if (hostfile := os.environ.get("MLX_HOSTFILE")) is not None:
        try:
            hosts = json.loads(Path(hostfile).read_text())
            return str(hosts[0][0]).rsplit(":", 1)[0]  # the ring's: [["ip:port", ...], ...], rank 0 first
        except (OSError, ValueError, LookupError, TypeError):
            return None
    return None


def _stdin_is_a_pipe() -> bool:
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):  # closed, or replaced by an object without a descriptor
        return False
    return stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    """The flags as `build_config` overrides (the same builder as the in-process API)."""
    model = args.model
    default_name = None
    if model is None:
        model, default_name = str(default_model_path()), DEFAULT_MODEL_NAME
    if os.path.isdir(model):
        # A local checkpoint needs nothing from the Hub; never let a library go looking there.
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    return build_config(model, served_model_name=args.served_model_name or default_name, **serve_overrides(args))


def pool_from_args(args: argparse.Namespace) -> tuple[ServerConfig, PoolConfig]:
    """`--model NAME=PATH` / `--models-config FILE`: the server's own config (its flags, for the
    first model) and the pool's, each model served with the flags and then its own settings.
    `ModelsConfigError` naming the file's line (or the flag) for what cannot be served."""
    if args.model is not None:
        raise ModelsConfigError("name every model with --model NAME=PATH (or in --models-config), not as MODEL too")
    entries = [parse_model_flag(text) for text in args.models or []]
    if args.models_config is not None:
        entries += read_models_file(Path(args.models_config))
    if any(os.path.isdir(named.entry.path) for named in entries):
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    overrides = serve_overrides(args)
    pool = pool_config(entries, overrides, budget=_gib(args.memory_budget_gb), default_idle_ttl_s=args.idle_ttl_s,
                       load_wait_s=args.load_wait_s, contention=args.contention, drain_timeout_s=args.drain_timeout)
    first = pool.models[0].config
    return build_config(first.model, served_model_name=first.served_model_name, **overrides), pool


def serve_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The serve flags as `build_config` overrides, every model's the same."""
    keys = list(args.api_key or [])
    if env_key := os.environ.get("MLX_RELAY_API_KEY"):
        keys.append(env_key)
    return dict(
        max_num_seqs=args.max_num_seqs,
        prefill_batch_size=args.prefill_batch_size,
        prefill_step_size=args.prefill_step_size,
        max_num_batched_tokens=args.max_num_batched_tokens,
        decode_stall_factor=args.decode_stall_factor,
        prefill_experts=args.prefill_experts,
        dense_16bit=args.dense_16bit,
        compiled_chunk_tokens=args.compiled_chunk_tokens,
        kv_bits=args.kv_bits,
        embedding_model=args.embedding_model,
        embedding_model_name=args.embedding_model_name,
        warmup=not args.no_warmup,
        compile_decode=not args.no_compile,
        mixed_steps=args.mixed_steps == "on",
        compile_mtp=not args.no_compile_mtp,
        prefill_shapes=args.prefill_shapes,
        engine_process=args.engine_process,
        pipeline=PipelineConfig(enabled=True, backend=args.pipeline_backend, split=_split(args.pipeline_split),
                                transfer=args.pipeline_transfer, rank=_launcher_rank(),
                                leader_host=_launcher_leader_host())
        if args.pipeline else PipelineConfig(),
        mtp=not args.no_mtp,
        mtp_block_size=args.mtp_block_size,
        mtp_max_batch=args.mtp_max_batch,
        mtp_verify=args.mtp_verify,
        mtp_policy=args.mtp_policy,
        speculation=args.speculation,
        max_draft_tokens=args.max_draft_tokens,
        context_policy=args.context_policy,
        draft_model=args.draft_model,
        draft_tokens=args.draft_tokens,
        prefix_cache=not args.no_prefix_cache,
        prefix_cache_bytes=_gib(args.prefix_cache_gb),
        prefix_min_snapshot_tokens=args.prefix_min_snapshot_tokens,
        prefix_cache_dir=args.prefix_cache_dir,
        prefix_cache_disk_bytes=_gib(args.prefix_cache_disk_gb),
        prefix_cache_preload=args.prefix_cache_preload,
        max_model_len=args.max_model_len,
        memory_limit_bytes=_gib(args.memory_limit_gb),
        cache_limit_bytes=_gib(args.cache_limit_gb),
        max_queue=args.max_queue,
        specprefill_draft_model=args.specprefill_draft_model,
        specprefill_threshold=args.specprefill_threshold,
        specprefill_chunk_size=args.specprefill_chunk_size,
        specprefill_keep_fraction=args.specprefill_keep,
        specprefill_query_window=args.specprefill_query_window,
        specprefill_anchor_ngram=args.specprefill_anchor_ngram,
        specprefill_anchor_query_tokens=args.specprefill_anchor_query_tokens,
        specprefill_anchor_max_occurrences=args.specprefill_anchor_max_occurrences,
        specprefill_anchor_follow=args.specprefill_anchor_follow,
        specprefill_anchor_max_share=args.specprefill_anchor_max_share,
        allowed_local_dir=args.allowed_local_media_dir,
        allow_remote=args.allow_remote_media,
        allow_private_networks=args.allow_private_media_hosts,
        max_media_bytes=args.max_media_bytes,
        max_image_pixels=args.max_image_pixels,
        max_video_frames=args.max_video_frames,
        tool_parser=args.tool_parser,
        tool_grammar=args.tool_grammar,
        render_timeout_s=args.render_timeout,
        allow_request_chat_template=args.allow_request_chat_template,
        max_request_bytes=args.max_request_bytes,
        read_timeout_s=args.request_read_timeout,
        stall_timeout_s=args.client_stall_timeout,
        max_tokens_policy=args.max_tokens_policy,
        host=args.host,
        port=args.port,
        api_keys=tuple(keys),
        model_aliases=tuple(args.model_alias or ()),
        default_max_tokens=args.default_max_tokens,
        drain_timeout_s=args.drain_timeout,
        exit_on_stdin_eof=args.exit_on_stdin_eof,
        log_level=args.log_level,
        log_format=args.log_format,
        log_prompts=args.log_prompts,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, serve_args = split_args(parser, argv)
    if serve_args and args.command != "cluster":
        parser.error(f"unrecognized arguments: {' '.join(serve_args)}")
    # cluster: its own lines are printed; its health polls are not worth a log line each
    configure_logging(getattr(args, "log_level", "warning"), args.log_format if args.command == "serve" else "text",
                      getattr(args, "log_name", None))
    if args.command == "serve":
        # json logs: the boot's progress as log lines too, so that every line on stderr is JSON
        progress = _progress_printer() if args.log_format == "text" else logging.getLogger("mlx_relay.boot").info
        if args.models or args.models_config:
            try:
                config, pool = pool_from_args(args)
            except ModelsConfigError as exc:
                parser.error(str(exc))
            if config.exit_on_stdin_eof and not _stdin_is_a_pipe():
                parser.error("--exit-on-stdin-eof needs stdin to be a pipe (or a socket) whose end means 'exit'")
            if config.engine.pipeline.enabled:
                parser.error("--pipeline serves one model: it does not run with --model / --models-config")
            return serve(config, ModelPool.boot(pool), progress)
        config = config_from_args(args)
        if config.exit_on_stdin_eof and not _stdin_is_a_pipe():
            parser.error("--exit-on-stdin-eof needs stdin to be a pipe (or a socket) whose end means 'exit'")
        if config.engine.pipeline.enabled and config.engine.pipeline.rank > 0:
            # a pipeline's other rank: its layers, no server (imported here: it loads MLX, which
            # a server whose engine runs in a process of its own never does)
            from mlx_relay.engine.hosting.pipeline_boot import serve_follower

            return serve_follower(config)
        return serve(config, one_model(Relay.start), progress)
    if args.command == "bench":
        return run_bench(args)
    if args.command == "cluster":
        # the serve flags it passes on, checked by serve's own parser before anything starts
        return run_cluster(args, serve_args, parser.parse_args(["serve", *serve_args]))
    return 2


if __name__ == "__main__":
    sys.exit(main())

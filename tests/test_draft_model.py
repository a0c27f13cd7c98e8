"""A draft model as the MTP lane's third source of drafts (issue 45.1; `engine/speculation/draft_model.py`),
on the real float32 fixtures: the served model drafting for itself (every draft right, so the draft's
caches must follow the committed tokens exactly), another model drafting (its drafts mostly wrong),
greedy output identical to plain decoding either way, compiled and eager; what the lane refuses."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from mlx_relay.config import EngineConfig, PipelineConfig
from mlx_relay.engine.models.loader import load_model
from mlx_relay.engine.speculation.draft_model import DraftModel, DraftModelIncompatible
from mlx_relay.errors import ModelLoadError
from mlx_relay.messages.gpu import Generate, SamplingParams
from mlx_relay.testing.fixtures import FixtureSpec, fixture_path
from mlx_relay.testing.reference import greedy_reference
from tests.conftest import References
from tests.test_mtp import _exact_two_token_distribution, assert_two_tokens_fit, run_engine

BASE = list(range(5, 25))


def _run(gpu: Callable, references: References, target: Path, draft: Path, *, compiled: bool,
         policy: str = "always") -> tuple[Any, ...]:
    max_tokens = [40, 12, 33, 25]
    prompts = [BASE, [*BASE[3:], 40, 41, 42], list(range(30, 70)), BASE * 2]

    def run() -> tuple[Any, ...]:
        loaded = load_model(target)
        plan = [(at, Generate(f"r{i}", p, SamplingParams(max_tokens=m, speculation="draft")))
                for i, (at, p, m) in enumerate(zip((0, 0, 2, 4), prompts, max_tokens, strict=True))]
        got = run_engine(loaded, plan, mtp_max_batch=4, compile_mtp=compiled, mtp_verify="batched",
                         draft_model=str(draft), draft_tokens=3, speculation="auto", mtp_policy="always",
                         context_policy=policy)
        return got, references(target, prompts, max(max_tokens))

    (tokens, finished, stats), ref = gpu(run)
    for sid, want in enumerate(ref):
        assert tokens[sid] == want[:max_tokens[sid]], sid
    return tokens, finished, stats


@pytest.mark.parametrize("compiled", [True, False])
def test_the_model_drafting_for_itself_is_always_right(gpu: Callable, references: References, compiled: bool) -> None:
    """Draft = target: every draft the round verifies is the target's own greedy token, so nearly
    all are accepted (float32; the draft runs the library's forward, the verify the engine's), and
    rounds emit several tokens: the draft's caches followed every row's committed tokens."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    _tokens, finished, stats = _run(gpu, references, path, path, compiled=compiled)
    drafted = sum(f.drafts.draft.drafted for f in finished.values())
    accepted = sum(f.drafts.draft.accepted for f in finished.values())
    assert drafted > 0 and accepted >= 0.9 * drafted, (drafted, accepted)
    assert stats.draft_drafted == drafted and stats.mtp_rounds < sum(f.completion_tokens for f in finished.values())
    # the draft model's drafts alone
    assert all(f.drafts.mtp.drafted == 0 and f.drafts.context.drafted == 0 for f in finished.values())


@pytest.mark.parametrize("compiled", [True, False])
def test_another_model_s_drafts_keep_greedy_output(gpu: Callable, references: References, compiled: bool) -> None:
    """A draft of other weights (same vocabulary): its drafts mostly miss; the output is still
    plain decoding's, verified draft by draft."""
    target = fixture_path(FixtureSpec(variant="fp32", seed=0))
    draft = fixture_path(FixtureSpec(variant="fp32", seed=1))
    _tokens, finished, _stats = _run(gpu, references, target, draft, compiled=compiled)
    drafted = sum(f.drafts.draft.drafted for f in finished.values())
    accepted = sum(f.drafts.draft.accepted for f in finished.values())
    assert drafted > 0 and accepted < drafted


def test_draft_model_drafts_keep_the_sampling_distribution(gpu: Callable) -> None:
    """Sampling rows whose second token is decided by the draft model's greedy draft (a point mass
    q, walked as a copied draft's: accept with p(d), else draw from p without d): the joint
    distribution of the first two tokens over many rows fits the exact one (G-test at p = 0.001).
    The draft is the target itself: its greedy draft is the target's likeliest token, which a draw
    at temperature 1.5 takes only some of the time, so both branches of the walk run."""
    target = draft = fixture_path(FixtureSpec(variant="bigram", seed=0))
    n = 200
    prompt = list(range(5, 35))

    def run() -> tuple[Any, ...]:
        loaded = load_model(target)
        params = SamplingParams(temperature=1.5, top_k=4, max_tokens=2, speculation="draft")
        plan = [(i // 16, Generate(f"s{i}", prompt, params)) for i in range(n)]
        tokens, finished, _stats = run_engine(loaded, plan, max_num_seqs=16, mtp_max_batch=16, mtp=False,
                                              draft_model=str(draft), draft_tokens=2, context_policy="always")
        exact = _exact_two_token_distribution(target, prompt, SamplingParams(temperature=1.5, top_k=4, max_tokens=2))
        return tokens, finished, exact

    tokens, finished, exact = gpu(run)
    drafted = sum(f.drafts.draft.drafted for f in finished.values())
    accepted = sum(f.drafts.draft.accepted for f in finished.values())
    assert drafted > n // 2 and 0 < accepted < drafted  # both branches of the walk ran
    assert_two_tokens_fit(tokens, exact, n)


def test_a_draft_of_another_vocabulary_is_refused(gpu: Callable) -> None:
    """Token ids of another vocabulary mean other text: refused at load, as a model load error."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))

    class OtherVocabulary:
        def get_vocab(self) -> dict[str, int]:
            return {"a": 0, "b": 1}

    with pytest.raises(DraftModelIncompatible, match="another vocabulary"):
        gpu(lambda: DraftModel.load(path, OtherVocabulary(), 3))


def test_a_draft_that_cannot_run_is_refused_at_load(gpu: Callable, tmp_path: Path) -> None:
    """A checkpoint that does not load or run as its config says (here: mlx-vlm's qwen3_5 with no
    full-attention layer, whose forward needs one) is refused when it is loaded (a load error), not
    when a round first asks it for drafts (the lane's step, every row of it, would fail)."""
    import json
    import shutil

    src = fixture_path(FixtureSpec(variant="fp32", seed=0))
    broken = tmp_path / "draft"
    shutil.copytree(src, broken)
    config = json.loads((broken / "config.json").read_text())
    text = config.get("text_config", config)
    text["full_attention_interval"] = 99  # no layer is full attention, which the model's forward needs
    text.pop("layer_types", None)
    (broken / "config.json").write_text(json.dumps(config))
    tok = gpu(lambda: load_model(src).processor)
    with pytest.raises(ModelLoadError):
        gpu(lambda: DraftModel.load(broken, getattr(tok, "tokenizer", tok), 3))


def test_draft_tokens_are_bounded() -> None:
    with pytest.raises(ValueError, match="draft_tokens"):
        EngineConfig(model_path="x", draft_tokens=0)
    with pytest.raises(ValueError, match="pipeline"):
        EngineConfig(model_path="x", draft_model="d", pipeline=PipelineConfig(enabled=True))


async def test_a_server_default_of_draft_serves_requests_that_do_not_ask(fp32_model: Path) -> None:
    """`--speculation draft`: a request without the extension (what an agent's CLI sends) takes the
    draft model's drafts, reported in its usage; the output is plain decoding's. A server default of
    "draft" without a draft model does not start."""
    from mlx_relay.relay import Relay

    ask = [{"role": "user", "content": "hello there"}]
    async with Relay.start(fp32_model, max_num_seqs=2, warmup=False, speculation="draft",
                           draft_model=str(fp32_model), context_policy="always") as relay:
        drafted = await relay.chat(ask, max_tokens=16, temperature=0)
    async with Relay.start(fp32_model, max_num_seqs=2, warmup=False, speculation="none") as relay:
        plain = await relay.chat(ask, max_tokens=16, temperature=0)
    assert drafted.token_ids == plain.token_ids
    assert drafted.drafts.draft.drafted > 0 and drafted.drafts.draft.accepted >= 0.9 * drafted.drafts.draft.drafted
    assert drafted.drafts.mtp.drafted == 0 and plain.drafts.draft.drafted == 0
    with pytest.raises(ValueError, match="draft model"):
        EngineConfig(model_path="x", speculation="draft")


def test_each_method_plans_the_draft_model_where_it_may_run() -> None:
    """With a draft model loaded: "draft" plans its drafts alone; "auto" plans them beside the head's
    and the context's (each round a row verifies the host proposal expected to yield the most);
    "context" and "mtp" do not; a grammar or a seeded sampling row takes none."""
    from mlx_relay.actors.text_mtp_executor import TextMTPExecutor
    from mlx_relay.messages.gpu import ModelInfo, Speculate
    from mlx_relay.messages.text_mtp import PlanText

    config = EngineConfig(model_path="m", mtp_policy="always", draft_model="d", draft_tokens=3)
    info = ModelInfo(model_path="m", model_type="qwen3_5", backend="cpu", context_length=100, vocab_size=10,
                     eos_token_ids=[1], has_vision=False, has_mtp=True, load_seconds=0.0, speculative_draft="d")
    ex = TextMTPExecutor(config, info)

    def plan(**kw: Any) -> Speculate | None:
        return ex.plan(PlanText("r", SamplingParams(**kw))).speculate

    assert plan(speculation="draft") == Speculate(2, head=False, context=3, draft=True, copy=False)
    assert plan() == Speculate(2, head=True, context=8, draft=True)
    assert plan(speculation="context") == Speculate(2, head=False, context=8)
    assert plan(speculation="mtp") == Speculate(2, head=True, context=0)
    assert plan(speculation="draft", grammar="start: /a/") is None
    assert plan(speculation="draft", temperature=0.7, seed=1) is None


@pytest.mark.parametrize("compiled", [True, False])
def test_auto_with_a_draft_model_verifies_the_likelier_host_proposal(gpu: Callable, compiled: bool) -> None:
    """Under "auto" a row holds both host proposers, the context's (free, scored every round) and the
    draft model's (made only for a round that verifies it), and each round verifies the one expected
    to yield more: with the target drafting for itself, the draft model's drafts are verified and
    nearly all accepted; the output is plain decoding's."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    max_tokens = [30, 20]
    prompts = [BASE, list(range(30, 60))]

    def run() -> tuple[Any, ...]:
        loaded = load_model(path)
        plan = [(0, Generate(f"r{i}", p, SamplingParams(max_tokens=m))) for i, (p, m) in
                enumerate(zip(prompts, max_tokens, strict=True))]
        got = run_engine(loaded, plan, mtp_max_batch=4, compile_mtp=compiled, mtp_verify="batched",
                         draft_model=str(path), draft_tokens=3, speculation="auto", mtp_policy="always",
                         max_draft_tokens=3, context_policy="always")
        return got, greedy_reference(path, prompts, max(max_tokens))

    (tokens, finished, _stats), ref = gpu(run)
    for sid, want in enumerate(ref):
        assert tokens[sid] == want[:max_tokens[sid]], sid
    drafted = sum(f.drafts.draft.drafted for f in finished.values())
    assert drafted > 0 and sum(f.drafts.draft.accepted for f in finished.values()) >= 0.9 * drafted


def test_a_long_prompt_is_read_by_the_draft_a_piece_a_round(gpu: Callable) -> None:
    """A row's prompt longer than FEED_CHUNK is read by the draft over several rounds (no round, and no
    other row's decoding, waits on its whole prefill in the draft): `ready` reads a piece and says no
    until what is left fits one round; the drafts then are those of the prompt read at once."""
    from mlx_relay.engine.speculation.proposer import FEED_CHUNK

    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    prompt = [5 + (i * 7) % 900 for i in range(FEED_CHUNK + 1000)]  # within the fixture's 4,096 positions

    def run() -> tuple[list[bool], list[int], list[int]]:
        tok = load_model(path).processor
        draft = DraftModel.load(path, getattr(tok, "tokenizer", tok), 3)
        pieces = draft.proposals(prompt)
        readiness = [pieces.ready() for _ in range(2)]
        at_once = draft.proposals(prompt[:FEED_CHUNK])
        at_once.extend(prompt[FEED_CHUNK:])  # read in one propose (what a short backlog does)
        return readiness, pieces.propose(3), at_once.propose(3)

    readiness, in_pieces, whole = gpu(run)
    assert readiness == [False, True]
    assert in_pieces == whole and len(whole) == 3


def test_compiled_drafts_equal_the_library_s_round_by_round(gpu: Callable) -> None:
    """A draft of a served family drafts through the engine's compiled decode step
    (`draft_compiled.py`); the same committed tokens give the same drafts as the library's eager
    forward (float32), round after round, whatever share of the last drafts the row committed:
    none, some, all of them (the state kept after the last taken draft, or one step past it), a
    round skipped (committed tokens the draft never proposed after), and drafts committed without
    the target's own token after them."""
    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    other = fixture_path(FixtureSpec(variant="fp32", seed=1))

    def run() -> tuple[list[list[int]], list[list[int]], bool, bool]:
        tok = load_model(path).processor
        tok = getattr(tok, "tokenizer", tok)
        compiled, eager = DraftModel.load(other, tok, 4), DraftModel.load(other, tok, 4, compiled=False)
        a, b = compiled.proposals(list(range(5, 40))), eager.proposals(list(range(5, 40)))
        got_a, got_b = [], []
        # per round: how many of the drafts the row takes, then the target's own token (None: no proposal)
        # (own None: the row committed only drafts, its own token not yet; taken None: no proposal)
        for taken, own in ((0, 7), (2, 9), (4, 11), (None, 13), (1, 15), (4, 17), (3, None), (2, None), (3, 19)):
            if taken is None:
                a.extend([own, own + 1])
                b.extend([own, own + 1])
                continue
            da, db = a.propose(4), b.propose(4)
            got_a.append(da)
            got_b.append(db)
            a.extend([*da[:taken], *([] if own is None else [own])])
            b.extend([*db[:taken], *([] if own is None else [own])])
        return got_a, got_b, compiled.info.compiled, eager.info.compiled

    got_a, got_b, is_compiled, eager_compiled = gpu(run)
    assert is_compiled and not eager_compiled
    assert got_a == got_b and all(len(d) == 4 for d in got_a), (got_a, got_b)


def test_a_served_family_s_draft_reads_tokens_as_the_library_s_forward(gpu: Callable) -> None:
    """`DraftModel.read`: a draft of a family the engine serves reads a row's tokens through the
    family's prefill forward (its CPU recurrence here, its kernels on a GPU) over the library's
    caches, in pieces at the caches' offsets; the caches after it equal the library's forward's
    over the same tokens (float32), and the eager draft (no compiled step) reads through the
    library's forward itself."""
    import mlx.core as mx

    from mlx_relay.engine.scoring.draft_library import cache_arrays, make_cache

    path = fixture_path(FixtureSpec(variant="fp32", seed=0))
    tokens = [5 + (i * 7) % 900 for i in range(150)]

    def run() -> tuple[bool, bool, float]:
        tok = load_model(path).processor
        draft = DraftModel.load(path, getattr(tok, "tokenizer", tok), 3)
        ours, theirs = make_cache(draft.model), make_cache(draft.model)
        draft.read(tokens[:70], ours)  # two pieces: the second at the first's offset
        draft.read(tokens[70:], ours)
        draft.forward(mx.array([tokens], dtype=mx.int32), theirs)
        a, b = cache_arrays(ours), cache_arrays(theirs)
        mx.eval(a, b)
        worst = max(float(mx.max(mx.abs(x.astype(mx.float32) - y.astype(mx.float32))))
                    for x, y in zip(a, b, strict=True))
        return draft.step is not None, len(a) == len(b) > 0, worst

    served, same_layout, worst = gpu(run)
    assert served and same_layout
    assert worst < 1e-4, worst

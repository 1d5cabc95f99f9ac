"""Batch isolation on real llama.cpp (Gemma 3 270M Q4_K_M): a checked session's digests do not
depend on the node's batch company or batch settings.

Two nodes hold the same span (layers 0-7) and compute the same session,
the one a spot check runs twice. Node A serves it alone, with the default
batch settings. Node B serves it while three other sessions' prefills and
decode steps load every round, with other ``batch_tokens`` /
``prefill_chunk_tokens`` and the session on another sequence id. Each node is
the real stack below the session machine: :class:`node.scheduler.Scheduler`
planning batches (node.batching) over :class:`node.backend.EngineBackend` and a
:class:`node.engine.ShardEngine`.

* Isolated (``OpenSession.isolated``): every step's output digest is the same
  on both nodes, bit for bit.
* Not isolated: the digests differ. For this model some llama.cpp CPU kernels
  pick their algorithm by a ubatch's row count (test_gemma3_real.py), so an
  honest node would be named a liar: this is what the isolation fixes, and
  why the isolated case is a real test.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import trio

from common.vocab import Vocabulary
from node.backend import EngineBackend
from node.engine import EngineConfig, ShardEngine
from node.sampling import SamplingParams
from node.scheduler import Scheduler
from node.session_machine import Compute, FreeKv, OpenKv, StepJob, StepOutcome
from node.shard import extract_shard
from node.testmodel import gemma3_model_path
from proto.codec import output_digest

pytestmark = pytest.mark.slow  # loads model weights into llama.cpp

SPAN = (0, 7)
CHECKED = "checked"
STORY = (
    "In the valley below the old observatory, the river divided into three arms before it reached the sea. "
    "Each spring the villagers rebuilt the wooden bridges the floods had taken, and each autumn the "
    "astronomers climbed the hill to count the falling stars. "
)
OTHERS = ("def fibonacci(n):\n    ", "Once upon a time, in a kingdom by the sea,", "1, 2, 3, 4, 5, 6, 7,")
N_DECODE = 12


@dataclass(frozen=True)
class NodeSettings:
    engine: EngineConfig
    max_batch_tokens: int
    prefill_chunk_tokens: int


# Node A: the defaults. Node B: other batch settings (node-local, free to differ between honest nodes).
NODE_A = NodeSettings(
    EngineConfig(threads=1, max_sessions=4, session_kv_tokens=512, batch_tokens=256), 256, 256
)
NODE_B = NodeSettings(
    EngineConfig(threads=1, max_sessions=4, session_kv_tokens=512, batch_tokens=128), 128, 48
)

Script = list[tuple[int, np.ndarray, bool]]  # (start, token ids, is decode) per step


@pytest.fixture(scope="module")
def gemma_path() -> Path:
    return gemma3_model_path()


@pytest.fixture(scope="module")
def scripts(gemma_path: Path) -> dict[str, Script]:
    """Each session's steps: one prefill step (as the gateway sends it), then decode steps of the
    text's next tokens (the first stage takes token ids; what a last stage would sample is not needed)."""
    with Vocabulary(gemma_path) as v:
        texts = {CHECKED: (STORY * 3, 100), **{f"o{i}": (t * 8, 20 + 25 * i) for i, t in enumerate(OTHERS)}}
        out: dict[str, Script] = {}
        for sid, (text, prompt_len) in texts.items():
            toks = np.asarray(v.tokenize(text, add_special=True), dtype=np.int32)
            assert len(toks) >= prompt_len + N_DECODE
            steps: Script = [(0, toks[:prompt_len], False)]
            steps += [(p, toks[p : p + 1], True) for p in range(prompt_len, prompt_len + N_DECODE)]
            out[sid] = steps
    return out


async def _serve(
    engine: ShardEngine,
    settings: NodeSettings,
    scripts: dict[str, Script],
    *,
    isolated: bool,
    earlier: Script | None = None,
) -> list[bytes]:
    """Run every session's steps round by round through a real scheduler; the checked session's
    per-step output digests. All of a round's steps are queued before the scheduler plans a batch.

    ``earlier``: a session served and freed first, after the others opened, so the checked session
    reuses its sequence (and KV cells) instead of a fresh one."""
    outcomes: dict[int, StepOutcome] = {}
    done = trio.Event()
    want = 0

    def on_outcome(outcome: StepOutcome) -> None:
        outcomes[outcome.job_id] = outcome
        if len(outcomes) >= want:
            done.set()

    scheduler = Scheduler(
        EngineBackend(engine),
        on_outcome,
        max_batch_tokens=settings.max_batch_tokens,
        prefill_chunk_tokens=settings.prefill_chunk_tokens,
    )
    digests: list[bytes] = []
    job_ids = iter(range(1, 1_000_000))
    async with trio.open_nursery() as nursery:
        await nursery.start(scheduler.run)
        if earlier is not None:
            assert await scheduler.run_control(OpenKv("earlier", 512, SamplingParams())) is None
        for sid in scripts:  # in this order: the lowest free sequence ids
            if sid == CHECKED and earlier is not None:
                for start, tokens, is_decode in earlier:
                    job = StepJob(next(job_ids), "earlier", start, tokens, None, False, None, is_decode)
                    scheduler.submit(Compute(job))
                    want = len(outcomes) + 1
                    done = trio.Event()
                    with trio.fail_after(120):
                        await done.wait()
                assert await scheduler.run_control(FreeKv("earlier")) is None
            assert await scheduler.run_control(OpenKv(sid, 512, SamplingParams())) is None
        for r in range(len(scripts[CHECKED])):
            checked_job = 0
            for sid, steps in scripts.items():
                start, tokens, is_decode = steps[r]
                job = StepJob(
                    next(job_ids),
                    sid,
                    start,
                    tokens,
                    None,
                    False,
                    None,
                    is_decode,
                    token_ids=tokens,
                    isolated=isolated and sid == CHECKED,
                )
                checked_job = job.job_id if sid == CHECKED else checked_job
                scheduler.submit(Compute(job))
            want = len(outcomes) + len(scripts)
            done = trio.Event()
            with trio.fail_after(120):
                await done.wait()
            out = outcomes[checked_job]
            assert out.error_status is None and out.hidden is not None, out.error_message
            digests.append(output_digest(out.hidden))
        stats = scheduler.statistics()
        if len(scripts) > 1:
            assert stats.multi_session_batches > 0  # the company really shared batches
        if isolated:
            assert stats.isolated_batches >= len(scripts[CHECKED])
        nursery.cancel_scope.cancel()
    return digests


@pytest.mark.parametrize("isolated", [True, False], ids=["isolated", "not-isolated"])
async def test_a_checked_session_digests_the_same_alone_and_in_a_loaded_batch(
    isolated: bool, gemma_path: Path, scripts: dict[str, Script], node_cache: Path
) -> None:
    files = extract_shard(gemma_path, *SPAN, node_cache)
    with ShardEngine(files, NODE_A.engine, node_cache) as a:
        alone = await _serve(a, NODE_A, {CHECKED: scripts[CHECKED]}, isolated=isolated)
    # Node B: the other sessions open first; the checked session then takes over the sequence of an
    # earlier session that was served and freed (another sequence id than on A, with used KV cells).
    loaded = {sid: s for sid, s in scripts.items() if sid != CHECKED} | {CHECKED: scripts[CHECKED]}
    earlier = scripts["o2"][:4]
    with ShardEngine(files, NODE_B.engine, node_cache) as b:
        crowded = await _serve(b, NODE_B, loaded, isolated=isolated, earlier=earlier)
    differing = [i for i, (x, y) in enumerate(zip(alone, crowded, strict=True)) if x != y]
    if isolated:
        assert differing == [], f"isolated steps differ between the nodes at steps {differing}"
    else:
        # Without isolation honest nodes disagree (the risk in docs/security.md, Limits).
        assert differing, "batched and alone gave the same digests: the inputs no longer show the risk"

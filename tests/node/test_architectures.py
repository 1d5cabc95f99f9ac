"""Every supported architecture, split into 2 and 3 shards, computes exactly what the whole model computes.

Tiny random-weight models (``tests/node/tiny_models.py``) with each
architecture's real tensor layout and metadata run through the layer-range
engine (real llama.cpp, one thread per context) and are compared with the
whole model in one plain llama.cpp context with the same context settings:
the logits after the prompt and after each of 32 greedy tokens are
bit-identical, and so are the tokens. The splits are ``[0,3)+[3,9)``
(uneven, starting at layer 3) and ``[0,2)+[2,7)+[7,9)`` (starting at layer 7):
neither 3 nor 7 is a multiple of any sliding-window period (2 for Gemma 2, 6
for Gemma 3). The sliding window of the tiny Gemmas is 32 positions and the
prompt plus generation is longer than 90.
"""

from __future__ import annotations

from pathlib import Path

import llama_cpp
import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from common import architectures
from common.vocab import Vocabulary
from node.engine import EngineConfig, ShardEngine, TokenEmbeddings, Work
from node.errors import LayerRangeError, UnsupportedArchitecture
from node.llama_runtime import BatchBuffer, TensorCapture, free_model, load_model, new_context
from node.reference import ReferenceModel
from node.shard import extract_shard, read_model_meta
from tests.node.tiny_models import SPECS, build

CONFIG = EngineConfig(threads=1, max_sessions=4, session_kv_tokens=256, batch_tokens=64)
N_NEW = 32
TEXT = (
    "The old lighthouse keeper counted the ships that passed each night, writing their names in a "
    "leather book. Storms came and went; the lamp never failed. One winter a stranger knocked at the "
    "door and asked for shelter. The keeper hesitated, then opened the book to a fresh page and wrote "
    "a name he had not seen in forty years, the name of a ship that had sunk before he was born, and"
)
SPLITS = {"2-uneven-from-3": [0, 3, 9], "3-from-7": [0, 2, 7, 9]}
PARITY_KEYS = [k for k in SPECS if k != "qwen3moe-varied"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory, model_path: Path):
    out = tmp_path_factory.mktemp("tiny-models")
    made: dict[str, Path] = {}

    def get(key: str) -> Path:
        if key not in made:
            made[key] = build(SPECS[key], model_path, out / f"{key}.gguf")
        return made[key]

    return get


@pytest.fixture(scope="module")
def prompt(vocab: Vocabulary) -> list[int]:
    toks = vocab.tokenize(TEXT)
    assert len(toks) > 64 and len(toks) + N_NEW > 90  # > n_batch (chunked), > window
    return toks


def reference_run(path: Path, prompt: list[int], n_new: int) -> tuple[list[int], list[bytes]]:
    """Greedy tokens and the logits (bytes) after the prompt and after each generated token."""
    with ReferenceModel(path, CONFIG.context_settings()) as ref:
        logits = [ref.prefill(prompt)]
        out = [int(np.argmax(logits[-1]))]
        pos = len(prompt)
        while len(out) < n_new:
            ref.decode([0], [pos], [out[-1]], [True])
            logits.append(ref.logits(0))
            out.append(int(np.argmax(logits[-1])))
            pos += 1
    return out, [x.tobytes() for x in logits]


class Route:
    def __init__(self, engines: list[ShardEngine]) -> None:
        self.engines = engines

    def step(self, items: list[tuple[str, int, list[int]]]) -> list:
        works = [Work(sid, pos, tokens=np.array(t, dtype=np.int32)) for sid, pos, t in items]
        for k, engine in enumerate(self.engines):
            if k == len(self.engines) - 1:
                for w in works:
                    w.sample = True
                    w.return_logits = True
            results = engine.step(works)
            for r in results:
                assert r.ok, r.error
            works = [Work(r.session_id, r.start_pos, hidden=r.hidden) for r in results]
        return results

    def generate(self, sid: str, prompt: list[int], n_new: int) -> tuple[list[int], list[bytes]]:
        for e in self.engines:
            e.open_session(sid)
        try:
            res = self.step([(sid, 0, prompt)])[0]
            out, logits = [res.sampled.token_id], [res.logits.tobytes()]
            pos = len(prompt)
            while len(out) < n_new:
                res = self.step([(sid, pos, [out[-1]])])[0]
                out.append(res.sampled.token_id)
                logits.append(res.logits.tobytes())
                pos += 1
        finally:
            for e in self.engines:
                e.release(sid)
        return out, logits


def open_route(path: Path, bounds: list[int], cache: Path) -> Route:
    return Route(
        [
            ShardEngine(extract_shard(path, a, b, cache), CONFIG, cache)
            for a, b in zip(bounds, bounds[1:], strict=False)
        ]
    )


def close_route(route: Route) -> None:
    for e in route.engines:
        e.close()


@pytest.mark.slow  # loads model weights into llama.cpp
@pytest.mark.parametrize("key", PARITY_KEYS)
def test_splits_are_bit_exact_with_the_whole_model(
    key: str, tiny, prompt: list[int], node_cache: Path
) -> None:
    path = tiny(key)
    want_tokens, want_logits = reference_run(path, prompt, N_NEW)
    for name, bounds in SPLITS.items():
        route = open_route(path, bounds, node_cache)
        try:
            tokens, logits = route.generate(f"{key}-{name}", prompt, N_NEW)
        finally:
            close_route(route)
        assert len(logits) == N_NEW
        for i, (got, want) in enumerate(zip(logits, want_logits, strict=True)):
            assert got == want, f"{key} {name}: logits differ at step {i}"
        assert tokens == want_tokens, f"{key} {name}"


@pytest.mark.slow  # cuts shards of tiny models
def test_sliding_window_layers_follow_absolute_indices(tiny, node_cache: Path) -> None:
    """A Gemma 3 shard from layer 3 marks its layer 2 (absolute 5) global, as the whole model does."""
    files = extract_shard(tiny("gemma3"), 3, 9, node_cache)
    pattern = GGUFReader(files.path).fields["gemma3.attention.sliding_window_pattern"].contents()
    assert pattern == [True, True, False, True, True, True]  # absolute 3..8: only 5 is global (5 % 6 == 5)
    files = extract_shard(tiny("gemma2"), 3, 9, node_cache)
    pattern = GGUFReader(files.path).fields["gemma2.attention.sliding_window_pattern"].contents()
    assert pattern == [False, True, False, True, False, True]  # absolute 3..8: even layers slide


# -- mixture of experts ------------------------------------------------------------------------


@pytest.mark.slow  # loads model weights into llama.cpp
def test_moe_cut_between_layers_routing_different_expert_counts(
    tiny, prompt: list[int], node_cache: Path
) -> None:
    """expert_used_count = [2,2,2,1,1,2,1,2,2]: a cut at 5 (after two 1-expert layers) matches exactly."""
    path = tiny("qwen3moe-varied")
    meta = read_model_meta(path, node_cache)
    # llama.cpp takes layer 0's count as the model-wide top-k: a shard may start only where it is the same.
    assert meta.split_points == (0, 1, 2, 5, 7, 8, 9)
    want_tokens, want_logits = reference_run(path, prompt, N_NEW)
    route = open_route(path, [0, 5, 9], node_cache)
    try:
        tokens, logits = route.generate("moe-varied", prompt, N_NEW)
    finally:
        close_route(route)
    assert logits == want_logits and tokens == want_tokens
    for start, end, bad in ((0, 3, 3), (3, 9, 3), (6, 9, 6)):
        with pytest.raises(LayerRangeError, match=f"cannot be cut from this model at layer {bad}; allowed"):
            extract_shard(path, start, end, node_cache)


@pytest.mark.slow  # loads model weights into llama.cpp
@pytest.mark.parametrize("key", ["qwen3moe", "gemma3"])
def test_four_sessions_batched_together_match_each_alone(
    key: str, tiny, vocab: Vocabulary, node_cache: Path
) -> None:
    path = tiny(key)
    texts = [
        TEXT,
        "def fibonacci(n):\n    if n < 2:",
        "1, 2, 3, 4, 5, 6, 7,",
        "Dear diary, today the weather",
    ]
    prompts = [vocab.tokenize(t) for t in texts]
    alone = [reference_run(path, p, 16)[0] for p in prompts]
    route = open_route(path, [0, 3, 9], node_cache)
    try:
        sids = [f"iso-{i}" for i in range(4)]
        for sid in sids:
            for e in route.engines:
                e.open_session(sid)
        first = route.step(
            [(sid, 0, p) for sid, p in zip(sids, prompts, strict=True)]
        )  # four prefills in one batch
        outs = [[r.sampled.token_id] for r in first]
        pos = [len(p) for p in prompts]
        for _ in range(15):
            res = route.step([(sid, pos[i], [outs[i][-1]]) for i, sid in enumerate(sids)])
            for i, r in enumerate(res):
                outs[i].append(r.sampled.token_id)
                pos[i] += 1
        for sid in sids:
            for e in route.engines:
                e.release(sid)
    finally:
        close_route(route)
    assert outs == alone


# -- stage 0's embedding lookup ------------------------------------------------------------------


@pytest.mark.slow  # loads model weights into llama.cpp
@pytest.mark.parametrize("key", PARITY_KEYS)
def test_stage0_lookup_equals_llama_cpp_get_rows(key: str, tiny, node_cache: Path) -> None:
    """The rows stage 0 feeds equal the graph's own token-input rows (after Gemma 3's scaling)."""
    path = tiny(key)
    spec = architectures.spec_for(SPECS[key].arch)
    n_embd = SPECS[key].n_embd
    name = "inp_scaled" if spec.scale_stage0 else "embd"
    ids = [0, 1, 17, 500, 4096, 49151, 12345, 2]
    model = load_model(path)
    cap = TensorCapture(name, n_embd, 64, node_cache)
    ctx = new_context(model, CONFIG.context_settings(), cb_eval=cap.callback_ptr, cb_user_data=cap.user_data)
    try:
        batch = BatchBuffer(64, 0)
        batch.use_embeddings(False)
        n = len(ids)
        batch.token[:n] = ids
        batch.pos[:n] = np.arange(n)
        batch.seq[:n] = 0
        batch.logits[:n] = 1
        batch.batch.n_tokens = n
        cap.reset()
        assert llama_cpp.llama_decode(ctx, batch.batch) == 0
        assert cap.error() is None and cap.ubatch_rows() == [n]
        from_graph = cap.rows().copy()
    finally:
        llama_cpp.llama_free(ctx)
        free_model(model)
    files = extract_shard(path, 0, 3, node_cache)
    scale = float(np.sqrt(np.float32(n_embd))) if spec.scale_stage0 else None
    ours = TokenEmbeddings(files.embeddings_path, n_embd, scale=scale).lookup(np.array(ids))
    assert ours.tobytes() == from_graph.tobytes(), f"{key}: {SPECS[key].embd_type.name} rows differ"


# -- refusals --------------------------------------------------------------------------------------


def _bare_gguf(path: Path, arch: str) -> Path:
    w = GGUFWriter(path, arch)
    w.add_uint32(f"{arch}.block_count", 4)
    w.add_uint32(f"{arch}.embedding_length", 8)
    w.add_tensor("token_embd.weight", np.zeros((16, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize(
    ("arch", "why"),
    [
        ("mamba", "a recurrent model"),
        ("rwkv7", "a recurrent model"),
        ("jamba", "a hybrid recurrent/attention model"),
        ("qwen3next", "a hybrid recurrent/attention model"),
        ("t5", "an encoder or encoder-decoder model"),
        ("bert", "an encoder or encoder-decoder model"),
        ("clip", "a vision/audio model"),
        ("qwen2vl", "a vision/audio model"),
        ("falcon", "a decoder no parity test covers yet"),
    ],
)
def test_unsplittable_architectures_are_refused_with_the_supported_list(
    arch: str, why: str, tmp_path: Path
) -> None:
    path = _bare_gguf(tmp_path / f"{arch}.gguf", arch)
    supported = "llama, qwen2, qwen3, qwen3moe, gemma2, gemma3, phi3"
    with pytest.raises(
        UnsupportedArchitecture, match=f"'{arch}' is not supported: {why}.*; supported: {supported}"
    ):
        extract_shard(path, 0, 2, tmp_path)


def test_gemma_27b_layer_counts_are_served_whole_only() -> None:
    """llama.cpp picks the 27B attention scale from the layer count, which a partial file would change."""
    for arch, n in (("gemma3", 62), ("gemma2", 46)):
        spec = architectures.spec_for(arch)
        points = architectures.split_points(spec, arch, {}, n)
        assert points == (0, n)
        assert architectures.split_refusal(0, n, n, points) is None
        assert "can only be served whole" in (architectures.split_refusal(0, 31, n, points) or "")
    assert architectures.split_points(architectures.spec_for("gemma3"), "gemma3", {}, 18) is None


def test_an_explicit_sliding_window_array_is_sliced_not_recomputed() -> None:
    spec = architectures.spec_for("gemma3")
    fields = {"gemma3.attention.sliding_window": 512, "gemma3.attention.sliding_window_pattern": [1, 0, 1, 1]}
    assert architectures.swa_layers(spec, "gemma3", fields, 4) == [True, False, True, True]
    # No window key: Gemma 3 then has no sliding layers at all.
    assert architectures.swa_layers(spec, "gemma3", {}, 4) is None
    # A period given as a number is expanded by absolute index.
    fields = {"gemma3.attention.sliding_window": 512, "gemma3.attention.sliding_window_pattern": 3}
    assert architectures.swa_layers(spec, "gemma3", fields, 6) == [True, True, False, True, True, False]

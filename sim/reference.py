"""The reference output of a swarm: the whole model in one plain llama.cpp context.

What the end-to-end tests and the benchmarks compare a swarm's answers with.
"""

from __future__ import annotations

from pathlib import Path

from common.vocab import Vocabulary
from gateway.chat_template import ChatTemplate
from gateway.vocab_store import template_of
from node.engine import EngineConfig
from node.reference import ReferenceModel

# What sim.launcher gives each node unless told otherwise; the reference must use the same
# attention and KV settings (flash attention on, f16 KV) -- the session count does not change numbers.
NODE_ENGINE = EngineConfig(threads=1, max_sessions=8, session_kv_tokens=2048)


def chat_template_of(vocab: Vocabulary) -> ChatTemplate:
    """The chat template the gateway renders for this model (gateway.vocab_store.template_of: Gemma's
    turns for a Gemma file without one, not ChatML -- which made every Gemma answer of
    sim.bench_wan_rebalance look wrong against the reference, though the swarm's text was exact)."""
    return template_of(vocab).compile()


class Reference:
    """The whole model in one plain llama.cpp context, prompted through the model's chat template."""

    def __init__(self, model_path: Path) -> None:
        self.ref = ReferenceModel(model_path, NODE_ENGINE.context_settings())
        self.vocab = Vocabulary(model_path)
        self.template = chat_template_of(self.vocab)

    def chat(self, question: str, n_new: int) -> str:
        text = self.template.render([{"role": "user", "content": question}], add_generation_prompt=True)
        self.ref.clear()
        tokens, _ = self.ref.greedy(self.vocab.tokenize(text, add_special=False), n_new)
        out = []
        for t in tokens:
            if self.vocab.is_eog(t):
                break
            out.append(t)
        return self.vocab.detokenize(out)

    def close(self) -> None:
        self.ref.close()
        self.vocab.close()

"""A 10-turn conversation by ``conversation_id`` on Qwen2.5-Coder-1.5B through a real swarm (issue 23).

Opt-in (``SWARM_QWEN_TESTS=1``; the 1.1 GB model from ``node.testmodel.qwen_coder_model_path``): a
tracker, three nodes -- ``[0,14)`` and two of ``[14,28)``, 2,048 KV positions per session -- and a
gateway with ``--prefix-exact``. Each turn sends only its new message through the official openai
client; its text must equal the whole model in one llama.cpp context (flash attention, f16 KV, greedy,
the gateway's prefill step) given the whole history the gateway reports it ran: the kept history, less
the messages it left out once the conversation outgrew 2,048 positions. Between turns 5 and 6 the
``[14,28)`` node that holds the conversation's KV is killed: the next turn prefills on the other one.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from common.vocab import Vocabulary
from gateway.chat_template import ChatTemplate
from gateway.conversations import prompt_of
from gateway.protocol import ChatMessage
from node.llama_runtime import ContextSettings
from node.reference import ReferenceModel
from sim.launcher import LocalSwarm, start_local_swarm
from tests.e2e.conftest import QWEN_OPT_IN

pytestmark = QWEN_OPT_IN

N_NEW = 24
STEP = 256  # the nodes' --batch-tokens and the gateway's prefill step: the reference cuts the same
SYSTEM = "You are a senior Python reviewer. Answer in at most two sentences and name the function."
CODE = (
    "def merge(a: list[int], b: list[int]) -> list[int]:\n"
    "    out = []\n"
    "    i = j = 0\n"
    "    while i < len(a) and j < len(b):\n"
    "        if a[i] <= b[j]:\n"
    "            out.append(a[i]); i += 1\n"
    "        else:\n"
    "            out.append(b[j]); j += 1\n"
    "    return out + a[i:] + b[j:]\n"
)
QUESTIONS = [
    f"Here is my code:\n{CODE}\nIs it correct?",
    "What is its time complexity?",
    "Does it handle empty lists?",
    "Rewrite the loop with heapq.merge, in code.",
    "Which one is faster for long lists?",
    "Add type hints for generic elements, in code.",
    "Write a pytest test for it, in code.",
    "What does the test check?",
    "Could merge be a generator instead? Show it.",
    "Summarize the changes we discussed.",
]


@pytest.fixture(scope="module")
def swarm(tmp_path_factory: pytest.TempPathFactory, qwen: Path) -> Iterator[LocalSwarm]:
    s = start_local_swarm(
        tmp_path_factory.mktemp("qwen-conversation"),
        model=qwen,
        n_nodes=2,
        spare=1,
        layers=["0:14", "14:28", "14:28"],
        session_kv_tokens=2048,
        gateway_args=["--prefix-exact", "--prefill-step-tokens", str(STEP)],
        node_args=["--no-benchmark", "--batch-tokens", str(STEP)],
        timeout_s=900,
    )
    yield s
    s.stop()


def kept_sessions(admin_port: int) -> float:
    text = httpx.get(f"http://127.0.0.1:{admin_port}/metrics", timeout=10).text
    found = re.search(r"^swarm_node_kept_sessions (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def test_ten_turns_sending_only_new_messages_equal_the_whole_model(swarm: LocalSwarm, qwen: Path) -> None:
    client = openai.OpenAI(base_url=swarm.base_url, api_key="qwen-chat", max_retries=0, timeout=1800)
    settings = ContextSettings(
        n_threads=1, n_seq_max=1, n_ctx=4096, n_batch=STEP, n_ubatch=STEP, flash_attn=True, kv_type="f16"
    )
    history = [ChatMessage("system", SYSTEM)]
    compacted = killed = False
    with Vocabulary(qwen) as vocab, ReferenceModel(qwen, settings) as ref:
        template = ChatTemplate(vocab.chat_template)
        for turn, question in enumerate(QUESTIONS):
            if turn == 5:
                holders = [n for n in swarm.nodes[1:] if kept_sessions(n.admin_port) > 0]
                assert holders, "no [14,28) node keeps the conversation's KV"
                holders[0].stop(15)  # the next turn must prefill on the other [14,28) node
                killed = True
            history.append(ChatMessage("user", question))
            new = [m.to_template() for m in history[-2 if turn == 0 else -1 :]]
            r = client.chat.completions.create(
                model=swarm.model_name,
                messages=new,  # type: ignore[arg-type]
                temperature=0,
                max_tokens=N_NEW,
                extra_body={"conversation_id": "qwen-review"},
            )
            info = (r.model_extra or {})["conversation"]
            text = r.choices[0].message.content or ""
            seen = prompt_of(history, info["left_out_messages"], "")
            prompt = vocab.tokenize(
                template.render([m.to_template() for m in seen], add_generation_prompt=True),
                add_special=False,
            )
            ref.clear()
            tokens, _ = ref.greedy(prompt, N_NEW)
            end = next((i for i, t in enumerate(tokens) if vocab.is_eog(t)), len(tokens))
            assert text == vocab.detokenize(tokens[:end]), (turn, info, text)
            compacted = compacted or info["compacted"]
            history.append(ChatMessage("assistant", text))
    assert killed and compacted

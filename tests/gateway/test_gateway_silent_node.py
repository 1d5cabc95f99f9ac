"""A node that answered ``Info`` too late once is not avoided into a sure 503 (issue 26), through the
real gateway and tracker processes, with a scripted node (no model loaded; slow tier all the same).

One ``FakeNode`` serves the whole model. Its first ``Info`` answer is held back past the gateway's
dial deadline (``--dial-timeout-s 0.3``): the gateway notes it unreachable and routes around it for
``avoid_unreachable_s`` (60 s). Seen on the emulated WAN on a loaded machine (docs/wan.md): every
request for the model then got 503 "layers not covered" for that minute although the node was fine.
Now, when no route avoids the nodes this gateway avoids for silence, they are let back in once for
the request (gateway/open_plan.py): the next request is served with the script's text.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import openai
import pytest
from fake_node import FakeNode
from swarm_fixtures import announce, url, vocab_bytes

from common.vocab import Vocabulary
from proto.announce import ModelSpec
from proto.swarm.v1 import shard_service_pb2
from sim.procs import NO_SPOT_CHECKS, Supervisor

pytestmark = pytest.mark.slow  # real tracker and gateway processes

FINGERPRINT = "fc" * 32
MODEL = ModelSpec(fingerprint=FINGERPRINT, name="fake-silent", architecture="llama", n_layers=30, n_embd=576)
SCRIPT_TEXT = "Slow once, served again."
HOLD_S = 3.0  # the first Info answer waits this long (the gateway's deadline is 0.3 s)


class SlowOnce(FakeNode):
    """A scripted node whose first ``Info`` answer is held back ``HOLD_S`` (it blocks the fake nodes'
    loop: nothing answers meanwhile)."""

    held: list[float]

    def info(self) -> shard_service_pb2.NodeInfo:
        if not self.held:
            self.held.append(time.monotonic())
            time.sleep(HOLD_S)
        return super().info()


def test_a_node_silent_once_still_serves_the_next_request(tmp_path: Path, model_path: Path) -> None:
    with Vocabulary(model_path) as vocab:
        script, eos = vocab.tokenize(SCRIPT_TEXT), vocab.eos
        expected = vocab.detokenize(script)
    SlowOnce.held = []
    node = SlowOnce(
        seed=70, fingerprint=FINGERPRINT, start=0, end=30, n_layers=30,
        vocab=vocab_bytes(model_path, tmp_path / "cache"), script=script, eos=eos,
    )  # fmt: skip
    sup = Supervisor(tmp_path)
    try:
        tracker = sup.start_tracker(extra_args=["--no-challenges"]).ready(60)  # fake nodes: no engine
        announce(url(tracker), node.key, MODEL, 0, 30, node.port)
        gateway = sup.start_gateway(
            tracker_url=url(tracker), extra_args=[*NO_SPOT_CHECKS, "--dial-timeout-s", "0.3"]
        ).ready(60)
        client = openai.OpenAI(base_url=url(gateway) + "/v1", api_key="t", max_retries=0, timeout=60)

        def ask() -> str:
            out = client.chat.completions.create(
                model="fake-silent", temperature=0, messages=[{"role": "user", "content": "go"}]
            )
            return out.choices[0].message.content or ""

        with pytest.raises(openai.APIError):
            ask()  # its one node did not answer Info in time: nothing else to try
        assert SlowOnce.held
        unreachable = [
            json.loads(line)
            for line in gateway.log_path.read_text(errors="replace").splitlines()
            if '"node_unreachable"' in line
        ]
        assert [e["node_id"] for e in unreachable] == [node.node_id]  # avoided for 60 s from now
        time.sleep(HOLD_S)  # the held answer is out of the way
        # Before: 503 "no complete route" for the next 60 s. Now: let back in, and served.
        assert ask() == expected
        assert node.state.opened >= 1
    finally:
        sup.stop_all()
        node.stop()

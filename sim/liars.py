"""A swarm with a lying node in it: what the spot-check tests and ``sim/bench_checks.py`` share.

The swarm has two honest nodes per half of the model ([0, n/2) and [n/2, n))
and one *liar slot*: a node started with a test-only failpoint (see
``node/failpoints.py``) on the half where its lie applies. A checked request
needs two disjoint routes and, when they disagree, a judge whose node at the
disputed stage is neither of theirs: three nodes on the liar's half, two on the
other, so five node processes in all.

The tracker challenges every node that joins (one step on its span, compared
with trusted nodes): a liar that lies from its first step never gets in. The
liars here answer that step honestly and lie from then on
(``honest_steps=1``), so what catches them is the gateways' spot checks; the
verdict goes to the tracker, which bans the key.

The gateway is driven by the official ``openai`` client, greedily, and every
answer is compared with the whole model's greedy output.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import openai

from node.failpoints import CONSENT, CONSENT_ENV, ENV
from sim.launcher import LocalSwarm, _wait_announced, start_local_swarm
from sim.procs import Service

# Where each lie can be told: a swapped sampler and a node without the model at the last stage
# (they change sampled tokens), a one-ulp change at the first (it changes the hidden state it sends).
LIE_STAGE = {"swap_sampler": 1, "no_model": 1, "perturb_hidden": 0}
# Longer than the gateway's trust report interval (gateway/trust_report.py, 2 s).
REPORT_WAIT_S = 5.0


@dataclass
class LiarSwarm:
    swarm: LocalSwarm
    model: Path
    node_cache: Path
    halves: tuple[str, str]  # "0:15", "15:30"
    liars: list[Service] = field(default_factory=list)

    @property
    def gateway_url(self) -> str:
        return f"http://127.0.0.1:{self.swarm.gateway.port}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.swarm.base_url, api_key="test", max_retries=0, timeout=120)

    def start_liar(
        self, kind: str, *, honest_steps: int = 1, claim_speed: bool = False, timeout_s: float = 120.0
    ) -> Service:
        """A node telling lie ``kind`` (a fresh identity each time), live at the tracker.

        ``honest_steps`` 1: it answers the tracker's join challenge (one step) honestly and lies from
        then on, as a liar that knows a challenge when it sees one would. With 0 it lies at once and
        the challenge keeps it out: use :meth:`start_node_only` and :func:`tracker_state` then.
        ``claim_speed``: it also announces an absurdly fast decode (failpoint ``fake_speed``), as a
        liar that wants traffic would; routing believes a claim until gateways report what they
        observed, so the liar serves from its first request instead of only when the honest nodes
        of its half happen to be slower than the 10 ms per token a node without a benchmark
        announces (which made how soon it served depend on the machine).
        """
        node = self.start_node_only(
            kind, honest_steps=honest_steps, claim_speed=claim_speed, timeout_s=timeout_s
        )
        _wait_announced(self.swarm.tracker_url, node, timeout_s)
        return node

    def start_node_only(
        self, kind: str, *, honest_steps: int, claim_speed: bool = False, timeout_s: float = 120.0
    ) -> Service:
        """Start the liar and wait for its ports and id; not for the tracker to let it in."""
        name = f"liar-{kind}-{len(self.liars) + 1}"
        layers = self.halves[LIE_STAGE[kind]]
        kinds = f"{kind},fake_speed" if claim_speed else kind
        env = {ENV: f"{kinds},honest_steps={honest_steps}", CONSENT_ENV: CONSENT}
        node = self.swarm.supervisor.start_node(
            name,
            model=self.model,
            layers=layers,
            tracker_url=self.swarm.tracker_url,
            cache_dir=self.node_cache,
            extra_args=["--no-benchmark"],
            env=env,
        )
        node.wait_port(timeout_s)
        health = httpx.get(f"http://127.0.0.1:{node.admin_port}/healthz", timeout=10).json()
        node.extra["node_id"] = health["node_id"]
        self.liars.append(node)
        return node

    def stop_liar(self, node: Service) -> None:
        node.stop()

    def trusted_nodes(self, stage: int, probation_checks: int = 3) -> list[str]:
        """Nodes of half ``stage`` off probation at the tracker (``probation_checks`` passed)."""
        start, end = (int(x) for x in self.halves[stage].split(":"))
        nodes = httpx.get(f"{self.swarm.tracker_url}/v1/swarm", timeout=10).json().get("nodes", [])
        return [
            n["node_id"]
            for n in nodes
            if n.get("state") == "live"
            and n.get("shard")
            and (n["shard"]["start"], n["shard"]["end"]) == (start, end)
            and n.get("checks_passed", 0) >= probation_checks
        ]

    def earn_trust(self, stage: int, questions: Sequence[str], n_new: int, *, max_requests: int = 24) -> int:
        """Send checked requests until a node of half ``stage`` is off probation at the tracker.

        The tracker judges a join challenge against the answers of trusted nodes only: until one
        node of the span has passed its spot checks, a newcomer is let in on probation whatever it
        answers. Returns the requests sent; raises if no node earned trust within ``max_requests``.
        """
        client = self.client()
        sent = 0
        while True:
            # The gateway reports passed checks every few seconds: wait for the last report first.
            deadline = time.monotonic() + REPORT_WAIT_S
            while time.monotonic() < deadline:
                if self.trusted_nodes(stage):
                    return sent
                time.sleep(0.25)
            if sent >= max_requests:
                raise AssertionError(f"no node of {self.halves[stage]} passed its checks in {sent} requests")
            chat(client, self.swarm.model_name, questions[sent % len(questions)], n_new)
            sent += 1


def tracker_state(tracker_url: str, node_id: str) -> str | None:
    """The node's state at the tracker (``live``, ``challenging``, ``challenge_failed``...), or None."""
    nodes = httpx.get(f"{tracker_url}/v1/swarm", timeout=10).json().get("nodes", [])
    return next((n.get("state") for n in nodes if n.get("node_id") == node_id), None)


def start_liar_swarm(
    workdir: Path,
    *,
    model: Path,
    node_cache: Path,
    n_layers: int,
    check_fraction: float,
    probation_checks: int,
    extra_gateway_args: Sequence[str] = (),
    quiet: bool = True,
) -> LiarSwarm:
    half = n_layers // 2
    halves = (f"0:{half}", f"{half}:{n_layers}")
    swarm = start_local_swarm(
        workdir,
        model=model,
        n_nodes=2,
        spare=2,
        layers=[halves[0], halves[1], halves[0], halves[1]],
        node_cache=node_cache,
        gateway_args=[
            "--route-ttl-s",
            "1",
            "--check-fraction",
            str(check_fraction),
            "--probation-checks",
            str(probation_checks),
            *extra_gateway_args,
        ],
        node_args=["--no-benchmark"],
        # Every node here announces from 127.0.0.1: a host ban (the default for a liar's host) would
        # refuse the next liars and honest spares alike. The key ban stays.
        # A node on probation costs routing 1 s more by default, so trusted nodes take the traffic and
        # a new liar may get none: here it competes on its merits, so what is measured is how fast
        # spot checks catch a liar that serves.
        tracker_args=["--ban-host-s", "0", "--probation-penalty-ms", "0"],
        quiet=quiet,
    )
    return LiarSwarm(swarm, model, node_cache, halves)


def metric(base: str, name: str, **labels: str) -> float:
    """One sample of the Prometheus text at ``base/metrics`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    key = f"{name}{{{want}}}" if labels else name
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line.startswith(key + " "):
            return float(line.split()[-1])
    return 0.0


@dataclass
class Answer:
    text: str
    ttft_s: float  # seconds to the first content
    total_s: float
    completion_tokens: int  # as the gateway counted them (usage)


def chat(client: openai.OpenAI, model: str, question: str, n_new: int) -> Answer:
    """One greedy streamed chat, timed."""
    t0 = time.perf_counter()
    first = 0.0
    tokens = 0
    stream = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": question}],
        max_tokens=n_new,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    parts: list[str] = []
    for chunk in stream:
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        if chunk.choices and chunk.choices[0].delta.content:
            if not parts:
                first = time.perf_counter() - t0
            parts.append(chunk.choices[0].delta.content)
    return Answer("".join(parts), first, time.perf_counter() - t0, tokens)


def verdicts(gateway: Service) -> list[dict]:
    """The gateway's ``spot_check_verdict`` log events."""
    lines = gateway.log_text().splitlines()
    return [json.loads(line) for line in lines if '"spot_check_verdict"' in line]


@dataclass
class Detection:
    kind: str
    node_id: str
    requests: int  # sent until the liar was caught (every answer checked against the reference)
    through_liar: int  # sessions the liar accepted a route ticket for meanwhile (it served them)
    caught: bool
    wrong_answers: int
    seconds: float
    verdict: dict | None


def requests_until_caught(
    ls: LiarSwarm,
    liar: Service,
    kind: str,
    questions: Sequence[str],
    expected: Callable[[str], str],
    *,
    n_new: int,
    max_requests: int,
    concurrency: int = 2,
) -> Detection:
    """Send ``questions`` round-robin, ``concurrency`` at a time, until the gateway names the liar.

    Every answer is compared with ``expected(question)``; a wrong one is counted, never hidden.
    """
    node_id = liar.extra["node_id"]
    client = ls.client()
    base = ls.gateway_url
    liar_base = f"http://127.0.0.1:{liar.admin_port}"
    served_before = metric(liar_base, "swarm_node_tickets_total", outcome="accepted")
    caught_before = metric(base, "swarm_gateway_checks_total", outcome="liar_caught")
    sent = wrong = 0
    t0 = time.perf_counter()
    found: dict | None = None
    with ThreadPoolExecutor(concurrency) as pool:
        while sent < max_requests and found is None:
            batch = [questions[(sent + i) % len(questions)] for i in range(concurrency)]
            sent += len(batch)
            answers = list(pool.map(lambda q: chat(client, ls.swarm.model_name, q, n_new).text, batch))
            wrong += sum(a != expected(q) for q, a in zip(batch, answers, strict=True))
            if metric(base, "swarm_gateway_checks_total", outcome="liar_caught") > caught_before:
                found = next((v for v in verdicts(ls.swarm.gateway) if v.get("liar") == node_id), None)
                if found is None:  # someone else was named: keep the evidence visible
                    found = {"unexpected": verdicts(ls.swarm.gateway)}
    return Detection(
        kind,
        node_id,
        sent,
        int(metric(liar_base, "swarm_node_tickets_total", outcome="accepted") - served_before),
        found is not None and found.get("liar") == node_id,
        wrong,
        time.perf_counter() - t0,
        found,
    )

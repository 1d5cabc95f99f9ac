"""The data plane on an emulated WAN: direct push vs the gateway relay, pipelined prefill, encodings.

    sudo .venv/bin/python -m sim.bench_wan [--parts decode,prefill,encodings] [--out FILE.json]

Three nodes hold the test model's layers [0,10), [10,20), [20,30), each in its
own network namespace of the emulated WAN (``sim/wan``, real kernel TCP with
user-space delays); the client host runs the gateway's own Route Session code
(``sim.route_client``, the code ``swarm-gateway`` runs) and, for the compute
floor, the same three shards in-process. Everything of one part runs side by
side in one run, in rounds whose order rotates.

* ``decode`` (profiles ``link-10ms`` and ``link-25ms``: every host-to-host hop
  10 / 25 ms one way): time per token and TTFT, direct push vs relay. The
  bound for push is compute + the one-way delays around the ring (stage 0 ->
  1 -> 2 -> 0: three hops); relay pays gateway -> stage -> gateway per stage
  (six one-way delays).
* ``prefill`` (``link-10ms``): TTFT of a 2000-token prompt with the prefill
  pipelined (4 steps of 256 in flight) vs one step at a time through every
  stage (``prefill_pipeline_steps=1``).
* ``encodings`` (``link-20mbit``: 20 Mbit/s per host, 5 ms one way): decode
  tok/s and the 2000-token TTFT with f32, f16 and int8-block activations; and
  the top-1 agreement with f32 over 512 greedy positions, teacher-forced
  in-process (the f32 sequence is fed to every setup, only the hidden states
  between stages are encoded and decoded), so the figure is the encoding's
  effect alone.

* ``spec`` (profiles as ``decode``): speculative decoding (docs/protocol.md,
  Speculation) against plain decoding on the same route, direct push, for two
  prompt classes: ``edit`` (the continuation copies text given in the
  prompt) and ``chat`` (novel text); time per token against the ring bound
  (in-process compute + three one-way delays), tokens per pass, same tokens.
  With ``--proposers ngram,draft,draft-always`` another route of three nodes
  per draft mode, started with ``--draft-model`` (a Q4_0 copy of the test
  model made with llama.cpp's quantizer) and ``--draft-model-choice auto`` /
  ``always``, runs in the same WAN, and its speculating requests take their
  turn beside plain decoding and n-gram drafts. ``ngram-flight`` and
  ``draft-always-flight`` are the same with windows in flight: routes whose
  nodes run ``--speculate-windows-in-flight`` ``--windows`` (default 2).
  ``draft-always-due`` and ``draft-always-flight-due`` are the two draft
  modes with ``--no-draft-lookahead`` (each window drafted only when it is
  due, not while the one before travels): the look-ahead's baseline.

Needs root (network namespaces); says why and exits 2 without.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

SPANS = ((0, 10), (10, 20), (20, 30))
PROMPT = "The three most important inventions of the last century are"
EDIT_PROMPT = (
    "Original code:\n\ndef add(a, b):\n    return a + b\n\n\ndef sub(a, b):\n    return a - b\n\n\n"
    "def mul(a, b):\n    return a * b\n\n\nThe same code, copied exactly:\n\ndef add(a, b):\n"
)
SESSION_KV = 2560


class InProcess:
    """The three shards in this process, stepped in lock step: the compute floor."""

    def __init__(self, model: Path, cache: Path) -> None:
        from node.engine import EngineConfig, ShardEngine
        from node.shard import extract_shard

        config = EngineConfig(threads=1, max_sessions=2, session_kv_tokens=SESSION_KV, batch_tokens=256)
        self.engines = [ShardEngine(extract_shard(model, a, b, cache), config, cache) for a, b in SPANS]
        self.pos = 0

    def reset(self) -> None:
        for engine in self.engines:
            if engine.has_session("bench"):
                engine.release("bench")
            engine.open_session("bench")
        self.pos = 0

    def step(self, tokens: list[int], transform: Any = None) -> int:
        from node.engine import Work

        hidden = None
        out = None
        for i, engine in enumerate(self.engines):
            last = i == len(self.engines) - 1
            work = (
                Work("bench", self.pos, tokens=np.asarray(tokens, dtype=np.int32))
                if i == 0
                else Work("bench", self.pos, hidden=hidden, sample=last)
            )
            (out,) = engine.step([work])
            if not last:
                hidden = out.hidden if transform is None else transform(out.hidden)
        self.pos += len(tokens)
        assert out is not None and out.sampled is not None
        return int(out.sampled.token_id)

    def decode_ms(self, prompt: list[int], n_new: int) -> float:
        self.reset()
        tokens = [self.step(prompt)]
        t0 = time.perf_counter()
        while len(tokens) < n_new:
            tokens.append(self.step([tokens[-1]]))
        return (time.perf_counter() - t0) * 1e3 / (n_new - 1)

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _codec_roundtrip(encoding: Any) -> Any:
    from proto import tensor_codec

    def transform(hidden: np.ndarray) -> np.ndarray:
        tensor = tensor_codec.encode_tensor("hidden", hidden, encoding)
        return tensor_codec.decode_tensor(tensor, 1 << 30)

    return transform


def agreement(model: Path, cache: Path, prompt: list[int], n: int) -> dict[str, float]:
    """Top-1 agreement with f32, teacher-forced on the f32 greedy sequence (in-process)."""
    from proto.swarm.v1 import frame_pb2

    inproc = InProcess(model, cache)
    try:
        inproc.reset()
        reference = [inproc.step(prompt)]
        while len(reference) < n:
            reference.append(inproc.step([reference[-1]]))
        out = {"f32": 1.0}
        for name, enc in (("f16", frame_pb2.ENCODING_F16), ("int8", frame_pb2.ENCODING_INT8_BLOCK)):
            transform = _codec_roundtrip(enc)
            inproc.reset()
            same = int(inproc.step(prompt, transform) == reference[0])
            for i in range(1, n):
                same += int(inproc.step([reference[i - 1]], transform) == reference[i])
            out[name] = same / n
        return out
    finally:
        inproc.close()


def _swarm(
    profile_name: str,
    workdir: Path,
    model: Path,
    cache: Path,
    routes: tuple[list[str], ...] = (),
) -> tuple[Any, Any, list[str]]:
    """Three nodes in the WAN; three more per ``routes`` entry, started with its extra arguments."""
    from sim.procs import Supervisor
    from sim.wan import WanEmulator, load_profile

    profile = load_profile(profile_name)
    region = next(iter(profile.regions))
    spans = list(SPANS) * (1 + len(routes))
    hosts = {"client": region, **{f"node{i + 1}": region for i in range(len(spans))}}
    wan = WanEmulator(profile, hosts)
    wan.start()
    sup = Supervisor(workdir, place=wan.argv)
    addresses = []
    try:
        for i, (a, b) in enumerate(spans):
            name = f"node{i + 1}"
            drafting = routes[i // len(SPANS) - 1] if i >= len(SPANS) else []
            node = sup.start_node(
                name,
                model=model,
                layers=f"{a}:{b}",
                tracker_url=None,
                host=wan.address(name),
                session_kv_tokens=SESSION_KV,
                max_sessions=4,
                cache_dir=cache,
                extra_args=["--no-benchmark", "--batch-tokens", "256", "--log-level", "warning", *drafting],
            )
            node.wait_port(300)
            addresses.append(f"{wan.address(name)}:{node.port}")
    except BaseException:
        sup.stop_all()
        wan.close()
        raise
    return wan, sup, addresses


def _in_client(wan: Any, fn: Any) -> Any:
    """Run an async benchmark body inside the client host, with the grpc runtime open."""
    import trio

    from common.grpc_adapter import open_grpc
    from gateway.grpc_bridge import NodeChannels

    async def main() -> Any:
        async with open_grpc() as grpc_rt:
            return await fn(NodeChannels(grpc_rt, max_frame_bytes=4 * 1024 * 1024, allow_plaintext=True))

    return wan.call("client", trio.run, main)


def part_decode(
    model: Path, cache: Path, prompt: list[int], n_new: int, rounds: int, profiles: list[str]
) -> dict[str, Any]:
    from gateway.route_session import DataPlane
    from sim.route_client import generate, route_on
    from sim.wan import load_profile

    out: dict[str, Any] = {}
    for profile_name in profiles:
        one_way_ms = max(p.delay_ms for p in load_profile(profile_name).paths.values())
        with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
            wan, sup, addresses = _swarm(profile_name, Path(tmp), model, cache)
            try:
                inproc = InProcess(model, cache)

                async def body(
                    channels: Any, addresses: list[str] = addresses, inproc: InProcess = inproc
                ) -> dict[str, Any]:
                    route, stages = await route_on(channels, addresses)
                    planes = {"push": DataPlane(push=True), "relay": DataPlane(push=False)}
                    for plane in planes.values():
                        await generate(channels, route, stages, prompt, 4, plane=plane)
                    got: dict[str, dict[str, list[float]]] = {
                        n: {"per_token_ms": [], "ttft_ms": []} for n in ("in-process", *planes)
                    }
                    tokens: dict[str, list[int]] = {}
                    names = ["in-process", "push", "relay"]
                    for r in range(rounds):
                        for name in names[r % 3 :] + names[: r % 3]:
                            if name == "in-process":
                                got[name]["per_token_ms"].append(inproc.decode_ms(prompt, n_new))
                                continue
                            gen = await generate(channels, route, stages, prompt, n_new, plane=planes[name])
                            tokens.setdefault(name, gen.tokens)
                            span = gen.arrivals_s[-1] - gen.arrivals_s[0]
                            got[name]["per_token_ms"].append(span * 1e3 / (len(gen.tokens) - 1))
                            got[name]["ttft_ms"].append(gen.ttft_s * 1e3)
                    return {"samples": got, "same_tokens": tokens.get("push") == tokens.get("relay")}

                measured = _in_client(wan, body)
                inproc.close()
            finally:
                sup.stop_all()
                wan.close()
        med = {
            n: {k: statistics.median(v) for k, v in d.items() if v} for n, d in measured["samples"].items()
        }
        compute = med["in-process"]["per_token_ms"]
        bound = compute + len(SPANS) * one_way_ms
        out[profile_name] = {
            "one_way_ms": one_way_ms,
            "median": med,
            "bound_push_ms": bound,
            "push_over_bound": med["push"]["per_token_ms"] / bound,
            "relay_over_push": med["relay"]["per_token_ms"] / med["push"]["per_token_ms"],
            "same_tokens": measured["same_tokens"],
            "samples": measured["samples"],
        }
    return out


def part_spec(
    model: Path,
    cache: Path,
    prompts: dict[str, list[int]],
    n_new: int,
    rounds: int,
    profiles: list[str],
    draft: Path | None = None,
    draft_modes: tuple[str, ...] = (),
    windows: int = 2,
) -> dict[str, Any]:
    """Plain decoding, n-gram drafts ("spec") and, each on a route of its own, draft-model drafts
    ("draft": nodes that choose per session, "draft-always": nodes that always draft with it) and
    windows in flight ("ngram-flight", "draft-always-flight": ``windows`` at once), in turns whose
    order rotates."""
    flight = ["--speculate-windows-in-flight", str(windows)]
    model_args = [] if draft is None else ["--draft-model", str(draft), "--draft-model-choice"]
    route_args = {
        "draft": [*model_args, "auto"],
        "draft-always": [*model_args, "always"],
        "ngram-flight": flight,
        "draft-always-flight": [*model_args, "always", *flight],
        # The draft model's look-ahead off: each window drafted only when it is due (the baseline of it).
        "draft-always-due": [*model_args, "always", "--no-draft-lookahead"],
        "draft-always-flight-due": [*model_args, "always", *flight, "--no-draft-lookahead"],
    }
    if draft is None and any(m.startswith("draft") for m in draft_modes):
        raise ValueError("draft modes need a draft model")
    from gateway.route_session import DataPlane
    from sim.route_client import generate, route_on
    from sim.wan import load_profile

    out: dict[str, Any] = {}
    plane = DataPlane(push=True)
    for profile_name in profiles:
        one_way_ms = max(p.delay_ms for p in load_profile(profile_name).paths.values())
        with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
            extra = tuple(route_args[m] for m in draft_modes)
            wan, sup, addresses = _swarm(profile_name, Path(tmp), model, cache, extra)
            try:
                inproc = InProcess(model, cache)

                async def body(
                    channels: Any, addresses: list[str] = addresses, inproc: InProcess = inproc
                ) -> dict[str, Any]:
                    routes = {"plain": await route_on(channels, addresses[: len(SPANS)])}
                    routes["spec"] = routes["plain"]
                    for j, mode in enumerate(draft_modes):
                        at = (j + 1) * len(SPANS)
                        routes[mode] = await route_on(channels, addresses[at : at + len(SPANS)])
                    for route, stages in {id(r): r for r in routes.values()}.values():
                        await generate(channels, route, stages, prompts["chat"], 4, plane=plane)
                    modes = list(routes)
                    got: dict[str, Any] = {}
                    for cls, prompt in prompts.items():
                        per: dict[str, list[float]] = {"in-process": [], **{m: [] for m in modes}}
                        tokens: dict[str, list[int]] = {}
                        for r in range(rounds):
                            per["in-process"].append(inproc.decode_ms(prompt, n_new))
                            for name in modes[r % len(modes) :] + modes[: r % len(modes)]:
                                route, stages = routes[name]
                                gen = await generate(
                                    channels,
                                    route,
                                    stages,
                                    prompt,
                                    n_new,
                                    plane=plane,
                                    max_drafts=0 if name == "plain" else 8,
                                )
                                tokens.setdefault(name, gen.tokens)
                                span = gen.arrivals_s[-1] - gen.arrivals_s[0]
                                per[name].append(span * 1e3 / (len(gen.tokens) - 1))
                                if name != "plain":
                                    # Tokens arriving together came from one window: passes = bursts.
                                    bursts = 1 + sum(
                                        1
                                        for a, b in zip(gen.arrivals_s, gen.arrivals_s[1:], strict=False)
                                        if b - a > 1e-3
                                    )
                                    key = "tokens_per_pass" if name == "spec" else f"{name}_tokens_per_pass"
                                    per.setdefault(key, []).append(len(gen.tokens) / bursts)
                        same = all(tokens[m] == tokens["plain"] for m in modes)
                        got[cls] = {"samples": per, "same_tokens": same}
                    return got

                measured = _in_client(wan, body)
                inproc.close()
            finally:
                sup.stop_all()
                wan.close()
        res: dict[str, Any] = {"one_way_ms": one_way_ms}
        for cls, m in measured.items():
            med = {k: statistics.median(v) for k, v in m["samples"].items()}
            bound = med["in-process"] + len(SPANS) * one_way_ms
            res[cls] = {
                "median": med,
                "bound_ms": bound,
                "plain_over_bound": med["plain"] / bound,
                "spec_over_bound": med["spec"] / bound,
                "spec_over_plain": med["spec"] / med["plain"],
                **{
                    f"{mode}_over_{what}": med[mode] / ref
                    for mode in draft_modes
                    for what, ref in (("bound", bound), ("plain", med["plain"]))
                },
                "same_tokens": m["same_tokens"],
                "samples": m["samples"],
            }
        out[profile_name] = res
    return out


def part_prefill(model: Path, cache: Path, prompt: list[int], rounds: int, profile: str) -> dict[str, Any]:
    from gateway.route_session import DataPlane
    from sim.route_client import generate, route_on

    with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
        wan, sup, addresses = _swarm(profile, Path(tmp), model, cache)
        try:

            async def body(channels: Any) -> dict[str, list[float]]:
                route, stages = await route_on(channels, addresses)
                planes = {
                    "pipelined": DataPlane(push=True, prefill_pipeline_steps=4),
                    "one_after_the_other": DataPlane(push=True, prefill_pipeline_steps=1),
                }
                await generate(channels, route, stages, prompt[:300], 2, plane=planes["pipelined"])
                got: dict[str, list[float]] = {n: [] for n in planes}
                names = list(planes)
                for r in range(rounds):
                    for name in names[r % 2 :] + names[: r % 2]:
                        gen = await generate(
                            channels, route, stages, prompt, 2, plane=planes[name], step_tokens=256
                        )
                        got[name].append(gen.ttft_s * 1e3)
                return got

            got = _in_client(wan, body)
        finally:
            sup.stop_all()
            wan.close()
    med = {n: statistics.median(v) for n, v in got.items()}
    return {
        "profile": profile,
        "prompt_tokens": len(prompt),
        "step_tokens": 256,
        "ttft_ms": med,
        "ratio": med["pipelined"] / med["one_after_the_other"],
        "samples": got,
    }


def part_encodings(
    model: Path, cache: Path, prompt: list[int], long_prompt: list[int], n_new: int, rounds: int
) -> dict[str, Any]:
    from gateway.route_session import DataPlane
    from proto.swarm.v1 import frame_pb2
    from sim.route_client import generate, route_on

    encodings = {
        "f32": frame_pb2.ENCODING_F32,
        "f16": frame_pb2.ENCODING_F16,
        "int8": frame_pb2.ENCODING_INT8_BLOCK,
    }
    with tempfile.TemporaryDirectory(prefix="bench-wan-") as tmp:
        wan, sup, addresses = _swarm("link-20mbit", Path(tmp), model, cache)
        try:

            async def body(channels: Any) -> dict[str, dict[str, list[float]]]:
                route, stages = await route_on(channels, addresses)
                got: dict[str, dict[str, list[float]]] = {
                    n: {"tok_s": [], "ttft_long_ms": []} for n in encodings
                }
                names = list(encodings)
                for r in range(rounds):
                    for name in names[r % 3 :] + names[: r % 3]:
                        plane = DataPlane(push=True, encoding=encodings[name])
                        gen = await generate(channels, route, stages, prompt, n_new, plane=plane)
                        span = gen.arrivals_s[-1] - gen.arrivals_s[0]
                        got[name]["tok_s"].append((len(gen.tokens) - 1) / span)
                        long = await generate(channels, route, stages, long_prompt, 2, plane=plane)
                        got[name]["ttft_long_ms"].append(long.ttft_s * 1e3)
                return got

            got = _in_client(wan, body)
        finally:
            sup.stop_all()
            wan.close()
    med = {n: {k: statistics.median(v) for k, v in d.items()} for n, d in got.items()}
    return {"profile": "link-20mbit", "median": med, "samples": got}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", default="decode,prefill,encodings")
    parser.add_argument("--profiles", default="link-10ms,link-25ms", help="decode part's profiles")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prefill-tokens", type=int, default=2000)
    parser.add_argument("--agreement-tokens", type=int, default=512)
    parser.add_argument(
        "--proposers",
        default="ngram",
        help="spec part: ngram, and any of draft, draft-always, ngram-flight, draft-always-flight, "
        "draft-always-due, draft-always-flight-due (commas)",
    )
    parser.add_argument("--windows", type=int, default=2, help="spec part: windows in flight of *-flight")
    parser.add_argument("--out", type=Path, default=Path("bench-results/wan-data-plane.json"))
    args = parser.parse_args(argv)

    from sim.wan.support import unavailable_reason

    reason = unavailable_reason()
    if reason is not None:
        print(f"bench_wan: the emulated WAN is unavailable here: {reason}", file=sys.stderr)
        return 2
    from common.vocab import Vocabulary
    from node.testmodel import test_model_path

    model = test_model_path()
    with Vocabulary(model) as vocab:
        prompt = vocab.tokenize(PROMPT, add_special=True)
        filler = vocab.tokenize(
            " ".join(["The history of science is a long story of questions and answers."] * 200)
        )
        edit_prompt = vocab.tokenize(EDIT_PROMPT, add_special=True)
    long_prompt = (prompt + filler)[: args.prefill_tokens]
    parts = [p for p in args.parts.split(",") if p]
    result: dict[str, Any] = {"benchmark": "bench_wan", "spans": SPANS, "parts": {}}
    with tempfile.TemporaryDirectory(prefix="bench-wan-cache-") as cache_dir:
        cache = Path(cache_dir)
        if "decode" in parts:
            decode = part_decode(model, cache, prompt, args.tokens, args.rounds, args.profiles.split(","))
            result["parts"]["decode"] = decode
            print("decode, 3 stages, greedy, median per token (ms) and TTFT (ms):")
            for name, d in decode.items():
                m = d["median"]
                print(
                    f"  {name}: in-process {m['in-process']['per_token_ms']:.1f} | "
                    f"push {m['push']['per_token_ms']:.1f} "
                    f"(TTFT {m['push']['ttft_ms']:.0f}) | relay {m['relay']['per_token_ms']:.1f} "
                    f"(TTFT {m['relay']['ttft_ms']:.0f}) | bound {d['bound_push_ms']:.1f} -> push/bound "
                    f"{d['push_over_bound']:.2f}, relay/push {d['relay_over_push']:.2f}, "
                    f"same tokens {d['same_tokens']}"
                )
        if "spec" in parts:
            draft = None
            modes = (
                "draft",
                "draft-always",
                "ngram-flight",
                "draft-always-flight",
                "draft-always-due",
                "draft-always-flight-due",
            )
            draft_modes = tuple(m for m in modes if m in args.proposers.split(","))
            if any(m.startswith("draft") for m in draft_modes):
                from node.draft_model import quantize

                draft = quantize(model, cache / "draft-q4_0.gguf", "q4_0")
            spec = part_spec(
                model,
                cache,
                {"edit": edit_prompt, "chat": prompt},
                args.tokens,
                args.rounds,
                args.profiles.split(","),
                draft,
                draft_modes,
                args.windows,
            )
            result["parts"]["spec"] = spec
            result["windows_in_flight"] = args.windows
            print("speculative decoding, 3 stages, greedy, median ms per token:")
            for name, d in spec.items():
                for cls in ("edit", "chat"):
                    c = d[cls]
                    m = c["median"]
                    print(
                        f"  {name} {cls}: in-process {m['in-process']:.1f} | plain {m['plain']:.1f} | "
                        f"spec {m['spec']:.1f} ({m['tokens_per_pass']:.2f} tokens per pass) | bound "
                        f"{c['bound_ms']:.1f} -> spec/bound {c['spec_over_bound']:.2f}, spec/plain "
                        f"{c['spec_over_plain']:.2f}, same tokens {c['same_tokens']}"
                    )
                    for mode in draft_modes:
                        print(
                            f"  {name} {cls}: {mode} {m[mode]:.1f} "
                            f"({m[mode + '_tokens_per_pass']:.2f} tokens per pass) -> {mode}/bound "
                            f"{c[mode + '_over_bound']:.2f}, {mode}/plain {c[mode + '_over_plain']:.2f}"
                        )
        if "prefill" in parts:
            prefill = part_prefill(model, cache, long_prompt, args.rounds, "link-10ms")
            result["parts"]["prefill"] = prefill
            t = prefill["ttft_ms"]
            print(
                f"prefill of {len(long_prompt)} tokens on link-10ms: pipelined {t['pipelined']:.0f} ms, "
                f"one after the other {t['one_after_the_other']:.0f} ms, ratio {prefill['ratio']:.2f}"
            )
        if "encodings" in parts:
            enc = part_encodings(model, cache, prompt, long_prompt, args.tokens, args.rounds)
            enc["agreement_top1"] = agreement(model, cache, prompt, args.agreement_tokens)
            result["parts"]["encodings"] = enc
            print("encodings on link-20mbit (20 Mbit/s per host, 5 ms):")
            for name, m in enc["median"].items():
                print(
                    f"  {name}: decode {m['tok_s']:.1f} tok/s, TTFT of {len(long_prompt)} tokens "
                    f"{m['ttft_long_ms']:.0f} ms, top-1 agreement with f32 over {args.agreement_tokens}: "
                    f"{enc['agreement_top1'][name]:.4f}"
                )
    result["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
    }
    result["time"] = time.time()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""``swarm-sim up``: a real swarm on this machine -- tracker, nodes and gateway as separate processes.

Placement is the tracker's: unless ``--layers`` is given, nodes start one
after another with ``--layers auto`` and take the span the tracker
recommends (so N nodes split the model, and spare nodes double the weakest
spans). Readiness comes from each service's health endpoint.

Stopping (docs/concurrency.md, "Signals and shutdown"): SIGINT (Ctrl-C),
SIGTERM and SIGHUP (the terminal closed), from whoever, while starting or
serving, stop every service it started, newest first (:meth:`Supervisor.stop_all`:
SIGTERM, SIGKILL after the grace period); a second one kills the rest at once.
If the launcher itself dies without stopping them (SIGKILL), every service gets
SIGTERM from the kernel (a parent-death signal, sim/procs.py) and stops itself.

With ``--wan PROFILE`` (``wan_profile=`` from code) the same swarm runs on an
emulated WAN (``sim/wan``, docs/wan.md): the tracker, the gateway and each node
in its own network namespace, bound to its 10.77.h.2 address, with the
profile's delays, loss and rate limits between them. The OpenAI endpoint and
the tracker are then reached through loopback forwarders that enter the WAN at
the profile's ``client`` host, so ``base_url`` and ``tracker_url`` work from
this namespace as before; ``LocalSwarm.wan`` is the emulator (live link
changes, ``wan.call(name, fn)`` to reach a node's admin port from inside it).
"""

from __future__ import annotations

import json
import math
import signal
import ssl
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import click
import httpx

from common.keyfile import load_or_create_key_file
from common.tls import fingerprint_pem
from node.identity import KEY_FILE as NODE_KEY_FILE
from node.testmodel import TestModelMissing, test_model_path
from proto.signing import public_key_hex
from sim.procs import LaunchError, Service, Supervisor, trust_only, wait_http
from sim.wan.emulator import WanEmulator
from sim.wan.errors import WanError
from sim.wan.profile import WanProfile, load_profile
from tracker.config import TLS_CERT_FILE as TRACKER_CERT_FILE

T = TypeVar("T")
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Stopped(KeyboardInterrupt):
    """Raised in the main thread by a stop signal (a KeyboardInterrupt, so :meth:`Supervisor.stop_all`
    kills the rest at once when a second one comes while it stops them)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _raise_stopped(signum: int, _frame: object) -> None:
    raise Stopped(signum)


def _tell(text: str) -> None:
    """A line on stderr; nothing when the terminal is gone (SIGHUP: writes fail), so stopping goes on."""
    try:
        click.echo(text, err=True)
    except OSError:
        pass


@dataclass
class LocalSwarm:
    supervisor: Supervisor
    tracker: Service
    nodes: list[Service]
    gateway: Service
    model_name: str
    wan: WanEmulator | None = None  # the emulated WAN the services run on (None: loopback)
    public_tracker_url: str | None = None  # on a WAN: the loopback forwarders into it
    public_base_url: str | None = None
    # With relayed nodes: the gateway flags that keep its certificate and HTTPS port (the nodes pin the
    # certificate and dial that port), for a test that restarts the gateway.
    gateway_tls_args: tuple[str, ...] = ()
    # With tracker_tls: the sha256 of the tracker's self-signed certificate, which nodes and gateway pin.
    tracker_tls_fingerprint: str = ""
    # With relayed nodes: the node flags that reach the gateway's relay (its URL and certificate pin).
    relay_args: tuple[str, ...] = ()

    @property
    def tracker_url(self) -> str:
        scheme = "https" if self.tracker_tls_fingerprint else "http"
        return self.public_tracker_url or f"{scheme}://127.0.0.1:{self.tracker.port}"

    @property
    def tracker_verify(self) -> ssl.SSLContext | bool:
        """What an httpx call to :attr:`tracker_url` verifies with (``httpx.get(..., verify=...)``)."""
        if not self.tracker_tls_fingerprint or self.tracker.data_dir is None:
            return True
        return trust_only(self.tracker.data_dir / TRACKER_CERT_FILE)

    @property
    def base_url(self) -> str:
        return self.public_base_url or f"http://127.0.0.1:{self.gateway.port}/v1"

    def stop(self) -> None:
        try:
            self.supervisor.stop_all()
        finally:
            if self.wan is not None:
                self.wan.close()


class _Network:
    """Where the services live: all on this namespace's loopback, or each in its WAN host."""

    def __init__(self, wan: WanEmulator | None) -> None:
        self.wan = wan

    def addr(self, service: str) -> str:
        return self.wan.address(service) if self.wan else "127.0.0.1"

    def probe(self, service: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """Call ``fn`` from where ``service`` is (its namespace on a WAN: its 127.0.0.1 is there)."""
        return self.wan.call(service, fn, *args, **kwargs) if self.wan else fn(*args, **kwargs)


def _say(quiet: bool, text: str) -> None:
    if not quiet:
        click.echo(text, err=True)


def _wait_announced(
    tracker_url: str,
    node: Service,
    timeout_s: float,
    net: _Network | None = None,
    verify: ssl.SSLContext | bool = True,
) -> dict:
    """Wait until the tracker lists this node as live; return its swarm entry.

    A relayed node announces no address, so nodes are matched by their id (admin /healthz)."""
    net = net or _Network(None)
    healthz = f"http://127.0.0.1:{node.admin_port}/healthz"
    node_id = net.probe(node.name, wait_http, node, healthz, timeout_s).json()["node_id"]
    node.extra["node_id"] = node_id

    def mine(n: dict) -> bool:
        return n.get("node_id") == node_id

    def announced(resp: httpx.Response) -> bool:
        if resp.status_code != 200:
            return False
        return any(n.get("state") == "live" and mine(n) for n in resp.json().get("nodes", []))

    resp = net.probe(
        node.name, wait_http, node, f"{tracker_url}/v1/swarm", timeout_s, ok=announced, verify=verify
    )
    return next(n for n in resp.json()["nodes"] if mine(n))


def _gateway_tls(workdir: Path) -> tuple[list[str], Path, str]:
    """A self-signed certificate for the gateway's relay: (gateway flags, its HTTPS port file, the pin)."""
    from common.files import write_atomic_sync
    from common.tls import generate_self_signed

    cert = generate_self_signed()
    where = workdir / "gateway-tls"
    where.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_atomic_sync(where / "gateway.crt", cert.cert_pem)
    write_atomic_sync(where / "gateway.key", cert.key_pem, mode=0o600)
    port_file = where / "tls-port"
    args = [
        *("--tls-cert-file", str(where / "gateway.crt"), "--tls-key-file", str(where / "gateway.key")),
        *("--tls-port", "0", "--tls-port-file", str(port_file)),
    ]
    return args, port_file, cert.fingerprint


def _read_port(path: Path, svc: Service, timeout_s: float) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.is_file() else ""
        if text.isdigit():
            return int(text)
        if not svc.alive():
            raise LaunchError(f"{svc.name} exited with code {svc.proc.returncode}:\n{svc.log_tail()}")
        time.sleep(0.1)
    raise LaunchError(f"{svc.name} wrote no port to {path} within {timeout_s:g} s")


def start_local_swarm(
    workdir: Path,
    *,
    model: Path,
    n_nodes: int = 2,
    spare: int = 0,
    layers: list[str] | None = None,
    threads: int = 1,
    gateway_port: int = 0,
    max_sessions: int = 8,
    session_kv_tokens: int = 2048,
    node_cache: Path | None = None,
    gateway_args: list[str] | None = None,
    node_args: list[str] | None = None,
    tracker_args: list[str] | None = None,
    timeout_s: float = 120.0,
    quiet: bool = True,
    relay_nodes: int = 0,
    relay_indices: list[int] | None = None,
    wan_profile: WanProfile | None = None,
    register_gateway: bool = False,
    tracker_tls: bool = False,
    register_model: bool = False,
    trust_nodes: bool = False,
) -> LocalSwarm:
    """Start tracker, nodes and gateway; return once the gateway can route the model.

    ``register_gateway``: create the gateway's key first and start the tracker with it as its one
    registered gateway (``--registered-gateways``), as an operator exposing a swarm would: route
    tickets then go to that gateway only and name it (docs/tracker.md, Route tickets).

    ``register_model``: register ``model`` with the tracker before any node starts (``swarm-tracker
    model add``, the operator's path): its name then resolves to its fingerprint only.

    ``relay_nodes`` K: the last K nodes start with ``--relay`` pointed at the gateway (they accept no
    connections and are reached over their WebSocket); ``relay_indices`` picks them by index instead.
    The gateway then starts before the nodes, since relayed nodes dial it.

    ``wan_profile``: run on an emulated WAN placed by ``wan_profile.place(n_nodes + spare)``
    (needs root; :class:`sim.wan.WanUnavailable` says why not). ``gateway_port`` is then the
    loopback port of the forwarder to the gateway; the services bind any port inside the WAN.

    ``trust_nodes``: create every node's key first and start the tracker with them as its
    ``--trusted-nodes`` (the operator's own nodes: off probation from their first announce, the
    reference for newcomers' challenges; docs/security.md, section 3).

    ``tracker_tls``: the tracker serves HTTPS with the self-signed certificate it makes on first start
    (``--tls-self-signed``); the nodes and the gateway pin it (``--tracker-tls-fingerprint``).
    """
    total = n_nodes + spare
    relayed = set(relay_indices if relay_indices is not None else range(total - relay_nodes, total))
    if relay_nodes < 0 or relay_nodes > total or any(not 0 <= i < total for i in relayed):
        raise LaunchError(f"relayed nodes must be among the {total} nodes")
    wan: WanEmulator | None = None
    if wan_profile is not None:
        wan = WanEmulator(wan_profile, n_nodes=total)
        wan.start()
        where_hosts = ", ".join(f"{h.name} {h.address} ({h.region})" for h in wan.hosts.values())
        _say(quiet, f"  WAN      {wan_profile.name}: {where_hosts}")
    net = _Network(wan)
    inner_gateway_port = 0 if wan else gateway_port
    sup = Supervisor(workdir, place=wan.argv if wan else None)
    try:
        t0 = time.monotonic()
        if register_gateway:
            # The key the gateway will load from its data directory (Supervisor: <workdir>/gateway).
            gateway_key, _ = load_or_create_key_file(Path(workdir) / "gateway" / "gateway.key")
            tracker_args = [*(tracker_args or []), "--registered-gateways", public_key_hex(gateway_key)]
        if trust_nodes:
            # The keys the nodes will load from their data directories (Supervisor: <workdir>/nodeN).
            keys = [
                public_key_hex(load_or_create_key_file(Path(workdir) / f"node{i + 1}" / NODE_KEY_FILE)[0])
                for i in range(total)
            ]
            tracker_args = [*(tracker_args or []), "--trusted-nodes", ",".join(keys)]
        if tracker_tls:
            tracker_args = [*(tracker_args or []), "--tls-self-signed"]
        tracker = sup.start_tracker(host=net.addr("tracker"), extra_args=tracker_args)
        tracker.wait_port(timeout_s)
        tracker_pin, pin_args = "", []
        verify: ssl.SSLContext | bool = True
        if tracker_tls:
            assert tracker.data_dir is not None
            # Made before the tracker listens, so it is there once the port file is.
            cert = tracker.data_dir / TRACKER_CERT_FILE
            tracker_pin = fingerprint_pem(cert.read_bytes())
            pin_args, verify = ["--tracker-tls-fingerprint", tracker_pin], trust_only(cert)
        tracker_url = f"{'https' if tracker_tls else 'http'}://{net.addr('tracker')}:{tracker.port}"
        net.probe("tracker", wait_http, tracker, f"{tracker_url}/healthz", timeout_s, verify=verify)
        _say(quiet, f"  tracker  ready at {tracker_url}  (pid {tracker.pid})")
        if tracker_pin:
            _say(quiet, f"  tracker  TLS certificate sha256 {tracker_pin} (nodes and gateway pin it)")
        if trust_nodes:
            _say(quiet, f"  tracker  trusts this swarm's {total} node(s) from the start (--trusted-nodes)")
        if register_model:
            _register_model(model, tracker_url, Path(workdir) / "tracker", net, pin_args)
            _say(quiet, f"  tracker  registered {model.name}: its name resolves to its fingerprint only")
        gateway: Service | None = None
        relay_args: list[str] = []
        keep_tls: tuple[str, ...] = ()
        if relayed:
            # The relay over wss:// (docs/tls.md): the gateway gets a certificate and an HTTPS port
            # beside its plain one (clients on loopback keep http://); relayed nodes pin it.
            tls_args, tls_port_file, relay_pin = _gateway_tls(Path(workdir))
            gateway = sup.start_gateway(
                tracker_url=tracker_url,
                tracker_id=str(tracker.extra["tracker_id"]),  # what it checks route tickets with
                port=inner_gateway_port,
                host=net.addr("gateway"),
                extra_args=[*tls_args, *pin_args, *(gateway_args or [])],
            )
            gateway.wait_port(timeout_s)
            gw_first = f"http://{net.addr('gateway')}:{gateway.port}"
            net.probe("gateway", wait_http, gateway, f"{gw_first}/healthz", timeout_s)
            tls_port = _read_port(tls_port_file, gateway, timeout_s)
            keep_tls = (*tls_args[:4], "--tls-port", str(tls_port))
            relay_args = [
                *("--relay", f"https://{net.addr('gateway')}:{tls_port}"),
                *("--relay-tls-fingerprint", relay_pin),
            ]
            _say(
                quiet,
                f"  gateway  up at {gw_first}, relay at wss://...:{tls_port} (first: relayed nodes dial it)",
            )
        from node.shard import read_model_meta  # parses the GGUF once; the nodes reuse the cache

        cache = node_cache or (Path(workdir) / "node-cache")
        meta = read_model_meta(model, cache)
        capacity = math.ceil(meta.n_layers / max(1, n_nodes))
        nodes: list[Service] = []
        for i in range(total):
            span = layers[i] if layers and i < len(layers) else "auto"
            name = f"node{i + 1}"
            _say(
                quiet,
                f"  {name}    loading "
                f"{'layers ' + span if span != 'auto' else 'the span the tracker recommends'} ...",
            )
            node = sup.start_node(
                name,
                model=model,
                layers=span,
                tracker_url=tracker_url,
                threads=threads,
                capacity_layers=capacity if span == "auto" else None,
                max_sessions=max_sessions,
                session_kv_tokens=session_kv_tokens,
                cache_dir=cache,
                extra_args=[
                    *pin_args,
                    *(node_args or []),
                    *(relay_args if i in relayed else []),
                ],
                host=net.addr(name),
            )
            node.extra["relayed"] = i in relayed
            node.wait_port(timeout_s)
            net.probe(name, wait_http, node, f"http://127.0.0.1:{node.admin_port}/healthz", timeout_s)
            entry = _wait_announced(tracker_url, node, timeout_s, net, verify)
            shard = entry.get("shard") or {}
            node.extra["span"] = (shard.get("start"), shard.get("end"))
            where = "through the gateway's relay" if i in relayed else f"on {net.addr(name)}:{node.port}"
            _say(
                quiet,
                f"  {name}    serving layers [{shard.get('start')}, {shard.get('end')}) {where}"
                f"  ({shard.get('decode_ms_per_token', 0):.1f} ms/token, pid {node.pid})",
            )
            nodes.append(node)
        if gateway is None:
            gateway = sup.start_gateway(
                tracker_url=tracker_url,
                tracker_id=str(tracker.extra["tracker_id"]),  # what it checks route tickets with
                port=inner_gateway_port,
                host=net.addr("gateway"),
                extra_args=[*pin_args, *(gateway_args or [])],
            )
            gateway.wait_port(timeout_s)
        gw_url = f"http://{net.addr('gateway')}:{gateway.port}"
        net.probe("gateway", wait_http, gateway, f"{gw_url}/healthz", timeout_s)

        def routable(resp: httpx.Response) -> bool:
            return resp.status_code == 200 and any(
                m.get("fingerprint") == meta.fingerprint for m in resp.json().get("data", [])
            )

        models = net.probe(
            "gateway", wait_http, gateway, f"{gw_url}/v1/models", timeout_s, ok=routable
        ).json()
        name = next(m["id"] for m in models["data"] if m.get("fingerprint") == meta.fingerprint)
        _say(
            quiet,
            f"  gateway  ready at {gw_url}/v1  (pid {gateway.pid}; {time.monotonic() - t0:.1f} s in all)",
        )
        swarm = LocalSwarm(
            sup,
            tracker,
            nodes,
            gateway,
            name,
            gateway_tls_args=keep_tls,
            tracker_tls_fingerprint=tracker_pin,
            relay_args=tuple(relay_args),
        )
        if wan is not None:
            # Loopback forwarders into the WAN, entering at the profile's client host.
            swarm.wan = wan
            swarm.public_base_url = (
                f"http://127.0.0.1:{wan.forward('gateway', gateway.port, listen_port=gateway_port)}/v1"
            )
            scheme = "https" if tracker_tls else "http"
            swarm.public_tracker_url = f"{scheme}://127.0.0.1:{wan.forward('tracker', tracker.port)}"
            _say(quiet, f"  client   enters the WAN at {wan.address('client')}: {swarm.base_url}")
        return swarm
    except BaseException:
        try:
            sup.stop_all()
        finally:
            if wan is not None:
                wan.close()
        raise


def _register_model(
    model: Path, tracker_url: str, tracker_dir: Path, net: _Network, pin_args: list[str]
) -> None:
    """``swarm-tracker model add`` with the tracker's own key (what an operator runs)."""
    argv = [sys.executable, "-m", "tracker.cli", "model", "add", str(model)]
    argv += ["--tracker", tracker_url, "--data-dir", str(tracker_dir), *pin_args]
    done = net.probe("tracker", subprocess.run, argv, capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise LaunchError(f"registering {model.name} failed: {(done.stderr or done.stdout).strip()[-400:]}")


def _sample_request(base_url: str, model: str) -> tuple[str, dict]:
    body = {
        "model": model,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
        "max_tokens": 32,
        "temperature": 0,
    }
    curl = f"curl -s {base_url}/chat/completions -H 'Content-Type: application/json' -d '{json.dumps(body)}'"
    return curl, body


@click.command("up")
@click.option(
    "--nodes", "n_nodes", default=2, show_default=True, help="Nodes that split the model between them."
)
@click.option(
    "--spare", default=0, show_default=True, help="Extra nodes placed where coverage is weakest (redundancy)."
)
@click.option(
    "--relay-nodes", default=0, show_default=True, help="Nodes reached through the gateway's WebSocket relay."
)
@click.option(
    "--model",
    "model_path",
    type=click.Path(path_type=Path, exists=True, dir_okay=False),
    default=None,
    help="GGUF model (default: the bundled test model).",
)
@click.option(
    "--layers", default=None, help="Fixed spans instead of the tracker's placement, e.g. 0:15,15:30."
)
@click.option("--threads", default=1, show_default=True, help="llama.cpp threads per node.")
@click.option(
    "--port", "gateway_port", default=8000, show_default=True, help="Gateway port (0: any free port)."
)
@click.option(
    "--workdir",
    type=click.Path(path_type=Path, file_okay=False),
    default=None,
    help="Where keys, the tracker database and logs go (default: a new temporary directory).",
)
@click.option(
    "--check", is_flag=True, help="Send the sample request, print the answer, stop the swarm and exit."
)
@click.option(
    "--tracker-tls",
    is_flag=True,
    help="The tracker serves HTTPS with a self-signed certificate; nodes and gateway pin it.",
)
@click.option(
    "--wan",
    "wan",
    default=None,
    metavar="PROFILE",
    help="Run on an emulated WAN (root): a profile file or a bundled name "
    "(three-regions, link-10ms, link-25ms, link-20mbit). See docs/wan.md.",
)
def up(
    n_nodes: int,
    spare: int,
    relay_nodes: int,
    model_path: Path | None,
    layers: str | None,
    threads: int,
    gateway_port: int,
    workdir: Path | None,
    check: bool,
    tracker_tls: bool,
    wan: str | None,
) -> None:
    """Start a local swarm: tracker, nodes and gateway on loopback or an emulated WAN; an OpenAI endpoint."""
    if n_nodes < 1:
        raise click.BadParameter("need at least one node", param_hint="--nodes")
    if not 0 <= relay_nodes <= n_nodes + spare:
        raise click.BadParameter(f"between 0 and {n_nodes + spare} (all nodes)", param_hint="--relay-nodes")
    try:
        model = model_path or test_model_path()
    except TestModelMissing as err:
        raise click.ClickException(str(err)) from err
    spans = [s.strip() for s in layers.split(",")] if layers else None
    if spans is not None and len(spans) != n_nodes + spare:
        raise click.BadParameter(f"give one span per node ({n_nodes + spare})", param_hint="--layers")
    try:
        wan_profile = load_profile(wan) if wan else None
    except WanError as err:
        raise click.BadParameter(str(err), param_hint="--wan") from err
    work = workdir or Path(tempfile.mkdtemp(prefix="swarm-sim-"))
    # From here on every stop signal raises Stopped wherever the main thread is: start-up and serving
    # both end in stop_all (start_local_swarm stops what it started when interrupted).
    for signum in STOP_SIGNALS:
        signal.signal(signum, _raise_stopped)
    try:
        _up(
            work, model, n_nodes, spare, spans, threads, gateway_port, check, relay_nodes, wan_profile,
            tracker_tls,
        )  # fmt: skip
    except Stopped as stop:  # while serving (or stopping): a requested stop
        _tell(f"stopped by {stop}.")


def _up(
    work: Path,
    model: Path,
    n_nodes: int,
    spare: int,
    spans: list[str] | None,
    threads: int,
    gateway_port: int,
    check: bool,
    relay_nodes: int,
    wan_profile: WanProfile | None,
    tracker_tls: bool,
) -> None:
    click.echo(f"starting a local swarm in {work} (logs in {work / 'logs'}) ...", err=True)
    try:
        swarm = start_local_swarm(
            work,
            model=model,
            n_nodes=n_nodes,
            spare=spare,
            layers=spans,
            threads=threads,
            gateway_port=gateway_port,
            node_cache=None,
            quiet=False,
            relay_nodes=relay_nodes,
            wan_profile=wan_profile,
            register_gateway=True,  # as exposed swarms run: tickets for the gateway only
            tracker_tls=tracker_tls,
            register_model=True,  # the operator's path: the name is bound to this fingerprint
            tracker_args=["--unregistered-names", "trusted"],  # the tracker's default, not the harness's
            # The operator's nodes are trusted from the start (--trusted-nodes), and the gateway serves
            # no output nobody could check: a volunteer that joins is checked against them or refused.
            trust_nodes=True,
            gateway_args=["--unconfirmed-routes", "refuse"],
        )
    except (LaunchError, WanError) as err:
        raise click.ClickException(str(err)) from err
    except Stopped as stop:  # start_local_swarm stopped what it had started
        _tell(f"start-up interrupted by {stop}; every service started is stopped.")
        sys.exit(128 + stop.signum)
    curl, body = _sample_request(swarm.base_url, swarm.model_name)
    try:
        click.echo("")
        click.echo(f"OpenAI base URL:  {swarm.base_url}")
        click.echo(f"model:            {swarm.model_name}")
        click.echo(f"try:              {curl}")
        for what, url in service_urls(swarm):
            click.echo(f"{what + ':':<18}{url}")
        if swarm.tracker_tls_fingerprint:
            click.echo(f"tracker TLS:      sha256 {swarm.tracker_tls_fingerprint} (self-signed)")
        if check:
            resp = httpx.post(f"{swarm.base_url}/chat/completions", json=body, timeout=120)
            resp.raise_for_status()
            click.echo(f"answer:           {resp.json()['choices'][0]['message']['content']!r}")
            return
        click.echo("Ctrl-C (or SIGTERM, SIGHUP) stops the swarm.")
        dead: set[str] = set()
        while not report_exits(swarm, dead):
            time.sleep(0.5)
    finally:
        _tell("stopping ...")
        swarm.stop()
        _tell("stopped.")


def service_urls(swarm: LocalSwarm) -> list[tuple[str, str]]:
    """Where to look at the running swarm: the dashboard and every service's metrics."""
    gateway = swarm.base_url.removesuffix("/v1")
    out = [
        ("dashboard", f"{swarm.tracker_url}/"),
        ("tracker metrics", f"{swarm.tracker_url}/metrics"),
        ("gateway metrics", f"{gateway}/metrics"),
    ]
    for node in swarm.nodes:
        if node.admin_port:
            out.append((f"{node.name} metrics", f"http://127.0.0.1:{node.admin_port}/metrics"))
    return out


def report_exits(swarm: LocalSwarm, dead: set[str]) -> bool:
    """Print each service that exited since the last call (once); True when the swarm must stop.

    A dead node is what a swarm is built to survive: the rest keeps serving (the dashboard
    shows the coverage it leaves). Without the tracker or the gateway nothing can be served."""
    must_stop = False
    for svc in [swarm.tracker, *swarm.nodes, swarm.gateway]:
        if svc.name in dead or svc.alive():
            continue
        dead.add(svc.name)
        click.echo(
            f"{svc.name} exited (code {svc.proc.returncode}); last log lines:\n{svc.log_tail()}", err=True
        )
        if svc is swarm.tracker or svc is swarm.gateway:
            click.echo(f"the swarm cannot serve without its {svc.name}: stopping", err=True)
            must_stop = True
        else:
            alive = sum(1 for n in swarm.nodes if n.alive())
            click.echo(
                f"keeping the swarm up without {svc.name}: {alive} of {len(swarm.nodes)} nodes left "
                f"(coverage: {swarm.tracker_url}/)",
                err=True,
            )
    return must_stop


if __name__ == "__main__":
    sys.exit(up())

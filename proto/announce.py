"""Payloads nodes and gateways send the tracker: announce, heartbeat, leave, usage report, gateway
stats, spot-check results and evidence.

Pure: standard library only. Each payload type is a frozen dataclass with
``from_json(obj)`` (validates a decoded, already signature-checked payload and
raises :class:`PayloadError` naming the offending field) and ``to_json()``
(the body a client signs; the envelope fields ``kind``, signer id,
``timestamp`` and ``nonce`` are added by ``proto.signing.make_payload``).

Validation is strict: unknown keys are refused (a typo must not silently drop
data), numbers must be finite and in range, strings and lists are bounded. The
JSON schema is written out in ``docs/tracker.md``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

ENVELOPE_FIELDS = frozenset({"kind", "timestamp", "nonce"})
_HEX64 = re.compile(r"^[0-9a-f]{64}$")
_HOSTPORT = re.compile(r"^(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-_]+):([0-9]{1,5})$")

MAX_ADDRESSES = 8
MAX_LIST = 32
MAX_NAME = 200
MAX_LAYERS = 100_000
MAX_USAGE_ENTRIES = 256
MAX_RTT_SAMPLES = 32  # RTT samples per heartbeat or gateway report (docs/tracker.md, Network coordinates)
MAX_RTT_MS = 60_000.0
MIN_RTT_MS = 0.001  # one microsecond: anything shorter is not a measurement
MAX_UPLINK_MBIT_S = 1_000_000.0


class PayloadError(ValueError):
    """A payload field is missing, of the wrong type, or out of range."""


# --- field readers -----------------------------------------------------------------------------


def _check_keys(obj: Mapping[str, Any], allowed: frozenset[str], where: str) -> None:
    extra = set(obj) - allowed
    if extra:
        raise PayloadError(f"{where}: unknown field(s) {sorted(extra)}")


def _obj(obj: Any, where: str) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise PayloadError(f"{where} must be a JSON object")
    return obj


def _int(obj: Mapping[str, Any], key: str, lo: int, hi: int, where: str) -> int:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int):
        raise PayloadError(f"{where}.{key} must be an integer")
    if not lo <= v <= hi:
        raise PayloadError(f"{where}.{key} must be in [{lo}, {hi}], got {v}")
    return v


def _num(
    obj: Mapping[str, Any], key: str, lo: float, hi: float, where: str, *, open_lo: bool = False
) -> float:
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, int | float) or not math.isfinite(v):
        raise PayloadError(f"{where}.{key} must be a finite number")
    if v > hi or v < lo or (open_lo and v == lo):
        raise PayloadError(f"{where}.{key} must be in {'(' if open_lo else '['}{lo}, {hi}], got {v}")
    return float(v)


def _str(obj: Mapping[str, Any], key: str, where: str, *, max_len: int = MAX_NAME, min_len: int = 1) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not min_len <= len(v) <= max_len:
        raise PayloadError(f"{where}.{key} must be a string of {min_len}..{max_len} characters")
    return v


def _hex64(obj: Mapping[str, Any], key: str, where: str) -> str:
    v = obj.get(key)
    if not isinstance(v, str) or not _HEX64.match(v):
        raise PayloadError(f"{where}.{key} must be 64 lowercase hex characters")
    return v


def _bool(obj: Mapping[str, Any], key: str, where: str) -> bool:
    v = obj.get(key)
    if not isinstance(v, bool):
        raise PayloadError(f"{where}.{key} must be true or false")
    return v


def _str_list(obj: Mapping[str, Any], key: str, where: str, max_items: int = MAX_LIST) -> tuple[str, ...]:
    v = obj.get(key)
    if not isinstance(v, list) or len(v) > max_items:
        raise PayloadError(f"{where}.{key} must be a list of at most {max_items} strings")
    for item in v:
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_NAME:
            raise PayloadError(f"{where}.{key} must contain strings of 1..{MAX_NAME} characters")
    return tuple(v)


def check_address(addr: str) -> str:
    m = _HOSTPORT.match(addr)
    if not m or not 1 <= int(m.group(2)) <= 65535 or len(addr) > 255:
        raise PayloadError(f"address {addr!r} must be host:port with a port in 1..65535")
    return addr


# --- round-trip samples -------------------------------------------------------------------------


@dataclass(frozen=True)
class RttSample:
    """A round trip the sender measured to a peer (a node or a gateway, by id)."""

    peer_id: str
    rtt_ms: float

    @classmethod
    def from_json(cls, obj: Any, where: str) -> RttSample:
        o = _obj(obj, where)
        _check_keys(o, frozenset({"peer_id", "rtt_ms"}), where)
        return cls(_hex64(o, "peer_id", where), _num(o, "rtt_ms", MIN_RTT_MS, MAX_RTT_MS, where))

    def to_json(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "rtt_ms": self.rtt_ms}


def _rtt_samples(o: Mapping[str, Any], where: str, sender: str) -> tuple[RttSample, ...]:
    """The optional ``rtt_samples`` list: at most ``MAX_RTT_SAMPLES``, one per peer, never the sender."""
    raw = o.get("rtt_samples", [])
    if not isinstance(raw, list) or len(raw) > MAX_RTT_SAMPLES:
        raise PayloadError(f"{where}.rtt_samples must be a list of at most {MAX_RTT_SAMPLES} objects")
    samples = tuple(RttSample.from_json(x, f"{where}.rtt_samples[]") for x in raw)
    peers = [s.peer_id for s in samples]
    if len(set(peers)) != len(peers):
        raise PayloadError(f"{where}.rtt_samples must name each peer once")
    if sender in peers:
        raise PayloadError(f"{where}.rtt_samples must not name the sender itself")
    return samples


MAX_PREFIX_HEADS = 32  # heads of cached KV block chains one heartbeat may carry
_HEAD32 = re.compile(r"^[0-9a-f]{32}$")


def _prefix_heads(o: Mapping[str, Any], where: str) -> tuple[str, ...]:
    """The optional ``prefix_heads`` list: at most ``MAX_PREFIX_HEADS`` distinct heads of the node's
    cached KV block chains, each 32 lowercase hex digits (common/prefix_chain.py)."""
    raw = o.get("prefix_heads", [])
    if not isinstance(raw, list) or len(raw) > MAX_PREFIX_HEADS:
        raise PayloadError(f"{where}.prefix_heads must be a list of at most {MAX_PREFIX_HEADS} heads")
    for x in raw:
        if not isinstance(x, str) or _HEAD32.match(x) is None:
            raise PayloadError(f"{where}.prefix_heads[] must be 32 lowercase hex digits, got {str(x)[:40]!r}")
    if len(set(raw)) != len(raw):
        raise PayloadError(f"{where}.prefix_heads must name each head once")
    return tuple(raw)


# --- announce ----------------------------------------------------------------------------------


@dataclass(frozen=True)
class Gpu:
    name: str
    memory_bytes: int

    @classmethod
    def from_json(cls, obj: Any) -> Gpu:
        o = _obj(obj, "hardware.gpus[]")
        _check_keys(o, frozenset({"name", "memory_bytes"}), "hardware.gpus[]")
        return cls(_str(o, "name", "hardware.gpus[]"), _int(o, "memory_bytes", 0, 1 << 50, "hardware.gpus[]"))


@dataclass(frozen=True)
class Hardware:
    cpu_cores: int
    ram_bytes: int
    gpus: tuple[Gpu, ...]
    backends: tuple[str, ...]  # e.g. "cpu", "cuda", "metal", "vulkan"
    free_disk_bytes: int

    @classmethod
    def from_json(cls, obj: Any) -> Hardware:
        w = "hardware"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"cpu_cores", "ram_bytes", "gpus", "backends", "free_disk_bytes"}), w)
        gpus = o.get("gpus")
        if not isinstance(gpus, list) or len(gpus) > MAX_LIST:
            raise PayloadError(f"{w}.gpus must be a list of at most {MAX_LIST} objects")
        return cls(
            cpu_cores=_int(o, "cpu_cores", 1, 1 << 20, w),
            ram_bytes=_int(o, "ram_bytes", 0, 1 << 60, w),
            gpus=tuple(Gpu.from_json(g) for g in gpus),
            backends=_str_list(o, "backends", w),
            free_disk_bytes=_int(o, "free_disk_bytes", 0, 1 << 62, w),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "cpu_cores": self.cpu_cores,
            "ram_bytes": self.ram_bytes,
            "gpus": [{"name": g.name, "memory_bytes": g.memory_bytes} for g in self.gpus],
            "backends": list(self.backends),
            "free_disk_bytes": self.free_disk_bytes,
        }


@dataclass(frozen=True)
class ModelSpec:
    fingerprint: str  # sha256 of the source GGUF, hex
    name: str
    architecture: str
    n_layers: int
    n_embd: int

    @classmethod
    def from_json(cls, obj: Any) -> ModelSpec:
        w = "model"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"fingerprint", "name", "architecture", "n_layers", "n_embd"}), w)
        return cls(
            _hex64(o, "fingerprint", w),
            _str(o, "name", w),
            _str(o, "architecture", w, max_len=64),
            _int(o, "n_layers", 1, MAX_LAYERS, w),
            _int(o, "n_embd", 1, 1 << 20, w),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint,
            "name": self.name,
            "architecture": self.architecture,
            "n_layers": self.n_layers,
            "n_embd": self.n_embd,
        }


_ANNOUNCE_KEYS = (
    frozenset(
        {
            "node_id",
            "addresses",
            "relay",
            "relay_via",
            "hardware",
            "software_version",
            "model",
            "shard_start",
            "shard_end",
            "decode_ms_per_token",
            "prefill_tokens_per_s",
            "max_sessions",
            "region",
            "uplink_mbit_s",
            "capacity_layers",
            "tls_fingerprint",
        }
    )
    | ENVELOPE_FIELDS
)


@dataclass(frozen=True)
class Announce:
    node_id: str
    addresses: tuple[str, ...]  # gRPC host:port the node listens on (may be empty when relayed)
    relay: bool  # reachable only through a gateway's WebSocket relay
    relay_via: str | None  # id of that gateway, when relayed
    hardware: Hardware
    software_version: str
    model: ModelSpec
    shard_start: int
    shard_end: int
    decode_ms_per_token: float
    prefill_tokens_per_s: float
    max_sessions: int
    region: str = ""  # free-form locality the operator chose ("eu-west", "home-lab"); "" = unsaid
    uplink_mbit_s: float | None = None  # the node's upload rate (what activations leave with); None = unsaid
    # Most layers of this model the node's memory holds (node/capacity.py); 0 = not computed.
    capacity_layers: int = 0
    # sha256 (hex) of the TLS certificate the node serves gRPC with: diallers pin it
    # (docs/tls.md). "" = the node serves plaintext (dialled only where that is allowed).
    tls_fingerprint: str = ""

    @classmethod
    def from_json(cls, obj: Any) -> Announce:
        w = "announce"
        o = _obj(obj, w)
        _check_keys(o, _ANNOUNCE_KEYS, w)
        addresses = tuple(check_address(a) for a in _str_list(o, "addresses", w, MAX_ADDRESSES))
        relay = _bool(o, "relay", w)
        relay_via = o.get("relay_via")
        if relay_via is not None and (not isinstance(relay_via, str) or not 1 <= len(relay_via) <= MAX_NAME):
            raise PayloadError(f"{w}.relay_via must be null or a string")
        if not relay and not addresses:
            raise PayloadError(f"{w}.addresses must not be empty for a node that is not relayed")
        model = ModelSpec.from_json(o.get("model"))
        start = _int(o, "shard_start", 0, model.n_layers - 1, w)
        end = _int(o, "shard_end", start + 1, model.n_layers, w)
        return cls(
            node_id=_hex64(o, "node_id", w),
            addresses=addresses,
            relay=relay,
            relay_via=relay_via,
            hardware=Hardware.from_json(o.get("hardware")),
            software_version=_str(o, "software_version", w, max_len=64),
            model=model,
            shard_start=start,
            shard_end=end,
            decode_ms_per_token=_num(o, "decode_ms_per_token", 0.0, 1e7, w, open_lo=True),
            prefill_tokens_per_s=_num(o, "prefill_tokens_per_s", 0.0, 1e9, w, open_lo=True),
            max_sessions=_int(o, "max_sessions", 1, 1 << 20, w),
            region=_str(o, "region", w, max_len=64, min_len=0) if "region" in o else "",
            uplink_mbit_s=_num(o, "uplink_mbit_s", 0.0, MAX_UPLINK_MBIT_S, w, open_lo=True)
            if o.get("uplink_mbit_s") is not None
            else None,
            capacity_layers=_int(o, "capacity_layers", 0, model.n_layers, w) if "capacity_layers" in o else 0,
            tls_fingerprint=_hex64(o, "tls_fingerprint", w) if o.get("tls_fingerprint") is not None else "",
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "node_id": self.node_id,
            "addresses": list(self.addresses),
            "relay": self.relay,
            "relay_via": self.relay_via,
            "hardware": self.hardware.to_json(),
            "software_version": self.software_version,
            "model": self.model.to_json(),
            "shard_start": self.shard_start,
            "shard_end": self.shard_end,
            "decode_ms_per_token": self.decode_ms_per_token,
            "prefill_tokens_per_s": self.prefill_tokens_per_s,
            "max_sessions": self.max_sessions,
        }
        if self.region:
            body["region"] = self.region
        if self.uplink_mbit_s is not None:
            body["uplink_mbit_s"] = self.uplink_mbit_s
        if self.capacity_layers:
            body["capacity_layers"] = self.capacity_layers
        if self.tls_fingerprint:
            body["tls_fingerprint"] = self.tls_fingerprint
        return body


# --- heartbeat ---------------------------------------------------------------------------------

_HEARTBEAT_KEYS = (
    frozenset(
        {
            "node_id",
            "active_sessions",
            "queue_depth",
            "kv_free_tokens",
            "tokens_served",
            "kv_used_tokens",
            "kv_pool_tokens",
            "kv_session_max_tokens",
            "rtt_samples",
            "kv_preemptions",
            "kv_refusals",
            "prefix_heads",
        }
    )
    | ENVELOPE_FIELDS
)


@dataclass(frozen=True)
class Heartbeat:
    node_id: str
    active_sessions: int
    queue_depth: int
    kv_free_tokens: int
    tokens_served: int  # tokens processed since the previous heartbeat
    kv_used_tokens: int | None = None  # KV positions held by sessions now (None = not reported)
    rtt_samples: tuple[RttSample, ...] = ()  # round trips measured since the last report
    kv_pool_tokens: int | None = None  # the KV pool's size in positions (None = not reported)
    kv_session_max_tokens: int | None = None  # most positions one session may hold here (None = not reported)
    # Since the node started (cumulative; None = not reported): sessions preempted to make room in its
    # KV pool, and steps refused because the pool had no room (each one makes a gateway wait for KV).
    kv_preemptions: int | None = None
    kv_refusals: int | None = None
    # Heads of the KV block chains the node keeps (common/prefix_chain.py; most recently used first,
    # at most MAX_PREFIX_HEADS): what prefix-aware route choice matches a prompt against.
    prefix_heads: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Any) -> Heartbeat:
        w = "heartbeat"
        o = _obj(obj, w)
        _check_keys(o, _HEARTBEAT_KEYS, w)
        big = 1 << 40
        node_id = _hex64(o, "node_id", w)
        return cls(
            node_id,
            _int(o, "active_sessions", 0, 1 << 20, w),
            _int(o, "queue_depth", 0, 1 << 20, w),
            _int(o, "kv_free_tokens", 0, big, w),
            _int(o, "tokens_served", 0, big, w),
            _int(o, "kv_used_tokens", 0, big, w) if o.get("kv_used_tokens") is not None else None,
            _rtt_samples(o, w, node_id),
            _int(o, "kv_pool_tokens", 0, big, w) if o.get("kv_pool_tokens") is not None else None,
            (
                _int(o, "kv_session_max_tokens", 0, big, w)
                if o.get("kv_session_max_tokens") is not None
                else None
            ),
            _int(o, "kv_preemptions", 0, big, w) if o.get("kv_preemptions") is not None else None,
            _int(o, "kv_refusals", 0, big, w) if o.get("kv_refusals") is not None else None,
            _prefix_heads(o, w),
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "node_id": self.node_id,
            "active_sessions": self.active_sessions,
            "queue_depth": self.queue_depth,
            "kv_free_tokens": self.kv_free_tokens,
            "tokens_served": self.tokens_served,
        }
        if self.kv_used_tokens is not None:
            body["kv_used_tokens"] = self.kv_used_tokens
        if self.rtt_samples:
            body["rtt_samples"] = [x.to_json() for x in self.rtt_samples]
        if self.kv_pool_tokens is not None:
            body["kv_pool_tokens"] = self.kv_pool_tokens
        if self.kv_session_max_tokens is not None:
            body["kv_session_max_tokens"] = self.kv_session_max_tokens
        if self.kv_preemptions is not None:
            body["kv_preemptions"] = self.kv_preemptions
        if self.kv_refusals is not None:
            body["kv_refusals"] = self.kv_refusals
        if self.prefix_heads:
            body["prefix_heads"] = list(self.prefix_heads)
        return body


# --- leave -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Leave:
    """A node that stops on purpose: the tracker stops routing to it at once."""

    node_id: str
    reason: str = "shutdown"

    @classmethod
    def from_json(cls, obj: Any) -> Leave:
        w = "leave"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"node_id", "reason"}) | ENVELOPE_FIELDS, w)
        return cls(_hex64(o, "node_id", w), _str(o, "reason", w, max_len=MAX_NAME))

    def to_json(self) -> dict[str, Any]:
        return {"node_id": self.node_id, "reason": self.reason}


# --- usage report (gateway -> tracker) ------------------------------------------------------------


@dataclass(frozen=True)
class UsageEntry:
    node_id: str
    tokens: int
    steps: int

    @classmethod
    def from_json(cls, obj: Any) -> UsageEntry:
        w = "usage.entries[]"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"node_id", "tokens", "steps"}), w)
        return cls(_hex64(o, "node_id", w), _int(o, "tokens", 0, 1 << 40, w), _int(o, "steps", 0, 1 << 40, w))


@dataclass(frozen=True)
class UsageReport:
    gateway_id: str
    request_id: str
    model_fingerprint: str
    entries: tuple[UsageEntry, ...]

    @classmethod
    def from_json(cls, obj: Any) -> UsageReport:
        w = "usage"
        o = _obj(obj, w)
        _check_keys(
            o, frozenset({"gateway_id", "request_id", "model_fingerprint", "entries"}) | ENVELOPE_FIELDS, w
        )
        entries = o.get("entries")
        if not isinstance(entries, list) or not 1 <= len(entries) <= MAX_USAGE_ENTRIES:
            raise PayloadError(f"{w}.entries must be a list of 1..{MAX_USAGE_ENTRIES} objects")
        return cls(
            _hex64(o, "gateway_id", w),
            _str(o, "request_id", w, max_len=128),
            _hex64(o, "model_fingerprint", w),
            tuple(UsageEntry.from_json(e) for e in entries),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gateway_id": self.gateway_id,
            "request_id": self.request_id,
            "model_fingerprint": self.model_fingerprint,
            "entries": [{"node_id": e.node_id, "tokens": e.tokens, "steps": e.steps} for e in self.entries],
        }


# --- gateway statistics (gateway -> tracker, periodic) ----------------------------------------------

MAX_ROUTE_STATS = 32


@dataclass(frozen=True)
class RouteStat:
    route_id: str  # the gateway's route label, e.g. "3fa2c1d0[0:15)>9bd1e2f3[15:30)"
    sessions: int  # sessions running on it now

    @classmethod
    def from_json(cls, obj: Any) -> RouteStat:
        w = "gateway_stats.routes[]"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"route_id", "sessions"}), w)
        return cls(_str(o, "route_id", w, max_len=400), _int(o, "sessions", 0, 1 << 20, w))


MAX_NODE_SPEEDS = 64
MAX_UNREACHABLE = 64  # node ids one statistics report may name as not answering


@dataclass(frozen=True)
class NodeSpeed:
    """One node's decode time as a gateway measured it: its share of the route's per-token time
    (apportioned by the stages' layer counts), averaged over ``samples`` sessions."""

    node_id: str
    model_fingerprint: str
    decode_ms_per_token: float
    samples: int

    @classmethod
    def from_json(cls, obj: Any) -> NodeSpeed:
        w = "gateway_stats.nodes[]"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"node_id", "model_fingerprint", "decode_ms_per_token", "samples"}), w)
        return cls(
            _hex64(o, "node_id", w),
            _hex64(o, "model_fingerprint", w),
            _num(o, "decode_ms_per_token", 0.0, 1e7, w, open_lo=True),
            _int(o, "samples", 1, 1 << 30, w),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "node_id": self.node_id,
            "model_fingerprint": self.model_fingerprint,
            "decode_ms_per_token": self.decode_ms_per_token,
            "samples": self.samples,
        }


def _opt_seconds(o: Mapping[str, Any], key: str, where: str) -> float | None:
    return None if o.get(key) is None else _num(o, key, 0.0, 86_400.0, where)


@dataclass(frozen=True)
class GatewayStats:
    """What a gateway saw during the last ``interval_s`` seconds, for the tracker's dashboard.

    Counts are deltas over the interval; latencies are quantiles estimated from the
    gateway's histograms over the same interval (None when nothing was observed)."""

    gateway_id: str
    interval_s: float
    sessions_active: int
    requests_queued: int
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    ttft_p50_s: float | None
    ttft_p95_s: float | None
    routes: tuple[RouteStat, ...] = ()
    url: str = ""  # the gateway's public base URL, if it knows one
    rtt_samples: tuple[RttSample, ...] = ()  # round trips to nodes measured since the last report
    # What this gateway measured of each node's decode time (routing trusts this, not the claim).
    nodes: tuple[NodeSpeed, ...] = ()
    # Nodes that did not answer this gateway's Info or OPEN in time since the last report (the
    # tracker challenges them again before it routes to them).
    unreachable: tuple[str, ...] = ()

    @classmethod
    def from_json(cls, obj: Any) -> GatewayStats:
        w = "gateway_stats"
        o = _obj(obj, w)
        keys = {
            "gateway_id",
            "interval_s",
            "sessions_active",
            "requests_queued",
            "requests",
            "errors",
            "prompt_tokens",
            "completion_tokens",
            "ttft_p50_s",
            "ttft_p95_s",
            "routes",
            "url",
            "rtt_samples",
            "nodes",
            "unreachable",
        }
        _check_keys(o, frozenset(keys) | ENVELOPE_FIELDS, w)
        unreachable = o.get("unreachable", [])
        if (
            not isinstance(unreachable, list)
            or len(unreachable) > MAX_UNREACHABLE
            or not all(isinstance(n, str) and _HEX64.match(n) for n in unreachable)
        ):
            raise PayloadError(f"{w}.unreachable must be a list of at most {MAX_UNREACHABLE} node ids")
        routes = o.get("routes", [])
        if not isinstance(routes, list) or len(routes) > MAX_ROUTE_STATS:
            raise PayloadError(f"{w}.routes must be a list of at most {MAX_ROUTE_STATS} objects")
        nodes = o.get("nodes", [])
        if not isinstance(nodes, list) or len(nodes) > MAX_NODE_SPEEDS:
            raise PayloadError(f"{w}.nodes must be a list of at most {MAX_NODE_SPEEDS} objects")
        big = 1 << 40
        gateway_id = _hex64(o, "gateway_id", w)
        return cls(
            gateway_id=gateway_id,
            interval_s=_num(o, "interval_s", 0.0, 3600.0, w, open_lo=True),
            sessions_active=_int(o, "sessions_active", 0, 1 << 20, w),
            requests_queued=_int(o, "requests_queued", 0, 1 << 20, w),
            requests=_int(o, "requests", 0, big, w),
            errors=_int(o, "errors", 0, big, w),
            prompt_tokens=_int(o, "prompt_tokens", 0, big, w),
            completion_tokens=_int(o, "completion_tokens", 0, big, w),
            ttft_p50_s=_opt_seconds(o, "ttft_p50_s", w),
            ttft_p95_s=_opt_seconds(o, "ttft_p95_s", w),
            routes=tuple(RouteStat.from_json(r) for r in routes),
            url=_str(o, "url", w, max_len=255, min_len=0) if "url" in o else "",
            rtt_samples=_rtt_samples(o, w, gateway_id),
            nodes=tuple(NodeSpeed.from_json(n) for n in nodes),
            unreachable=tuple(sorted(set(unreachable))),
        )

    def to_json(self) -> dict[str, Any]:
        body: dict[str, Any] = {
            "gateway_id": self.gateway_id,
            "interval_s": self.interval_s,
            "sessions_active": self.sessions_active,
            "requests_queued": self.requests_queued,
            "requests": self.requests,
            "errors": self.errors,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "ttft_p50_s": self.ttft_p50_s,
            "ttft_p95_s": self.ttft_p95_s,
            "routes": [{"route_id": r.route_id, "sessions": r.sessions} for r in self.routes],
            "url": self.url,
        }
        if self.rtt_samples:
            body["rtt_samples"] = [x.to_json() for x in self.rtt_samples]
        if self.nodes:  # only when there is something: a tracker without the field still accepts the rest
            body["nodes"] = [n.to_json() for n in self.nodes]
        if self.unreachable:
            body["unreachable"] = list(self.unreachable)
        return body


# --- spot-check results and evidence (gateway -> tracker) ----------------------------------------

MAX_CHECK_ENTRIES = 256
MAX_CHECKS_PER_REPORT = 10_000  # checks one node may be credited with in one report
MAX_EVIDENCE_RUNS = 4
MAX_TOP_LOGPROBS = 64


@dataclass(frozen=True)
class CheckPass:
    node_id: str
    checks: int  # spot checks this node passed since the gateway's previous report


@dataclass(frozen=True)
class CheckResults:
    """Nodes that passed spot checks at one gateway (a check: the node's every step report of a
    request equalled an independent route's, bit for bit)."""

    gateway_id: str
    passed: tuple[CheckPass, ...]

    @classmethod
    def from_json(cls, obj: Any) -> CheckResults:
        w = "check_results"
        o = _obj(obj, w)
        _check_keys(o, frozenset({"gateway_id", "passed"}) | ENVELOPE_FIELDS, w)
        items = o.get("passed")
        if not isinstance(items, list) or not 1 <= len(items) <= MAX_CHECK_ENTRIES:
            raise PayloadError(f"{w}.passed must be a list of 1..{MAX_CHECK_ENTRIES} objects")
        passed: list[CheckPass] = []
        seen: set[str] = set()
        for item in items:
            e = _obj(item, f"{w}.passed[]")
            _check_keys(e, frozenset({"node_id", "checks"}), f"{w}.passed[]")
            node = _hex64(e, "node_id", f"{w}.passed[]")
            if node in seen:
                raise PayloadError(f"{w}.passed lists node {node[:16]} twice")
            seen.add(node)
            passed.append(CheckPass(node, _int(e, "checks", 1, MAX_CHECKS_PER_REPORT, f"{w}.passed[]")))
        return cls(_hex64(o, "gateway_id", w), tuple(passed))

    def to_json(self) -> dict[str, Any]:
        return {
            "gateway_id": self.gateway_id,
            "passed": [{"node_id": p.node_id, "checks": p.checks} for p in self.passed],
        }


@dataclass(frozen=True)
class StepClaim:
    """What one node reported about one step: the output digest (hex; stages before the last) and,
    for the last stage, the sampled token with its logprob and top logprobs."""

    node_id: str
    epoch: int
    step_id: int
    digest: str
    token_id: int | None = None
    logprob: float | None = None
    top_logprobs: tuple[tuple[int, float], ...] = ()

    @classmethod
    def from_json(cls, obj: Any, where: str) -> StepClaim:
        o = _obj(obj, where)
        _check_keys(
            o,
            frozenset({"node_id", "epoch", "step_id", "digest", "token_id", "logprob", "top_logprobs"}),
            where,
        )
        digest = o.get("digest")
        if (
            not isinstance(digest, str)
            or len(digest) > 128
            or any(c not in "0123456789abcdef" for c in digest)
        ):
            raise PayloadError(f"{where}.digest must be at most 128 lowercase hex characters")
        token = _int(o, "token_id", 0, 1 << 31, where) if o.get("token_id") is not None else None
        logprob = _num(o, "logprob", -1e30, 0.0, where) if o.get("logprob") is not None else None
        tops = o.get("top_logprobs", [])
        if not isinstance(tops, list) or len(tops) > MAX_TOP_LOGPROBS:
            raise PayloadError(f"{where}.top_logprobs must be a list of at most {MAX_TOP_LOGPROBS} pairs")
        pairs: list[tuple[int, float]] = []
        for pair in tops:
            if not isinstance(pair, list) or len(pair) != 2:
                raise PayloadError(f"{where}.top_logprobs[] must be [token_id, logprob]")
            p = {"t": pair[0], "l": pair[1]}
            pairs.append((_int(p, "t", 0, 1 << 31, where), _num(p, "l", -1e30, 0.0, where)))
        return cls(
            _hex64(o, "node_id", where),
            _int(o, "epoch", 0, 1 << 31, where),
            _int(o, "step_id", 0, 1 << 62, where),
            digest,
            token,
            logprob,
            tuple(pairs),
        )

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "node_id": self.node_id,
            "epoch": self.epoch,
            "step_id": self.step_id,
            "digest": self.digest,
        }
        if self.token_id is not None:
            out["token_id"] = self.token_id
            out["logprob"] = self.logprob
            out["top_logprobs"] = [list(p) for p in self.top_logprobs]
        return out

    def says_same_as(self, other: StepClaim) -> bool:
        """Both reports claim the same output (digest and sampled token, bit for bit)."""
        return (self.digest, self.token_id, self.logprob, self.top_logprobs) == (
            other.digest,
            other.token_id,
            other.logprob,
            other.top_logprobs,
        )


@dataclass(frozen=True)
class Evidence:
    """A gateway's verdict on a spot check: two runs of a request parted at one step and a third
    (the judge) decided it. ``conclusive``: the judge agreed with exactly one run, and ``liar``
    is the node of the other one at that stage."""

    gateway_id: str
    request_id: str
    liar: str  # "" when the verdict is not conclusive
    conclusive: bool
    stage: int
    positions: tuple[int, int]
    reports: tuple[tuple[str, StepClaim], ...]  # (run name, its report of the step)
    judge: StepClaim
    detail: str
    time_s: float

    @classmethod
    def from_json(cls, obj: Any) -> Evidence:
        w = "evidence"
        o = _obj(obj, w)
        keys = {"gateway_id", "request_id", "liar", "conclusive", "stage", "positions", "reports"}
        _check_keys(o, frozenset(keys | {"judge", "detail", "time"}) | ENVELOPE_FIELDS, w)
        liar = o.get("liar")
        if liar != "":
            liar = _hex64(o, "liar", w)
        conclusive = _bool(o, "conclusive", w)
        if conclusive and not liar:
            raise PayloadError(f"{w}: a conclusive verdict must name the liar")
        positions = o.get("positions")
        if (
            not isinstance(positions, list)
            or len(positions) != 2
            or not all(isinstance(p, int) and not isinstance(p, bool) for p in positions)
            or not 0 <= positions[0] < positions[1] <= 1 << 31
        ):
            raise PayloadError(f"{w}.positions must be [start, end] with 0 <= start < end")
        raw = o.get("reports")
        if not isinstance(raw, Mapping) or not 2 <= len(raw) <= MAX_EVIDENCE_RUNS:
            raise PayloadError(f"{w}.reports must map 2..{MAX_EVIDENCE_RUNS} run names to reports")
        reports = []
        for name, report in sorted(raw.items()):
            if not isinstance(name, str) or not 1 <= len(name) <= 32:
                raise PayloadError(f"{w}.reports keys must be run names of 1..32 characters")
            reports.append((name, StepClaim.from_json(report, f"{w}.reports.{name}")))
        return cls(
            gateway_id=_hex64(o, "gateway_id", w),
            request_id=_str(o, "request_id", w, max_len=128),
            liar=str(liar),
            conclusive=conclusive,
            stage=_int(o, "stage", 0, 10_000, w),
            positions=(positions[0], positions[1]),
            reports=tuple(reports),
            judge=StepClaim.from_json(o.get("judge"), f"{w}.judge"),
            detail=_str(o, "detail", w, max_len=400, min_len=0) if "detail" in o else "",
            time_s=_num(o, "time", 0.0, 1e11, w) if "time" in o else 0.0,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "gateway_id": self.gateway_id,
            "request_id": self.request_id,
            "liar": self.liar,
            "conclusive": self.conclusive,
            "stage": self.stage,
            "positions": list(self.positions),
            "reports": {name: r.to_json() for name, r in self.reports},
            "judge": self.judge.to_json(),
            "detail": self.detail,
            "time": self.time_s,
        }

    def inconsistency(self) -> str | None:
        """Why this verdict does not follow from its own reports (None: it does).

        A conclusive verdict needs the liar's report to disagree with the judge, at least one
        other run to agree with it, and the judge to be another node than the liar: a gateway
        cannot ban a node with reports that do not convict it."""
        if not self.conclusive:
            return None
        if self.judge.node_id == self.liar:
            return "the judge is the accused node"
        accused = [r for _, r in self.reports if r.node_id == self.liar]
        others = [r for _, r in self.reports if r.node_id != self.liar]
        if not accused:
            return "no report of the accused node"
        if all(r.says_same_as(self.judge) for r in accused):
            return "the accused node's report agrees with the judge"
        if not any(r.says_same_as(self.judge) for r in others):
            return "no other run agrees with the judge"
        return None

"""The trust tables' side of the SQLAlchemy adapter: reputation, bans, evidence, challenges, observed
speed, signed usage reports.

:class:`TrustStore` holds the :class:`tracker.database.Database` that
:class:`tracker.store.Store` holds too (``Store.trust`` is this object), so the
registry keeps one transaction per operation: a ban check runs inside the
announce's own transaction and observed speeds inside the statistics report's
(the store hands its session to :meth:`TrustStore.check_announce`,
:meth:`TrustStore.ban_of`, :meth:`TrustStore.record_observed`); a trust write a
signed message authorises records the message's nonce in its own transaction
(:meth:`tracker.database.Database.consume_nonce`); a usage report's envelope and
receipt are kept inside the ledger write (:meth:`tracker.store.Store.record_usage`).
Synchronous, like the rest of the adapter (called through the registry's
:class:`tracker.gatekeeper.Gatekeeper`, a worker thread behind its limiter).

Bounds: evidence per node (``keep_per_node``, the oldest deleted in the same
transaction), evidence and receipts by age (:meth:`TrustStore.purge_trust`),
banned hosts by expiry, one challenge result per (node, model), one
reputation row per node.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, delete, or_, select, update
from sqlalchemy.orm import Session

from proto.announce import Announce, CheckResults, Evidence, GatewayStats
from tracker.database import Database, NonceRecord
from tracker.errors import Banned
from tracker.models import (
    NODE_BANNED,
    NODE_CHALLENGE_FAILED,
    NODE_CHALLENGING,
    NODE_LIVE,
    BannedHost,
    ChallengeResult,
    Model,
    Node,
    Reputation,
    Shard,
    TrustEvidence,
    Usage,
    UsageReportRow,
)


def address_host(address: str) -> str:
    """The host of ``host:port`` (brackets of an IPv6 literal removed); "" for relay addresses."""
    if not address or address.startswith("relay:"):
        return ""
    host = address.rsplit(":", 1)[0] if ":" in address else address
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def node_hosts(addresses: list[str] | tuple[str, ...], announced_from: str) -> list[str]:
    """Every host a node can be recognised by: its announced addresses' and where it announced from."""
    out = [h for h in (address_host(a) for a in addresses) if h]
    if announced_from:
        out.append(announced_from)
    return sorted(set(h[:255] for h in out))


@dataclass(frozen=True)
class ChecksRecorded:
    credited: int  # nodes whose count went up
    unknown: int  # node ids the registry has never seen (ignored)
    graduated: tuple[str, ...]  # nodes that left probation with this report


@dataclass(frozen=True)
class EvidenceRecorded:
    node_id: str
    banned: bool
    banned_until_s: float | None
    hosts: tuple[str, ...]
    known: bool  # the accused node is in the registry


@dataclass(frozen=True)
class ChallengeTarget:
    node_id: str
    model_fingerprint: str
    address: str
    start: int
    end: int
    n_layers: int
    n_embd: int
    tls_fingerprint: str = ""  # as announced; "" = the node serves plaintext
    relay_via: str = ""  # a relayed node (address ""): the gateway that relays it


def _target(node: Node, shard: Shard, model: Model) -> ChallengeTarget:
    address = "" if node.relay or not node.addresses else node.addresses[0]
    return ChallengeTarget(
        node.id,
        shard.model_fingerprint,
        address,
        shard.layer_start,
        shard.layer_end,
        model.n_layers,
        model.n_embd,
        node.tls_fingerprint,
        relay_via=(node.relay_via or "") if node.relay else "",
    )


class TrustStore:
    """The trust tables on the shared :class:`Database`; its gates take the caller's session."""

    def __init__(self, db: Database) -> None:
        self.db = db

    # --- gates inside other writes ----------------------------------------------------------------

    def check_announce(self, s: Session, a: Announce, remote: str, now_s: float) -> None:
        """Refuse (:class:`Banned`) an announce from a banned key, or from a key first seen after
        a ban of one of the hosts it announces or comes from."""
        rep = s.get(Reputation, a.node_id)
        if rep is not None and rep.banned_until_s is not None and rep.banned_until_s > now_s:
            left_s = rep.banned_until_s - now_s
            raise Banned(f"node {a.node_id[:16]} is banned for {left_s:.0f} s more: {rep.ban_reason}")
        hosts = node_hosts(a.addresses, remote)
        if not hosts:
            return
        node = s.get(Node, a.node_id)
        first_seen = node.first_seen_s if node is not None else now_s
        ban = s.scalars(
            select(BannedHost)
            .where(BannedHost.host.in_(hosts), BannedHost.until_s > now_s, BannedHost.since_s <= first_seen)
            .limit(1)
        ).first()
        if ban is not None:
            raise Banned(
                f"host {ban.host} is banned for new nodes for {ban.until_s - now_s:.0f} s more: {ban.reason}"
            )

    def ban_of(self, s: Session | Connection, node_id: str, now_s: float) -> tuple[float, str] | None:
        """``(until, reason)`` of the node's ban while it lasts, else None."""
        row = s.execute(
            select(Reputation.banned_until_s, Reputation.ban_reason).where(Reputation.node_id == node_id)
        ).first()
        if row is None or row[0] is None or row[0] <= now_s:
            return None
        return float(row[0]), str(row[1])

    def record_observed(self, s: Session, g: GatewayStats, now_s: float, alpha: float) -> int:
        """Fold a gateway's measured decode times into the shards' observed speed (EWMA)."""
        updated = 0
        for n in g.nodes:
            shard = s.scalars(
                select(Shard).where(
                    Shard.node_id == n.node_id, Shard.model_fingerprint == n.model_fingerprint
                )
            ).first()
            if shard is None:
                continue
            old = shard.observed_ms_per_token
            shard.observed_ms_per_token = (
                n.decode_ms_per_token if old is None else (1 - alpha) * old + alpha * n.decode_ms_per_token
            )
            shard.observed_at_s = now_s
            updated += 1
        return updated

    # --- spot checks and evidence -----------------------------------------------------------------

    def _reputation(self, s: Session, node_id: str, now_s: float) -> Reputation:
        rep = s.get(Reputation, node_id)
        if rep is None:
            rep = Reputation(
                node_id=node_id, checks_passed=0, checks_failed=0, ban_reason="", updated_s=now_s
            )
            s.add(rep)
            s.flush()
        return rep

    def record_checks(
        self, r: CheckResults, now_s: float, nonce: NonceRecord | None, *, probation_checks: int
    ) -> ChecksRecorded:
        with Session(self.db.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            known = set(s.scalars(select(Node.id).where(Node.id.in_([p.node_id for p in r.passed]))))
            graduated: list[str] = []
            credited = 0
            for p in r.passed:
                if p.node_id not in known:
                    continue
                rep = self._reputation(s, p.node_id, now_s)
                before = rep.checks_passed
                rep.checks_passed = before + p.checks
                rep.updated_s = now_s
                credited += 1
                if before < probation_checks <= rep.checks_passed:
                    graduated.append(p.node_id)
        return ChecksRecorded(credited, len(r.passed) - credited, tuple(graduated))

    def record_evidence(
        self,
        e: Evidence,
        envelope: dict[str, Any],
        now_s: float,
        nonce: NonceRecord | None,
        *,
        ban_node_s: float,
        ban_host_s: float,
        keep_per_node: int,
    ) -> EvidenceRecorded:
        """Keep the signed verdict; a conclusive one bans the node's key and (new keys from) its hosts."""
        node_id = e.liar if e.liar else _first_node(e)
        with Session(self.db.engine) as s, s.begin():
            self.db.consume_nonce(s, nonce, now_s)
            s.add(
                TrustEvidence(
                    node_id=node_id,
                    gateway_id=e.gateway_id,
                    request_id=e.request_id,
                    conclusive=e.conclusive,
                    at_s=now_s,
                    envelope=envelope,
                )
            )
            s.flush()
            keep = select(TrustEvidence.id).where(TrustEvidence.node_id == node_id)
            keep = keep.order_by(TrustEvidence.at_s.desc(), TrustEvidence.id.desc()).limit(keep_per_node)
            s.execute(
                delete(TrustEvidence).where(
                    TrustEvidence.node_id == node_id, TrustEvidence.id.not_in(keep.scalar_subquery())
                )
            )
            node = s.get(Node, node_id)
            if not e.conclusive:
                return EvidenceRecorded(node_id, False, None, (), node is not None)
            rep = self._reputation(s, node_id, now_s)
            rep.checks_failed += 1
            until = max(rep.banned_until_s or 0.0, now_s + ban_node_s)
            rep.banned_until_s = until
            reason = (
                f"caught lying by gateway {e.gateway_id[:16]} (request {e.request_id[:64]}, stage {e.stage})"
            )
            rep.ban_reason = reason[:400]
            rep.updated_s = now_s
            hosts: list[str] = []
            if node is not None:
                node.state = NODE_BANNED
                if ban_host_s > 0:
                    hosts = node_hosts(node.addresses, node.announced_from)
                    for host in hosts:
                        row = s.get(BannedHost, host)
                        if row is None:
                            s.add(
                                BannedHost(
                                    host=host,
                                    since_s=now_s,
                                    until_s=now_s + ban_host_s,
                                    reason=reason[:400],
                                    node_id=node_id,
                                )
                            )
                        else:
                            row.until_s = max(row.until_s, now_s + ban_host_s)
                            row.since_s = min(row.since_s, now_s)
                            row.reason, row.node_id = reason[:400], node_id
        return EvidenceRecorded(node_id, True, until, tuple(hosts), node is not None)

    def node_trust(
        self,
        node_id: str,
        now_s: float,
        *,
        probation_checks: int,
        evidence_limit: int = 20,
        trusted_nodes: frozenset[str] = frozenset(),
    ) -> dict[str, Any]:
        with Session(self.db.engine) as s:
            rep = s.get(Reputation, node_id)
            node = s.get(Node, node_id)
            challenges = s.scalars(select(ChallengeResult).where(ChallengeResult.node_id == node_id)).all()
            evidence = s.scalars(
                select(TrustEvidence)
                .where(TrustEvidence.node_id == node_id)
                .order_by(TrustEvidence.at_s.desc(), TrustEvidence.id.desc())
                .limit(evidence_limit)
            ).all()
            passed = rep.checks_passed if rep is not None else 0
            banned = rep is not None and rep.banned_until_s is not None and rep.banned_until_s > now_s
            return {
                "node_id": node_id,
                "registered": node is not None,
                "state": node.state if node is not None else None,
                "checks_passed": passed,
                "checks_failed": rep.checks_failed if rep is not None else 0,
                "probation": node_id not in trusted_nodes and passed < probation_checks,
                "operator_trusted": node_id in trusted_nodes,
                "banned_until": rep.banned_until_s if banned and rep is not None else None,
                "ban_reason": rep.ban_reason if banned and rep is not None else "",
                "challenges": [
                    {
                        "model_fingerprint": c.model_fingerprint,
                        "recipe_fingerprint": c.recipe_fingerprint,
                        "start": c.layer_start,
                        "end": c.layer_end,
                        "outcome": c.outcome,
                        "detail": c.detail,
                        "at_s": c.at_s,
                    }
                    for c in challenges
                ],
                "evidence": [
                    {
                        "gateway_id": ev.gateway_id,
                        "request_id": ev.request_id,
                        "conclusive": ev.conclusive,
                        "at_s": ev.at_s,
                        "envelope": ev.envelope,
                    }
                    for ev in evidence
                ],
            }

    def bans(self, now_s: float, *, limit: int = 1000) -> dict[str, Any]:
        with Session(self.db.engine) as s:
            nodes = s.execute(
                select(Reputation.node_id, Reputation.banned_until_s, Reputation.ban_reason)
                .where(Reputation.banned_until_s > now_s)
                .order_by(Reputation.banned_until_s.desc())
                .limit(limit)
            ).all()
            hosts = s.scalars(
                select(BannedHost)
                .where(BannedHost.until_s > now_s)
                .order_by(BannedHost.until_s.desc())
                .limit(limit)
            ).all()
            return {
                "nodes": [{"node_id": n, "until": u, "reason": r} for n, u, r in nodes],
                "hosts": [
                    {
                        "host": h.host,
                        "since": h.since_s,
                        "until": h.until_s,
                        "reason": h.reason,
                        "node_id": h.node_id,
                    }
                    for h in hosts
                ],
            }

    # --- challenges -------------------------------------------------------------------------------

    def challenge_target(self, node_id: str) -> ChallengeTarget | None:
        """What to challenge for a node in state ``challenging`` (None: nothing to do)."""
        with Session(self.db.engine) as s:
            row = s.execute(
                select(Node, Shard, Model)
                .join(Shard, Shard.node_id == Node.id)
                .join(Model, Model.fingerprint == Shard.model_fingerprint)
                .where(Node.id == node_id, Node.state == NODE_CHALLENGING)
                .order_by(Shard.updated_s.desc())
                .limit(1)
            ).first()
            if row is None:
                return None
            node, shard, model = row
            return _target(node, shard, model)

    def relayed_challenges(
        self, gateway_id: str, node_ids: list[str], now_s: float, *, live_within_s: float
    ) -> list[ChallengeTarget]:
        """Of ``node_ids``, those waiting for a challenge, announced as relayed through the gateway
        ``gateway_id`` and heard from within ``live_within_s``."""
        if not node_ids:
            return []
        with Session(self.db.engine) as s:
            rows = s.execute(
                select(Node, Shard, Model)
                .join(Shard, Shard.node_id == Node.id)
                .join(Model, Model.fingerprint == Shard.model_fingerprint)
                .where(
                    Node.id.in_(node_ids),
                    Node.state == NODE_CHALLENGING,
                    Node.relay.is_(True),
                    Node.relay_via == gateway_id,
                    Node.last_seen_s >= now_s - live_within_s,
                )
                .order_by(Node.id, Shard.updated_s.desc())
            ).all()
            out: dict[str, ChallengeTarget] = {}
            for node, shard, model in rows:
                out.setdefault(node.id, _target(node, shard, model))  # a node's latest shard
            return list(out.values())

    def challenge_references(
        self,
        target: ChallengeTarget,
        recipe: str,
        input_id: str,
        now_s: float,
        *,
        probation_checks: int,
        trusted_nodes: frozenset[str] = frozenset(),
    ) -> set[str]:
        """Digests trusted nodes (off probation or listed in the operator's ``trusted_nodes``; not
        banned, not the target) gave for the same input."""
        with Session(self.db.engine) as s:
            rows = s.execute(
                select(ChallengeResult.digest)
                .outerjoin(Reputation, Reputation.node_id == ChallengeResult.node_id)
                .where(
                    ChallengeResult.model_fingerprint == target.model_fingerprint,
                    ChallengeResult.recipe_fingerprint == recipe,
                    ChallengeResult.layer_start == target.start,
                    ChallengeResult.layer_end == target.end,
                    ChallengeResult.input_id == input_id,
                    ChallengeResult.node_id != target.node_id,
                    ChallengeResult.digest != "",
                    ChallengeResult.outcome.in_(("passed", "no_reference")),
                    or_(
                        Reputation.checks_passed >= probation_checks,
                        ChallengeResult.node_id.in_(sorted(trusted_nodes)),
                    ),
                    or_(Reputation.banned_until_s.is_(None), Reputation.banned_until_s <= now_s),
                )
            ).all()
            return {r[0] for r in rows}

    def finish_challenge(
        self,
        target: ChallengeTarget,
        *,
        recipe: str,
        input_id: str,
        digest: str,
        outcome: str,
        detail: str,
        routable: bool,
        now_s: float,
        route_recipe: str = "",
    ) -> bool:
        """Record the result and move the node out of ``challenging`` (to live, or to
        challenge_failed); False when the node is no longer waiting for this challenge."""
        with Session(self.db.engine) as s, s.begin():
            row = s.get(ChallengeResult, (target.node_id, target.model_fingerprint))
            if row is None:
                row = ChallengeResult(node_id=target.node_id, model_fingerprint=target.model_fingerprint)
                s.add(row)
            row.recipe_fingerprint = recipe[:64]
            row.route_recipe = route_recipe[:64]
            row.layer_start, row.layer_end = target.start, target.end
            row.input_id, row.digest, row.outcome = input_id[:32], digest[:64], outcome[:24]
            row.detail, row.at_s = detail[:400], now_s
            if outcome == "mismatch":
                rep = self._reputation(s, target.node_id, now_s)
                rep.checks_failed += 1
                rep.updated_s = now_s
            moved = (
                s.connection()
                .execute(
                    update(Node)
                    .where(Node.id == target.node_id, Node.state == NODE_CHALLENGING)
                    .values(state=NODE_LIVE if routable else NODE_CHALLENGE_FAILED)
                )
                .rowcount
            )
        return bool(moved)

    def rechallenge(self, node_ids: tuple[str, ...]) -> list[str]:
        """Live direct nodes a gateway found silent go back to ``challenging`` (out of routing until
        they answer the tracker's challenge again); the ids moved."""
        if not node_ids:
            return []
        with self.db.engine.begin() as conn:
            moved = list(
                conn.execute(
                    select(Node.id).where(
                        Node.id.in_(node_ids), Node.state == NODE_LIVE, Node.relay.is_(False)
                    )
                ).scalars()
            )
            if moved:
                conn.execute(
                    update(Node)
                    .where(Node.id.in_(moved), Node.state == NODE_LIVE)
                    .values(state=NODE_CHALLENGING)
                )
            return moved

    def challenging_nodes(self, now_s: float, *, live_within_s: float, limit: int) -> list[str]:
        """Nodes waiting for a challenge and heard from recently (the periodic sweep's work list)."""
        with Session(self.db.engine) as s:
            return list(
                s.scalars(
                    select(Node.id)
                    .where(Node.state == NODE_CHALLENGING, Node.last_seen_s >= now_s - live_within_s)
                    .order_by(Node.last_seen_s)
                    .limit(limit)
                )
            )

    # --- usage receipts ---------------------------------------------------------------------------

    def ledger(self, node_id: str, since_s: float, *, limit: int) -> list[dict[str, Any]]:
        """The node's ledger rows from ``since_s`` (oldest first), each with the gateway's signed
        report and the tracker's receipt when they were kept."""
        with Session(self.db.engine) as s:
            rows = s.execute(
                select(Usage, UsageReportRow)
                .outerjoin(UsageReportRow, UsageReportRow.id == Usage.report_id)
                .where(Usage.node_id == node_id, Usage.at_s >= since_s)
                .order_by(Usage.at_s, Usage.id)
                .limit(limit)
            ).all()
            return [
                {
                    "request_id": u.request_id,
                    "gateway_id": u.gateway_id,
                    "model_fingerprint": u.model_fingerprint,
                    "tokens": u.tokens,
                    "steps": u.steps,
                    "at_s": u.at_s,
                    "report": r.envelope if r is not None else None,
                    "receipt": r.receipt if r is not None else None,
                }
                for u, r in rows
            ]

    def purge_trust(self, now_s: float, *, keep_s: float) -> dict[str, int]:
        """Old evidence and usage receipts, expired host bans."""
        with self.db.engine.begin() as conn:
            evidence = conn.execute(delete(TrustEvidence).where(TrustEvidence.at_s < now_s - keep_s)).rowcount
            hosts = conn.execute(delete(BannedHost).where(BannedHost.until_s < now_s)).rowcount
            old = select(UsageReportRow.id).where(UsageReportRow.at_s < now_s - keep_s)
            conn.execute(update(Usage).where(Usage.report_id.in_(old)).values(report_id=None))
            receipts = conn.execute(
                delete(UsageReportRow).where(UsageReportRow.at_s < now_s - keep_s)
            ).rowcount
        return {"evidence": evidence, "banned_hosts": hosts, "usage_reports": receipts}


def _first_node(e: Evidence) -> str:
    """The node an inconclusive verdict is filed under: the first run's node at that stage."""
    return e.reports[0][1].node_id if e.reports else e.judge.node_id


__all__ = [
    "ChallengeTarget",
    "ChecksRecorded",
    "EvidenceRecorded",
    "TrustStore",
    "address_host",
    "node_hosts",
]

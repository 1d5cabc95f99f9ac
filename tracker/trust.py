"""Trust between strangers, the tracker's side: who may report, what a report earns, what it costs a liar.

* **Registered gateways.** Usage, statistics (which carry measured node
  speeds), spot-check results and evidence are accepted only from the
  gateways whose keys the operator listed (``registered_gateways``); with an
  empty list every gateway is accepted and the tracker says at start-up that
  this suits private swarms only.
* **Probation.** A node is on probation until registered gateways have seen
  it pass ``probation_checks`` spot checks (``POST /v1/checks``); route
  answers flag such hops and routing adds ``probation_penalty_ms`` to them.
* **Evidence.** ``POST /v1/evidence`` carries a gateway's verdict (both runs'
  and the judge's reports of the step where they parted). It is kept signed,
  at most ``evidence_per_node_max`` per node. A conclusive verdict that
  follows from its own reports bans the liar's key for ``ban_node_s`` and new
  keys from the hosts it announced from for ``ban_host_s``; the node leaves
  routing at once (its sessions are moved by the gateways themselves).
* **Accountable usage.** Every accepted usage report is kept as signed, with
  the tracker's countersignature (a receipt over the report's bytes), and a
  node fetches its ledger rows with both (``GET /v1/usage/nodes/<id>/ledger``;
  ``proto.ledger.verify_ledger_entry`` checks one). Node-reported counters
  (heartbeats) are shown next to the ledger, never credited.

Each call verifies the envelope before anything else and writes in one
transaction; a refused message writes nothing.

The trust room's collaborators come in by its constructor: the registry's
:class:`tracker.gatekeeper.Gatekeeper` (envelopes, signed writes, database
calls), the trust tables (:class:`tracker.trust_store.TrustStore`, the
registry store's ``trust``), the tracker's key (receipts) and ``on_change``,
called when routing must see a change (a node banned or out of probation).
"""

from __future__ import annotations

import base64
import functools
import hashlib
import logging
from collections.abc import Callable
from typing import Any

import nacl.signing

from common.logs import event
from proto.announce import CheckResults, Evidence, PayloadError
from proto.signing import make_payload, sign_envelope
from tracker.config import TrackerConfig
from tracker.errors import BadRequest, UnregisteredGateway
from tracker.gatekeeper import Gatekeeper
from tracker.metrics import Metrics
from tracker.trust_store import TrustStore

log = logging.getLogger("swarm.tracker")
LEDGER_MAX_ROWS = 1000


class TrustService:
    def __init__(
        self,
        gate: Gatekeeper,
        store: TrustStore,
        config: TrackerConfig,
        metrics: Metrics,
        key: nacl.signing.SigningKey,
        *,
        on_change: Callable[[], None],
    ) -> None:
        self.gate = gate
        self.store = store
        self.config = config
        self.metrics = metrics
        self.key = key
        self.tracker_id = bytes(key.verify_key).hex()
        self.on_change = on_change
        self.gateways = config.gateway_keys()

    def warn_if_open(self) -> None:
        if not self.gateways:
            event(
                log,
                "gateways_unrestricted",
                level=logging.WARNING,
                message=(
                    "registered_gateways is empty: any key may report usage, statistics, spot checks and "
                    "evidence (and so ban nodes); fine for a private swarm only"
                ),
            )

    def require_gateway(self, gateway_id: str, kind: str) -> None:
        """Refuse (403) a report from a gateway the operator did not register."""
        if self.gateways and gateway_id not in self.gateways:
            self.metrics.inc("swarm_tracker_refusals_total", reason="unregistered_gateway")
            event(log, "gateway_refused", level=logging.WARNING, kind=kind, gateway_id=gateway_id)
            raise UnregisteredGateway(f"gateway {gateway_id[:16]} is not registered with this tracker")

    # --- spot checks ------------------------------------------------------------------------------

    async def report_checks(self, envelope: Any) -> dict[str, Any]:
        gate = self.gate
        payload, nonce = gate.open_envelope(envelope, "check_results", signer_field="gateway_id")
        try:
            r = CheckResults.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        self.require_gateway(r.gateway_id, "check_results")
        result = await gate.signed_write(
            "check_results",
            functools.partial(
                self.store.record_checks,
                r,
                gate.clock(),
                nonce,
                probation_checks=self.config.probation_checks,
            ),
        )
        self.metrics.inc("swarm_tracker_checks_credited_total", sum(p.checks for p in r.passed))
        if result.graduated:
            self.on_change()  # probation flags changed
            for node in result.graduated:
                event(log, "node_trusted", node_id=node, checks=self.config.probation_checks)
        return {"credited": result.credited, "unknown": result.unknown, "graduated": list(result.graduated)}

    async def report_evidence(self, envelope: Any) -> dict[str, Any]:
        gate = self.gate
        payload, nonce = gate.open_envelope(envelope, "evidence", signer_field="gateway_id")
        try:
            e = Evidence.from_json(payload)
        except PayloadError as err:
            raise BadRequest(str(err)) from err
        self.require_gateway(e.gateway_id, "evidence")
        why = e.inconsistency()
        if why is not None:
            raise BadRequest(f"evidence does not support the verdict: {why}")
        result = await gate.signed_write(
            "evidence",
            functools.partial(
                self.store.record_evidence,
                e,
                dict(envelope),
                gate.clock(),
                nonce,
                ban_node_s=self.config.ban_node_s,
                ban_host_s=self.config.ban_host_s,
                keep_per_node=self.config.evidence_per_node_max,
            ),
        )
        self.metrics.inc("swarm_tracker_evidence_total", conclusive=str(e.conclusive).lower())
        if result.banned:
            self.metrics.inc("swarm_tracker_bans_total")
            self.on_change()
        event(
            log,
            "node_banned" if result.banned else "evidence_recorded",
            level=logging.WARNING,
            node_id=result.node_id,
            gateway_id=e.gateway_id,
            request_id=e.request_id,
            conclusive=e.conclusive,
            stage=e.stage,
            banned_until=result.banned_until_s,
            hosts=list(result.hosts),
            detail=e.detail,
        )
        return {
            "node_id": result.node_id,
            "banned": result.banned,
            "banned_until": result.banned_until_s,
            "hosts_banned": list(result.hosts),
        }

    # --- reads ------------------------------------------------------------------------------------

    async def node_trust(self, node_id: str) -> dict[str, Any]:
        gate = self.gate
        return await gate.run_db(
            functools.partial(
                self.store.node_trust,
                node_id,
                gate.clock(),
                probation_checks=self.config.probation_checks,
                trusted_nodes=self.config.trusted_node_keys(),
            )
        )

    async def bans(self) -> dict[str, Any]:
        gate = self.gate
        return {"time": gate.clock(), **await gate.run_db(self.store.bans, gate.clock())}

    async def ledger(self, node_id: str, since_s: float, limit: int) -> dict[str, Any]:
        gate = self.gate
        if not 1 <= limit <= LEDGER_MAX_ROWS:
            raise BadRequest(f"limit must be in 1..{LEDGER_MAX_ROWS}")
        rows = await gate.run_db(functools.partial(self.store.ledger, node_id, since_s, limit=limit))
        more = len(rows) == limit
        return {
            "node_id": node_id,
            "tracker_id": self.tracker_id,
            "entries": rows,
            "next_since": rows[-1]["at_s"] if more else None,
        }

    # --- receipts ---------------------------------------------------------------------------------

    def usage_receipt(self, envelope: dict[str, Any], now_s: float) -> dict[str, str]:
        """The tracker's countersignature of a usage report: it names the report's exact bytes."""
        body = base64.b64decode(str(envelope["payload"]).encode("ascii"))
        receipt = {
            "report_sha256": hashlib.sha256(body).hexdigest(),
            "gateway_id": str(envelope["public_key"]),
            "recorded_at": now_s,
        }
        return sign_envelope(self.key, make_payload("usage_receipt", "tracker_id", self.key, now_s, receipt))

"""Checking one's own usage ledger: what a node does with ``GET /v1/usage/nodes/<id>/ledger``.

A ledger row credits a node with tokens of a request. The tracker keeps, for
every row, the gateway's signed usage report it came from and its own signed
receipt of that report. :func:`verify_ledger_entry` checks, without trusting
the tracker's word for any number:

* the report is an envelope signed by the gateway the row names, of kind
  ``usage``, for this request and model, and it lists this node with exactly
  the row's tokens and steps;
* the receipt is signed by the tracker key the node pinned, names the exact
  bytes of that report (sha256) and the same gateway.

So a node can prove what a gateway reported about it, and a tracker cannot
credit or debit a node with a report no registered gateway signed. Pure:
pynacl (through ``proto.signing``) and the standard library.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from typing import Any

from proto.announce import PayloadError, UsageReport
from proto.signing import SignatureError, verify_envelope


class LedgerError(ValueError):
    """A ledger entry that does not hold up; the message says which part."""


def _payload(envelope: Any, what: str) -> tuple[dict[str, Any], bytes, str]:
    try:
        body, signer = verify_envelope(envelope)
        payload = json.loads(body.decode("utf-8"))
    except SignatureError as err:
        raise LedgerError(f"{what}: {err.message}") from err
    except (UnicodeDecodeError, ValueError) as err:
        raise LedgerError(f"{what}: payload is not JSON") from err
    if not isinstance(payload, dict):
        raise LedgerError(f"{what}: payload is not an object")
    return payload, body, signer


def verify_ledger_entry(entry: Mapping[str, Any], *, node_id: str, tracker_public_key: str) -> UsageReport:
    """Check one entry of a node's ledger; returns the gateway's report (LedgerError if it fails)."""
    report, body, gateway = _payload(entry.get("report"), "report")
    if report.get("kind") != "usage" or report.get("gateway_id") != gateway:
        raise LedgerError("report: not a usage report signed by the gateway it names")
    try:
        usage = UsageReport.from_json(report)
    except PayloadError as err:
        raise LedgerError(f"report: {err}") from err
    if (usage.gateway_id, usage.request_id, usage.model_fingerprint) != (
        entry.get("gateway_id"),
        entry.get("request_id"),
        entry.get("model_fingerprint"),
    ):
        raise LedgerError("report: gateway, request or model differ from the ledger row")
    mine = [e for e in usage.entries if e.node_id == node_id]
    if len(mine) != 1 or (mine[0].tokens, mine[0].steps) != (entry.get("tokens"), entry.get("steps")):
        raise LedgerError("report: this node's tokens and steps differ from the ledger row")
    receipt, _, signer = _payload(entry.get("receipt"), "receipt")
    if signer != tracker_public_key or receipt.get("tracker_id") != signer:
        raise LedgerError("receipt: not signed by the pinned tracker key")
    if receipt.get("kind") != "usage_receipt":
        raise LedgerError("receipt: not a usage receipt")
    if (
        receipt.get("report_sha256") != hashlib.sha256(body).hexdigest()
        or receipt.get("gateway_id") != gateway
    ):
        raise LedgerError("receipt: names another report")
    return usage

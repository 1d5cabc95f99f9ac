"""Without root or without a tool, the emulated WAN says exactly what is missing (runs everywhere)."""

from __future__ import annotations

import shutil

import pytest

from sim.wan import support
from sim.wan.errors import WanError, WanUnavailable


def test_not_root_is_named_as_the_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support.os, "geteuid", lambda: 1000)
    with pytest.raises(WanUnavailable) as info:
        support._probe()
    assert info.value.reason == "needs root (network namespaces, veth links, iptables)"
    assert isinstance(info.value, WanError) and "emulated WAN unavailable" in str(info.value)


@pytest.mark.parametrize(("missing", "reason"), [("tc", "no `tc`"), ("iptables", "no `iptables`")])
def test_a_missing_tool_is_named(monkeypatch: pytest.MonkeyPatch, missing: str, reason: str) -> None:
    real_which = shutil.which
    monkeypatch.setattr(support.os, "geteuid", lambda: 0)
    blocked = {missing, "iptables-legacy"} if missing == "iptables" else {missing}
    monkeypatch.setattr(support.shutil, "which", lambda name: None if name in blocked else real_which(name))
    with pytest.raises(WanUnavailable, match=reason):
        support._probe()


def test_the_verdict_is_cached_per_process(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(support, "_cached", WanUnavailable("a reason"))
    assert support.unavailable_reason() == "a reason"
    with pytest.raises(WanUnavailable, match="a reason"):
        support.check_support()

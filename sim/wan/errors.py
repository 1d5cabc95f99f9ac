"""The emulated WAN's exceptions, all in one tree.

- :class:`WanError` -- base of everything raised by ``sim.wan``.
  - :class:`ProfileError` -- a profile file is malformed (unknown key, wrong type, impossible
    value, a region pair without a path). Raised by the pure parser; nothing was started.
  - :class:`WanUnavailable` -- this machine cannot emulate a WAN (not root, no ``ip`` or
    ``iptables``, no C compiler, no nfnetlink_queue, no ``tbf`` qdisc). ``reason`` says which;
    tests turn it into a skip.
  - :class:`WanSetupError` -- a step of building or changing the emulation failed (a command
    exited non-zero, the delayer did not come up); the message carries the command's output.
"""

from __future__ import annotations


class WanError(RuntimeError):
    """Base of every error of the emulated WAN."""


class ProfileError(WanError, ValueError):
    """A WAN profile is malformed."""


class WanUnavailable(WanError):
    """This machine cannot emulate a WAN; ``reason`` says why (for a clear skip or CLI message)."""

    def __init__(self, reason: str) -> None:
        super().__init__(f"emulated WAN unavailable: {reason}")
        self.reason = reason


class WanSetupError(WanError):
    """Building, changing or tearing down the emulation failed."""

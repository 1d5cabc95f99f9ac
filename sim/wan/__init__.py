"""An emulated wide-area network on one machine: network namespaces, a user-space packet delayer, tbf.

See docs/wan.md. ``profile`` is pure (parsing and placement); ``emulator`` builds and tears
down the namespaces (root only); ``probes`` and ``bench`` measure them.
"""

from sim.wan.emulator import Host, WanEmulator, WanStatistics
from sim.wan.errors import ProfileError, WanError, WanSetupError, WanUnavailable
from sim.wan.profile import LinkParams, WanProfile, bundled_profiles, load_profile, parse_profile
from sim.wan.support import check_support, unavailable_reason

__all__ = [
    "Host",
    "LinkParams",
    "ProfileError",
    "WanEmulator",
    "WanError",
    "WanProfile",
    "WanSetupError",
    "WanStatistics",
    "WanUnavailable",
    "bundled_profiles",
    "check_support",
    "load_profile",
    "parse_profile",
    "unavailable_reason",
]

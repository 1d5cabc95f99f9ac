"""One config schema per service (common.config.settings, common.cli.config_options): every knob has
help and a topic, one name as file key, environment variable and option, ``--help`` by topic, the
layers' order through the real commands, and the older option spellings. No child process: the
commands run in-process with their service main replaced."""

from __future__ import annotations

import dataclasses
import functools
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import pytest
from click.testing import CliRunner

import common.cli
import common.logs
from common.config import ConfigError, knob, load_layered, settings
from gateway import cli as gateway_cli
from gateway.config import ENV_PREFIX as GATEWAY_ENV
from gateway.config import GatewayConfig
from node import cli as node_cli
from node.config import ENV_PREFIX as NODE_ENV
from node.config import NodeConfig
from tracker import cli as tracker_cli
from tracker.config import ENV_PREFIX as TRACKER_ENV
from tracker.config import TrackerConfig


@dataclasses.dataclass(frozen=True)
class Service:
    name: str
    config: type
    env_prefix: str
    section: str
    group: click.Group
    command: str

    def args(self, config_file: Path | None, *options: str) -> list[str]:
        """The command line of the service's config-taking command (the tracker's --config is the
        group's)."""
        if config_file is None:
            return [self.command, *options]
        if self.name == "tracker":
            return ["--config", str(config_file), self.command, *options]
        return [self.command, "--config", str(config_file), *options]


SERVICES = [
    Service("node", NodeConfig, NODE_ENV, "node", node_cli.main, "start"),
    Service("gateway", GatewayConfig, GATEWAY_ENV, "gateway", gateway_cli.main, "serve"),
    Service("tracker", TrackerConfig, TRACKER_ENV, "tracker", tracker_cli.main, "serve"),
]
BY_NAME = {s.name: s for s in SERVICES}


@pytest.fixture
def started(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[list[Any]]:
    """The configs the commands would have served with: run_service records its main's config and
    exits 0; no logging set-up; no SWARM_* variable of this process leaks in; the node's pid file in a
    temporary data dir."""
    import os

    for var in list(os.environ):
        if var.startswith("SWARM_"):
            monkeypatch.delenv(var)
    monkeypatch.setenv("SWARM_NODE_DATA_DIR", str(tmp_path / "node"))
    seen: list[Any] = []

    def run_service(prog: str, main: functools.partial[Any], **_: Any) -> None:
        seen.append(main.args[0])
        raise SystemExit(0)

    monkeypatch.setattr(common.cli, "run_service", run_service)
    monkeypatch.setattr(common.logs, "configure", lambda *a, **k: None)
    yield seen


def _run(service: Service, args: list[str], env: dict[str, str] | None = None) -> click.testing.Result:
    return CliRunner().invoke(service.group, args, env=env, catch_exceptions=False)


def _help_body(service: Service) -> str:
    """The command's ``--help`` from its first option heading on (past the description)."""
    text = _run(service, [service.command, "--help"]).output
    return text[text.index("\nOptions:\n") :]


def _names_columns(body: str) -> set[str]:
    """Every option spelling in the left column of the help's rows."""
    out: set[str] = set()
    for line in body.splitlines():
        if line.startswith("  -"):
            left = line.strip().split("  ")[0]
            out.update(word.strip(",") for word in left.split() if word.startswith("-"))
    return out


def _row_start(body: str, option: str) -> int:
    found = re.search(rf"\n  {re.escape(option)}[ \n]", body)
    assert found, option
    return found.start()


def _option_value(setting: Any, value: Any) -> list[str]:
    """The command-line words that set ``setting`` to ``value``."""
    if setting.kind is bool:
        if setting.name.startswith("no_"):
            return [setting.option] if value else []
        return [setting.option if value else f"--no-{setting.option[2:]}"]
    return [setting.option, str(value)]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_knob_has_help_and_a_topic_and_one_name(service: Service) -> None:
    knobs = settings(service.config, service.env_prefix)
    assert [k.name for k in knobs] == [f.name for f in dataclasses.fields(service.config)]
    for k in knobs:
        assert k.knob.help.strip() and k.knob.topic.strip(), k.name
        assert k.env == service.env_prefix + k.name.upper()
        assert k.option == "--" + k.name.replace("_", "-")
    params = {p.name: p for p in service.group.commands[service.command].params}
    for k in knobs:
        assert k.option in params[k.name].opts, k.name  # the option's value goes to the field
        assert params[k.name].default is None  # "not given" stays distinguishable


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_every_knob_is_reachable_by_file_key_env_and_option(
    service: Service, tmp_path: Path, started: list[Any]
) -> None:
    knobs = settings(service.config, service.env_prefix)
    default = load_layered(service.config, section=service.section, env_prefix=service.env_prefix, env={})
    default = dataclasses.replace(default, data_dir=str(tmp_path / "data"))  # the node's pid file
    # Each layer names every knob (with its default value): none is unknown to the loader.
    file = tmp_path / "all.toml"
    lines = [f"[{service.section}]"]
    for k in knobs:
        value = getattr(default, k.name)
        lines.append(f"{k.name} = {str(value).lower() if k.kind is bool else repr(value)}")
    file.write_text("\n".join(lines) + "\n")
    env = {k.env: str(getattr(default, k.name)) for k in knobs}
    flags = {k.name: getattr(default, k.name) for k in knobs}
    loaded = load_layered(
        service.config,
        section=service.section,
        env_prefix=service.env_prefix,
        file=file,
        env=env,
        flags=flags,
    )
    assert loaded == default
    # And every option of the real command, given at once.
    words = [w for k in knobs for w in _option_value(k, getattr(default, k.name))]
    result = _run(service, service.args(None, *words))
    assert result.exit_code == 0, result.output
    assert started == [default]


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_help_lists_the_options_under_their_topics(service: Service) -> None:
    body = _help_body(service)
    knobs = settings(service.config, service.env_prefix)
    topics = list(dict.fromkeys(k.knob.topic for k in knobs))
    assert len(topics) >= 5
    positions = {topic: body.index(f"\n{topic}:\n") for topic in topics}
    assert list(positions.values()) == sorted(positions.values())  # in the schema's order
    flat = " ".join(body.split())
    for k in knobs:
        row = _row_start(body, k.option)
        assert max((t for t in topics if positions[t] < row), key=positions.__getitem__) == k.knob.topic
        # The help names the file key and the variable (wrapped lines joined).
        assert f"file key {k.name}; env {k.env};" in flat, k.name


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_option_beats_env_beats_file_beats_default(
    service: Service, tmp_path: Path, started: list[Any]
) -> None:
    ints = [k for k in settings(service.config, service.env_prefix) if k.kind is int and k.default >= 1]
    by_option, by_env, by_file, untouched = _four(ints)
    file = tmp_path / "c.toml"
    file.write_text(
        f"[{service.section}]\n"
        + "".join(f"{k.name} = {k.default + 1}\n" for k in (by_option, by_env, by_file))
    )
    env = {k.env: str(k.default + 2) for k in (by_option, by_env)}
    result = _run(service, service.args(file, by_option.option, str(by_option.default + 3)), env=env)
    assert result.exit_code == 0, result.output
    (config,) = started
    assert getattr(config, by_option.name) == by_option.default + 3
    assert getattr(config, by_env.name) == by_env.default + 2
    assert getattr(config, by_file.name) == by_file.default + 1
    assert getattr(config, untouched.name) == untouched.default


def _four(ints: list[Any]) -> tuple[Any, Any, Any, Any]:
    """Four int knobs whose default + 3 is still valid (sizes and counts, not ports or bounds)."""
    safe = [
        k
        for k in ints
        if k.name.startswith("max_") or k.name.endswith(("_tokens", "_streams", "_k", "_burst", "_max"))
    ]
    assert len(safe) >= 4, [k.name for k in ints]
    return safe[0], safe[1], safe[2], safe[3]


ALIASES = [
    (
        "node",
        ["--tracker", "http://t:1", "--peer", "a:1", "--peer", "b:2,c:3", "--relay", "http://g:1"]
        + ["--no-benchmark"],
        {"tracker_url": "http://t:1", "peers": "a:1,b:2,c:3", "relay_url": "http://g:1", "benchmark": False},
    ),
    (
        "gateway",
        ["--tracker", "http://t:1", "--no-usage-reports", "--no-anonymous", "--prefix-inexact"],
        {"tracker_url": "http://t:1", "report_usage": False, "allow_anonymous": False, "prefix_exact": False},
    ),
    (
        "tracker",
        ["--no-zeroconf", "--no-dashboard", "--no-challenges"],
        {"zeroconf": False, "dashboard": False, "challenge_nodes": False},
    ),
]


@pytest.mark.parametrize(("name", "args", "expected"), ALIASES, ids=[a[0] for a in ALIASES])
def test_older_spellings_still_work(
    name: str, args: list[str], expected: dict[str, Any], started: list[Any]
) -> None:
    service = BY_NAME[name]
    result = _run(service, service.args(None, *args))
    assert result.exit_code == 0, result.output
    (config,) = started
    assert {key: getattr(config, key) for key in expected} == expected


@pytest.mark.parametrize("service", SERVICES, ids=lambda s: s.name)
def test_older_spellings_are_accepted_and_named_in_the_help_only(service: Service) -> None:
    command = service.group.commands[service.command]
    names = {p.name: [*p.opts, *getattr(p, "secondary_opts", ())] for p in command.params}
    body = _help_body(service)
    flat = " ".join(body.split())
    for k in settings(service.config, service.env_prefix):
        for alias in k.knob.aliases + k.knob.off_aliases:
            assert alias in names[k.name]
            assert alias not in _names_columns(body)  # listed under the knob's own name only
            assert f"also {alias}" in flat


def test_an_option_outside_its_choices_is_a_usage_error(started: list[Any]) -> None:
    result = CliRunner().invoke(gateway_cli.main, ["serve", "--data-plane", "carrier-pigeon"])
    assert result.exit_code == 2 and "carrier-pigeon" in result.output and not started


def test_a_field_without_a_knob_is_refused() -> None:
    documented = dataclasses.field(default=1, metadata=knob("a count", topic="Counts"))
    bare = dataclasses.make_dataclass("Bare", [("documented", int, documented), ("bare", int, 2)])
    with pytest.raises(ConfigError, match="Bare.bare has no knob"):
        settings(bare, "X_")
    good = dataclasses.make_dataclass("Good", [("documented", int, documented)])
    (only,) = settings(good, "X_")
    assert (only.env, only.option, only.knob.topic) == ("X_DOCUMENTED", "--documented", "Counts")

"""Configuration layering and the sandboxed chat template (pure)."""

from __future__ import annotations

from pathlib import Path

import pytest

from common.config import help_of
from gateway.chat_template import ChatTemplate, TemplateError
from gateway.config import ConfigError, GatewayConfig, load_config


def test_layers_in_order(tmp_path: Path) -> None:
    file = tmp_path / "gw.toml"
    file.write_text('[gateway]\nmax_sessions = 3\nmax_queue = 4\ntracker_url = "http://t:1"\n')
    env = {"SWARM_GATEWAY_MAX_QUEUE": "5", "SWARM_GATEWAY_QUEUE_TIMEOUT_S": "2.5", "OTHER": "x"}
    config = load_config(file=file, env=env, flags={"max_sessions": 7, "port": None})
    assert (config.max_sessions, config.max_queue, config.queue_timeout_s) == (7, 5, 2.5)
    assert config.tracker_url == "http://t:1" and config.port == GatewayConfig().port
    with pytest.raises(AttributeError):
        config.max_sessions = 1  # type: ignore[misc]  # frozen


@pytest.mark.parametrize(
    ("file_text", "env", "flags", "needle"),
    [
        ("max_sesions = 3\n", {}, {}, "unknown key"),
        ("", {"SWARM_GATEWAY_MAX_SESIONS": "3"}, {}, "unknown environment variable"),
        ("", {}, {"max_sessions": 0}, "max_sessions"),
        ("", {"SWARM_GATEWAY_PORT": "eighty"}, {}, "port must be a int"),
        ("", {}, {"tracker_url": "tracker:7460"}, "http://"),
        ("", {}, {"log_level": "loud"}, "log_level"),
        ("", {}, {"responses_store_ttl_s": -1.0}, "responses_store_ttl_s"),
    ],
)
def test_refusals(tmp_path: Path, file_text: str, env: dict, flags: dict, needle: str) -> None:
    file = tmp_path / "gw.toml"
    file.write_text(file_text)
    with pytest.raises(ConfigError) as info:
        load_config(file=file, env=env, flags=flags)
    assert needle in str(info.value)


def test_every_field_documented_with_unit() -> None:
    import dataclasses

    for f in dataclasses.fields(GatewayConfig):
        assert help_of(f), f.name
        if "timeout" in f.name or "ttl" in f.name:
            assert f.name.endswith("_s"), f.name


SMOL = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are helpful<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_renders_with_generation_prompt() -> None:
    text = ChatTemplate(SMOL).render([{"role": "user", "content": "hi"}])
    assert text == (
        "<|im_start|>system\nYou are helpful<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    assert ChatTemplate(None).render([{"role": "user", "content": "x"}]).endswith("<|im_start|>assistant\n")


def test_sandbox_and_template_errors() -> None:
    escape = "{{ messages.__class__.__mro__[1].__subclasses__() }}"
    with pytest.raises(TemplateError):
        ChatTemplate(escape).render([{"role": "user", "content": "x"}])
    raising = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(TemplateError) as info:
        ChatTemplate(raising).render([{"role": "user", "content": "x"}])
    assert "roles must alternate" in info.value.message and info.value.status == 400
    with pytest.raises(TemplateError):
        ChatTemplate("{{ messages[5]['content'] + 1 }}").render([{"role": "user", "content": "x"}])

"""ToolsConfig: loaded like every config section (unknown keys refused), validated in one
line per mistake, documented field by field."""

from __future__ import annotations

import pytest

from pivot_hpc.agentic.config import ToolsConfig
from pivot_hpc.config.docs import field_docs
from pivot_hpc.config.loader import from_dict
from pivot_hpc.errors import ConfigError


def test_defaults_validate_and_build_the_limits():
    cfg = from_dict(ToolsConfig, {"enabled": True, "tools": ["calculator"]}, "tools")
    cfg.validate("tools")
    limits = cfg.sandbox_limits()
    assert (limits.timeout_s, limits.cpu_s, limits.memory_mb) == (5.0, 2, 256)
    assert cfg.trajectory_limits().max_tool_output_tokens == 64


def test_every_field_is_documented():
    docs = field_docs(ToolsConfig)
    assert docs and all(docs.values()), [k for k, v in docs.items() if not v]


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"shell": True}, "unknown config key"),
        ({"tools": ["calculator", "shell"]}, "unknown tool"),
        ({"tools": ["calculator", "calculator"]}, "each tool once"),
        ({"enabled": True, "tools": []}, "at least one tool"),
        ({"max_turns": 0}, "tools.max_turns"),
        ({"max_tool_output_tokens": 600}, "below tools.max_context_tokens"),
        ({"call_timeout_s": 0}, "tools.call_timeout_s"),
        ({"memory_mb": 8}, "tools.memory_mb"),
        ({"truncation_side": "middle"}, "valid choices"),
        ({"unhealthy_after_failures": 0}, "tools.unhealthy_after_failures"),
    ],
)
def test_mistakes_are_one_line(data, message):
    with pytest.raises(ConfigError, match=message) as info:
        from_dict(ToolsConfig, data, "tools").validate("tools")
    assert "\n" not in str(info.value)

"""docs/running.md's table of defaults that differ from Megatron-LM's states gridtron's own defaults:
each row's gridtron column equals the default of the flag it names (every flag of the row), so the
table cannot go stale when a default changes."""
import re
from pathlib import Path

from engine.config.cli import build_parser
from engine.config.fields import field_table

DOC = Path(__file__).resolve().parents[3] / "docs" / "running.md"


def rows() -> list[tuple[list[str], str]]:
    text = DOC.read_text()
    section = text[text.index("### Coming from Megatron-LM"):]
    section = section[:section.index("\nRules that differ")]
    out = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`--"):
            flags = re.findall(r"`(--[a-z0-9-]+)`", cells[0].split("(")[0])
            out.append((flags, cells[1]))
    return out


def shown(value) -> str:
    return {True: "on", False: "off"}.get(value, str(value)) if isinstance(value, bool) else str(value)


def test_the_gridtron_column_is_the_code_default():
    dest = {opt: a.dest for a in build_parser()._actions for opt in a.option_strings}
    table = field_table()
    found = rows()
    assert len(found) >= 15
    for flags, value in found:
        for flag in flags:
            assert shown(table[dest[flag]].default) == value, (flag, value)


# Megatron-LM's defaults (its argument parser and config dataclasses) of flags gridtron also has.
MEGATRON_DEFAULTS = {
    "--weight-decay": 0.01, "--adam-beta1": 0.9, "--adam-beta2": 0.999, "--adam-eps": 1e-8,
    "--clip-grad": 1.0, "--lr-decay-style": "linear", "--min-lr": 0.0, "--lr-warmup-iters": 0,
    "--dropout": 0.1, "--initial-loss-scale": 2.0 ** 32, "--loss-scale-window": 1000,
    "--hysteresis": 2, "--min-loss-scale": 1.0, "--log-interval": 100, "--eval-iters": 100,
    "--overlap-grad-reduce": False, "--overlap-param-gather": False, "--moe-grouped-gemm": False,
    "--moe-token-dispatcher-type": "allgather", "--log-straggler": False,
    "--use-distributed-optimizer": False, "--sequence-parallel": False, "--init-std": 0.02,
    "--rope-base": 10000, "--moe-router-topk": 2, "--moe-aux-loss-coeff": 0.0, "--seed": 1234,
    "--norm-eps": 1e-5, "--fp8-recipe": "delayed",
}


def test_every_default_that_differs_from_megatron_has_a_row():
    """A default that differs from Megatron-LM's (``--log-straggler``: on here, off there) is
    listed, so a ported script's user learns what it now gets."""
    dest = {opt: a.dest for a in build_parser()._actions for opt in a.option_strings}
    table = field_table()
    listed = {flag for flags, _ in rows() for flag in flags}
    differ = {flag for flag, theirs in MEGATRON_DEFAULTS.items()
              if table[dest[flag]].default != theirs}
    assert "--log-straggler" in differ and not differ - listed, sorted(differ - listed)

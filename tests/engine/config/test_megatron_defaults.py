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

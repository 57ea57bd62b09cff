"""The package's rooms: the map in docs/architecture.md names every folder of hf_zero/, and no module lies loose beside
them."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PKG = REPO / "hf_zero"


def _readme_map() -> str:
    text = (REPO / "docs" / "architecture.md").read_text()
    section = text.split("## Where things live", 1)[1].split("\n## ", 1)[0]
    return section.split("```", 2)[1]


def test_the_readme_map_names_every_room_and_only_rooms_that_exist():
    rooms = {p.name for p in PKG.iterdir() if (p / "__init__.py").is_file()}
    mapped = set(re.findall(r"^  ([a-z_]+)/", _readme_map(), re.M))
    assert mapped == rooms


def test_only_the_command_entry_point_lies_at_the_top_of_the_package():
    loose = {p.name for p in PKG.glob("*.py")} - {"__init__.py"}
    assert loose == {"cli.py"}


def test_every_module_the_map_names_exists_in_its_room():
    current = None
    named = []
    for line in _readme_map().splitlines():
        room = re.match(r"^  ([a-z_]+)/", line)
        if room:
            current = room.group(1)
        if current and line.startswith("  "):
            named += [(current, m) for m in re.findall(r"\(([a-z_]+\.py)", line)]
    assert named, "the map names no module"
    for room, module in named:
        assert (PKG / room / module).is_file(), f"{room}/{module} is named in the docs' map but does not exist"

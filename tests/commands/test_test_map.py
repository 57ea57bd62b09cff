"""docs/test-map.md says where a removed, merged or moved test's assertions run now. Instead of pinning the page to
a commit, every test its `now` column names must exist: a test renamed or removed later fails here, and the page is
fixed with it. (The `before` column names tests that are gone on purpose.)"""

import re

from testing_utils import REPO

PAGE = REPO / "docs" / "test-map.md"
NODE = re.compile(r"`(tests/[\w/]+\.py)::(\w+)")


def named_now(text: str) -> list[tuple[str, str]]:
    """(file, test function) of every node id in the table cells after the first (`before`) one."""
    return [hit for line in text.splitlines() if line.startswith("|")
            for cell in line.strip().strip("|").split("|")[1:] for hit in NODE.findall(cell)]


def missing(text: str) -> list[str]:
    out = []
    for path, name in named_now(text):
        source = REPO / path
        if not source.is_file() or not re.search(rf"^\s*(async )?def {name}\b", source.read_text(), re.M):
            out.append(f"{path}::{name}")
    return out


def test_every_test_the_map_points_to_exists():
    text = PAGE.read_text()
    assert len(named_now(text)) >= 20  # the page still maps tests (a format change would find none)
    assert missing(text) == []


def test_a_renamed_test_is_caught():
    row = "| `tests/old.py::test_gone` | `tests/commands/test_test_map.py::test_that_was_renamed` (fast) |"
    assert missing(row) == ["tests/commands/test_test_map.py::test_that_was_renamed"]
    assert missing(row.replace("test_that_was_renamed", "test_a_renamed_test_is_caught")) == []

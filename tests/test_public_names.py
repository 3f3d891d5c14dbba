"""The public names the architecture page lists are the package's, both ways: none listed that does not exist,
none exported that is not listed."""

import os
import re

import elastic

README = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "architecture.md")


def listed_names(text: str) -> set:
    """The `elastic.NAME` entries of the README's "Public names" list."""
    section = text.split("**Public names**", 1)[1].split("\n\n", 2)[1]
    return set(re.findall(r"`elastic\.(\w+)`", section))


def test_the_list_is_read_from_the_readme():
    assert {"run", "TorchState", "EvictedAsStraggler"} <= listed_names(open(README).read())


def test_every_listed_name_exists_and_every_exported_name_is_listed():
    listed = listed_names(open(README).read())
    assert [n for n in sorted(listed) if not hasattr(elastic, n)] == []
    assert listed == set(elastic.__all__)

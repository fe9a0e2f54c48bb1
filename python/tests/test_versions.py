"""The supported torch range (graphed.torch._versions), which setup.py and
`python -m graphed.torch.check` read, and the import error of an extension
built for another torch. Pure Python but the last test (torch)."""
import importlib.util

import pytest

from graphed.torch import _versions


def test_range_ends_are_supported_and_neighbours_are_not():
    oldest = f"{_versions.OLDEST[0]}.{_versions.OLDEST[1]}.0"
    newest = f"{_versions.NEWEST[0]}.{_versions.NEWEST[1]}.0+cu132"
    assert _versions.supported(oldest)
    assert _versions.supported(newest)
    assert not _versions.supported(f"{_versions.OLDEST[0]}.{_versions.OLDEST[1] - 1}.1")
    assert not _versions.supported(f"{_versions.NEWEST[0]}.{_versions.NEWEST[1] + 1}.0")
    assert _versions.text() == "2.11 to 2.15"


@pytest.mark.parametrize(
    "version, parsed",
    [("2.11.0", (2, 11)), ("2.15.0+cu132", (2, 15)), ("2.13.0a0+git1234", (2, 13)), ("3.0", (3, 0))],
)
def test_parse_reads_major_and_minor(version, parsed):
    assert _versions.parse(version) == parsed


@pytest.mark.parametrize("version", ["", "2", "two.eleven", "2.x.0"])
def test_parse_refuses_what_is_not_a_version(version):
    with pytest.raises(ValueError, match="not a torch version"):
        _versions.parse(version)


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")
def test_an_extension_built_for_another_torch_says_which(tmp_path, monkeypatch):
    import torch

    import graphed
    from graphed.torch import _make

    monkeypatch.setattr(graphed, "__file__", str(tmp_path / "__init__.py"))
    assert _make._built_for() == ""  # no record: nothing to say
    (tmp_path / "built_with_torch.txt").write_text(torch.__version__ + "\n")
    assert _make._built_for() == ""  # built for this torch
    (tmp_path / "built_with_torch.txt").write_text("2.0.0+other\n")  # never the torch running
    assert _make._built_for() == (
        f" It was built against torch 2.0.0+other; this is torch {torch.__version__}: rebuild it against this torch."
    )

"""The supported torch range (graphed.torch._versions), which setup.py and
`python -m graphed.torch.check` read. Pure Python: no torch needed."""
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

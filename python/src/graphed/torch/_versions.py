"""The PyTorch versions graphed.torch builds on and is tested against, in
one place: setup.py refuses others at install (unless
GRAPHED_ALLOW_ANY_TORCH=1), `python -m graphed.torch.check` prints the
range, and CI builds against both ends (scripts/torch-compat.sh).

Imports nothing, so that setup.py can read it before torch is imported.
"""

OLDEST = (2, 11)
NEWEST = (2, 15)


def parse(version):
    """(major, minor) of a torch version string such as '2.15.0+cu132'."""
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        raise ValueError(f"not a torch version: {version!r}") from None


def supported(version):
    return OLDEST <= parse(version) <= NEWEST


def text():
    return f"{OLDEST[0]}.{OLDEST[1]} to {NEWEST[0]}.{NEWEST[1]}"

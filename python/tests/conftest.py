"""pytest setup: the tests use the installed graphed package, else the
sources in python/src (the pure-Python parts import without the compiled
extension)."""
import pathlib
import sys

try:
    import graphed  # noqa: F401
except ImportError:
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

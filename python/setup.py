"""Builds graphed's PyTorch extension (graphed._torch_ext) against the
installed torch, at build time, and bundles libgraphed.so beside it; the
extension finds the library through an $ORIGIN rpath, so the wheel works
wherever it is installed or moved.

    pip install --no-build-isolation python/                  # builds libgraphed.so with cargo
    GRAPHED_PREBUILT_LIBRARY=/path/to/libgraphed.so \\
        pip install --no-build-isolation --no-deps python/    # machines without Rust

The header comes from GRAPHED_INCLUDE_DIR, else the repository's include/.
Set GRAPHED_CUDA_ARCH_LIST, TORCH_CUDA_ARCH_LIST or MAX_JOBS as with any
torch extension (the extension itself has no device code).
"""
import os
import pathlib
import shutil
import subprocess

from setuptools import setup
from torch.utils.cpp_extension import BuildExtension, CUDAExtension

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def graphed_library():
    """The libgraphed.so to bundle."""
    prebuilt = os.environ.get("GRAPHED_PREBUILT_LIBRARY")
    if prebuilt:
        path = pathlib.Path(prebuilt).expanduser().resolve()
        if not path.is_file():
            raise SystemExit(f"graphed: GRAPHED_PREBUILT_LIBRARY={prebuilt} is not a file")
        return path
    if not (REPO / "Cargo.toml").is_file():
        raise SystemExit(
            "graphed: no libgraphed.so: set GRAPHED_PREBUILT_LIBRARY to a built one "
            "(this source tree is not inside the graphed repository, so cargo cannot build it)"
        )
    cargo = shutil.which("cargo")
    if cargo is None:
        raise SystemExit(
            "graphed: no libgraphed.so: cargo is not installed here; build the library on a machine "
            "with Rust (cargo build --release) and set GRAPHED_PREBUILT_LIBRARY to it"
        )
    subprocess.run([cargo, "build", "--release", "--quiet"], cwd=REPO, check=True)
    return REPO / "target" / "release" / "libgraphed.so"


def graphed_include_dir():
    path = pathlib.Path(os.environ.get("GRAPHED_INCLUDE_DIR", REPO / "include")).resolve()
    if not (path / "graphed.h").is_file():
        raise SystemExit(f"graphed: graphed.h is not in {path}; set GRAPHED_INCLUDE_DIR")
    return path


class Build(BuildExtension):
    """Copies libgraphed.so next to the extension, then builds it."""

    def build_extensions(self):
        library = graphed_library()
        out_dir = pathlib.Path(self.get_ext_fullpath("graphed._torch_ext")).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, out_dir / "libgraphed.so")
        include = str(graphed_include_dir())
        for ext in self.extensions:
            ext.include_dirs.append(include)
            ext.library_dirs.append(str(out_dir))
        super().build_extensions()
        if self.inplace:  # editable installs: the extension is copied into the sources
            package = pathlib.Path(self.get_finalized_command("build_py").get_package_dir("graphed"))
            shutil.copy2(library, package / "libgraphed.so")


setup(
    ext_modules=[
        CUDAExtension(
            name="graphed._torch_ext",
            # The Python extension (csrc/extension.cpp) and the adapter (csrc/graphed_torch/).
            sources=[str(p.relative_to(HERE)) for p in sorted((HERE / "csrc").glob("**/*.cpp"))],
            include_dirs=[str(HERE / "csrc")],
            libraries=["graphed"],
            extra_compile_args={"cxx": ["-O2", "-Wall", "-Wno-unused-function"]},
            # The bundled library sits beside the extension.
            extra_link_args=["-Wl,-rpath,$ORIGIN"],
        )
    ],
    cmdclass={"build_ext": Build},
)

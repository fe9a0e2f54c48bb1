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

The torch it builds against must be one of the supported versions
(src/graphed/torch/_versions.py; GRAPHED_ALLOW_ANY_TORCH=1 tries another),
and a CUDA compiler must be found (CUDA_HOME or nvcc on PATH); a failed build
names both.
"""
import os
import pathlib
import shutil
import subprocess

from setuptools import setup

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parent


def supported_versions():
    """src/graphed/torch/_versions.py, read without importing the package."""
    namespace = {}
    source = HERE / "src" / "graphed" / "torch" / "_versions.py"
    exec(compile(source.read_text(), str(source), "exec"), namespace)
    return namespace


VERSIONS = supported_versions()

try:
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CUDAExtension
except ImportError as e:
    raise SystemExit(
        f"graphed: torch is not importable here ({e}); install the torch you will run first "
        f"(supported: {VERSIONS['text']()}), then `pip install --no-build-isolation python/`"
    ) from e

TORCH = f"torch {torch.__version__} (built with CUDA {torch.version.cuda})"


def cuda_compiler():
    """What nvcc the build uses, in words."""
    if CUDA_HOME is None:
        return "no CUDA compiler (CUDA_HOME is not set and nvcc is not on PATH)"
    nvcc = pathlib.Path(CUDA_HOME) / "bin" / "nvcc"
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, check=True).stdout
        release = next((line.split("release")[1].split(",")[0].strip() for line in out.splitlines() if "release" in line), "?")
        return f"nvcc {release} at {nvcc}"
    except (OSError, subprocess.CalledProcessError) as e:
        return f"no working nvcc at {nvcc} ({e})"


if torch.version.cuda is None:
    raise SystemExit(f"graphed: {TORCH} has no CUDA; graphed.torch needs a CUDA build of torch")
if not VERSIONS["supported"](torch.__version__) and os.environ.get("GRAPHED_ALLOW_ANY_TORCH") != "1":
    raise SystemExit(
        f"graphed: {TORCH} is outside the supported range {VERSIONS['text']()}; "
        "install a supported torch, or set GRAPHED_ALLOW_ANY_TORCH=1 to try the build anyway"
    )
if CUDA_HOME is None:
    raise SystemExit(f"graphed: building against {TORCH} needs a CUDA compiler: {cuda_compiler()}")


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
        print(f"graphed: building against {TORCH} with {cuda_compiler()}")
        try:
            self._build()
        except Exception as e:
            raise SystemExit(
                f"graphed: the extension did not build against {TORCH} with {cuda_compiler()} "
                f"(supported torch: {VERSIONS['text']()}): {e}"
            ) from e

    def _build(self):
        library = graphed_library()
        out_dir = pathlib.Path(self.get_ext_fullpath("graphed._torch_ext")).parent
        out_dir.mkdir(parents=True, exist_ok=True)
        shutil.copy2(library, out_dir / "libgraphed.so")
        include = str(graphed_include_dir())
        for ext in self.extensions:
            ext.include_dirs.append(include)
            ext.library_dirs.append(str(out_dir))
        # The torch this build is for, read back when the extension fails to
        # load under another torch (graphed.torch._make.extension).
        (out_dir / "built_with_torch.txt").write_text(torch.__version__ + "\n")
        super().build_extensions()

    def copy_extensions_to_source(self):
        """In place (build_ext --inplace, editable installs), setuptools builds
        into build/ with inplace off, then copies the extension into the
        sources: the library and the torch version go beside it."""
        super().copy_extensions_to_source()
        built = pathlib.Path(self.build_lib) / "graphed"
        package = pathlib.Path(self.get_finalized_command("build_py").get_package_dir("graphed"))
        for name in ("libgraphed.so", "built_with_torch.txt"):
            shutil.copy2(built / name, package / name)


setup(
    ext_modules=[
        CUDAExtension(
            name="graphed._torch_ext",
            # The Python extension (csrc/extension.cpp, csrc/extension/) and the adapter (csrc/graphed_torch/).
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

"""llama.cpp's own server, `llama-server`: where it is, and building it once from the llama.cpp that the
installed llama-cpp-python's source distribution vendors (MIT) — the same llama.cpp as modelpool's own engine,
so the two differ only in their serving layers.

`python -m services.engines.llama_server.binary` (run by `make install`) builds it when it is missing:
portable (no -march=native), statically linked, about 10 minutes on 2 cores, into
`~/.cache/modelpool/bin/llama-server-<version>` (or `$MODELPOOL_CACHE_DIR/bin`), beside the llama.cpp wheel,
so fresh clones on the same machine reuse it. `MODELPOOL_LLAMA_SERVER` names another binary instead.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

BINDING = "llama_cpp_python"
CMAKE_FLAGS = ["-DGGML_NATIVE=OFF", "-DLLAMA_BUILD_SERVER=ON", "-DLLAMA_CURL=OFF", "-DBUILD_SHARED_LIBS=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DCMAKE_BUILD_TYPE=Release"]


class LlamaServerMissing(RuntimeError):
    pass


def binding_version() -> str:
    return importlib.metadata.version(BINDING)


def cached_binary(version: str | None = None) -> Path:
    cache = Path(os.environ.get("MODELPOOL_CACHE_DIR") or Path.home() / ".cache" / "modelpool")
    return cache / "bin" / f"llama-server-{version or binding_version()}"


def llama_server_binary() -> Path:
    """The llama-server to run: `MODELPOOL_LLAMA_SERVER`, else the one built for the installed binding;
    `LlamaServerMissing` saying how to get one otherwise."""
    named = os.environ.get("MODELPOOL_LLAMA_SERVER")
    path = Path(named) if named else cached_binary()
    if path.is_file() and os.access(path, os.X_OK):
        return path
    raise LlamaServerMissing(f"no llama-server at {path}: build it with `python -m services.engines.llama_server.binary`"
                             " (make install does), or set MODELPOOL_LLAMA_SERVER to one")


def available() -> bool:
    try:
        llama_server_binary()
    except (LlamaServerMissing, importlib.metadata.PackageNotFoundError):
        return False
    return True


def say(message: str) -> None:
    print(f"[llama-server] {message}", file=sys.stderr, flush=True)


def build(version: str, out: Path, jobs: int) -> Path:
    """Download llama-cpp-python's sdist of `version`, build its vendored llama.cpp's llama-server, install it
    at `out` (atomically: an interrupted build leaves nothing half-written there)."""
    began = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="modelpool-llama-server-") as tmp:
        work = Path(tmp)
        say(f"downloading the source of llama-cpp-python {version}")
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
                        "--dest", str(work), f"llama-cpp-python=={version}"], check=True)
        archive = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(archive) as tar:
            vendored = [m for m in tar.getmembers() if "/vendor/llama.cpp/" in m.name]
            tar.extractall(work, members=vendored, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build_dir = work / "build"
        say(f"configuring ({' '.join(CMAKE_FLAGS)})")
        subprocess.run(["cmake", "-S", str(source), "-B", str(build_dir), *CMAKE_FLAGS], check=True,
                       stdout=subprocess.DEVNULL)
        say(f"compiling llama-server with {jobs} jobs (about 10 minutes on 2 cores)")
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "llama-server", "-j", str(jobs)], check=True,
                       stdout=subprocess.DEVNULL)
        out.parent.mkdir(parents=True, exist_ok=True)
        staged = out.with_name(f".{out.name}.partial")
        shutil.copy2(build_dir / "bin" / "llama-server", staged)
        shutil.copy2(source / "LICENSE", out.with_name(f"{out.name}.LICENSE"))
        staged.chmod(0o755)
        os.replace(staged, out)
    say(f"built {out} in {time.monotonic() - began:.0f} s")
    return out


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m services.engines.llama_server.binary",
                                     description="build llama-server once for the installed llama-cpp-python")
    parser.add_argument("--force", action="store_true", help="build even if the binary is there")
    parser.add_argument("--jobs", type=int, default=int(os.environ.get("CMAKE_BUILD_PARALLEL_LEVEL") or os.cpu_count() or 2))
    args = parser.parse_args(argv)
    out = cached_binary()
    if out.is_file() and not args.force:
        say(f"{out} is there")
        return 0
    build(binding_version(), out, args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

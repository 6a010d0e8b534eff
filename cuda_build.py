"""How setup.py builds the CUDA extension ``bertfast._C`` from csrc/.

Environment:
  BERTFAST_BUILD_CUDA   auto (default): build when nvcc is found, else install without the module;
                        1: build or fail loudly; 0: never build.
  BERTFAST_CUDA_ARCHS   compute capabilities, ";"- or ","-separated (default "80;90a"): one
                        ``-gencode`` each (SASS), plus PTX of the newest for later GPUs. >= 80.
                        90a is sm_90 with its arch-specific features (wgmma: the CUDA attention's
                        wgmma kernels run from it); give 90 or 90a, not both.
  MAX_JOBS              compiles at once (default: CPU count), nvcc's threads counted: each nvcc runs
                        its targets (an arch's SASS, the PTX) in threads of their own (--threads), so
                        MAX_JOBS // targets sources compile side by side.
  CUDA_HOME / CUDA_PATH where the toolkit lives (default: found from nvcc).
  CXX                   host compiler for nvcc (-ccbin) and the binding (default: g++).

The .cu files (torch-free) compile with nvcc, the pybind11 binding with the host compiler,
both through ninja when it is installed (else a thread pool); the module links the CUDA
runtime statically when libcudart_static.a is there (it then imports on a machine with no
driver: no CUDA call happens at import), else the shared libcudart (also the pip
nvidia-cuda-runtime layout). A compile error fails the build whenever a build was attempted,
so CI catches it. No --use_fast_math: the exact GELU needs a precise erf.
"""
from __future__ import annotations

import concurrent.futures
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.join(ROOT, "csrc")
EXT_NAME = "bertfast._C"
DEFAULT_ARCHS = "80;90a"


def _log(msg: str) -> None:
    print(f"[bertfast cuda_build] {msg}", file=sys.stderr, flush=True)


def build_mode() -> str:
    mode = os.environ.get("BERTFAST_BUILD_CUDA", "auto").strip().lower()
    if mode not in ("auto", "0", "1"):
        raise RuntimeError(f"BERTFAST_BUILD_CUDA must be auto, 0 or 1, got {mode!r}")
    return mode


def find_nvcc():
    """Path of nvcc: $CUDA_HOME/bin/nvcc, $CUDA_PATH/bin/nvcc, then PATH; None when absent."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home and os.path.isfile(os.path.join(home, "bin", "nvcc")):
            return os.path.join(home, "bin", "nvcc")
    return shutil.which("nvcc")


def parse_archs(text: str):
    """'80;90' -> ['80', '90'] (also '8.0', '90a'); each must be >= 80 (bf16 tensor cores)."""
    archs = []
    for item in re.split(r"[;,\s]+", text.strip()):
        if not item:
            continue
        arch = item.replace(".", "").replace("sm_", "").replace("compute_", "")
        if not re.fullmatch(r"\d{2,3}[af]?", arch) or int(re.match(r"\d+", arch).group()) < 80:
            raise RuntimeError(f"BERTFAST_CUDA_ARCHS: {item!r} is not a compute capability >= 8.0 "
                               f"(expected e.g. '80;90')")
        if arch not in archs:
            archs.append(arch)
    if not archs:
        raise RuntimeError("BERTFAST_CUDA_ARCHS is empty")
    for arch in archs:
        if arch.endswith("a") and arch[:-1] in archs:  # two cubins for one GPU: which one loads is unclear
            raise RuntimeError(f"BERTFAST_CUDA_ARCHS: give {arch[:-1]} or {arch}, not both ({arch} is {arch[:-1]} "
                               "with its arch-specific features)")
    return archs


def gencode_flags(archs):
    flags = []
    for arch in archs:
        flags += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    # PTX of the newest arch (its portable part: 90a gives compute_90), JIT-compiled on later GPUs
    newest = max(int(re.match(r"\d+", a).group()) for a in archs)
    flags += ["-gencode", f"arch=compute_{newest},code=compute_{newest}"]
    return flags


def _nvcc_dirs(nvcc: str):
    """(include dirs, library dirs) nvcc itself uses (`nvcc --dryrun`), e.g. targets/x86_64-linux."""
    try:
        out = subprocess.run([nvcc, "--dryrun", "-c", "x.cu", "-o", "x.o"], capture_output=True, text=True,
                             timeout=60).stderr
    except (OSError, subprocess.SubprocessError):
        return [], []
    incs, libs = [], []
    for line in out.splitlines():
        if line.startswith("#$ INCLUDES=") or line.startswith("#$ LIBRARIES="):
            for tok in shlex.split(line.split("=", 1)[1]):
                if tok.startswith("-I"):
                    incs.append(os.path.normpath(tok[2:]))
                elif tok.startswith("-L") and not tok.rstrip("/").endswith("stubs"):
                    libs.append(os.path.normpath(tok[2:]))
    return incs, libs


def _pip_cuda_runtime_dirs():
    """include/lib of a pip-installed CUDA runtime (nvidia/cuda_runtime for cu12, nvidia/cu13)."""
    found = []
    for site in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for sub in ("nvidia/cu13", "nvidia/cuda_runtime"):
            base = os.path.join(site, sub)
            if os.path.isfile(os.path.join(base, "include", "cuda_runtime.h")):
                found.append((os.path.join(base, "include"), os.path.join(base, "lib")))
    return found


def find_cuda(nvcc: str) -> dict:
    """Include dir and how to link the CUDA runtime, for the host compile and the link."""
    candidates_inc, candidates_lib = _nvcc_dirs(nvcc)
    homes = [os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
             os.path.dirname(os.path.dirname(os.path.realpath(nvcc))), "/usr/local/cuda"]
    for home in filter(None, homes):
        candidates_inc += [os.path.join(home, "include"), os.path.join(home, "targets", "x86_64-linux", "include")]
        candidates_lib += [os.path.join(home, d) for d in ("lib64", "lib", "targets/x86_64-linux/lib")]
    for inc, lib in _pip_cuda_runtime_dirs():
        candidates_inc.append(inc)
        candidates_lib.append(lib)
    include = next((d for d in candidates_inc if os.path.isfile(os.path.join(d, "cuda_runtime.h"))), None)
    if include is None:
        raise RuntimeError(f"cuda_runtime.h not found (nvcc at {nvcc}; looked in {candidates_inc})")
    for d in candidates_lib:
        if os.path.isfile(os.path.join(d, "libcudart_static.a")):
            return {"include": include, "lib_dir": d, "libs": ["cudart_static", "dl", "rt", "pthread"],
                    "rpath": [], "runtime": "static"}
    for d in candidates_lib:
        shared = sorted(glob.glob(os.path.join(d, "libcudart.so*")))
        if shared:
            name = "cudart" if os.path.exists(os.path.join(d, "libcudart.so")) else ":" + os.path.basename(shared[-1])
            return {"include": include, "lib_dir": d, "libs": [name], "rpath": [d], "runtime": "shared"}
    raise RuntimeError(f"libcudart not found (nvcc at {nvcc}; looked in {candidates_lib})")


def _sources():
    cu = sorted(glob.glob(os.path.join(CSRC, "*.cu")))
    cpp = sorted(glob.glob(os.path.join(CSRC, "*.cpp")))
    return cu, cpp


def _max_jobs() -> int:
    try:
        return max(1, int(os.environ.get("MAX_JOBS", "")))
    except ValueError:
        return max(1, os.cpu_count() or 1)


def nvcc_threads(archs) -> int:
    """nvcc's threads for one source: a thread per target, each arch's SASS and the PTX."""
    return len(archs) + 1


def _parallel_sources(archs) -> int:
    return max(1, _max_jobs() // nvcc_threads(archs))


def _host_cxx() -> str:
    return os.environ.get("CXX") or shutil.which("g++") or "c++"


def _compile_commands(nvcc, cuda, archs, obj_dir):
    """[(object, command list)] for every source."""
    import pybind11

    cu, cpp = _sources()
    cxx = _host_cxx()
    archs_text = ";".join(archs)
    nvcc_flags = ["-std=c++17", "-O3", "-lineinfo", "-ccbin", cxx, "-Xcompiler", "-fPIC", "--threads",
                  str(nvcc_threads(archs)), "-I" + CSRC] + gencode_flags(archs)
    cxx_flags = ["-std=c++17", "-O2", "-fPIC", "-fvisibility=hidden", "-I" + CSRC,
                 "-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
                 f'-DBERTFAST_CUDA_ARCHS="{archs_text}"', f'-DBERTFAST_CUDA_RUNTIME="{cuda["runtime"]}"']
    jobs = []
    for src in cu:
        obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
        jobs.append((obj, [nvcc] + nvcc_flags + ["-c", src, "-o", obj], "nvcc"))
    for src in cpp:
        obj = os.path.join(obj_dir, os.path.basename(src) + ".o")
        jobs.append((obj, [cxx] + cxx_flags + ["-c", src, "-o", obj], "cxx"))
    return jobs


def _run_ninja(jobs, build_dir, parallel: int) -> None:
    ninja = shutil.which("ninja")
    if ninja is None:
        try:
            import ninja as ninja_pkg  # the PyPI wheel ships the binary

            ninja = os.path.join(ninja_pkg.BIN_DIR, "ninja")
        except ImportError:
            ninja = None
    if ninja is None:
        _log(f"ninja not found; compiling with a thread pool of {parallel}")
        with concurrent.futures.ThreadPoolExecutor(parallel) as pool:
            results = list(pool.map(lambda j: subprocess.run(j[1], capture_output=True, text=True), jobs))
        for (obj, cmd, _), res in zip(jobs, results):
            if res.returncode != 0:
                raise RuntimeError(f"compiling {obj} failed:\n{' '.join(cmd)}\n{res.stdout}{res.stderr}")
        return
    lines = ["ninja_required_version = 1.3", ""]
    for kind in ("nvcc", "cxx"):
        lines += [f"rule {kind}", "  command = $cmd -MD -MF $out.d", "  depfile = $out.d", "  deps = gcc",
                  f"  description = {kind} $out", ""]
    for obj, cmd, kind in jobs:
        src = cmd[cmd.index("-c") + 1]
        body = " ".join(shlex.quote(c) for c in cmd).replace("$", "$$")
        lines += [f"build {_ninja_escape(obj)}: {kind} {_ninja_escape(src)}", f"  cmd = {body}", ""]
    path = os.path.join(build_dir, "build.ninja")
    with open(path, "w") as fh:
        fh.write("\n".join(lines))
    _log(f"ninja -j {parallel} ({len(jobs)} sources)")
    subprocess.run([ninja, "-C", build_dir, "-j", str(parallel)], check=True)


def _ninja_escape(path: str) -> str:
    return path.replace("$", "$$").replace(" ", "$ ").replace(":", "$:")


def cuda_extension_kwargs() -> dict:
    """setup() keyword arguments that build bertfast._C, or {} when it is not to be built."""
    mode = build_mode()
    if mode == "0":
        _log("BERTFAST_BUILD_CUDA=0: installing without bertfast._C")
        return {}
    nvcc = find_nvcc()
    if nvcc is None:
        if mode == "1":
            raise RuntimeError("BERTFAST_BUILD_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
        _log("nvcc not found: installing without bertfast._C (BERTFAST_BUILD_CUDA=auto)")
        return {}
    archs = parse_archs(os.environ.get("BERTFAST_CUDA_ARCHS", DEFAULT_ARCHS))

    from setuptools import Extension
    from setuptools.command.build_ext import build_ext

    class CudaBuildExt(build_ext):
        """Compiles csrc/ with nvcc + the host compiler, links with setuptools' linker."""

        def build_extension(self, ext):
            if ext.name != EXT_NAME:
                return super().build_extension(ext)
            import time

            start = time.time()
            cuda = find_cuda(nvcc)
            build_dir = os.path.abspath(os.path.join(self.build_temp, "bertfast_cuda"))
            os.makedirs(build_dir, exist_ok=True)
            jobs = _compile_commands(nvcc, cuda, archs, build_dir)
            _log(f"nvcc {nvcc}; CUDA include {cuda['include']}; runtime {cuda['runtime']} from {cuda['lib_dir']}; "
                 f"archs {';'.join(archs)}")
            _run_ninja(jobs, build_dir, _parallel_sources(archs))
            out = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
            link = [_host_cxx(), "-shared", "-o", out] + [obj for obj, _, _ in jobs]
            link += ["-L" + cuda["lib_dir"]] + ["-l" + lib for lib in cuda["libs"]]
            link += ["-Wl,-rpath," + d for d in cuda["rpath"]]
            subprocess.run(link, check=True)
            _log(f"built {out} ({os.path.getsize(out) / 1e6:.1f} MB) in {time.time() - start:.0f} s")

    ext = Extension(EXT_NAME, sources=[os.path.relpath(p, ROOT) for p in sum(_sources(), [])])
    return {"ext_modules": [ext], "cmdclass": {"build_ext": CudaBuildExt}}

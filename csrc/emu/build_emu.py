"""Build bertfast's CUDA kernels as a CPU-emulated pybind11 module (for testing without a GPU).

The csrc/ sources are copied with three mechanical rewrites, then compiled with g++ against
emu.h (threads, barriers, shuffles and the PTX the attention issues, on the CPU) and emu_runtime.cpp
(runtime stubs):
  kernel<<<grid, block, smem, stream>>>(args);  ->  ::emu::launch(kernel, grid, block, smem, stream, args);
  extern __shared__ [__align__(n)] T name[];     ->  T* name = reinterpret_cast<T*>(::emu::dyn_smem());
  __shared__ T name[...];                        ->  static T name[...];   (blocks run one at a time)
and with BERTFAST_EMU defined, under which ptx.cuh and wgmma.cuh leave their inline PTX (ldmatrix, mma.sync,
cp.async, wgmma) to emu.h's emulation. Everything else (kernels, launchers, binding) is the real code. Usage:
  python csrc/emu/build_emu.py OUT_DIR     -> OUT_DIR/_C<ext suffix>; load with load(OUT_DIR).
"""
import concurrent.futures
import glob
import importlib.machinery
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = os.path.dirname(HERE)


def _split_top(text: str):
    """Split on commas outside (), <>, [] and {}."""
    parts, depth, cur = [], 0, []
    for ch in text:
        if ch in "([{<":
            depth += 1
        elif ch in ")]}>":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append("".join(cur).strip())
            cur = []
        else:
            cur.append(ch)
    if cur:
        parts.append("".join(cur).strip())
    return parts


def _rewrite_launches(src: str) -> str:
    out, pos = [], 0
    while True:
        i = src.find("<<<", pos)
        if i < 0:
            out.append(src[pos:])
            return "".join(out)
        # kernel expression: back to the start of the statement
        start = i
        while start > 0 and src[start - 1] not in ";{}\n":
            start -= 1
        while src[start] in " \t":
            start += 1
        kernel = src[start:i]
        j = src.index(">>>", i)
        config = _split_top(src[i + 3:j])
        while len(config) < 4:
            config.append("0" if len(config) == 2 else "nullptr")
        k = src.index("(", j)
        depth, m = 0, k
        while True:
            if src[m] == "(":
                depth += 1
            elif src[m] == ")":
                depth -= 1
                if depth == 0:
                    break
            m += 1
        args = src[k + 1:m].strip()
        call = f"::emu::launch({kernel}, {', '.join(config)}" + (f", {args})" if args else ")")
        out.append(src[pos:start] + call)
        pos = m + 1


def transform(src: str) -> str:
    src = re.sub(r"extern __shared__\s+(?:__align__\(\d+\)\s+)?([\w:][\w:\s]*?)\s+(\w+)\[\];",
                 r"\1* \2 = reinterpret_cast<\1*>(::emu::dyn_smem());", src)
    src = re.sub(r"(?<![\w])__shared__\s+", "static ", src)
    return _rewrite_launches(src)


def build(out_dir: str, jobs: int = 0) -> str:
    import pybind11

    src_dir = os.path.join(out_dir, "src")
    os.makedirs(src_dir, exist_ok=True)
    units = []
    for path in glob.glob(os.path.join(CSRC, "*")):
        name = os.path.basename(path)
        if not os.path.isfile(path):
            continue
        with open(path) as fh:
            text = fh.read()
        if name.endswith((".cu", ".cuh")):
            text = transform(text)
        if name == "common.cuh":
            text = text.replace('#include "bertfast.h"', '#include "bertfast.h"\n#include "emu.h"')
        target = name[:-3] + ".cpp" if name.endswith(".cu") else name
        with open(os.path.join(src_dir, target), "w") as fh:
            fh.write(text)
        if target.endswith(".cpp"):
            units.append(os.path.join(src_dir, target))
    shutil.copy(os.path.join(HERE, "emu.h"), src_dir)
    shutil.copy(os.path.join(HERE, "emu_runtime.cpp"), src_dir)
    units.append(os.path.join(src_dir, "emu_runtime.cpp"))

    cuda_inc = _cuda_include()
    flags = ["-std=c++20", "-O1", "-g0", "-fPIC", "-pthread", "-w", "-I" + src_dir, "-I" + cuda_inc,
             "-I" + pybind11.get_include(), "-I" + sysconfig.get_paths()["include"],
             '-DBERTFAST_EMU', '-DBERTFAST_CUDA_ARCHS="emu"', '-DBERTFAST_CUDA_RUNTIME="emulated"']

    def compile_one(unit):
        obj = unit + ".o"
        res = subprocess.run(["g++"] + flags + ["-c", unit, "-o", obj], capture_output=True, text=True)
        if res.returncode:
            raise RuntimeError(f"g++ failed on {unit}:\n{res.stderr[-6000:]}")
        return obj

    jobs = jobs or int(os.environ.get("MAX_JOBS", os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max(1, jobs)) as pool:
        objs = list(pool.map(compile_one, units))
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    target = os.path.join(out_dir, "_C" + suffix)
    subprocess.run(["g++", "-shared", "-pthread", "-o", target] + objs, check=True)
    return target


def _cuda_include() -> str:
    sys.path.insert(0, os.path.dirname(CSRC))
    import cuda_build

    nvcc = cuda_build.find_nvcc()
    if nvcc is None:
        raise RuntimeError("the CUDA headers (found through nvcc) are needed to build the emulation")
    return cuda_build.find_cuda(nvcc)["include"]


def load(out_dir: str):
    path = os.path.join(out_dir, "_C" + sysconfig.get_config_var("EXT_SUFFIX"))
    loader = importlib.machinery.ExtensionFileLoader("_C", path)
    spec = importlib.util.spec_from_loader("_C", loader)
    module = importlib.util.module_from_spec(spec)
    loader.exec_module(module)
    return module


if __name__ == "__main__":
    print(build(sys.argv[1]))

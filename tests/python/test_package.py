#!/usr/bin/python3
"""`pip install .` gives a package that works outside the checkout: into a fresh virtual
environment that sees this interpreter's packages (torch among them: a .pth file names its
site-packages; offline: --no-index --no-build-isolation, as a user installs into their own
environment with their torch), then, from a directory outside the repository with no
VRAMSWAP_* path set:
  - `vramswap --version` prints vramswap.__version__, which is CMakeLists.txt's VERSION;
  - `vramswap doctor --json` reports the torch imported here, and both LibTorch extensions
    (the CPU-emulation one, and the CUDA one where torch is a CUDA build) "ok";
  - `vramswap run --help`, `bench --help` and `replay --help` print their usage and exit 0;
  - the package loads its own libvramswap.so on its own cudasim (both inside the
    environment) and serves an allocation;
  - `vramswap run -- python train.py` trains a small model in the CPU-emulation mode, with
    evictions, through the console script;
  - `vramswap bench --quick` runs the default scenario from the installed package.
The libraries come from this build (VRAMSWAP_CMAKE_BUILD_DIR: setup.py copies them rather
than building them again); a fresh build through setup.py is the same copy after a CMake
build.
Usage: python3 tests/python/test_package.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY (this build's libvramswap.so: its tree is the one copied),
VRAMSWAP_CACHE_DIR (the torch extension, built once for all the Python tests).
"""
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

TRAIN = """
import torch, vramswap
torch.manual_seed(0)
model = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.GELU()) for _ in range(6)])
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(512, 256)
for _ in range(3):
    loss = model(x).square().mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
s = vramswap.memory_stats()
print("trained", float(loss), "evictions", s["num_evictions"])
"""


def main():
    from vramswap._version import __version__
    failures = []

    def check(cond, what, detail=""):
        print(("ok   " if cond else "FAIL ") + what)
        if not cond:
            failures.append(what)
            if detail:
                print("     " + detail.strip().replace("\n", "\n     ")[-3000:])

    cmake = re.search(r"project\(vramswap VERSION ([0-9.]+)", (REPO / "CMakeLists.txt").read_text())
    check(cmake and cmake.group(1) == __version__,
          f"vramswap.__version__ ({__version__}) is CMakeLists.txt's VERSION ({cmake and cmake.group(1)})")
    build_dir = Path(os.environ["VRAMSWAP_LIBRARY"]).resolve().parent.parent
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        venv = tmp / "venv"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        import sysconfig
        import torch
        site = subprocess.run([str(venv / "bin" / "python"), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                              capture_output=True, text=True, check=True).stdout.strip()
        (Path(site) / "suite_torch.pth").write_text(sysconfig.get_path("purelib") + "\n")
        env = {k: v for k, v in os.environ.items()
               if not k.startswith(("VRAMSWAP_", "CUDASIM_")) and k != "PYTHONPATH"}
        pip = subprocess.run([str(venv / "bin" / "pip"), "install", "--no-build-isolation", "--no-index",
                              "--no-deps", "--quiet", str(REPO)],
                             env=dict(env, VRAMSWAP_CMAKE_BUILD_DIR=str(build_dir)), cwd=tmp,
                             capture_output=True, text=True)
        check(pip.returncode == 0, "pip install . into a fresh virtual environment", pip.stdout + pip.stderr)
        if pip.returncode != 0:
            return 1
        work = tmp / "elsewhere"
        work.mkdir()

        def run(*args, extra=None, timeout=300):
            return subprocess.run([str(a) for a in args], env=dict(env, **(extra or {})), cwd=work,
                                  capture_output=True, text=True, timeout=timeout)

        exe, python = venv / "bin" / "vramswap", venv / "bin" / "python"
        v = run(exe, "--version")
        check(v.returncode == 0 and v.stdout.strip() == f"vramswap {__version__}",
              f"vramswap --version says 'vramswap {__version__}'", v.stdout + v.stderr)
        doctor = run(exe, "doctor", "--json", extra={
            "VRAMSWAP_CACHE_DIR": os.environ.get("VRAMSWAP_CACHE_DIR", str(tmp / "ext"))}, timeout=600)
        report = json.loads(doctor.stdout) if doctor.returncode == 0 else {}
        check(report.get("torch_version") == torch.__version__ and report.get("cpu_extension") == "ok"
              and report.get("cuda_extension") == ("ok" if torch.version.cuda else report.get("cuda_extension")),
              f"vramswap doctor --json reports torch {torch.__version__} and both extensions ok "
              f"(torch_version {report.get('torch_version')!r}, cpu_extension {report.get('cpu_extension')!r}, "
              f"cuda_extension {report.get('cuda_extension')!r})", doctor.stdout + doctor.stderr)
        for sub in ("run", "bench", "replay"):
            h = run(exe, sub, "--help")
            check(h.returncode == 0 and "usage" in h.stdout.lower(), f"vramswap {sub} --help prints its usage, exit 0",
                  h.stdout + h.stderr)
        probe = run(python, "-c", """
import json, vramswap, vramswap._lib as l
lib = l.load(cudasim=True)
p = lib.vramswap_malloc(1 << 20, 0, None)
lib.vramswap_free(p, 1 << 20, 0, None)
print(json.dumps({"module": vramswap.__file__, "library": str(l.library_path()), "sim": str(l.cudasim_dir()),
                  "loaded": str(l._loaded_path), "ptr": p or 0, "error": lib.vramswap_last_error().decode()}))
""")
        check(probe.returncode == 0, "the installed package imports and loads its library", probe.stdout + probe.stderr)
        if probe.returncode == 0:
            got = json.loads(probe.stdout.strip().splitlines()[-1])
            inside = lambda p: Path(p).resolve().is_relative_to(venv.resolve())
            check(inside(got["module"]) and inside(got["library"]) and inside(got["sim"]) and inside(got["loaded"]),
                  "the package, its libvramswap.so and its cudasim are the environment's, not the checkout's",
                  json.dumps(got))
            check(got["ptr"] != 0 and got["error"] == "", "its library serves an allocation on its cudasim",
                  json.dumps(got))
        (work / "train.py").write_text(TRAIN)
        trained = run(exe, "run", "--", "python", "train.py", extra={
            "VRAMSWAP_TORCH_DEVICE": "cpu-sim", "VRAMSWAP_LIMIT": "10MiB", "VRAMSWAP_MIN_OFFLOAD_BYTES": "64KiB",
            "VRAMSWAP_CACHE_DIR": os.environ.get("VRAMSWAP_CACHE_DIR", str(tmp / "ext"))}, timeout=600)
        m = re.search(r"trained ([0-9.eE+-]+) evictions (\d+)", trained.stdout)
        check(trained.returncode == 0 and m is not None, "vramswap run -- python train.py trains through the console script",
              trained.stdout + trained.stderr)
        if m:
            check(int(m.group(2)) > 0, f"... under a 10 MiB limit (its peak is 12 MiB), with evictions ({m.group(2)})")
        bench = run(exe, "bench", "--quick", "--out", tmp / "bench")
        check(bench.returncode == 0 and "vramswap 50%" in bench.stdout, "vramswap bench --quick runs from the package",
              bench.stdout + bench.stderr)
    print("all checks passed" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The project's C++ tests that need no cudasim, run on whichever CUDA driver the library
path gives: on a GPU, NVIDIA's (scripts/gpu, step 6); here, cudasim (the runner's own test).

The test executables link the toolkit's libcudart.so.13 and libcuda.so.1 with a RUNPATH of
the build's sim/ directory, so that CTest runs them on cudasim. This runner puts the real
libraries' directories first on LD_LIBRARY_PATH (searched before a RUNPATH), then asks the
loader which libcuda.so.1 and libcudart.so.13 an executable gets, and refuses to report a
run on the other driver than the one expected (`--expect`).

Each case runs in a process of its own, as CTest runs it (run together, the dlopen cases
share the plugin's state and some fail), `--jobs` at a time, with GoogleTest's JSON report.
A case that needs cudasim skips itself where it can tell (cudasim's counters or fault
injection absent: SKIP_UNLESS_CUDASIM and the like) or is left out by name below, with the
reason. The report lists, per run, the cases that passed, failed (with their first message
and the output's end) and skipped (with why), in a JSON file and a table. Exit status: 0
when every run ended and no case failed, 1 when a case failed or the time ran out, 2 when
the driver loaded was not the one expected or no executable was found.

Usage: tests/gpu/cpp_tests.py --build BUILD [--out FILE.json] [--expect driver|cudasim]
                              [--lib-dir DIR ...] [--time-budget S] [--jobs N] [--only RUN ...]
"""

from __future__ import annotations

import argparse
import concurrent.futures
import datetime
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

# The runs: a name, the executable (relative to the build directory), a GoogleTest filter,
# the environment CTest gives it (tests/*/CMakeLists.txt), and the cases left out because
# only cudasim can run them, with why. Left out whole: tests/sim (cudasim's own), the
# registrations that exist for cudasim's settings (CUDASIM_CHAOS, a pinned limit, two
# devices, a limit in percent of its 1 GiB device), and the executables with no CUDA in
# them (config, policy, stats). The disk tier's run holds its cuFile cases: on a GPU machine
# they load NVIDIA's libcufile.so.0 (real_library_dirs() looks for it too), and fail, saying
# so, where it is missing.
OFFLOAD_ENV = {"VRAMSWAP_LIMIT": "64MiB", "VRAMSWAP_TEST_EXPECTED_LIMIT": "67108864"}
RUNS = [
    ("pool_conformance", "tests/pool/pool_conformance_test", "*", {}, {}),
    ("pool_stress", "tests/pool/pool_stress_test", "*", {}, {}),
    ("residency_engine", "tests/residency/residency_engine_test", "*", {}, {
        "EngineTest.AnEvictedBlockHasNoPagesUnderItsAddress":
            "touches an evicted block from the host: cudasim maps device memory into the host's "
            "address space, a GPU does not",
    }),
    ("residency_reclaim", "tests/residency/residency_reclaim_test", "*", {}, {}),
    ("residency_disk_tier", "tests/residency/residency_disk_tier_test", "*", {}, {
        "DiskTierCuFile.*": "times the disk on cudasim's virtual clock (CUDASIM_TIME=virtual)",
    }),
    ("host_tier", "tests/host_tier/host_tier_test", "*", {}, {
        "HostTierPinnedLimit.*": "needs CUDASIM_HOST_PINNED_LIMIT (a host that pins no more)",
    }),
    ("host_tier_stress", "tests/host_tier/host_tier_stress_test", "*", {}, {}),
    # Host pages (src/cuda/vmm.h): what cudasim models of host-located VMM memory, on the driver.
    ("cuda_vmm", "tests/cuda/cuda_vmm_test", "HostPages.*", {}, {}),
    ("plugin_dlopen", "tests/plugin/plugin_dlopen_test", "Plugin.*",
     {"VRAMSWAP_LIMIT": "256MiB", "VRAMSWAP_TEST_EXPECTED_LIMIT": "268435456"}, {}),
    ("plugin_dlopen.bad_environment", "tests/plugin/plugin_dlopen_test", "PluginBadEnvironment.*",
     {"VRAMSWAP_LIMIT": "12XB"}, {}),
    ("plugin_dlopen.tiny_limit", "tests/plugin/plugin_dlopen_test", "PluginTinyLimit.*", {"VRAMSWAP_LIMIT": "1MiB"}, {}),
    ("plugin_dlopen.offload", "tests/plugin/plugin_dlopen_test", "PluginOffload.*", OFFLOAD_ENV, {}),
    ("plugin_dlopen.offload_verify", "tests/plugin/plugin_dlopen_test", "PluginOffload.*",
     dict(OFFLOAD_ENV, VRAMSWAP_VERIFY="1"), {}),
]

# A case that runs longer has hung (CTest gives each 60 s on cudasim).
CASE_TIMEOUT_S = 120

# What tells cudasim's libraries from NVIDIA's: their own name, in their exports and messages.
CUDASIM_MARK = b"cudasim"


def real_library_dirs() -> list[str]:
    """The directories of NVIDIA's libcuda.so.1 (the loader's cache), libcudart.so.13 and
    libcufile.so.0 (the toolkit, or the wheels torch uses), in that order, those found."""
    dirs: list[str] = []
    try:
        cache = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, check=False).stdout
    except OSError:
        cache = ""
    for line in cache.splitlines():
        m = re.search(r"\blibcuda\.so\.1 \(.*x86-64.*\) => (\S+)", line)
        if m:
            dirs.append(os.path.dirname(os.path.realpath(m.group(1))))
            break
    else:  # not in the loader's cache: where containers mount the driver
        for d in [p for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p] + [
                "/usr/local/nvidia/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib64"]:
            if os.path.exists(os.path.join(d, "libcuda.so.1")) and not is_cudasim(os.path.join(d, "libcuda.so.1")):
                dirs.append(d)
                break
    # The runtime (libcudart.so.13) and cuFile (libcufile.so.0, the disk tier's
    # VRAMSWAP_DISK_IO=cufile): the toolkit's, or those of the wheels torch's CUDA builds
    # depend on (nvidia/cu13/lib, nvidia/cuda_runtime/lib, nvidia/cufile/lib, ...).
    candidates = [os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "lib64"),
                  "/usr/local/cuda/lib64", "/usr/local/cuda/targets/x86_64-linux/lib"]
    try:
        import nvidia
        candidates += [d for base in nvidia.__path__ for d in sorted(glob.glob(os.path.join(base, "*", "lib")))]
    except ImportError:
        pass
    for name in ("libcudart.so.13", "libcufile.so.0"):
        found = next((d for d in candidates if os.path.exists(os.path.join(d, name))), None)
        if found:
            dirs.append(found)
    return list(dict.fromkeys(dirs))


def resolved_libraries(exe: str, env: dict) -> dict[str, str]:
    """The paths the loader gives `exe`'s CUDA libraries under `env` (ldd's own mechanism)."""
    out = subprocess.run([exe], env=dict(env, LD_TRACE_LOADED_OBJECTS="1"), capture_output=True, text=True,
                         timeout=60, check=False).stdout
    found = {}
    for name in ("libcuda.so.1", "libcudart.so.13"):
        m = re.search(re.escape(name) + r" => (\S+)", out)
        found[name] = os.path.realpath(m.group(1)) if m else "not found"
    return found


def is_cudasim(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return CUDASIM_MARK in f.read()
    except OSError:
        return False


def list_cases(exe: str, gtest_filter: str, env: dict) -> list[str]:
    out = subprocess.run([exe, "--gtest_list_tests", "--gtest_filter=" + gtest_filter], env=env, capture_output=True,
                         text=True, timeout=60, check=False).stdout
    cases, suite = [], ""
    for line in out.splitlines():
        if not line.strip() or line.startswith(("Running main()", "Note:")):
            continue
        if not line.startswith(" "):
            suite = line.split("#")[0].strip()
        else:
            cases.append(suite + line.split("#")[0].strip())
    return cases


def run_case(exe: str, case: str, env: dict, timeout_s: float) -> tuple[str, str, str, float]:
    """One case in a process of its own, as CTest runs it: ("passed" | "failed" | "skipped",
    the first message, the output's end, seconds)."""
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="vramswap-cpp-tests-") as tmp:
        report = os.path.join(tmp, "report.json")
        try:
            proc = subprocess.run([exe, f"--gtest_output=json:{report}", "--gtest_filter=" + case], env=env,
                                  capture_output=True, text=True, timeout=max(timeout_s, 1), check=False)
            tail, rc = (proc.stdout + proc.stderr)[-3000:], proc.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.stdout or b"") + (e.stderr or b"")
            return "failed", f"stopped after {timeout_s:.0f} s", out.decode(errors="replace")[-3000:], timeout_s
        seconds = time.monotonic() - started
        if not os.path.exists(report):
            last = next((line for line in reversed(tail.splitlines()) if line.strip()), "")
            return "failed", f"no report (exit status {rc}): {last}", tail, seconds
        with open(report) as f:
            doc = json.load(f)
    for suite in doc.get("testsuites", []):
        for c in suite.get("testsuite", []):
            if c.get("failures"):
                return "failed", c["failures"][0].get("failure", ""), tail, seconds
            if c.get("result") == "SKIPPED":
                m = re.search(r"Skipped\s*\n(.*)", tail)
                return "skipped", m.group(1).strip() if m else "", tail, seconds
    if rc != 0:
        return "failed", f"exit status {rc} with no failed assertion", tail, seconds
    return "passed", "", tail, seconds


def run_executable(name: str, exe: str, gtest_filter: str, excluded: dict[str, str], env: dict, deadline: float,
                   jobs: int) -> dict:
    """Runs the cases of `exe` that `gtest_filter` names but the excluded ones, `jobs` at a
    time; what passed, failed and skipped."""
    result = {"run": name, "executable": os.path.basename(exe), "filter": gtest_filter, "excluded": excluded,
              "passed": [], "failed": [], "skipped": [], "not_run": [], "status": "ran"}
    started = time.monotonic()
    full_filter = gtest_filter + ("-" + ":".join(excluded) if excluded else "")
    cases = list_cases(exe, full_filter, env)
    if not cases:
        result["status"] = "no case listed"
        return result

    def one(case):
        left = deadline - time.monotonic()
        if left < 2:
            return case, ("not run", "", "", 0.0)
        return case, run_case(exe, case, env, min(left, CASE_TIMEOUT_S))

    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        for case, (outcome, message, tail, _) in pool.map(one, cases):
            if outcome == "passed":
                result["passed"].append(case)
            elif outcome == "skipped":
                result["skipped"].append({"case": case, "message": message})
            elif outcome == "failed":
                result["failed"].append({"case": case, "message": message[:2000], "output_tail": tail})
            else:
                result["not_run"].append(case)
    if result["not_run"]:
        result["status"] = "out of time"
    result["seconds"] = round(time.monotonic() - started, 2)
    return result


def device_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        return out.splitlines()[0] if out else "none"
    except (OSError, subprocess.TimeoutExpired):
        return "none"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--build", required=True, help="a build directory configured with BUILD_TESTING=ON")
    p.add_argument("--out", help="write the report here (JSON)")
    p.add_argument("--expect", choices=("driver", "cudasim"), default="driver",
                   help="the driver the run must load (default: NVIDIA's)")
    p.add_argument("--lib-dir", action="append", default=None,
                   help="put this directory first on LD_LIBRARY_PATH (repeatable; default: NVIDIA's "
                        "libcuda.so.1 and libcudart.so.13, found on this machine)")
    p.add_argument("--time-budget", type=float, default=300, help="seconds for every executable together")
    p.add_argument("--jobs", type=int, default=4, help="cases run at once (each in a process of its own)")
    p.add_argument("--only", nargs="+", help="these runs alone (their names: see RUNS)")
    args = p.parse_args(argv)

    lib_dirs = args.lib_dir if args.lib_dir is not None else real_library_dirs()
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = ":".join(lib_dirs + [d for d in env.get("LD_LIBRARY_PATH", "").split(":") if d])
    if args.expect == "cudasim":
        env.setdefault("CUDASIM_DEVICE_MEMORY", "1GiB")  # as CTest runs them
    chosen = [(name, os.path.join(args.build, rel), filt, run_env, excl) for name, rel, filt, run_env, excl in RUNS
              if not args.only or name in args.only]
    present = [run for run in chosen if os.access(run[1], os.X_OK)]
    report = {"date": datetime.date.today().isoformat(), "device": device_name(), "expect": args.expect,
              "library_path": env["LD_LIBRARY_PATH"], "missing": [run[0] for run in chosen if run not in present],
              "runs": []}
    def write(rep):
        if args.out:
            os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
            with open(args.out, "w") as f:
                json.dump(rep, f, indent=1)
                f.write("\n")

    if not present:
        print(f"cpp_tests: no test executable under {args.build} (configure it with -DBUILD_TESTING=ON and "
              "build the tests)", file=sys.stderr)
        write(dict(report, status="no test executable", totals={"passed": 0, "failed": 0, "skipped": 0}))
        return 2
    # Which driver: asked of an executable that links CUDA (plugin_dlopen_test links none, and
    # loads the same libraries through libvramswap.so).
    probe = next((exe for exe in (os.path.join(args.build, run[1]) for run in RUNS)
                  if "dlopen" not in exe and os.access(exe, os.X_OK)), None)
    loaded = resolved_libraries(probe, env) if probe else {}
    report["loaded"] = loaded
    sims = [is_cudasim(path) for path in loaded.values()]
    print(f"cpp_tests: {os.path.basename(probe or '?')} loads {loaded} "
          f"({'cudasim' if all(sims) else 'NVIDIA' if not any(sims) else 'a mix'}; "
          f"LD_LIBRARY_PATH={env['LD_LIBRARY_PATH']})")
    if not loaded or "not found" in loaded.values() or sims != [args.expect == "cudasim"] * len(sims):
        print(f"cpp_tests: expected {'cudasim' if args.expect == 'cudasim' else 'the NVIDIA driver'}, but the "
              f"executables load {loaded}: pass --lib-dir with the directories of the libcuda.so.1 and "
              "libcudart.so.13 to run on", file=sys.stderr)
        report["status"] = "wrong driver"
        rc = 2
    else:
        deadline = time.monotonic() + args.time_budget
        for name, exe, gtest_filter, run_env, excluded in present:
            left = deadline - time.monotonic()
            if left < 5:
                report["runs"].append({"run": name, "status": "not run: out of time"})
                continue
            r = run_executable(name, exe, gtest_filter, excluded, dict(env, **run_env), deadline, args.jobs)
            report["runs"].append(r)
            print(f"  {r['run']:<30} {r['status']:<12} passed {len(r['passed']):4}  failed "
                  f"{len(r['failed']):3}  skipped {len(r['skipped']):3}  left out {len(excluded)}  "
                  f"({r.get('seconds', 0)} s)")
            for f in r["failed"]:
                print(f"    FAILED {f['case']}: {f['message'].splitlines()[0] if f['message'] else ''}")
        ok = all(r["status"] == "ran" and not r["failed"] for r in report["runs"])
        report["status"] = "passed" if ok else "failed"
        rc = 0 if ok else 1
    totals = {k: sum(len(r.get(k, [])) for r in report["runs"]) for k in ("passed", "failed", "skipped")}
    report["totals"] = totals
    print(f"cpp_tests: {report['status']}: {totals['passed']} passed, {totals['failed']} failed, "
          f"{totals['skipped']} skipped")
    write(report)
    return rc


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Runs tests/plugin/programs/preload_app under LD_PRELOAD=libvramswap_preload.so on cudasim
and checks what came out: the exit status, lines on stdout and stderr, what cudaMemGetInfo
reported, and the VRAMSWAP_STATS_FILE the process left behind.

Each --env adds one variable; VRAMSWAP_STATS_FILE is set to a fresh temporary file. The
program always runs with LD_LIBRARY_PATH=<sim dir> (cudasim's libcudart.so.13 and
libcuda.so.1) and without any inherited VRAMSWAP_* variable. Exit status 0 when every
expectation held; otherwise each failed one is printed with the program's output.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile


def run(args, env, preload):
    full = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") and k != "LD_PRELOAD"}
    full["LD_LIBRARY_PATH"] = args.sim_dir
    full.update(env)
    if preload:
        full["LD_PRELOAD"] = ":".join(args.preload_first + [args.preload])
    return subprocess.run([args.app] + args.app_args, env=full, capture_output=True, text=True, timeout=120)


def meminfo_total(stdout):
    for line in stdout.splitlines():
        if line.startswith("meminfo "):
            fields = dict(f.split("=") for f in line.split()[1:])
            return int(fields["total"]), int(fields["free"])
    return None, None


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--app", required=True)
    p.add_argument("--preload", required=True)
    p.add_argument("--sim-dir", required=True)
    p.add_argument("--preload-first", action="append", default=[],
                   help="a library preloaded before the preload (a sanitizer build's runtime, which "
                        "must come first in a process the sanitizer did not build)")
    p.add_argument("--env", action="append", default=[], help="NAME=VALUE for the preloaded run")
    p.add_argument("--app-arg", dest="app_args", action="append", default=[])
    p.add_argument("--expect-exit", type=int, default=0)
    p.add_argument("--expect-total", type=int, help="cudaMemGetInfo's total, in bytes, under the preload")
    p.add_argument("--baseline-total", type=int, help="... and without the preload")
    p.add_argument("--expect-stderr", action="append", default=[], help="text stderr must contain")
    p.add_argument("--expect-stderr-count", action="append", default=[],
                   help="TEXT=N: stderr contains TEXT exactly N times")
    p.add_argument("--expect-stdout", action="append", default=[], help="text stdout must contain")
    p.add_argument("--forbid-stdout", action="append", default=[], help="text stdout must not contain")
    p.add_argument("--expect-stats", action="store_true",
                   help="the stats file exists, shows allocations, and every allocation was freed")
    p.add_argument("--expect-no-stats", action="store_true", help="no stats file was written")
    p.add_argument("--expect-stat", action="append", default=[],
                   help="KEY=N, KEY>N or KEY<=N on a top-level number of the stats file (with --expect-stats)")
    args = p.parse_args()

    failures = []
    workdir = tempfile.mkdtemp(prefix="vramswap_preload_")
    stats_path = os.path.join(workdir, "stats.json")
    env = dict(e.split("=", 1) for e in args.env)
    env["VRAMSWAP_STATS_FILE"] = stats_path

    if args.baseline_total is not None:
        base = run(args, {}, preload=False)
        total, _ = meminfo_total(base.stdout)
        if base.returncode != 0:
            failures.append(f"without the preload the program exited {base.returncode}: {base.stderr}")
        if total != args.baseline_total:
            failures.append(f"without the preload cudaMemGetInfo total={total}, expected {args.baseline_total}")

    r = run(args, env, preload=True)
    if r.returncode != args.expect_exit:
        failures.append(f"exit status {r.returncode}, expected {args.expect_exit}")
    for text in args.expect_stderr:
        if text not in r.stderr:
            failures.append(f"stderr does not contain {text!r}")
    for spec in args.expect_stderr_count:
        text, n = spec.rsplit("=", 1)
        if r.stderr.count(text) != int(n):
            failures.append(f"stderr contains {text!r} {r.stderr.count(text)} times, expected {n}")
    for text in args.expect_stdout:
        if text not in r.stdout:
            failures.append(f"stdout does not contain {text!r}")
    for text in args.forbid_stdout:
        if text in r.stdout:
            failures.append(f"stdout contains {text!r}")
    if args.expect_total is not None:
        total, free = meminfo_total(r.stdout)
        if total != args.expect_total:
            failures.append(f"cudaMemGetInfo total={total}, expected the limit {args.expect_total}")
        elif free is None or free > total:
            failures.append(f"cudaMemGetInfo free={free} is more than total={total}")

    if args.expect_stats:
        try:
            with open(stats_path) as f:
                stats = json.load(f)
        except (OSError, ValueError) as e:
            failures.append(f"stats file {stats_path}: {e}")
            stats = None
        if stats is not None:
            if stats.get("num_allocs", 0) <= 0:
                failures.append("stats show no allocation: the program's cudaMalloc did not reach vramswap")
            if stats.get("num_frees") != stats.get("num_allocs"):
                failures.append("stats: num_frees != num_allocs, though the program freed everything")
            if stats.get("allocated_bytes") != 0:
                failures.append("stats: allocated_bytes is not 0 at exit")
            if args.expect_total is not None and stats.get("device_limit_bytes") != args.expect_total:
                failures.append(f"stats: device_limit_bytes={stats.get('device_limit_bytes')}, "
                                f"expected {args.expect_total}")
            if stats.get("num_invalid_frees", 0) < 1:
                failures.append("stats: the program's double free was not counted in num_invalid_frees")
            for spec in args.expect_stat:
                for op, holds in (("<=", lambda a, b: a <= b), (">", lambda a, b: a > b), ("=", lambda a, b: a == b)):
                    if op in spec:
                        key, n = spec.split(op, 1)
                        value = stats.get(key)
                        if value is None or not holds(value, int(n)):
                            failures.append(f"stats: {key}={value}, expected {op}{n}")
                        break
                else:
                    failures.append(f"--expect-stat {spec!r}: not KEY=N, KEY>N or KEY<=N")
            devices = stats.get("devices", [])
            if len(devices) != 1 or devices[0].get("device") != 0:
                failures.append(f"stats: expected one device, 0: {devices}")
            print(json.dumps(stats, indent=1))
    if args.expect_no_stats and os.path.exists(stats_path):
        failures.append(f"a stats file was written: {stats_path}")

    shutil.rmtree(workdir, ignore_errors=True)
    if failures:
        print("FAILED:\n  " + "\n  ".join(failures))
        print("--- stdout ---\n" + r.stdout + "--- stderr ---\n" + r.stderr)
        return 1
    print("--- stderr ---\n" + r.stderr)
    print("ok")
    return 0


if __name__ == "__main__":
    sys.exit(main())

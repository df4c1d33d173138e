#!/usr/bin/env python3
"""tests/gpu/cpp_tests.py, the GPU suite's runner of the C++ tests, exercised on cudasim:
it runs every case of its runs in a process of its own and reports them, and it refuses to
call a run on one driver a run on the other.

Usage: test_cpp_tests.py BUILD_DIR SIM_DIR (CTest passes the build and cudasim's directory)
"""

import json
import os
import subprocess
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
RUNNER = os.path.join(HERE, "cpp_tests.py")
BUILD, SIM = sys.argv[1], sys.argv[2]


def run(*args):
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "report.json")
        proc = subprocess.run([sys.executable, RUNNER, "--build", BUILD, "--out", out, *args],
                              capture_output=True, text=True, timeout=600, check=False)
        report = None
        if os.path.exists(out):
            with open(out) as f:
                report = json.load(f)
    return proc, report


class CppTests(unittest.TestCase):
    def test_every_run_passes_on_cudasim_case_by_case(self):
        proc, report = run("--expect", "cudasim", "--lib-dir", SIM, "--jobs", "2")
        self.assertEqual(0, proc.returncode, proc.stdout + proc.stderr)
        self.assertEqual("passed", report["status"])
        runs = {r["run"]: r for r in report["runs"]}
        self.assertGreaterEqual(len(runs), 10)
        # The dlopen cases need a process each (the plugin's state is the process's): run
        # together, two of Plugin.* fail.
        self.assertGreaterEqual(len(runs["plugin_dlopen"]["passed"]), 25)
        self.assertIn("EngineTest.AnEvictedBlockHasNoPagesUnderItsAddress", runs["residency_engine"]["excluded"])
        self.assertNotIn("EngineTest.AnEvictedBlockHasNoPagesUnderItsAddress", runs["residency_engine"]["passed"])
        self.assertGreater(report["totals"]["passed"], 250)
        self.assertTrue(all(path.startswith(os.path.realpath(SIM)) for path in report["loaded"].values()),
                        report["loaded"])

    def test_a_run_that_loads_cudasim_is_not_reported_as_the_driver(self):
        # Only cudasim's directory is given, so whatever the machine has, cudasim loads.
        proc, report = run("--expect", "driver", "--lib-dir", SIM, "--only", "pool_conformance")
        self.assertEqual(2, proc.returncode, proc.stdout + proc.stderr)
        self.assertEqual("wrong driver", report["status"])
        self.assertEqual(0, report["totals"]["passed"])
        self.assertIn("expected the NVIDIA driver", proc.stderr)

    def test_a_failing_case_fails_the_run_and_is_named(self):
        # A device size cudasim refuses: every case of the run fails.
        env = dict(os.environ, CUDASIM_DEVICE_MEMORY="16MiB")
        with tempfile.TemporaryDirectory() as tmp:
            out = os.path.join(tmp, "report.json")
            proc = subprocess.run([sys.executable, RUNNER, "--build", BUILD, "--out", out, "--expect", "cudasim",
                                   "--lib-dir", SIM, "--only", "residency_reclaim"],
                                  env=env, capture_output=True, text=True, timeout=600, check=False)
            with open(out) as f:
                report = json.load(f)
        self.assertEqual(1, proc.returncode, proc.stdout + proc.stderr)
        self.assertEqual("failed", report["status"])
        failed = [f for r in report["runs"] for f in r["failed"]]
        self.assertEqual(6, len(failed), report)
        self.assertIn("FAILED " + failed[0]["case"], proc.stdout)
        self.assertTrue(failed[0]["message"], failed[0])

if __name__ == "__main__":
    unittest.main(argv=sys.argv[:1])

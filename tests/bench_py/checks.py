"""The TAP-like reporting the benchmark tests share: `check(name, ok, detail)` prints one
line per check and remembers the failures, `skip(name, why)` says what was not checked, and
`finish()` prints the verdict and exits (status 1 when a check failed).

Thread safety: one test thread.
"""
import sys

failures = []


def check(name, ok, detail=""):
    print(("ok - " if ok else "FAIL - ") + name + ("" if ok else f": {detail}"), flush=True)
    if not ok:
        failures.append(name)


def skip(name, why):
    print(f"skip - {name}: {why}", flush=True)


def finish():
    print(f"FAILED: {len(failures)} check(s): {', '.join(failures)}" if failures else "PASSED")
    sys.exit(1 if failures else 0)

#!/usr/bin/env python3
"""The CPU-emulation mode's namespace and the process's C library (Note [cudasim in a
namespace of its own] in vramswap/_lib.py). Plain python3, no torch: prints one "ok - ..."
or "FAIL - ..." line per check and exits 0 only when no check failed.

cudasim's stream threads are created by the namespace's own C library, so the process's C
library never learns that the process has threads. Its malloc then takes the single-thread
path, without locks, in every thread; and the dynamic loader, which both namespaces share,
allocates a thread's thread-local storage with the process's malloc on the thread's first
use of a variable. A benchmark child (a Python with no threads of its own) aborted, once in
some hundreds of runs on a loaded 2-core machine, with "malloc(): unsorted double linked
list corrupted": a cudasim stream thread's first thread-local access allocated from the
process's heap while the interpreter allocated from it too.

What it holds the loader to: after _lib.load(cudasim=True) in a process that has created no
thread, the process's C library is in its multi-threaded mode (glibc's
__libc_single_threaded is 0; glibc never sets it back).

Environment: VRAMSWAP_LIBRARY / VRAMSWAP_CUDASIM_DIR as for the package (default: build/).
"""
import ctypes
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from checks import check, finish, skip  # noqa: E402

CHILD = """
import ctypes, sys, threading
flag = ctypes.c_char.in_dll(ctypes.CDLL(None), "__libc_single_threaded")
before = flag.value[0]
from vramswap import _lib
_lib.load(cudasim=True)
print(before, flag.value[0], threading.active_count())
"""


def main():
    try:
        ctypes.c_char.in_dll(ctypes.CDLL(None), "__libc_single_threaded")
    except ValueError:
        skip("the process's C library is in its multi-threaded mode",
             "this C library has no __libc_single_threaded (glibc 2.32 and later have)")
        finish()
    out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         env={**__import__("os").environ, "PYTHONPATH": str(REPO / "plugin" / "python")})
    fields = out.stdout.split()
    check("the child loads the CPU-emulation mode", out.returncode == 0 and len(fields) == 3,
          f"status {out.returncode}: {out.stderr[-2000:]}")
    if len(fields) == 3:
        before, after, python_threads = map(int, fields)
        check("the child starts single-threaded (or the check proves nothing)",
              before == 1 and python_threads == 1, f"__libc_single_threaded {before}, {python_threads} threads")
        check("after loading, the process's C library is in its multi-threaded mode",
              after == 0, f"__libc_single_threaded is {after}")
    finish()


if __name__ == "__main__":
    main()

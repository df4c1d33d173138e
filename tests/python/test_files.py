#!/usr/bin/python3
"""The files vramswap creates at paths a user names cannot be redirected by another local
user (vramswap/_files.py; the C++ side, VRAMSWAP_STATS_FILE, is tests/plugin/stats_file_test.cpp):
  - write_file: a regular file is replaced whole, through a temporary file with a random
    name created exclusively (a link planted at the old predictable names redirects
    nothing), nothing is left beside it; the user's own link is followed and stays a link;
    another user's link is refused (run as root, which can give a link away); a FIFO is
    written in place; a directory is an error;
  - dump_snapshot and the benchmark's report write through it;
  - the torch extensions' cache must be a directory only this user can write, since
    vramswap loads the code it finds there: one of this user's own loses others' write
    permission, one of another user's is refused, and a built extension this user does not
    own (or others can write) is built again.
Usage: python3 tests/python/test_files.py   (exit status 0: every check held)
"""
import os
import pickle
import stat
import sys
import tempfile
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

from vramswap import _files  # noqa: E402  (after the path)
from vramswap.bench import report  # noqa: E402

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def raises(fn, kind, text):
    try:
        fn()
    except kind as e:
        return text in str(e)
    return False


def main():
    with tempfile.TemporaryDirectory() as d:
        d = Path(d)
        victim = d / "victim"
        victim.write_text("secret")
        victim.chmod(0o600)
        path = d / "out.json"
        for planted in (path.with_name(f"out.json.tmp.{os.getpid()}"), path.with_name("out.json.tmp"),
                        path.with_suffix(f".{os.getpid()}.tmp")):
            planted.symlink_to(victim)
        path.write_text("an older and longer document")
        _files.write_file(path, "{}\n")
        check(path.read_text() == "{}\n" and path.is_file() and not path.is_symlink(),
              "a regular file is replaced whole")
        check(victim.read_text() == "secret", "links planted at predictable names redirect nothing")
        check(sorted(p.name for p in d.iterdir() if not p.is_symlink()) == ["out.json", "victim"],
              "no temporary file is left beside it")

        own = d / "own.json"
        own.symlink_to("real.json")
        _files.write_file(own, b"x")
        check(own.is_symlink() and (d / "real.json").read_bytes() == b"x",
              "the user's own link is followed (to a file that did not exist) and stays a link")

        if os.geteuid() == 0:
            foreign = d / "foreign.json"
            foreign.symlink_to(victim)
            os.lchown(foreign, 65534, 65534)
            check(raises(lambda: _files.write_file(foreign, "{}"), _files.UnsafePathError, "owned by another user")
                  and victim.read_text() == "secret", "another user's link is refused, and its target kept")
        else:
            print("skip another user's link: needs root, to give a link away")

        fifo = d / "stats.fifo"
        os.mkfifo(fifo)
        got = []
        reader = threading.Thread(target=lambda: got.append(fifo.read_bytes()))
        reader.start()
        _files.write_file(fifo, b"through a pipe")
        reader.join()
        check(got == [b"through a pipe"] and stat.S_ISFIFO(os.lstat(fifo).st_mode),
              "a FIFO is written in place and stays a FIFO")
        check(raises(lambda: _files.write_file(d, "{}"), IsADirectoryError, "is a directory"),
              "a directory is an error")

        # The benchmark's report: every file through write_file (a planted link at a result's
        # name is another user's only as root; here: the written files replace what was there).
        out = d / "bench"
        out.mkdir()
        (out / "table.txt").symlink_to(victim)
        if os.geteuid() == 0:
            os.lchown(out / "table.txt", 65534, 65534)
            check(raises(lambda: report.write(out, "s", []), _files.UnsafePathError, "owned by another user")
                  and victim.read_text() == "secret", "the bench's report refuses another user's link")

        # dump_snapshot: the pickle through write_file (snapshot() itself needs the library).
        import vramswap
        saved = vramswap.snapshot
        vramswap.snapshot = lambda: {"segments": [], "device_traces": []}
        try:
            snap = d / "snap.pickle"
            snap.symlink_to(victim)
            if os.geteuid() == 0:
                os.lchown(snap, 65534, 65534)
                check(raises(lambda: vramswap.dump_snapshot(snap), _files.UnsafePathError, "owned by another user")
                      and victim.read_text() == "secret", "dump_snapshot refuses another user's link")
            snap.unlink()
            vramswap.dump_snapshot(snap)
            check(pickle.loads(snap.read_bytes()) == {"segments": [], "device_traces": []},
                  "dump_snapshot writes the pickle")
        finally:
            vramswap.snapshot = saved

        # The extensions' cache: code vramswap loads, so only this user may write it.
        try:
            from vramswap import _ext
        except ImportError as e:
            print(f"skip the extension cache: {e}")
        else:
            shared = d / "shared-cache"
            shared.mkdir()
            shared.chmod(0o777)
            _ext._check_private(shared)
            check(stat.S_IMODE(shared.stat().st_mode) == 0o755,
                  "a cache of this user's own that others could write loses their write permission")
            mine = shared / "libvramswap_torch_cpu_0123456789abcdef.so"
            mine.write_bytes(b"\x7fELF")
            mine.chmod(0o755)
            check(_ext._trusted(mine), "an extension this user built is loaded")
            mine.chmod(0o777)
            check(not _ext._trusted(mine), "one others could write is built again")
            if os.geteuid() == 0:
                mine.chmod(0o755)
                os.chown(mine, 65534, 65534)
                check(not _ext._trusted(mine), "one another user left there is built again")
                theirs = d / "their-cache"
                theirs.mkdir()
                theirs.chmod(0o777)
                os.chown(theirs, 65534, 65534)
                check(raises(lambda: _ext.build(out_dir=theirs), RuntimeError, "can be written by another user")
                      and list(theirs.iterdir()) == [],
                      "a cache another user owns, others may write, is refused before anything is built")
            private = d / "private-cache"
            private.mkdir(mode=0o700)
            check(not raises(lambda: _ext._check_private(private), RuntimeError, ""),
                  "a cache only this user can write is accepted")

    print("PASSED" if not failures else f"FAILED: {len(failures)}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""vramswap.install(): its refusals, and the ctypes path end to end, on a machine without a GPU.

The machine this runs on has no GPU (torch may be a CUDA build, but sees no device), so
torch's side of the swap is played by stand-ins, and each case says which. Each case runs in a fresh child process
(libvramswap.so is loaded once per process, for one mode; torch's allocator can be swapped
once):
  initialized  torch "has initialized CUDA": torch.version.cuda / torch.cuda.is_available are
               patched to a CUDA build with a device and torch.cuda.is_initialized to return
               True (the real one is False here). install() must raise VramswapError saying
               why (torch's caching allocator / CUDA context, swap only before the first CUDA
               allocation) and what to do (install() earlier, or `python3 -m vramswap run`),
               without loading the library or swapping anything.
  no-cuda      a torch built without CUDA (torch.version.cuda patched to None), then a CUDA
               build that sees no device (torch.version.cuda "13.0", the real is_available()
               False): both refused with a pointer to the CPU-emulation mode.
  ctypes       the ctypes path (VRAMSWAP_TORCH_EXT_CUDA=0): torch.cuda.memory's
               CUDAPluggableAllocator and change_current_allocator are recording fakes; the
               fake resolves the symbols by name with ctypes as torch's does. cudasim,
               preloaded (LD_PRELOAD: a CUDA build of torch would otherwise load NVIDIA's
               runtime first, whose soname libvramswap.so's then resolves to), stands in for
               the CUDA runtime and driver that libvramswap.so links. Checks: a bad config value is refused
               naming its key with nothing swapped; then the real library path and the
               names vramswap_torch_malloc / vramswap_free reach torch (not vramswap_malloc:
               torch does not check its alloc function's result for NULL), the symbols
               exist, the reset and record_stream hooks get vramswap_empty_cache /
               vramswap_record_stream; calling the resolved functions as torch would
               allocates and frees through vramswap under the configured VRAMSWAP_LIMIT, and
               size 0 is NULL without a throw. Past the limit vramswap_torch_malloc throws a
               C++ exception, which cannot unwind through ctypes (the process would abort),
               so that failure is checked here through vramswap_malloc, the same allocation
               (NULL, counted in num_ooms, the report as the last error), and the throw
               itself by tests/plugin/dlopen_test.cpp (Plugin.TorchMalloc*); a second
               install() only applies config; sim.install_cpu() is then refused.
  auto         VRAMSWAP_TORCH_EXT_CUDA unset / =1 on a torch whose C++ headers have no
               CUDAPluggableAllocator.h: =1 is refused naming the missing header with nothing
               swapped; unset falls back to the ctypes path with a RuntimeWarning that says
               a failed allocation raises RuntimeError there, OutOfMemoryError only with the
               extension.
  after-cpu    sim.install_cpu() (the real CPU-emulation mode), then install(): refused.
  bad-env      VRAMSWAP_HORIZON=many in the environment: install() raises ConfigError with the
               library's message, nothing swapped.
  run          `python3 -m vramswap run` (through vramswap.__main__.main, so the stand-ins
               can be patched in first) with a "CUDA device": the script runs with
               vramswap.installed() true; with CUDA "initialized", or VRAMSWAP_LIMIT=lots, the
               run stops with status 2 and install()'s message (the library's for the value).

Usage: python3 tests/python/test_install.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py).
"""
import ctypes
import os
import subprocess
import sys
import tempfile
import time
import types
import warnings
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))
MIB = 1 << 20

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


def has_all(text, words):
    missing = [w for w in words if w not in text]
    return not missing, missing


def check_words(text, words, what):
    ok, missing = has_all(text, words)
    check(ok, what + (f" (missing {missing} in: {text!r})" if missing else ""))


# --- torch's side, played by stand-ins -------------------------------------------------

class Recorder:
    """What the fake torch.cuda.memory saw."""
    created = []   # FakePluggableAllocator instances
    changed = []   # allocators passed to change_current_allocator


class FakeRawAllocator:
    """Stands in for torch._C._cuda_CUDAAllocator (torch 2.x's _CUDAPluggableAllocator
    binding, which has set_reset_fn / set_record_stream_fn taking function addresses)."""

    def __init__(self):
        self.hooks = {}

    def set_reset_fn(self, address):
        self.hooks["reset"] = address

    def set_record_stream_fn(self, address):
        self.hooks["record_stream"] = address


class FakePluggableAllocator:
    """Stands in for torch.cuda.memory.CUDAPluggableAllocator: resolves the two functions by
    name in the .so with ctypes, as torch's does (a missing symbol raises)."""

    def __init__(self, path_to_so_file, alloc_fn_name, free_fn_name):
        self.path, self.alloc_name, self.free_name = path_to_so_file, alloc_fn_name, free_fn_name
        so = ctypes.CDLL(path_to_so_file)
        self.alloc_fn = ctypes.cast(getattr(so, alloc_fn_name), ctypes.c_void_p).value
        self.free_fn = ctypes.cast(getattr(so, free_fn_name), ctypes.c_void_p).value
        self._raw = FakeRawAllocator()
        Recorder.created.append(self)

    def allocator(self):
        return self._raw


def fake_cuda_torch(initialized=False, available=True):
    """Makes the imported torch look like a CUDA build (CUDA 13.0) with a device, CUDA
    initialized or not, and swaps torch.cuda.memory's allocator API for the recording fakes.
    current_stream() answers the legacy stream (the tracker asks it when a scope closes)."""
    import torch
    torch.cuda.current_stream = lambda device=None: types.SimpleNamespace(cuda_stream=0)
    torch.version.cuda = "13.0"
    torch.cuda.is_available = lambda: available
    torch.cuda.is_initialized = lambda: initialized
    torch.cuda.memory.CUDAPluggableAllocator = FakePluggableAllocator
    torch.cuda.memory.change_current_allocator = lambda allocator: Recorder.changed.append(allocator)
    return torch


def expect_raise(fn, exc_type):
    try:
        fn()
    except exc_type as e:
        return e
    except Exception as e:  # noqa: BLE001 - a wrong type is a failed check, with its message
        return AssertionError(f"raised {type(e).__name__} instead of {exc_type.__name__}: {e}")
    return None


# --- the cases, each in a child process --------------------------------------------------

def case_initialized():
    fake_cuda_torch(initialized=True)
    import vramswap
    from vramswap import _lib
    e = expect_raise(vramswap.install, vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError) and isinstance(e, RuntimeError),
          f"install() with CUDA initialized raises VramswapError, a RuntimeError ({e!r})")
    check_words(str(e), ["already initialized CUDA", "caching allocator", "CUDA context",
                         "only be swapped before its first CUDA allocation",
                         "Call vramswap.install() before any CUDA tensor",
                         "python3 -m vramswap run -- script.py"],
                "the message says why (initialized allocator/context) and what to do")
    check(_lib._lib is None, "nothing loaded: libvramswap.so not loaded after the refusal")
    check(not Recorder.created and not Recorder.changed, "nothing swapped")
    check(not vramswap.installed(), "installed() is False")


def case_no_cuda():
    import torch
    import vramswap
    torch.version.cuda = None  # a torch built without CUDA
    e = expect_raise(vramswap.install, vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError), f"install() on a torch without CUDA raises VramswapError ({e!r})")
    check_words(str(e), ["built without CUDA", "vramswap.sim.install_cpu(", "VRAMSWAP_TORCH_DEVICE=cpu-sim"],
                "the message points to the CPU-emulation mode")
    torch.version.cuda = "13.0"  # a CUDA build; the real is_available() is False here
    check(not torch.cuda.is_available(), "torch.cuda.is_available() is really False here")
    e = expect_raise(vramswap.install, vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError), f"install() with no device raises VramswapError ({e!r})")
    check_words(str(e), ["sees no CUDA device", "vramswap.sim.install_cpu(", "VRAMSWAP_TORCH_DEVICE=cpu-sim"],
                "the no-device message points to the CPU-emulation mode")
    check(not vramswap.installed(), "installed() is False")


def case_ctypes():
    fake_cuda_torch()
    import vramswap
    from vramswap import _lib, cuda
    lib_path = str(_lib.library_path())

    # A bad value: refused naming the key, before anything is swapped.
    e = expect_raise(lambda: vramswap.install(limit="12 parsecs", torch_ext_cuda=0), ValueError)
    check(isinstance(e, ValueError) and "VRAMSWAP_LIMIT" in str(e) and "12 parsecs" in str(e),
          f"a bad VRAMSWAP_LIMIT is refused naming the key and the value ({e})")
    check(not Recorder.created and not Recorder.changed and not vramswap.installed(),
          "nothing swapped after the refused value")

    got = vramswap.install(limit="64MiB", torch_ext_cuda=0)
    check(got == "ctypes" and cuda.backend() == "ctypes" and vramswap.installed(),
          f"install(torch_ext_cuda=0) takes the ctypes path (returned {got!r}) and installed() is True")
    check(len(Recorder.created) == 1 and len(Recorder.changed) == 1
          and Recorder.changed[0] is Recorder.created[0],
          "one CUDAPluggableAllocator, made torch's current allocator")
    fake = Recorder.created[0]
    check(fake.path == lib_path and os.path.samefile(fake.path, _lib.loaded_path()),
          f"torch gets the real library path ({fake.path})")
    check((fake.alloc_name, fake.free_name) == ("vramswap_torch_malloc", "vramswap_free"),
          f"torch gets the names vramswap_torch_malloc / vramswap_free ({fake.alloc_name}, {fake.free_name})")
    lib = _lib.lib()

    def addr(fn):
        return ctypes.cast(fn, ctypes.c_void_p).value

    check(fake.alloc_fn == addr(lib.vramswap_torch_malloc) and fake.free_fn == addr(lib.vramswap_free)
          and fake.alloc_fn and fake.free_fn and fake.alloc_fn != addr(lib.vramswap_malloc),
          "torch's ctypes lookup finds both symbols, in the library vramswap loaded "
          "(the throwing vramswap_torch_malloc, not vramswap_malloc)")
    hooks = fake.allocator().hooks
    check(hooks.get("reset") == addr(lib.vramswap_empty_cache),
          "the reset hook (torch.cuda.empty_cache) is vramswap_empty_cache")
    check(hooks.get("record_stream") == addr(lib.vramswap_record_stream),
          "the record_stream hook is vramswap_record_stream")

    # Call the functions torch resolved, with torch's signatures.
    alloc = ctypes.CFUNCTYPE(ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(fake.alloc_fn)
    free = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p)(fake.free_fn)
    record = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_void_p)(hooks["record_stream"])
    reset = ctypes.CFUNCTYPE(None)(hooks["reset"])
    before = vramswap.memory_stats()
    p = alloc(4 * MIB, 0, None)
    mid = vramswap.memory_stats()
    check(bool(p) and mid["allocated_bytes"] - before["allocated_bytes"] >= 4 * MIB,
          "torch's malloc (vramswap_torch_malloc) serves 4 MiB through vramswap")
    check(_lib.last_error() == "", f"no error after it ({_lib.last_error()!r})")
    check(not alloc(0, 0, None) and _lib.last_error() == ""
          and vramswap.memory_stats()["num_allocs"] == mid["num_allocs"],
          "torch's malloc of size 0 is NULL, with no error and nothing allocated (no throw)")
    record(p, None)
    check(_lib.last_error() == "", f"record_stream on the block: no error ({_lib.last_error()!r})")
    free(p, 4 * MIB, 0, None)
    reset()
    after = vramswap.memory_stats()
    check(after["allocated_bytes"] == before["allocated_bytes"], "torch's free (vramswap_free) returns it")
    # Past the limit torch's malloc would throw (a C++ exception cannot cross ctypes), so the
    # same allocation is checked through vramswap_malloc: it fails, with the report.
    big = lib.vramswap_malloc(128 * MIB, 0, None)
    report = _lib.last_error()  # before the next vramswap call clears it
    oom = vramswap.memory_stats()
    check(not big and oom["num_ooms"] == after["num_ooms"] + 1,
          "past VRAMSWAP_LIMIT=64MiB (applied by install) the allocation fails, counted in num_ooms")
    check_words(report, ["out of memory", "64 MiB", "VRAMSWAP_LIMIT"],
                "its report (what vramswap_torch_malloc's exception carries) names the limit")

    # Second install(): only config.
    e = expect_raise(lambda: vramswap.install(horizon="many"), ValueError)
    check(isinstance(e, ValueError) and "VRAMSWAP_HORIZON" in str(e),
          f"a second install() applies config: a bad horizon is refused naming the key ({e})")
    check(vramswap.install(log="warn") == "ctypes" and len(Recorder.created) == 1 and len(Recorder.changed) == 1,
          "a second install() (log=warn, a setting that applies at once) swaps nothing again")
    e = expect_raise(lambda: vramswap.install(torch_ext_cuda="maybe"), ValueError)
    check(isinstance(e, ValueError) and "VRAMSWAP_TORCH_EXT_CUDA" in str(e),
          f"a bad VRAMSWAP_TORCH_EXT_CUDA is refused naming the key ({e})")

    # (d) one process, one mode.
    e = expect_raise(vramswap.sim.install_cpu, vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError), f"sim.install_cpu() after install() is refused ({e!r})")
    check_words(str(e), ["vramswap.install()", "CPU-emulation mode", "once per process"],
                "the refusal says the library already serves CUDA in this process")
    check(not vramswap.sim.installed(), "sim.installed() stays False")


def case_auto():
    fake_cuda_torch()
    import vramswap
    from vramswap import _ext, cuda
    try:
        _ext._cuda_flags()
        print("skip the auto case: this torch has what the CUDA extension needs; it would really "
              "swap torch's allocator")
        return
    except _ext.ExtensionUnavailable as e:
        unavailable = str(e)
    check("CUDAPluggableAllocator.h" in unavailable, f"the extension is unavailable: {unavailable}")
    e = expect_raise(lambda: vramswap.install(torch_ext_cuda=1), vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError), f"install(torch_ext_cuda=1) is refused ({e!r})")
    check_words(str(e), ["VRAMSWAP_TORCH_EXT_CUDA=1", "CUDAPluggableAllocator.h"],
                "the refusal names the key and what is missing")
    check(not Recorder.changed and not vramswap.installed(), "nothing swapped after it")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = vramswap.install()
    check(got == "ctypes" and len(Recorder.changed) == 1,
          f"install() with VRAMSWAP_TORCH_EXT_CUDA unset falls back to the ctypes path ({got!r})")
    texts = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    check(len(texts) == 1 and "raises RuntimeError" in texts[0] and "OutOfMemoryError" in texts[0]
          and "VRAMSWAP_TORCH_EXT_CUDA=0" in texts[0],
          f"the fallback warns once, saying what is lost and how to choose it ({texts})")
    check(Recorder.created[0].alloc_name == "vramswap_torch_malloc",
          f"the fallback gives torch vramswap_torch_malloc ({Recorder.created[0].alloc_name})")
    check("CUDAPluggableAllocator.h" in (cuda.fallback_reason() or ""), "fallback_reason() has the reason")


def case_after_cpu():
    import vramswap
    vramswap.sim.install_cpu()
    check(vramswap.sim.installed(), "the CPU-emulation mode is installed")
    fake_cuda_torch()
    e = expect_raise(vramswap.install, vramswap.VramswapError)
    check(isinstance(e, vramswap.VramswapError), f"install() after sim.install_cpu() is refused ({e!r})")
    check_words(str(e), ["CPU-emulation mode", "already installed", "process of its own"],
                "the refusal says why and what to do")
    check(not Recorder.created and not Recorder.changed and not vramswap.installed(), "nothing swapped")


def case_bad_env():
    os.environ["VRAMSWAP_HORIZON"] = "many"  # before the library loads: it reads the environment then
    fake_cuda_torch()
    import vramswap
    e = expect_raise(lambda: vramswap.install(torch_ext_cuda=0), vramswap.ConfigError)
    check(isinstance(e, vramswap.ConfigError) and isinstance(e, ValueError),
          f"install() with VRAMSWAP_HORIZON=many in the environment raises ConfigError ({e!r})")
    check_words(str(e), ["VRAMSWAP_HORIZON='many' is not valid", "expected an integer"],
                "the message is the library's: the variable, the value and what is accepted")
    check(not Recorder.created and not Recorder.changed and not vramswap.installed(), "nothing swapped")


def case_run():
    """Child of the `run` case: argv after --case run: initialized(0/1) script."""
    initialized, script = sys.argv[3] == "1", sys.argv[4]
    fake_cuda_torch(initialized=initialized)
    from vramswap.__main__ import main
    sys.exit(main(["run", "--", "python3", script]))


CASES = {"initialized": case_initialized, "no-cuda": case_no_cuda, "ctypes": case_ctypes,
         "auto": case_auto, "after-cpu": case_after_cpu, "bad-env": case_bad_env}

RUN_SCRIPT = """\
import vramswap
from vramswap import cuda
print("installed", vramswap.installed(), cuda.backend(), vramswap.sim.installed())
"""


def child_env(cudasim):
    """The environment of a case's process; `cudasim`: cudasim preloaded as the CUDA runtime
    and driver (only for the cases that load libvramswap.so as torch's CUDA allocator)."""
    env = dict(os.environ)
    for k in ("VRAMSWAP_TORCH_DEVICE", "VRAMSWAP_TORCH_EXT_CUDA", "VRAMSWAP_LOG"):
        env.pop(k, None)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    if cudasim:  # cudasim stands in for the CUDA runtime and driver libvramswap.so links
        from vramswap import _lib
        sim = _lib.cudasim_dir()
        env["LD_PRELOAD"] = " ".join(str(sim / name) for name in ("libcuda.so.1", "libcudart.so.13"))
    return env


# The cases that load libvramswap.so on the CUDA path, on cudasim.
ON_CUDASIM = {"ctypes", "auto", "bad-env", "run"}


def spawn(args, **env_extra):
    env = child_env(args[1] in ON_CUDASIM)
    env.update(env_extra)
    return subprocess.run([sys.executable, __file__] + args, env=env, capture_output=True,
                          text=True, timeout=240)


def main():
    if len(sys.argv) > 2 and sys.argv[1] == "--case":
        if sys.argv[2] == "run":
            case_run()
        CASES[sys.argv[2]]()
        sys.exit(1 if failures else 0)

    start = time.monotonic()
    for name in CASES:
        print(f"--- {name}")
        proc = spawn(["--case", name])
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            failures.append(name)
            print(f"FAIL case {name} exited with status {proc.returncode}:\n{proc.stderr[-3000:]}")

    print("--- run")
    with tempfile.TemporaryDirectory() as tmp:
        script = os.path.join(tmp, "script.py")
        Path(script).write_text(RUN_SCRIPT)
        proc = spawn(["--case", "run", "0", script], VRAMSWAP_TORCH_EXT_CUDA="0")
        check(proc.returncode == 0 and "installed True ctypes False" in proc.stdout,
              "vramswap run with a CUDA device installs vramswap as torch's CUDA allocator "
              f"(status {proc.returncode}, stdout {proc.stdout!r}, stderr {proc.stderr[-1500:]!r})")
        proc = spawn(["--case", "run", "0", script], VRAMSWAP_TORCH_EXT_CUDA="0", VRAMSWAP_LIMIT="lots")
        check(proc.returncode == 2 and "vramswap: error: VRAMSWAP_LIMIT='lots' is not valid" in proc.stderr
              and "installed" not in proc.stdout and "Traceback" not in proc.stderr,
              "vramswap run with a CUDA device and VRAMSWAP_LIMIT=lots stops with status 2 before the "
              f"script, naming the variable (status {proc.returncode}, stderr {proc.stderr[-1500:]!r})")
        proc = spawn(["--case", "run", "1", script])
        check(proc.returncode == 2 and "vramswap run: vramswap.install(): torch has already initialized CUDA"
              in proc.stderr and "installed" not in proc.stdout,
              f"vramswap run with CUDA initialized stops with status 2 and the reason "
              f"(status {proc.returncode}, stderr {proc.stderr[-1500:]!r})")

    print(f"     {time.monotonic() - start:.1f} s")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""Bad VRAMSWAP_* values and out-of-memory in the CPU-emulation mode and `vramswap run`:
clear errors, before anything runs.

  run          `VRAMSWAP_LIMIT=lots python3 -m vramswap run -- python3 script.py` (with and
               without VRAMSWAP_TORCH_DEVICE=cpu-sim) exits with status 2 before the script
               runs, printing the error line the LD_PRELOAD library prints for the same
               environment (compared with its own output when the preload library is at
               SUITE_PRELOAD_LIBRARY), one per bad value; an unknown VRAMSWAP_* variable
               is only the library's warning and the script runs.
  import       `import vramswap` with VRAMSWAP_TORCH_DEVICE=cpu-sim and a bad value stops the
               program the same way; VRAMSWAP_TORCH_DEVICE=cpu is refused by `import vramswap`
               and by `vramswap run` alike (exit status 2, naming the variable, the value and
               cpu-sim).
  install_cpu  vramswap.sim.install_cpu() with a bad VRAMSWAP_HORIZON in the environment
               raises ConfigError (a ValueError) naming it, installs nothing, and is not
               talked out of it by horizon= in its config.
  values       Python values in install_cpu(**config): "8GiB\\x00junk" (NUL), a lone
               surrogate, 1.5, nan, True for a size, a list: each refused with ConfigError
               naming VRAMSWAP_LIMIT and the value, nothing applied; 2.0 * MiB (a float with no
               fraction), True for VRAMSWAP_VERIFY and None are accepted; the limit in force
               afterwards is the one last accepted. offload(min_bytes=1.5) and
               offload(horizon="8\\x00") are refused the same way.
  oom          an allocation past the limit, in the forward and in backward, raises
               vramswap.OutOfMemoryError, which is torch.cuda.OutOfMemoryError and a
               RuntimeError, with one "vramswap: " at the start of its message.
  unpack_oom   backward's unpack of an evicted saved tensor with no memory left: an
               out-of-memory with the pool's report, counted in num_ooms; once memory is
               freed the same backward runs.
  conf         VRAMSWAP_CONF="limit:48MiB,horizon:2" sets the limit under `vramswap run` in
               the CPU-emulation mode; VRAMSWAP_LIMIT wins over its limit item; a bad item
               stops `vramswap run` (exit status 2) with the preload's error line.
  keys         the package's own VRAMSWAP_* keys (vramswap._config.PYTHON_KEYS) are the
               ones src/config/config.h's kPythonKeys tells the library to skip.

Usage: python3 tests/python/test_config_errors.py [CASE...]   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py);
SUITE_PRELOAD_LIBRARY (optional) for the comparison with the preload's message.
"""
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))
MIB = 1 << 20
LIMIT_ERROR = "VRAMSWAP_LIMIT='lots' is not valid"
SCRIPT = 'open("ran", "w").write("the script ran")\nprint("the script ran")\n'

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def child_env(**extra):
    """The environment of a child: this one's paths, no VRAMSWAP_* setting of its own."""
    keep = ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR", "VRAMSWAP_TORCH_EXT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") or k in keep}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    return env


def spawn(cmd, cwd, **extra):
    return subprocess.run(cmd, env=child_env(**extra), cwd=cwd, capture_output=True, text=True,
                          timeout=300)


def preload_lines(**extra):
    """The "vramswap: error:" lines libvramswap_preload.so prints for this environment (it
    stops /bin/true before main), or None without the preload library."""
    preload = os.environ.get("SUITE_PRELOAD_LIBRARY")
    if not preload or not Path(preload).is_file():
        return None
    from vramswap import _lib
    env = child_env(LD_PRELOAD=preload, LD_LIBRARY_PATH=str(_lib.cudasim_dir()), **extra)
    proc = subprocess.run(["/bin/true"], env=env, capture_output=True, text=True, timeout=60)
    check(proc.returncode == 2, f"the preload stops /bin/true with status 2 ({proc.returncode})")
    return [line for line in proc.stderr.splitlines()
            if line.startswith("vramswap: error: VRAMSWAP_")]


def same_as_preload(proc, what, count=None, **env):
    """Checks that `proc` printed the "vramswap: error: VRAMSWAP_..." lines the preload prints
    for `env` (all `count` of them when given); nothing without the preload library."""
    preload = preload_lines(**env)
    if preload is None:
        return
    ours = [line for line in proc.stderr.splitlines() if line.startswith("vramswap: error: VRAMSWAP_")]
    check(ours == preload and (count is None or len(ours) == count),
          f"{what}: the error lines are the preload's, in its order ({preload} / {ours})")


def stopped(proc, tmp, what, words):
    """Checks that a child stopped with status 2 before the script ran, saying `words`."""
    ran = (Path(tmp) / "ran").exists() or "the script ran" in proc.stdout
    missing = [w for w in words if w not in proc.stderr]
    check(proc.returncode == 2 and not ran and not missing,
          f"{what}: exit status 2 ({proc.returncode}), the script did not run ({not ran}), "
          f"the message says {words}" + (f" (missing {missing} in {proc.stderr[-1500:]!r})" if missing else ""))
    check("Traceback" not in proc.stderr, f"{what}: no traceback")


def case_run():
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "script.py").write_text(SCRIPT)
        run = [py, "-m", "vramswap", "run", "--", "python3", "script.py"]
        for device in ("", "cpu-sim"):
            label = "vramswap run" + (" (VRAMSWAP_TORCH_DEVICE=cpu-sim)" if device else "")
            proc = spawn(run, tmp, VRAMSWAP_LIMIT="lots", VRAMSWAP_TORCH_DEVICE=device)
            stopped(proc, tmp, f"{label}, VRAMSWAP_LIMIT=lots",
                    [f"vramswap: error: {LIMIT_ERROR}", "expected a size", "exit status 2"])
            same_as_preload(proc, label, VRAMSWAP_LIMIT="lots")

        bad = dict(VRAMSWAP_LIMIT="lots", VRAMSWAP_HORIZON="many", VRAMSWAP_LOG="loud")
        proc = spawn(run, tmp, **bad)
        stopped(proc, tmp, "vramswap run with three bad values",
                ["VRAMSWAP_HORIZON='many'", "VRAMSWAP_LOG='loud'", LIMIT_ERROR])
        same_as_preload(proc, "vramswap run with three bad values", count=3, **bad)

        proc = spawn(run, tmp, VRAMSWAP_LIMT="64MiB")
        check(proc.returncode == 0 and "the script ran" in proc.stdout
              and "unknown variable VRAMSWAP_LIMT; did you mean VRAMSWAP_LIMIT?" in proc.stderr,
              f"an unknown VRAMSWAP_* variable is the library's warning, and the script runs "
              f"(status {proc.returncode}, stderr {proc.stderr[-800:]!r})")


def case_import():
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        code = "import vramswap\n" + SCRIPT
        proc = spawn([py, "-c", code], tmp, VRAMSWAP_TORCH_DEVICE="cpu-sim", VRAMSWAP_LIMIT="lots")
        stopped(proc, tmp, "import vramswap with VRAMSWAP_TORCH_DEVICE=cpu-sim, VRAMSWAP_LIMIT=lots",
                [f"vramswap: error: {LIMIT_ERROR}", "exit status 2"])
        Path(tmp, "script.py").write_text(SCRIPT)
        words = ["VRAMSWAP_TORCH_DEVICE='cpu' is not valid", "cpu-sim", "exit status 2"]
        proc = spawn([py, "-c", code], tmp, VRAMSWAP_TORCH_DEVICE="cpu")
        stopped(proc, tmp, "import vramswap with VRAMSWAP_TORCH_DEVICE=cpu", words)
        proc = spawn([py, "-m", "vramswap", "run", "--", "script.py"], tmp, VRAMSWAP_TORCH_DEVICE="cpu")
        stopped(proc, tmp, "vramswap run with VRAMSWAP_TORCH_DEVICE=cpu", words)
        proc = spawn([py, "-c", code], tmp, VRAMSWAP_TORCH_DEVICE="")
        check(proc.returncode == 0 and "the script ran" in proc.stdout,
              f"VRAMSWAP_TORCH_DEVICE empty is accepted at import (status {proc.returncode}, {proc.stderr[-500:]!r})")


def refused(fn, words, what):
    """Checks that fn() raises vramswap.ConfigError (a ValueError) whose message has `words`."""
    import vramswap
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a wrong type is a failed check, with its message
        missing = [w for w in words if w not in str(e)]
        check(isinstance(e, vramswap.ConfigError) and isinstance(e, ValueError) and not missing,
              f"{what}: ConfigError naming {words} ({type(e).__name__}: {e})")
        return
    check(False, f"{what}: refused (nothing was raised)")


def case_install_cpu():
    os.environ["VRAMSWAP_HORIZON"] = "many"  # before the library loads: it reads the environment then
    import vramswap
    refused(vramswap.sim.install_cpu, ["VRAMSWAP_HORIZON='many'", "expected an integer"],
            "install_cpu() with VRAMSWAP_HORIZON=many in the environment")
    refused(lambda: vramswap.sim.install_cpu(horizon=2), ["VRAMSWAP_HORIZON='many'"],
            "install_cpu(horizon=2) with VRAMSWAP_HORIZON=many in the environment")
    check(not vramswap.sim.installed(), "nothing installed")


def case_values():
    import torch
    import vramswap
    limit = "VRAMSWAP_LIMIT"
    for value, words, what in [
            ("8GiB\x00junk", [limit, r"'8GiB\x00junk'", "NUL"], "a NUL character"),
            ("8GiB\udc80", [limit, r"'8GiB\udc80'", "surrogate"], "a lone surrogate"),
            (1.5, [limit, "1.5", "fractional"], "a float with a fractional part"),
            (float("nan"), [limit, "nan", "finite"], "nan"),
            (True, [limit, "'true'", "expected a size"], "True for a size"),
            ([1], [limit, "[1]", "list"], "a list")]:
        refused(lambda: vramswap.sim.install_cpu(limit=value), words, f"install_cpu(limit={value!r}): {what}")
    check(not vramswap.sim.installed(), "nothing installed after the refusals")
    vramswap.sim.install_cpu(limit=2.0 * 32 * MIB, verify=True, horizon=None)
    check(vramswap.sim.installed(), "limit=2.0 * 32 MiB (a float with no fraction), verify=True and "
                                    "horizon=None are accepted")
    refused(lambda: vramswap.sim.install_cpu(limit=3.25), [limit, "3.25"], "a second install_cpu(limit=3.25)")

    def scope(**kw):
        with vramswap.offload(**kw):
            pass
    refused(lambda: scope(min_bytes=1.5), ["VRAMSWAP_MIN_OFFLOAD_BYTES", "1.5", "fractional"],
            "offload(min_bytes=1.5)")
    refused(lambda: scope(horizon="8\x00"), ["VRAMSWAP_HORIZON", "NUL"], "offload(horizon='8\\x00')")
    t = torch.empty(MIB // 4)
    stats = vramswap.memory_stats()
    check(stats["device_limit_bytes"] == 64 * MIB,
          f"the limit in force is the one last accepted, 64 MiB ({stats['device_limit_bytes']} bytes)")
    del t


def case_oom():
    import torch
    import vramswap
    vramswap.sim.install_cpu(limit="64MiB", log="off")
    check("OutOfMemoryError" in vramswap.__all__ and "ConfigError" in vramswap.__all__,
          "vramswap exports OutOfMemoryError and ConfigError")
    check(vramswap.OutOfMemoryError is torch.cuda.OutOfMemoryError
          and issubclass(vramswap.OutOfMemoryError, RuntimeError),
          "vramswap.OutOfMemoryError is torch.cuda.OutOfMemoryError, a RuntimeError")

    def one_prefix(e, what):
        text = str(e)
        check(text.startswith("vramswap: out of memory allocating ") and "vramswap: vramswap" not in text
              and text.count("vramswap: ") == 1 and "64 MiB" in text,
              f"{what}: one 'vramswap: ' at the start, the report with the limit ({text[:300]!r})")

    try:
        torch.empty(128 * MIB // 4)
        check(False, "an allocation past the limit raises")
    except vramswap.OutOfMemoryError as e:
        check(True, f"an allocation past the limit raises vramswap.OutOfMemoryError ({type(e).__name__})")
        one_prefix(e, "forward")
    except RuntimeError as e:
        check(False, f"an allocation past the limit raises vramswap.OutOfMemoryError, not {type(e).__name__}: {e}")

    x = torch.ones(MIB // 4, requires_grad=True)     # 1 MiB
    y = (x.unsqueeze(1) * torch.ones(1, 16)).sum()    # backward makes a 16 MiB gradient and more
    hold = torch.empty(50 * MIB // 4)                 # leaves less than that
    try:
        y.backward()
        check(False, "an allocation past the limit in backward raises")
    except vramswap.OutOfMemoryError as e:
        check(True, f"an allocation past the limit in backward raises vramswap.OutOfMemoryError ({type(e).__name__})")
        one_prefix(e, "backward")
    except RuntimeError as e:
        check(False, f"in backward: vramswap.OutOfMemoryError, not {type(e).__name__}: {e}")
    del hold


def case_unpack_oom():
    """A saved tensor evicted under a limit that the program then fills: backward's unpack
    cannot bring it back. vramswap_unpack returns -2 (an out-of-memory) with the pool's
    report, counted in num_ooms; the tracker raises vramswap.OutOfMemoryError, which reaches
    backward()'s caller as torch's autograd passes on an exception from a Python hook (a
    RuntimeError whose message starts with the class's name, on torch 1.13)."""
    import torch
    import vramswap
    vramswap.sim.install_cpu(limit="16MiB", horizon=0, log="off")
    x = torch.ones(2 * MIB // 4, requires_grad=True)  # 2 MiB
    with vramswap.offload():
        y = (x * 2).sin()  # saves x * 2, which the program drops: cold
    fillers = []
    try:
        while True:
            fillers.append(torch.empty(2 * MIB // 4))  # evicts the saved tensor, then fills the limit
    except vramswap.OutOfMemoryError:
        pass
    check(vramswap.memory_stats()["num_evictions"] >= 1, "the saved tensor was evicted for the fillers")
    ooms = vramswap.memory_stats()["num_ooms"]
    try:
        y.sum().backward()
        check(False, "backward's unpack with no memory left raises")
    except RuntimeError as e:
        text = str(e)
        check(isinstance(e, vramswap.OutOfMemoryError) or text.startswith("OutOfMemoryError: vramswap: "),
              f"backward's unpack raises vramswap.OutOfMemoryError ({type(e).__name__}: {text[:120]!r})")
        check("cannot bring block" in text and "out of memory on device 0" in text and "Limit 16 MiB" in text,
              f"with the report of what holds the memory ({text[:400]!r})")
    check(vramswap.memory_stats()["num_ooms"] == ooms + 1, "counted in num_ooms")
    fillers.clear()  # memory again: the same backward can run
    y.sum().backward()
    check(torch.equal(x.grad, 2 * torch.cos(x.detach() * 2)), "after freeing memory, backward brings it back")


LIMIT_SCRIPT = "import torch, vramswap\nx = torch.ones(1024)\nprint('limit', vramswap.memory_stats()['device_limit_bytes'])\n"


def case_conf():
    """VRAMSWAP_CONF="limit:...,horizon:..." (Note [VRAMSWAP_CONF]): applied in the
    CPU-emulation mode, a variable of its own wins, and a bad item stops `vramswap run` as a
    bad variable does, with the preload's line."""
    py = sys.executable
    with tempfile.TemporaryDirectory() as tmp:
        Path(tmp, "script.py").write_text(SCRIPT)
        Path(tmp, "limit.py").write_text(LIMIT_SCRIPT)
        run = [py, "-m", "vramswap", "run", "--", "python3"]
        proc = spawn(run + ["limit.py"], tmp, VRAMSWAP_TORCH_DEVICE="cpu-sim", VRAMSWAP_CONF="limit:48MiB,horizon:2")
        check(proc.returncode == 0 and f"limit {48 * MIB}" in proc.stdout,
              f"VRAMSWAP_CONF=limit:48MiB,horizon:2 sets the limit ({proc.stdout.strip()!r}, {proc.stderr[-400:]!r})")
        proc = spawn(run + ["limit.py"], tmp, VRAMSWAP_TORCH_DEVICE="cpu-sim", VRAMSWAP_CONF="limit:48MiB",
                     VRAMSWAP_LIMIT="32MiB")
        check(proc.returncode == 0 and f"limit {32 * MIB}" in proc.stdout,
              f"VRAMSWAP_LIMIT=32MiB wins over VRAMSWAP_CONF's limit:48MiB ({proc.stdout.strip()!r})")
        conf_error = "VRAMSWAP_CONF='limit:lots' is not valid: item 'limit:lots': VRAMSWAP_LIMIT='lots' is not valid"
        for device in ("", "cpu-sim"):
            proc = spawn(run + ["script.py"], tmp, VRAMSWAP_CONF="limit:lots", VRAMSWAP_TORCH_DEVICE=device)
            stopped(proc, tmp, f"vramswap run{' (cpu-sim)' if device else ''}, VRAMSWAP_CONF=limit:lots",
                    [f"vramswap: error: {conf_error}", "expected a size", "exit status 2"])
        same_as_preload(proc, "VRAMSWAP_CONF=limit:lots", VRAMSWAP_CONF="limit:lots")


def case_keys():
    from vramswap import _config
    header = (REPO / "src" / "config" / "config.h").read_text()
    m = re.search(r"kPythonKeys\[\]\s*=\s*\{([^}]*)\}", header)
    cpp = set(re.findall(r'"(VRAMSWAP_\w+)"', m.group(1))) if m else set()
    check(cpp and cpp == set(_config.PYTHON_KEYS),
          f"the package's own keys are config.h's kPythonKeys ({sorted(cpp)} / {sorted(_config.PYTHON_KEYS)})")


CASES = {"run": case_run, "import": case_import, "install_cpu": case_install_cpu,
         "values": case_values, "oom": case_oom, "unpack_oom": case_unpack_oom, "keys": case_keys,
         "conf": case_conf}
IN_PARENT = ("run", "import", "keys", "conf")  # these spawn their own children


def main(argv):
    if len(argv) == 2 and argv[0] == "--child":
        CASES[argv[1]]()
        return 1 if failures else 0
    names = argv or list(CASES)
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown case(s) {unknown}; known: {', '.join(CASES)}")
        return 2
    for name in names:
        print(f"== {name}", flush=True)
        if name in IN_PARENT:
            CASES[name]()
            continue
        proc = subprocess.run([sys.executable, __file__, "--child", name], env=child_env(),
                              capture_output=True, text=True, timeout=300)
        sys.stdout.write(proc.stdout)
        if proc.returncode != 0:
            failures.append(name)
            print(f"FAIL case {name} exited with status {proc.returncode}:\n{proc.stderr[-3000:]}")
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

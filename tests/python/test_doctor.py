#!/usr/bin/python3
"""`python3 -m vramswap doctor [--json]` (vramswap/_doctor.py), run as a user would: a child
process started in a temporary directory outside the repository, with PYTHONPATH naming
plugin/python.

  json     one JSON object: torch_version is the imported torch's; cpu_extension is "ok" and
           cuda_extension too when torch is a CUDA build; cuda_available is torch's, and with
           no device the install path is the CPU-emulation mode, named with
           VRAMSWAP_TORCH_DEVICE=cpu-sim and "CUDA is not available"; the config shows
           VRAMSWAP_HORIZON=3 from "environment" over VRAMSWAP_CONF's horizon item,
           VRAMSWAP_LIMIT from "VRAMSWAP_CONF" and VRAMSWAP_SOFT_LIMIT at its "default";
           libvramswap.so is the one VRAMSWAP_LIBRARY names, one libcudart and one libcuda
           are marked as the ones its calls go to (cudasim's, with no warning, in the
           CPU-emulation mode), and torch's directory is torch's.
  human    the same facts on aligned lines, exit status 0.
  compile  with a compiler that fails with a long cascade of errors, each extension is
           reported as "compile failed: " and the first error lines, not the tail.
  errors   VRAMSWAP_LIMIT=lots stops it with exit status 2 and the library's message naming
           the variable; an unknown option exits 2 naming itself and the accepted ones.

Usage: python3 tests/python/test_doctor.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_config_errors.py).
"""
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"VRAMSWAP_HORIZON": "3", "VRAMSWAP_CONF": "limit:48MiB,horizon:2"}
CUDA = torch.version.cuda is not None and torch.cuda.is_available()

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def doctor(*args, **extra):
    """Runs `python3 -m vramswap doctor ARGS` with this environment's paths, no VRAMSWAP_*
    setting of its own but `extra`."""
    keep = ("VRAMSWAP_LIBRARY", "VRAMSWAP_CUDASIM_DIR", "VRAMSWAP_CACHE_DIR", "VRAMSWAP_TORCH_EXT")
    env = {k: v for k, v in os.environ.items() if not k.startswith("VRAMSWAP_") or k in keep}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO / "plugin" / "python")]
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    env.update(extra)
    with tempfile.TemporaryDirectory() as tmp:
        return subprocess.run([sys.executable, "-m", "vramswap", "doctor", *args], env=env, cwd=tmp,
                              capture_output=True, text=True, timeout=600)


def case_json():
    proc = doctor("--json", **SETTINGS)
    check(proc.returncode == 0, f"doctor --json exits 0 ({proc.returncode}; {proc.stderr[-1500:]!r})")
    try:
        r = json.loads(proc.stdout)
    except ValueError as e:
        check(False, f"doctor --json prints one JSON object ({e}: {proc.stdout[:500]!r})")
        return
    keys = ("vramswap_version", "torch_version", "cuda_available", "cpu_extension", "cuda_extension",
            "config", "devices", "install_path", "libraries")
    check(all(k in r for k in keys), f"the object has the keys {keys} ({sorted(r)})")
    from vramswap import __version__
    check(r.get("vramswap_version") == __version__, f"vramswap_version {r.get('vramswap_version')}")
    check(r.get("torch_version") == torch.__version__,
          f"torch_version is the imported torch's ({r.get('torch_version')} / {torch.__version__})")
    check(r.get("cpu_extension") == "ok", f"cpu_extension is ok ({r.get('cpu_extension')!r})")
    if torch.version.cuda is not None:
        check(r.get("cuda_extension") == "ok",
              f"cuda_extension is ok with torch built for CUDA {torch.version.cuda} ({r.get('cuda_extension')!r})")
    else:
        check(r.get("cuda_extension") not in ("ok", None), f"cuda_extension says why not ({r.get('cuda_extension')!r})")
    check(r.get("cuda_available") is CUDA, f"cuda_available is {CUDA} ({r.get('cuda_available')!r})")
    detail = r.get("install_detail", "")
    if CUDA:
        check(r.get("install_path", "").startswith("cuda-") and len(r.get("devices", [])) == torch.cuda.device_count(),
              f"with a GPU, a CUDA install path and every device ({r.get('install_path')}, {r.get('devices')})")
    else:
        check(r.get("install_path") == "cpu-sim" and "CUDA is not available" in detail
              and "VRAMSWAP_TORCH_DEVICE=cpu-sim" in detail and r.get("devices") == [],
              f"with no GPU: CUDA is not available, the CPU-emulation mode is named "
              f"({r.get('install_path')}: {detail})")
    config = r.get("config", {})
    check(config.get("VRAMSWAP_HORIZON", {}).get("value") == "3"
          and config.get("VRAMSWAP_HORIZON", {}).get("source") == "environment",
          f"VRAMSWAP_HORIZON=3 from the environment, over VRAMSWAP_CONF's item ({config.get('VRAMSWAP_HORIZON')})")
    check(config.get("VRAMSWAP_LIMIT", {}).get("value") == "48MiB"
          and config.get("VRAMSWAP_LIMIT", {}).get("source") == "VRAMSWAP_CONF",
          f"VRAMSWAP_LIMIT=48MiB from VRAMSWAP_CONF ({config.get('VRAMSWAP_LIMIT')})")
    from vramswap import _config
    check(_config.conf_items('disk_dir:"/data/a,b:c" , Horizon:2,limit') ==
          {"VRAMSWAP_DISK_DIR": "/data/a,b:c", "VRAMSWAP_HORIZON": "2"},
          "doctor reads VRAMSWAP_CONF's items as the library does (a quoted value holds commas)")
    soft = config.get("VRAMSWAP_SOFT_LIMIT", {})
    check(soft.get("source") == "default" and soft.get("value") == soft.get("default") and soft.get("value"),
          f"VRAMSWAP_SOFT_LIMIT untouched: its default ({soft})")
    check(config.get("VRAMSWAP_TORCH_EXT_CUDA", {}).get("source") == "default"
          and config.get("VRAMSWAP_CONF", {}).get("source") == "environment",
          "the package's own keys are listed too (VRAMSWAP_TORCH_EXT_CUDA, VRAMSWAP_CONF)")
    libs = r.get("libraries", {})
    if os.environ.get("VRAMSWAP_LIBRARY"):
        check(libs.get("libvramswap") == os.path.realpath(os.environ["VRAMSWAP_LIBRARY"]),
              f"libvramswap.so is VRAMSWAP_LIBRARY's ({libs.get('libvramswap')}; {libs.get('libvramswap_error')})")
    for name in ("libcudart", "libcuda"):
        used = [e for e in libs.get(name, []) if e.get("used_by_vramswap")]
        check(len(used) == 1 and used[0].get("origin") in ("cudasim", "NVIDIA"),
              f"one {name} is the one libvramswap.so's calls go to ({libs.get(name)})")
    if not CUDA:
        used = [e.get("origin") for name in ("libcudart", "libcuda") for e in libs.get(name, [])
                if e.get("used_by_vramswap")]
        check(used == ["cudasim", "cudasim"] and r.get("warnings") == [],
              f"in the CPU-emulation mode libvramswap.so's calls reach cudasim's libcudart and libcuda, "
              f"with no warning ({used}; {r.get('warnings')})")
    check(libs.get("torch") == os.path.dirname(torch.__file__), f"torch's directory ({libs.get('torch')})")


def case_human():
    proc = doctor(**SETTINGS)
    out = proc.stdout
    check(proc.returncode == 0, f"doctor exits 0 ({proc.returncode}; {proc.stderr[-1500:]!r})")
    lines = out.splitlines()

    def line(label):
        """The fact's line, with the lines that continue it (indented to its value)."""
        at = next((i for i, x in enumerate(lines) if x.startswith(label + " ")), None)
        if at is None:
            return ""
        rest = [x.strip() for x in lines[at + 1:]]
        more = next((i for i, x in enumerate(lines[at + 1:]) if not x.startswith(" ")), len(rest))
        return " ".join([lines[at]] + rest[:more])

    check(torch.__version__ in line("torch"), f"the torch line names {torch.__version__} ({line('torch')!r})")
    check(line("cpu extension").split()[-1:] == ["ok"], f"cpu extension: ok ({line('cpu extension')!r})")
    if torch.version.cuda is not None:
        check(line("cuda extension").split()[-1:] == ["ok"], f"cuda extension: ok ({line('cuda extension')!r})")
    check(line("cuda available").split()[-1:] == (["yes"] if CUDA else ["no"]),
          f"cuda available ({line('cuda available')!r})")
    if not CUDA:
        install = line("install path")
        check("CUDA is not available" in install and "VRAMSWAP_TORCH_DEVICE=cpu-sim" in install,
              f"the install path names the CPU-emulation mode ({install!r})")
    check("3" in line("VRAMSWAP_HORIZON").split() and "[environment]" in line("VRAMSWAP_HORIZON"),
          f"VRAMSWAP_HORIZON's line ({line('VRAMSWAP_HORIZON')!r})")
    check("48MiB" in line("VRAMSWAP_LIMIT").split() and "[VRAMSWAP_CONF]" in line("VRAMSWAP_LIMIT"),
          f"VRAMSWAP_LIMIT's line ({line('VRAMSWAP_LIMIT')!r})")
    check("[default]" in line("VRAMSWAP_SOFT_LIMIT"), f"VRAMSWAP_SOFT_LIMIT's line ({line('VRAMSWAP_SOFT_LIMIT')!r})")
    check(all(line(label) for label in ("vramswap", "python", "libvramswap", "libcudart", "libcuda", "torch dir")),
          "a line each for vramswap, python, libvramswap, libcudart, libcuda and torch's directory")
    facts = [x for x in lines if not x.startswith("VRAMSWAP_")]
    settings = [x for x in lines if x.startswith("VRAMSWAP_")]
    check(all(len(x) > 17 and x[16] == " " and x[17] != " " for x in facts if x.strip())
          and all(len(x) > 28 and x[27] == " " and x[28] != " " for x in settings),
          f"the values are aligned, in one column for the facts and one for the settings ({lines})")


def case_compile():
    """A compiler whose first errors are followed by a long cascade: both extensions report
    the first error lines, not the tail."""
    with tempfile.TemporaryDirectory() as tmp:
        cxx = Path(tmp) / "cxx"
        cxx.write_text("#!/bin/sh\necho 'a.cpp:1:1: error: FIRST' >&2\necho 'a.cpp:2:1: error: SECOND' >&2\n"
                       "i=0; while [ $i -lt 200 ]; do echo \"  note: candidate $i of a long cascade\" >&2; "
                       "i=$((i+1)); done\necho 'a.cpp:99:1: error: LAST' >&2\nexit 1\n")
        cxx.chmod(0o755)
        proc = doctor("--json", CXX=str(cxx), VRAMSWAP_CACHE_DIR=str(Path(tmp) / "cache"), VRAMSWAP_TORCH_EXT="")
    r = json.loads(proc.stdout) if proc.returncode == 0 else {}
    for kind in ("cpu", "cuda") if torch.version.cuda is not None else ("cpu",):
        reason = r.get(f"{kind}_extension", "")
        check(reason.startswith("compile failed: a.cpp:1:1: error: FIRST\na.cpp:2:1: error: SECOND")
              and "note:" not in reason, f"a failed {kind} build reports the first error lines ({reason!r})")


def case_errors():
    proc = doctor("--json", VRAMSWAP_LIMIT="lots")
    check(proc.returncode == 2 and "vramswap: error: VRAMSWAP_LIMIT='lots' is not valid" in proc.stderr
          and "Traceback" not in proc.stderr and not proc.stdout.strip(),
          f"VRAMSWAP_LIMIT=lots: exit status 2 naming the variable ({proc.returncode}; {proc.stderr[-800:]!r})")
    proc = doctor("--bogus")
    check(proc.returncode == 2 and "--bogus" in proc.stderr and "--json" in proc.stderr and not proc.stdout,
          f"an unknown option: exit status 2, naming itself and --json ({proc.returncode}; {proc.stderr!r})")


def main():
    for name, case in (("json", case_json), ("human", case_human), ("compile", case_compile), ("errors", case_errors)):
        print(f"== {name}", flush=True)
        case()
    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.path.insert(0, str(REPO / "plugin" / "python"))
    sys.exit(main())

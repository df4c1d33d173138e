"""`vramswap doctor [--json]`: what vramswap will do on this machine, one fact per line (or one
JSON object): the versions of vramswap, Python and torch; whether torch sees CUDA and which
devices; the path vramswap would take (vramswap.install()'s CUDA extension or ctypes path, or
the CPU-emulation mode); whether each LibTorch extension builds and loads; the VRAMSWAP_*
settings in force and where each comes from; and the libraries loaded, from where.

Rules:
  - it installs nothing: libvramswap.so is loaded for the mode vramswap would use (on cudasim
    for the CPU-emulation mode) and the environment checked as install() checks it; a bad
    VRAMSWAP_* value stops it with the same "vramswap: error:" lines and exit status 2, as
    `vramswap run` does. The extensions are built into the usual cache (VRAMSWAP_CACHE_DIR,
    default ~/.cache/vramswap) and loaded into torch, which proves that they load;
  - the library's settings come from the library, so its table is written once (src/config):
    the C ABI has no call that returns them, but VRAMSWAP_LOG=info prints the effective
    settings when the first pool is created, so a child process (libvramswap.so on cudasim,
    one 1-byte allocation, then os._exit, which skips the stats file) prints them for this
    environment. The source of each ("environment", "VRAMSWAP_CONF" or "default") follows
    the library's precedence: a key's own variable wins over its VRAMSWAP_CONF item.
Exit status: 0 when it could report (a failure to report is itself a fact), 2 for a bad
VRAMSWAP_* value or a bad argument.
"""
import ctypes
import json
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

from . import _config, _lib
from ._version import __version__

USAGE = "usage: vramswap doctor [--json]"
_SETTING = re.compile(r"vramswap: (VRAMSWAP_\w+)=(.*) \((?:default|set; default: (.*))\)$")
# The child prints the effective settings; VRAMSWAP_TORCH_DEVICE is left out of its
# environment, so that `import vramswap` there loads no torch.
_DESCRIBE = ("import os\nfrom vramswap import _lib\n"
             "_lib.load(cudasim=True).vramswap_malloc(1, 0, None)\nos._exit(0)\n")


def _settings():
    """-> ({key: {"value", "source", "default"}} for the library's keys, None), or ({}, why)."""
    env = {k: v for k, v in os.environ.items() if k != "VRAMSWAP_TORCH_DEVICE"}
    env["VRAMSWAP_LOG"] = "info"
    package_dir = str(Path(__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join([package_dir] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    try:
        proc = subprocess.run([sys.executable, "-c", _DESCRIBE], env=env, capture_output=True,
                              text=True, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as e:
        return {}, f"the settings could not be read: {e}"
    conf = _config.conf_items(os.environ.get("VRAMSWAP_CONF", ""))
    settings = {}
    for line in proc.stderr.splitlines():
        m = _SETTING.match(line)
        if not m:
            continue
        key, value, default = m.group(1), m.group(2), m.group(3)
        default = value if default is None else ("" if default == "unset" else default)
        source = "environment" if key in os.environ else "VRAMSWAP_CONF" if key in conf else "default"
        if key == "VRAMSWAP_LOG":  # the child's own level, not the one in force here
            value = {"environment": os.environ.get(key), "VRAMSWAP_CONF": conf.get(key)}.get(source, default)
        settings[key] = {"value": value, "source": source, "default": default}
    if not settings:
        tail = proc.stderr.strip().splitlines()[-1:] or [f"exit status {proc.returncode}"]
        return {}, "libvramswap.so printed no settings: " + tail[0]
    return settings, None


def _python_settings():
    """The package's own keys (and VRAMSWAP_CONF): the value in force and its source."""
    in_force = {"VRAMSWAP_TORCH_DEVICE": "", "VRAMSWAP_TORCH_EXT_CUDA": "auto",
                "VRAMSWAP_LIBRARY": str(_lib.library_path()), "VRAMSWAP_CUDASIM_DIR": str(_lib.cudasim_dir()),
                "VRAMSWAP_CACHE_DIR": str(Path.home() / ".cache" / "vramswap"), "VRAMSWAP_TORCH_EXT": "",
                "VRAMSWAP_CONF": ""}
    return {key: {"value": os.environ.get(key, in_force[key]),
                  "source": "environment" if key in os.environ else "default"} for key in in_force}


def _extension(kind):
    """-> ("ok", path) once the extension is built (or found in the cache) and loaded into
    torch, else (why not, None): ExtensionUnavailable's message, or the compiler's first
    error lines (ExtensionBuildError keeps its whole output)."""
    from . import _ext
    try:
        if kind == "cpu":
            path = os.environ.get("VRAMSWAP_TORCH_EXT") or _ext.build(kind="cpu")
            _ext.load()
        else:
            path = _ext.build(kind="cuda")
            _ext.load_cuda()
        return "ok", str(path)
    except _ext.ExtensionUnavailable as e:
        return str(e), None
    except _ext.ExtensionBuildError as e:
        lines = [line.strip() for line in e.compiler_output.splitlines() if "error" in line.lower()]
        if lines:
            return "compile failed: " + "\n".join(lines[:3]), None
        return str(e).strip().splitlines()[0], None
    except Exception as e:  # noqa: BLE001 - a failed load is the answer, not an error
        return str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__, None


class _DlInfo(ctypes.Structure):
    _fields_ = [("fname", ctypes.c_char_p), ("fbase", ctypes.c_void_p),
                ("sname", ctypes.c_char_p), ("saddr", ctypes.c_void_p)]


def _provider(symbol):
    """The file libvramswap.so's calls to `symbol` reach: looked up from its handle, so in
    its own link-map namespace (the CPU-emulation mode's, Note [cudasim in a namespace of its
    own] in _lib.py) and through the dependencies the loader matched by soname when it bound
    them (in the process's namespace, whatever CUDA runtime torch loaded first)."""
    try:
        address = ctypes.cast(_lib.lib()[symbol], ctypes.c_void_p)
    except (AttributeError, _lib.VramswapError):
        return None
    info = _DlInfo()
    found = ctypes.CDLL(None).dladdr(address, ctypes.byref(info))
    return os.path.realpath(info.fname.decode()) if found and info.fname else None


def _libraries():
    """The CUDA runtimes and drivers mapped in this process (/proc/self/maps), each marked
    cudasim's or NVIDIA's and whether libvramswap.so's calls go to it."""
    paths = []
    with open("/proc/self/maps") as maps:
        for fields in (line.split(maxsplit=5) for line in maps):
            path = os.path.realpath(fields[5].strip()) if len(fields) == 6 and fields[5].startswith("/") else None
            if path and path not in paths:
                paths.append(path)
    sim = os.path.realpath(_lib.cudasim_dir()) + os.sep
    found = {}
    for name, prefix, symbol in (("libcudart", "libcudart.so", "cudaMalloc"), ("libcuda", "libcuda.so", "cuMemCreate")):
        used = _provider(symbol)
        found[name] = [{"path": p, "origin": "cudasim" if p.startswith(sim) else "NVIDIA",
                        "used_by_vramswap": p == used} for p in paths if os.path.basename(p).startswith(prefix)]
    return found


def _install_path(torch, cuda_available, cuda_extension):
    """-> (word, sentence): what vramswap.install() and `vramswap run` would do here."""
    cpu_mode = ("the CPU-emulation mode (VRAMSWAP_TORCH_DEVICE=cpu-sim, vramswap.sim.install_cpu(): "
                "torch's CPU tensors on cudasim)")
    if os.environ.get("VRAMSWAP_TORCH_DEVICE") == "cpu-sim":
        return "cpu-sim", f"VRAMSWAP_TORCH_DEVICE=cpu-sim: `import vramswap` installs {cpu_mode}"
    if torch is None or not cuda_available:
        why = ("torch is not importable" if torch is None else
               f"torch {torch.__version__} is built without CUDA" if torch.version.cuda is None else
               f"torch {torch.__version__} sees no CUDA device")
        return "cpu-sim", (f"CUDA is not available ({why}): vramswap.install() refuses; "
                           f"`vramswap run` uses {cpu_mode}")
    # check_environment() has refused a bad value wherever the library loaded.
    choice = _config.EXT_CUDA_WORDS.get(os.environ.get("VRAMSWAP_TORCH_EXT_CUDA", "").strip().lower(), "auto")
    ctypes_path = "vramswap.install() takes the ctypes path (torch.cuda.memory.CUDAPluggableAllocator)"
    if choice == "ctypes":
        return "cuda-ctypes", f"{ctypes_path}: VRAMSWAP_TORCH_EXT_CUDA chooses it"
    if cuda_extension == "ok":
        return "cuda-extension", "vramswap.install() makes vramswap torch's CUDA allocator through the " \
                                 "CUDA pluggable-allocator extension (csrc/cuda_alloc.cpp)"
    if choice == "extension":
        return "refused", "vramswap.install() raises: VRAMSWAP_TORCH_EXT_CUDA=1 asks for the CUDA extension, " \
                          "which cannot be used"
    return "cuda-ctypes", f"{ctypes_path}, with a warning: the CUDA extension cannot be used"


def report():
    """Everything doctor says, as the JSON object; exits with status 2 (SystemExit) on a bad
    VRAMSWAP_* value."""
    out = {"vramswap_version": __version__, "python_version": platform.python_version(),
           "python": sys.executable, "torch_version": None, "torch_cuda": None, "cuda_available": False,
           "devices": []}
    try:
        import torch
    except Exception as e:  # noqa: BLE001 - a missing or broken torch is a fact to report
        torch, out["torch_error"] = None, f"{type(e).__name__}: {e}"
    if torch is not None:
        out.update(torch_version=torch.__version__, torch_cuda=torch.version.cuda)
        out["cuda_available"] = bool(torch.version.cuda) and torch.cuda.is_available()
        for i in range(torch.cuda.device_count() if out["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(i)
            out["devices"].append({"index": i, "name": props.name, "memory_bytes": props.total_memory})
    on_cuda = out["cuda_available"] and os.environ.get("VRAMSWAP_TORCH_DEVICE") != "cpu-sim"
    libraries = {"libvramswap": None}
    try:
        lib = _lib.load(cuda=True) if on_cuda else _lib.load(cudasim=True)
        libraries["libvramswap"] = os.path.realpath(_lib.loaded_path())
    except (_lib.VramswapError, OSError) as e:
        lib, libraries["libvramswap_error"] = None, str(e)
    if lib is not None:
        try:
            _config.check_environment(lib)
        except _config.ConfigError as e:
            _config.stop_program(e, "vramswap doctor")
    settings, why = _settings()
    out["config"] = dict(settings, **_python_settings())
    if why:
        out["config_error"] = why
    for kind in ("cpu", "cuda"):
        out[f"{kind}_extension"], libraries[f"{kind}_extension"] = (
            _extension(kind) if torch is not None else ("torch is not importable", None))
    out["install_path"], out["install_detail"] = _install_path(torch, out["cuda_available"], out["cuda_extension"])
    libraries.update(_libraries())
    # The CPU-emulation mode runs only on cudasim: a call that reaches NVIDIA's runtime or
    # driver there fails (no GPU, or the wrong one), so a binding elsewhere is named.
    out["warnings"] = [f"libvramswap.so's {name} calls go to {e['path']}, not to cudasim's, which the "
                       "CPU-emulation mode needs" for name in ("libcudart", "libcuda") for e in libraries[name]
                       if out["install_path"] == "cpu-sim" and e["used_by_vramswap"] and e["origin"] != "cudasim"]
    libraries["torch"] = os.path.dirname(torch.__file__) if torch is not None else None
    out["libraries"] = libraries
    return out


def _human(r):
    def line(label, value):
        first, *rest = str(value).splitlines() or [""]
        return "\n".join([f"{label:<16} {first}"] + [f"{'':<16} {x}" for x in rest])

    lines = [line("vramswap", r["vramswap_version"]), line("python", f"{r['python_version']} ({r['python']})"),
             line("torch", r["torch_version"] and f"{r['torch_version']} (CUDA {r['torch_cuda'] or 'none'})"
                  or r.get("torch_error")),
             line("cuda available", "yes" if r["cuda_available"] else "no")]
    lines += [line(f"device {d['index']}", f"{d['name']}, {d['memory_bytes'] / 2**30:.1f} GiB") for d in r["devices"]]
    lines += [line("install path", f"{r['install_path']}: {r['install_detail']}".replace("; ", ";\n")),
              line("cpu extension", r["cpu_extension"]), line("cuda extension", r["cuda_extension"])]
    libs = r["libraries"]
    lines.append(line("libvramswap", libs["libvramswap"] or "not loaded: " + libs.get("libvramswap_error", "")))
    for name in ("libcudart", "libcuda"):
        entries = [f"{e['path']} ({e['origin']}" + (", vramswap's)" if e["used_by_vramswap"] else ")")
                   for e in libs[name]]
        lines.append(line(name, "\n".join(entries) or "not loaded"))
    for kind in ("cpu", "cuda"):
        if libs.get(f"{kind}_extension"):
            lines.append(line(f"{kind} ext file", libs[f"{kind}_extension"]))
    lines.append(line("torch dir", libs["torch"]))
    lines += [line("warning", w) for w in r["warnings"]]
    if r.get("config_error"):
        lines.append(line("config", r["config_error"]))
    lines += [f"{key:<27} {entry['value'] or '(unset)'}  [{entry['source']}]" for key, entry in r["config"].items()]
    return "\n".join(lines)


def main(argv):
    as_json = False
    for a in argv:
        if a in ("-h", "--help"):
            print(USAGE + "\nReports what vramswap will do on this machine (README, \"vramswap doctor\").")
            return 0
        if a != "--json":
            what = "unknown option" if a.startswith("-") else "unexpected argument"
            print(f"vramswap doctor: {what} {a} (accepted: --json, --help)\n{USAGE}", file=sys.stderr)
            return 2
        as_json = True
    r = report()
    print(json.dumps(r, indent=2) if as_json else _human(r), flush=True)
    return 0

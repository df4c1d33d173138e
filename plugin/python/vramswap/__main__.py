"""`python3 -m vramswap run [--no-offload] [--offload-frozen] [--offload-optimizer] -- [python] script.py args...`
`python3 -m vramswap bench [SCENARIO...|SNAPSHOT...] [--out DIR | --results] [--json] [--quick] [--warmup N]`
`python3 -m vramswap replay SNAPSHOT [--limit SIZE|PCT] [--horizon N] [--card SIZE] [--pcie GBPS] [--warmup N]
 [--policy none|offload_all|vramswap] [--until PHASE] [--json]`
`python3 -m vramswap doctor [--json]`

bench and replay are the memory-pressure benchmark on cudasim in virtual time
(vramswap/bench/cli.py); they need neither torch nor a GPU, and import no torch.
doctor reports what vramswap will do on this machine (vramswap/_doctor.py): versions, CUDA
and its devices, the install path, whether each torch extension builds and loads, the
VRAMSWAP_* settings in force and where each comes from, and the libraries loaded.
The rest of this docstring is about `run`.

Runs an unmodified torch script under vramswap:
  1. installs vramswap as torch's allocator, configured by the VRAMSWAP_* environment
     (VRAMSWAP_LIMIT, VRAMSWAP_HORIZON, VRAMSWAP_STATS_FILE, VRAMSWAP_LOG, ...; libvramswap.so
     reads them when it loads): with a CUDA device, vramswap.install(), torch's CUDA
     allocator swapped before the script can initialize CUDA (VRAMSWAP_TORCH_EXT_CUDA picks
     its path, see cuda.py); with VRAMSWAP_TORCH_DEVICE=cpu-sim, or when torch has no CUDA
     or sees no device, the CPU-emulation mode (vramswap.sim.install_cpu(): torch's CPU
     tensors on cudasim). Every VRAMSWAP_* value of the environment is checked first: a
     bad one stops the run before the script starts, with exit status 2 and the lines the
     LD_PRELOAD library prints ("vramswap: error: VRAMSWAP_LIMIT='lots' is not valid:
     expected ..."; an unknown VRAMSWAP_* variable is only warned about, as there). An
     install that is refused for another reason stops the run with vramswap's message and
     exit status 2 too;
  2. opens an offload scope around every outermost module forward that autograd records
     (tracker.offload_forwards(): torch's global module forward hooks), so that the tensors
     every forward saves for backward may be evicted, while parameters, gradients and
     optimizer state, made outside any forward, stay untagged (--no-offload: only the
     allocator, e.g. to measure a script's peak without offload);
  2b. --offload-frozen: the first forward of each outermost module (global forward pre-hook)
     streams the frozen parameters under it (vramswap.offload_frozen(module), once per module);
     --offload-optimizer: every optimizer created from then on keeps its state off the device
     between steps (vramswap.offload_optimizer(optimizer), applied at the end of
     torch.optim.Optimizer.__init__);
  3. runs the script with runpy as __main__, with sys.argv = [script, args...] and the
     script's directory first on sys.path, as `python3 script.py args...` would. `-m module`
     in place of the script runs a module the same way.

It writes nothing of its own to stdout or stderr; vramswap itself logs what VRAMSWAP_LOG
asks, and writes VRAMSWAP_STATS_FILE at exit. The exit status is the script's.

A leading interpreter (`-- python script.py`, `-- python3 ...`, `-- /usr/bin/python3 ...`)
is skipped: the script runs in this interpreter.

torch's launchers (`-m torch.distributed.run`, `-m torch.distributed.launch`, `torchrun`) are
refused with exit status 2: they start every rank in a process of their own, where vramswap
would not be installed (only the launcher would run under it). `vramswap run` goes after the
launcher, in each rank: `torchrun [OPTIONS] -m vramswap run -- script.py args...`.
"""
import contextlib
import os
import re
import runpy
import sys

USAGE = """usage: vramswap run [--no-offload] [--offload-frozen] [--offload-optimizer] [--] [python]
                    (script.py | -m module) [args...]
       vramswap bench [SCENARIO...|SNAPSHOT...|all] [--out DIR | --results] [--json] [--quick]
                      [--warmup N] [--list]
       vramswap replay SNAPSHOT [--limit SIZE|PCT] [--horizon N] [--card SIZE] [--pcie GBPS]
                      [--warmup N] [--policy none|offload_all|vramswap] [--until PHASE] [--json]
       vramswap doctor [--json]
       vramswap --version
(`python3 -m vramswap ...` is the same command, from a checkout or without the console script.)

run: runs a torch script with vramswap as torch's allocator and an offload scope around every
module forward that autograd records. Settings come from the VRAMSWAP_* environment (see README, "Configuration").
--offload-frozen streams frozen parameters layer by layer (vramswap.offload_frozen on each
outermost module); --offload-optimizer keeps optimizer state off the device between steps
(vramswap.offload_optimizer on each optimizer).
With a CUDA device, vramswap becomes torch's CUDA allocator (vramswap.install());
VRAMSWAP_TORCH_DEVICE=cpu-sim (or no CUDA device) selects the CPU-emulation mode.
Several processes: run goes inside torch's launcher, in every rank
(`torchrun --nproc-per-node N -m vramswap run -- train.py`); around it, it is refused.

bench, replay: the memory-pressure benchmark on cudasim in virtual time (no GPU, no torch);
`vramswap bench --help` and `vramswap replay --help` describe them.

doctor: what vramswap will do here: versions, CUDA devices, the install path, whether each
torch extension builds and loads, the VRAMSWAP_* settings in force and their sources, the
libraries loaded (--json: one JSON object). Exit status 2 for a bad VRAMSWAP_* value."""


# torch's launchers, which start each rank in a new process: `vramswap run` must be inside them.
_LAUNCHER_MODULES = ("torch.distributed.run", "torch.distributed.launch")
_LAUNCHER_SCRIPTS = ("torchrun",)


def _launcher(kind, target):
    """The launcher `target` names, or None."""
    if kind == "module":
        return target if target in _LAUNCHER_MODULES else None
    return target if os.path.basename(target) in _LAUNCHER_SCRIPTS else None


def _usage(status):
    print(USAGE, file=sys.stderr if status else sys.stdout)
    return status


def _parse(argv):
    """-> (options, kind, target, args): options {"offload", "frozen", "optimizer"}, kind
    'path' or 'module'; raises ValueError."""
    options = {"offload": True, "frozen": False, "optimizer": False}
    flags = {"--no-offload": ("offload", False), "--offload-frozen": ("frozen", True),
             "--offload-optimizer": ("optimizer", True)}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--":
            i += 1
            break
        if a in flags:
            key, value = flags[a]
            options[key] = value
            i += 1
            continue
        if a.startswith("-") and a != "-m":
            raise ValueError(f"unknown option {a}")
        break
    rest = argv[i:]
    if rest and re.fullmatch(r"python[0-9.]*", os.path.basename(rest[0])):
        rest = rest[1:]
    if not rest:
        raise ValueError("no script given")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise ValueError("-m needs a module name")
        return options, "module", rest[1], rest[2:]
    return options, "path", rest[0], rest[1:]


@contextlib.contextmanager
def _offload_frozen_everywhere(vramswap):
    """vramswap.offload_frozen(module) at the first forward of each outermost module, once."""
    import weakref
    import torch
    done = weakref.WeakSet()
    depth = [0]
    kept = []

    def pre(module, inputs):
        if depth[0] == 0 and module not in done:
            done.add(module)
            if any(not p.requires_grad for p in module.parameters()):
                kept.append(vramswap.offload_frozen(module))
        depth[0] += 1

    def post(module, inputs, output):
        depth[0] = max(depth[0] - 1, 0)

    hooks = [torch.nn.modules.module.register_module_forward_pre_hook(pre),
             torch.nn.modules.module.register_module_forward_hook(post)]
    try:
        yield
    finally:
        for h in hooks:
            h.remove()


@contextlib.contextmanager
def _offload_optimizers(vramswap):
    """vramswap.offload_optimizer(optimizer) for every optimizer created inside."""
    import torch
    init = torch.optim.Optimizer.__init__

    def patched(self, *args, **kwargs):
        init(self, *args, **kwargs)
        vramswap.offload_optimizer(self)

    torch.optim.Optimizer.__init__ = patched
    try:
        yield
    finally:
        torch.optim.Optimizer.__init__ = init


def _install():
    """Installs vramswap as torch's allocator; returns the module. Every VRAMSWAP_* value
    of the environment is checked first (`import vramswap` has checked
    VRAMSWAP_TORCH_DEVICE, and installed the CPU-emulation mode for cpu-sim): a refused one
    stops the run before the script starts, with exit status 2 and the messages the
    LD_PRELOAD library prints."""
    import torch
    import vramswap
    mode = os.environ.get("VRAMSWAP_TORCH_DEVICE", "")
    # torch.cuda.is_available() does not initialize CUDA, so the swap is still possible after it.
    on_cuda = mode != "cpu-sim" and torch.version.cuda is not None and torch.cuda.is_available()
    try:
        if on_cuda:
            vramswap.install()
        else:
            vramswap.sim.install_cpu()  # idempotent: `import vramswap` may have done it (cpu-sim)
    except vramswap.ConfigError as e:
        from . import _config
        _config.stop_program(e, "vramswap run")
    except (vramswap.VramswapError, ValueError) as e:
        print(f"vramswap run: {e}", file=sys.stderr)
        raise SystemExit(2)
    return vramswap


def run(argv):
    try:
        options, kind, target, args = _parse(argv)
    except ValueError as e:
        print(f"vramswap run: {e}", file=sys.stderr)
        return _usage(2)
    launcher = _launcher(kind, target)
    if launcher:
        print(f"vramswap run: {launcher} starts every rank in a process of its own, where vramswap would not be "
              "installed; put vramswap run after the launcher, in each rank: torchrun [OPTIONS] -m vramswap run -- "
              "script.py ARGS", file=sys.stderr)
        return 2
    if kind == "path" and not os.path.exists(target):
        print(f"vramswap run: can't open file {target!r}", file=sys.stderr)
        return 2
    vramswap = _install()
    if kind == "path":
        sys.argv = [target] + args
        sys.path[0] = os.path.dirname(os.path.abspath(target))
    else:
        sys.argv = [target] + args  # runpy replaces argv[0] with the module's file
        sys.path[0] = os.getcwd()
    from . import tracker
    with contextlib.ExitStack() as stack:
        if options["offload"]:
            stack.enter_context(tracker.offload_forwards())
        if options["frozen"]:
            stack.enter_context(_offload_frozen_everywhere(vramswap))
        if options["optimizer"]:
            stack.enter_context(_offload_optimizers(vramswap))
        if kind == "path":
            runpy.run_path(target, run_name="__main__")
        else:
            runpy.run_module(target, run_name="__main__", alter_sys=True)
    return 0


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        return _usage(0 if argv else 2)
    if argv[0] in ("--version", "-V"):
        from ._version import __version__
        print(f"vramswap {__version__}")
        return 0
    if argv[0] in ("bench", "replay"):
        from .bench import cli  # imports no torch
        try:
            return getattr(cli, argv[0])(argv[1:])
        except SystemExit as e:  # argparse: --help (0) and usage errors (2)
            return e.code if isinstance(e.code, int) else 2
    if argv[0] == "doctor":
        from . import _doctor
        return _doctor.main(argv[1:])
    if argv[0] != "run":
        print(f"vramswap: unknown command {argv[0]!r}", file=sys.stderr)
        return _usage(2)
    if argv[1:2] in (["-h"], ["--help"]):
        return _usage(0)
    return run(argv[1:])


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/python3
"""vramswap.tracker.offload_forwards() (what `vramswap run` opens): an offload scope around
each outermost module forward that autograd records, and nowhere else
(Note [Tag only what backward saves] in tracker.py).

Runs in the CPU-emulation mode with VRAMSWAP_MIN_OFFLOAD_BYTES at 64 KiB, on modules whose
parameters, gradients, optimizer state and activations are all large enough to be tagged
inside a scope; "tagged" below is memory_stats()'s tagged_bytes (live tagged blocks).

  parameters    a model built inside the context has no tagged block (construction runs
                no forward)
  forward       inside a forward with grad mode on, an allocation is tagged, in nested
                modules too; after the outermost forward returns, an allocation is not,
                and the saved tensors are still tagged (and packed: tracker_stats)
  no_grad       a forward under torch.no_grad() tags nothing
  training      a whole step (forward, loss outside the model, backward, AdamW step):
                after backward and the optimizer step nothing is tagged (gradients and
                AdamW's state are untagged)
  raised        a forward that raises leaves the scope open; calling that module again
                starts afresh, and after it returns an allocation is untagged again
  threads       a forward running in another thread does not tag the main thread's
                allocations
  exit          leaving the context with a scope still open (a raised forward) closes it

Usage: python3 tests/python/test_forward_scopes.py   (exit status 0: every check held)
Paths: VRAMSWAP_LIBRARY, VRAMSWAP_CUDASIM_DIR, VRAMSWAP_CACHE_DIR (as test_cpu_emulation.py).
"""
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "plugin" / "python"))

FLOATS = 1 << 15  # 128 KiB: at least min_offload_bytes below, so tagged inside a scope
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def main():
    import torch
    import vramswap
    from vramswap import tracker

    torch.set_num_threads(1)
    vramswap.sim.install_cpu(min_offload_bytes="64KiB")

    def tagged():
        return vramswap.memory_stats()["tagged_bytes"]

    def tags_now():
        """Whether an allocation made now, on this thread, is tagged."""
        before = tagged()
        t = torch.empty(FLOATS)
        grew = tagged() > before
        del t
        return grew

    seen = {}

    class Probe(torch.nn.Module):
        """Records, under `name`, whether its forward's allocations are tagged."""

        def __init__(self, name, fail=False):
            super().__init__()
            self.name = name
            self.fail = fail

        def forward(self, x):
            seen[self.name] = tags_now()
            if self.fail:
                raise RuntimeError("the forward fails")
            return x

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1 = torch.nn.Linear(256, 256)  # 256 KiB weights
            self.inner = Probe("inner")
            self.fc2 = torch.nn.Linear(256, 256)

        def forward(self, x):
            seen["outer"] = tags_now()
            h = self.inner(torch.relu(self.fc1(x)))
            seen["after inner"] = tags_now()
            return self.fc2(h)

    with tracker.offload_forwards():
        check(not tags_now(), "outside any forward: an allocation is not tagged")
        net = Net()
        opt = torch.optim.AdamW(net.parameters(), lr=1e-3)
        check(tagged() == 0, f"parameters: a model built inside the context has no tagged block ({tagged()} B)")

        x = torch.randn(512, 256)  # 512 KiB activations
        packs = vramswap.tracker_stats()["packs"]
        out = net(x)
        check(seen.get("outer") and seen.get("inner") and seen.get("after inner"),
              f"forward: allocations inside the forward are tagged, nested module included ({seen})")
        check(not tags_now(), "forward: after the outermost forward returned, an allocation is not tagged")
        check(tagged() > 0, f"forward: the tensors it saved are still tagged ({tagged()} B)")
        check(vramswap.tracker_stats()["packs"] > packs, "forward: the saved tensors were packed")

        loss = out.square().mean()
        loss.backward()
        del out, loss
        opt.step()
        opt.zero_grad(set_to_none=False)
        check(tagged() == 0, f"training: after backward and AdamW's step nothing is tagged ({tagged()} B)")
        check(len(opt.state) == 4 and all("exp_avg" in st for st in opt.state.values()),
              "training: AdamW's state exists (so the check above found it untagged)")

        seen.clear()
        with torch.no_grad():
            net(x)
        check(seen.get("outer") is False and seen.get("inner") is False,
              f"no_grad: a forward under torch.no_grad() tags nothing ({seen})")

        bad = Probe("bad", fail=True)
        try:
            bad(x)
        except RuntimeError:
            pass
        check(seen.get("bad") is True, "raised: the forward that raised was inside a scope")
        check(tags_now(), "raised: the scope stays open after a forward raised")
        bad.fail = False
        bad(x)
        check(not tags_now(), "raised: the module called again starts afresh, and closes the scope when it returns")

        done = threading.Event()
        go = threading.Event()
        result = {}

        class Slow(torch.nn.Module):
            def forward(self, y):
                result["worker"] = tags_now()
                go.set()
                done.wait(10)
                return y

        worker = threading.Thread(target=lambda: Slow()(x))
        worker.start()
        go.wait(10)
        result["main"] = tags_now()
        done.set()
        worker.join(10)
        check(result.get("worker") is True and result.get("main") is False,
              f"threads: another thread's forward tags its own allocations, not this thread's ({result})")

        bad.fail = True
        try:
            bad(x)
        except RuntimeError:
            pass
    check(not tags_now(), "exit: leaving the context closed the scope a raised forward left open")

    print("PASS" if not failures else f"{len(failures)} check(s) failed")
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""smoke_within.py: runs a benchmark's smoke run and fails if it needed more memory than a
smoke run may take.

CTest runs the suite two or more tests at a time on a machine of a few GiB per test, under
AddressSanitizer as well, so a smoke run (there so a benchmark cannot rot unnoticed, not
for its figures) must stay small: one that pins gigabytes of host memory can get a
neighbouring test, or itself, killed by the kernel's out-of-memory killer, and the suite
fails for no defect. Usage:

  smoke_within.py MAX_MIB COMMAND [ARG...]

Runs COMMAND, passes on its exit status, and exits 1 with a message if the peak resident
set of the process (getrusage's ru_maxrss of the child) was over MAX_MIB mebibytes.
"""
import resource
import subprocess
import sys


def main(argv):
    if len(argv) < 3:
        sys.stderr.write(__doc__)
        return 2
    try:
        max_mib = int(argv[1])
    except ValueError:
        sys.stderr.write(f"smoke_within.py: MAX_MIB must be a whole number of MiB, got {argv[1]!r}\n")
        return 2
    status = subprocess.call(argv[2:])
    if status != 0:
        return status if status > 0 else 128 - status  # killed by a signal: 128 + its number
    peak_mib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024  # KiB on Linux
    if peak_mib > max_mib:
        sys.stderr.write(f"smoke_within.py: {argv[2]} peaked at {peak_mib:.0f} MiB resident, over the "
                         f"{max_mib} MiB a smoke run may take\n")
        return 1
    print(f"smoke_within.py: peak resident {peak_mib:.0f} MiB (at most {max_mib})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

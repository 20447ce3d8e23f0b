"""``make test-fast``: the pure layer in two pytest processes side by side, each over its own
test folders.

    python tests/run_fast.py [pytest options...]

The pure layer is every test but the end-to-end and kernel folders (``tests/e2e``,
``tests/kernels``) and the tests marked ``heavy`` (``tests/conftest.py``). It takes about a
minute of CPU on two cores, a third of it collection: pytest-xdist would have each of its
workers collect (import) every test module, so two processes that each collect only their own
folders finish sooner. The first runs ``FIRST`` (the scheduler and the gateway: no model code),
the second every other folder. Each runs torch on one thread (the two fill the cores, as
``make test``'s workers do). Their outputs are printed one after the other once both are done;
the exit status is the first failing process's, else 0.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent
NOT_PURE = {"e2e", "kernels"}  # folders of the e2e and kernel layers
FIRST = ["scheduler", "gateway"]  # about half of the pure layer's time, little of its imports
PYTEST = ["-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", "-m", "not e2e and not kernel and not heavy"]


def groups() -> list[list[str]]:
    """The two processes' folders: ``FIRST``, and every other folder of the pure layer (a
    folder added later lands in the second)."""
    folders = sorted(p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py")))
    rest = [f for f in folders if f not in NOT_PURE and f not in FIRST]
    return [[str(TESTS / f) for f in FIRST], [str(TESTS / f) for f in rest]]


def main() -> int:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, *PYTEST, *sys.argv[1:], *folders], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for folders in groups()]
    outputs = [proc.communicate()[0] for proc in procs]
    for folders, output in zip(groups(), outputs, strict=True):
        print(f"==== {' '.join(Path(f).name for f in folders)}\n{output}", end="", flush=True)
    return next((proc.returncode for proc in procs if proc.returncode), 0)


if __name__ == "__main__":
    sys.exit(main())

"""Run by tests/benchmarks/test_device_check_launch.py as ``python -m tests.helpers.stage_probe``
(forked or fresh): prints what it was given, registers an ``atexit`` handler, then exits with
the code asked for, or sleeps (``sleep``) after starting a child that sleeps too (``child``;
``session``: the child in a session of its own, as torchrun starts its workers)."""
import atexit
import os
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    out = argv[0]
    print(f"argv {argv[1:]} cwd {os.getcwd()} probe {os.environ.get('STAGE_PROBE')} "
          f"main {__name__}", flush=True)
    atexit.register(lambda: open(os.path.join(out, "atexit"), "w").close())
    if "child" in argv:
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"],
                                 start_new_session="session" in argv)
        with open(os.path.join(out, "child.pid"), "w") as f:
            f.write(str(child.pid))
    if "sleep" in argv:
        time.sleep(600)
    print("to stderr", file=sys.stderr)
    return int(argv[1])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

#!/usr/bin/env python
"""Start N local processes of train/run.py that train together, as N hosts would.

    python train/launch.py --processes 2 -- --mesh 2x4 --steps 100

Each process gets a share of simulated CPU devices (mesh devices / N) and joins
JAX's distributed runtime through a coordinator on a free localhost port; the
mesh after ``--`` is global. Process 0 prints; the others print only errors.
If one process fails, the others are stopped and the launcher exits with its
status. For real hosts, run train/run.py on each with --coordinator,
--num-processes and --process-id (see the README).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the project importable
  sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from train.errors import OneLineParser, port_number, positive_int

RUN = Path(__file__).resolve().parent / "run.py"

def free_port() -> int:
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream, out, prefix: str) -> None:
  for line in iter(stream.readline, ""):
    out.write(prefix + line)
    out.flush()


def main(argv: list[str] | None = None) -> int:
  argv = sys.argv[1:] if argv is None else argv
  ours, run_args = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv \
      else (argv, [])
  parser = OneLineParser(prog="train/launch.py", description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", type=positive_int, default=2,
                      help="local processes to start")
  parser.add_argument("--port", type=port_number, default=None,
                      help="coordinator port (default: free)")
  parser.add_argument("--grace", type=float, default=10.0,
                      help="seconds the others get to stop after one fails")
  args = parser.parse_args(ours)
  port = args.port or free_port()
  children = []
  for pid in range(args.processes):
    env = {**os.environ, "FLAX_TP_COORDINATOR": f"127.0.0.1:{port}",
           "FLAX_TP_NUM_PROCESSES": str(args.processes), "FLAX_TP_PROCESS_ID": str(pid),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which
    # forwards it once (a second, separate signal would make run.py abort unsaved).
    child = subprocess.Popen([sys.executable, str(RUN), *run_args], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    prefix = "" if pid == 0 else f"[process {pid}] "
    # Only process 0 speaks; the others' stdout is their (silent) console.
    threading.Thread(target=_pump, args=(child.stdout, sys.stdout if pid == 0 else
                                         open(os.devnull, "w"), prefix), daemon=True).start()
    threading.Thread(target=_pump, args=(child.stderr, sys.stderr, prefix), daemon=True).start()
    children.append(child)

  interrupted: list[int] = []

  def forward(signum, _frame):
    # Each signal the launcher gets goes to every child once: the first makes
    # them save and stop together, a second makes them abort at once.
    interrupted.append(signum)
    for c in children:
      if c.poll() is None:
        c.send_signal(signum)

  for signum in (signal.SIGINT, signal.SIGTERM):
    signal.signal(signum, forward)
  status = 0
  while any(c.poll() is None for c in children):
    failed = [(i, c.returncode) for i, c in enumerate(children) if c.returncode not in (None, 0)]
    if failed and not interrupted:
      pid, status = failed[0]
      print(f"train/launch.py: process {pid} exited with status {status}; stopping the others",
            file=sys.stderr, flush=True)
      _stop(children, args.grace)
      break
    time.sleep(0.2)
  codes = [c.wait() for c in children]
  time.sleep(0.2)  # let the output threads drain
  if interrupted:
    return 128 + interrupted[0]
  return status or next((c for c in codes if c), 0)


def _stop(children, grace: float) -> None:
  for c in children:
    if c.poll() is None:
      c.send_signal(signal.SIGTERM)
  deadline = time.time() + grace
  for c in children:
    try:
      c.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      c.kill()


if __name__ == "__main__":
  sys.exit(main())

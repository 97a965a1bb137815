#!/usr/bin/env python
"""Start N local processes of train/run.py that train together, as N hosts would.

    python train/launch.py --processes 2 -- --mesh 2x4 --steps 100

Each process gets a share of simulated CPU devices (mesh devices / N) and joins
JAX's distributed runtime through a coordinator on a free localhost port; the
mesh after ``--`` is global. Process 0 prints; the others print only errors.
If one process fails, the others are stopped and the launcher reports the run's
failure in one line: a process killed by a signal (status 1), or the first failing
process's own error (with its status). The processes' native (C++) log lines go to
files in a temporary folder, named in that line when there are any. For real hosts, run train/run.py on each with --coordinator,
--num-processes and --process-id (see the README).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
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


ERROR_PREFIX = "train/run.py: error: "


# What run.py says when a signal asks it to stop (train/signals.py).
STOP_NOTICE = " received: stopping after the current step"


def _pump(stream, out, prefix: str, held: list[str] | None = None,
          stopping: threading.Event | None = None) -> None:
  """Copies a child's lines to ``out``; with ``held``, its error lines go there instead
  (the launcher reports one line for the whole run, not one per process). Once
  ``stopping`` is set (the launcher stops the others after one failed), their notices
  that they are stopping are dropped: the failure's one line says why."""
  for line in iter(stream.readline, ""):
    if held is not None and line.startswith(ERROR_PREFIX):
      held.append(line.rstrip("\n"))
      continue
    if stopping is not None and stopping.is_set() and STOP_NOTICE in line:
      continue
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
  # Native (C++) log lines of the children (gRPC's, when a peer dies) go to files here,
  # named in the failure line; the terminal gets the run's own one-line errors.
  logs = Path(tempfile.mkdtemp(prefix="flax_tp-launch-"))
  children: list[subprocess.Popen] = []
  held: list[list[str]] = []
  interrupted: list[int] = []
  stopped: set[int] = set()  # children the launcher itself signalled
  stopping = threading.Event()  # set when the launcher stops the others after a failure

  def forward(signum, _frame):
    # Each signal the launcher gets goes to every child once: the first makes
    # them save and stop together, a second makes them abort at once.
    interrupted.append(signum)
    for c in children:
      if c.poll() is None:
        c.send_signal(signum)

  for signum in (signal.SIGINT, signal.SIGTERM):  # before any child: none is left behind
    signal.signal(signum, forward)
  threads = []
  for pid in range(args.processes):
    env = {**os.environ, "FLAX_TP_COORDINATOR": f"127.0.0.1:{port}",
           "FLAX_TP_NUM_PROCESSES": str(args.processes), "FLAX_TP_PROCESS_ID": str(pid),
           "FLAX_TP_NATIVE_LOG": str(logs / f"process-{pid}.log"),
           "JAX_PLATFORMS": "cpu", "PYTHONUNBUFFERED": "1"}
    # A session of its own: a terminal's Ctrl-C reaches the launcher only, which
    # forwards it once (a second, separate signal would make run.py abort unsaved).
    child = subprocess.Popen([sys.executable, str(RUN), *run_args], env=env, text=True,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             start_new_session=True)
    prefix = "" if pid == 0 else f"[process {pid}] "
    held.append([])
    # Only process 0 speaks; the others' stdout is their (silent) console.
    threads.append(threading.Thread(target=_pump, args=(
        child.stdout, sys.stdout if pid == 0 else open(os.devnull, "w"), prefix), daemon=True))
    threads.append(threading.Thread(target=_pump, args=(child.stderr, sys.stderr, prefix,
                                                        held[pid], stopping), daemon=True))
    threads[-2].start()
    threads[-1].start()
    children.append(child)

  failed_first: int | None = None
  frozen: list[int] = []  # children found stopped (SIGSTOP, a debugger) when one failed
  while any(c.poll() is None for c in children):
    failed = [i for i, c in enumerate(children) if c.returncode not in (None, 0)]
    if failed and not interrupted:
      failed_first = failed[0]
      frozen = [i for i, c in enumerate(children) if c.poll() is None and _is_stopped(c.pid)]
      stopped.update(i for i, c in enumerate(children) if c.poll() is None)
      stopping.set()  # (before the SIGTERMs: their notices are not the run's news)
      _stop(children, args.grace)
      break
    time.sleep(0.2)
  codes = [c.wait() for c in children]
  for t in threads:
    t.join(timeout=5)  # the output drained
  if interrupted:
    for lines in held:  # what the children said while stopping
      for line in dict.fromkeys(lines):
        print(line, file=sys.stderr)
    shutil.rmtree(logs, ignore_errors=True)
    return 128 + interrupted[0]
  if not any(codes):
    shutil.rmtree(logs, ignore_errors=True)
    return 0
  line, status = _failure(codes, held, stopped, failed_first, frozen)
  native = sorted(p for p in logs.glob("*.log") if p.stat().st_size)
  where = f"; native logs in {logs}" if native else ""
  if not native:
    shutil.rmtree(logs, ignore_errors=True)
  print(f"{line}{where}", file=sys.stderr, flush=True)
  return status


def _failure(codes: list[int], held: list[list[str]], stopped: set[int],
             first: int | None, frozen: list[int] = ()) -> tuple[str, int]:
  """The one line and exit status that explain a failed run.

  A process found stopped when another failed (``kill -STOP``, a debugger) is the cause:
  the others lost its heartbeat and gave up (process 0, which hosts the coordination
  service, aborts with SIGABRT then): status 1. So is a process killed by a signal nobody
  in the run sent (an OOM killer, ``kill -9``), whatever the others said after losing it.
  Otherwise the first process that failed speaks, once, with its own status (2: bad
  input, 1: failure)."""
  if frozen:
    names = ", ".join(map(str, frozen))
    return (f"train/launch.py: error: process {names} was stopped (SIGSTOP, or a debugger) "
            "and stopped answering; the others lost contact with it and the run stopped", 1)
  for i, code in enumerate(codes):
    if code < 0 and i not in stopped:
      name = signal.Signals(-code).name
      return f"train/launch.py: error: process {i} was killed by {name}; the run stopped", 1
  order = ([first] if first is not None else []) + [i for i, c in enumerate(codes) if c]
  for i in order:
    if held[i]:
      return held[i][0], codes[i] if codes[i] > 0 else 1
  i = order[0]
  return f"train/launch.py: error: process {i} exited with status {codes[i]}", 1


def _is_stopped(pid: int) -> bool:
  """Whether process ``pid`` is stopped (state T or t in /proc; False where there is none)."""
  try:
    stat = Path(f"/proc/{pid}/stat").read_text()
  except OSError:
    return False
  return stat[stat.rindex(")") + 2:][:1] in ("T", "t")


def _stop(children, grace: float) -> None:
  for c in children:
    if c.poll() is None:
      if _is_stopped(c.pid):  # it cannot stop with the others (its peers are gone)
        c.kill()
      else:
        c.send_signal(signal.SIGTERM)
  deadline = time.time() + grace
  for c in children:
    try:
      c.wait(timeout=max(0.0, deadline - time.time()))
    except subprocess.TimeoutExpired:
      c.kill()


if __name__ == "__main__":
  sys.exit(main())

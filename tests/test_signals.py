"""train/signals.py: the first SIGINT/SIGTERM asks to stop after the step, a second aborts."""

import os
import signal
import time

import pytest


def test_second_signal_aborts_at_once(monkeypatch, capfd):
  from train import signals

  class Aborted(Exception):
    pass

  def fake_exit(code):
    raise Aborted(code)

  monkeypatch.setattr(signals.os, "_exit", fake_exit)
  # (Python's default_int_handler, or SIG_IGN where the suite was started in the
  # background by a shell without job control)
  before = signal.getsignal(signal.SIGINT)
  with signals.Interrupts() as interrupts:
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(0.05)  # the handler runs in the main thread, between bytecodes
    assert interrupts.requested() and interrupts.exit_status == 143
    with pytest.raises(Aborted) as aborted:
      os.kill(os.getpid(), signal.SIGINT)
      time.sleep(0.05)
  assert aborted.value.args == (128 + signal.SIGINT,)
  assert "second signal (SIGINT): aborting without saving" in capfd.readouterr().err
  assert signal.getsignal(signal.SIGINT) is before  # put back

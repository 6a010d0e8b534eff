"""Exit codes of ``bertfast pretrain`` and ``bertfast finetune``, so a scheduler or a script can
tell a finished run from one to resume or to fix (docs/training.md lists them):

  0   the run completed (its last step, or the ``--stop-at-step`` it was asked to stop at)
  1   an unexpected error (a bug: the traceback is printed)
  2   bad configuration or input (the message names the option, file or line)
  3   ``--parity-strict``: the fast path diverged from the reference (the report is printed)
  4   the loss, the gradient norm or a parameter stopped being finite (``training.nonfinite``)
  5   an I/O error, such as a full disk (the message names the path and the cause)
  75  stopped by SIGTERM or SIGINT after saving a checkpoint: resume it with ``--resume``
      (EX_TEMPFAIL: "try again later")
"""
from __future__ import annotations

import json
import sys
from typing import Callable

from bertfast.parity import ParityError
from bertfast.training.nonfinite import NonFiniteError

OK, USAGE, PARITY, NONFINITE, IO, STOPPED = 0, 2, 3, 4, 5, 75


def run_command(prog: str, run: Callable[[], bool]) -> int:
    """Call ``run()`` (True when a signal stopped the run early) and turn its outcome into an exit
    code, printing the error of a failed run on stderr."""
    def fail(message: str) -> None:
        print(f"{prog}: error: {message}", file=sys.stderr, flush=True)

    try:
        stopped = run()
    except ParityError as e:
        fail(str(e))
        print(json.dumps(e.report, indent=2, default=str), file=sys.stderr)
        return PARITY
    except NonFiniteError as e:
        fail(str(e))
        return NONFINITE
    except (ValueError, FileNotFoundError) as e:
        fail(str(e))
        return USAGE
    except OSError as e:
        fail(str(e) if e.filename is None or str(e.filename) in str(e) else f"{e.filename}: {e}")
        return IO
    return STOPPED if stopped else OK

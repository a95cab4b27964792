"""How a run can fail, and the exit code `rankmix` gives each failure class.

| code | class                  | meaning                                                     |
|------|------------------------|-------------------------------------------------------------|
| 0    |                        | finished                                                    |
| 2    | ValueError             | bad input: config, options, data files (one line, no trace) |
| 3    | NonFiniteLossError     | the loss or a dense gradient was NaN/inf; training stopped  |
| 4    | DataUnavailableError   | the data store could not be read within the retry budget    |
| 143  | Interrupted            | SIGTERM/SIGINT: a due checkpoint was saved, then it stopped |

Schedulers can act on these: 3 needs a person, 4 and 143 can be retried as they are
(the run resumes from its newest complete checkpoint). After 3 no checkpoint holds an update
of the non-finite step or a later one: the flags are read every `train.check_every` steps and
before every save (`Trainer.check`).
"""

from __future__ import annotations

BAD_INPUT = 2


class RankmixError(RuntimeError):
    """A failure of the run (not of the user's input) with its own exit code."""

    exit_code = 1


class NonFiniteLossError(RankmixError):
    """Training stopped on a NaN or infinite loss or dense gradient norm; no checkpoint holds that update."""

    exit_code = 3


class DataUnavailableError(RankmixError):
    """The data store stayed unreachable (or kept failing) for the whole retry budget."""

    exit_code = 4


class Interrupted(RankmixError):
    """The process was asked to stop (SIGTERM from Slurm or Kubernetes, or SIGINT)."""

    exit_code = 143

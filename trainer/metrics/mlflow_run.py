"""MLflow tracking beside TensorBoard (metrics.mlflow_uri; docs/training.md, "MLflow").

One MLflow run per run folder, found again by its tag `rankmix.run_dir` when the folder resumes:
the resolved config as params (flattened `section.key`, credentials redacted) when the run is
created, every logged record as metrics `kind/name` at its step, the summary as `summary/*`, and
each published artifact's folder as a tag `rankmix.artifact.<name>`.

Tracking never stops training: the first call that fails (a server down, a store that cannot be
written) is said once, with the URI, and MLflow is off for the rest of the run. Calls are
bounded (MLFLOW_HTTP_REQUEST_MAX_RETRIES / _TIMEOUT, unless set) so that a server down costs
seconds, not the client's minutes of retries.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from typing import Any

from trainer.credentials import redact_uri

RUN_DIR_TAG = "rankmix.run_dir"
ARTIFACT_TAG = "rankmix.artifact."
_BATCH = 100  # MLflow's log_batch takes at most 100 params (1000 metrics) a call
_BOUNDS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "1", "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
           "MLFLOW_HTTP_REQUEST_TIMEOUT": "10"}


def flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """`section.key` -> value text of a nested config dict; a list of tables by their `name`."""
    out: dict[str, str] = {}
    for key, value in config.items():
        dotted = f"{prefix}{key}"
        if isinstance(value, dict):
            out |= flat_params(value, dotted + ".")
        elif isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
            for i, entry in enumerate(value):
                out |= flat_params(entry, f"{dotted}.{entry.get('name', i)}.")
        else:
            out[dotted] = str(value)[:6000]  # MLflow's longest param value
    return out


def _experiment(client, name: str) -> str:
    """The id of experiment `name`, made if need be (a sweep's runs may race to make it)."""
    from mlflow.exceptions import MlflowException  # loaded with the client

    found = client.get_experiment_by_name(name)
    if found:
        return found.experiment_id
    try:
        return client.create_experiment(name)
    except MlflowException:
        found = client.get_experiment_by_name(name)
        if found is None:
            raise
        return found.experiment_id


class MlflowRun:
    """The MLflow run of one run folder (rank 0 only). `say` prints a line for the user."""

    def __init__(self, uri: str, experiment: str, run_dir: str, params: dict[str, str], say: Callable[[str], None]):
        self.uri, self.say = uri, say
        self.client: Any = None
        self.run_id = ""
        self.finished = False
        self._call(lambda: self._start(experiment, run_dir, params), "start the run")

    def _start(self, experiment: str, run_dir: str, params: dict[str, str]) -> None:
        for name, value in _BOUNDS.items():
            os.environ.setdefault(name, value)
        if self.uri.startswith("file:"):  # MLflow 3 keeps its file store only on request
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param  # an optional dependency, imported when tracking is on
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=self.uri)
        experiment_id = _experiment(client, experiment)
        quoted = run_dir.replace("'", "\\'")
        earlier = client.search_runs([experiment_id], filter_string=f"tags.`{RUN_DIR_TAG}` = '{quoted}'",
                                     max_results=1)
        if earlier:  # a resume goes on in the run it started; its params are those it started with
            self.run_id = earlier[0].info.run_id
            client.update_run(self.run_id, status="RUNNING")
        else:
            self.run_id = client.create_run(experiment_id, run_name=os.path.basename(run_dir.rstrip("/")),
                                            tags={RUN_DIR_TAG: run_dir}).info.run_id
        if not earlier or not earlier[0].data.params:  # a start that failed before its params were in
            items = [Param(k, v) for k, v in params.items()]
            for i in range(0, len(items), _BATCH):
                client.log_batch(self.run_id, params=items[i:i + _BATCH])
        self.client = client
        self.say(f"mlflow: run {self.run_id} in experiment {experiment!r} at {redact_uri(self.uri)}")

    def log(self, step: int, prefix: str, values: dict) -> None:
        """The finite numbers of `values` as metrics `prefix/key` at `step`."""
        if self.client is None:
            return
        from mlflow.entities import Metric  # loaded with the client

        now = int(time.time() * 1000)
        metrics = [Metric(f"{prefix}/{k}", float(v), now, step) for k, v in values.items()
                   if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)]
        for i in range(0, len(metrics), 10 * _BATCH):
            self._call(lambda chunk=metrics[i:i + 10 * _BATCH]: self.client.log_batch(self.run_id, metrics=chunk),
                       "log metrics")

    def artifact(self, name: str, folder: str) -> None:
        """A published artifact's folder, as the tag rankmix.artifact.<name>."""
        self._call(lambda: self.client.set_tag(self.run_id, ARTIFACT_TAG + name, folder), "tag an artifact")

    def finish(self, summary: dict) -> None:
        """The summary's numbers as summary/*, and the run marked finished."""
        self.log(int(summary.get("steps", 0)), "summary", summary)
        self._call(lambda: self.client.set_terminated(self.run_id), "finish the run")
        self.finished = True

    def close(self) -> None:
        """A run that stops before its summary (a signal, an error) is marked KILLED, not left RUNNING."""
        if not self.finished:
            self._call(lambda: self.client.set_terminated(self.run_id, status="KILLED"), "end the run")
            self.finished = True

    def _call(self, fn: Callable[[], None], what: str) -> None:
        if self.client is None and self.run_id:
            return  # off since an earlier failure
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - any failure of tracking leaves training alone
            text = (str(e).strip().splitlines() or [type(e).__name__])[0][:200]
            self.say(f"mlflow: cannot {what} at {redact_uri(self.uri)} ({redact_uri(text)}); "
                     "training goes on without MLflow")
            self.client, self.run_id = None, self.run_id or "off"

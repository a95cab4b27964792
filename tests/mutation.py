"""`make test-mutation`: mutation testing (mutmut 3) of the pure-logic modules, each against
its own fast tests; prints every module's kill rate and its surviving mutants.

    .venv/bin/python tests/mutation.py [MODULE ...] [--workers N] [--jobs N]

Modules that share test files mutate in one run (RUNS), in a folder of its own,
`.mutation/<run>/` (made afresh; ignored by git, named after its first module), which links
the packages and tests and holds a pyproject.toml whose [tool.mutmut] is the repository's
plus that run's: the files to mutate and the test files to run. A mutant runs only the
tests that call the mutated function (mutmut's per-function statistics), the likeliest
killers first (tests/mutation_hooks.py). To look at one mutant afterwards:
`cd .mutation/encode && ../../.venv/bin/mutmut show NAME`.

A surviving mutant either gets a test that kills it or an entry in EQUIVALENT, which names
the function and the changed line, so that an entry stops matching when the code changes.
The kill rate counts killed (and timed-out) mutants over the mutants that are not equivalent;
the script fails when a module's is below TARGET.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import subprocess
import sys
import time
import tomllib
from concurrent.futures import ThreadPoolExecutor, as_completed
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path

import tomli_w
from mutmut.mutation.data import SourceFileMutationData
from mutmut.mutation.diff_apply import get_diff_for_mutant
from mutmut.stats import status_by_exit_code

import mutation_hooks

REPO = Path(__file__).resolve().parents[1]
WORK = REPO / ".mutation"
LINKED = ("trainer", "dense", "embeddings", "launch", "tests", "configs")


@dataclass(frozen=True)
class Target:
    """A file to mutate, optionally only some of its functions ("Class.method" or "function"),
    and the test files that cover it."""

    path: str
    tests: tuple[str, ...]
    functions: tuple[str, ...] = ()
    warm: tuple[str, ...] = ()  # "test_module:function": cached makers called before mutmut forks (mutation_hooks.py)
    # tests not run: multi-rank runs, whose ranks (other processes, 5-30 s) no mutant reaches
    deselect: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        return self.path.removesuffix(".py").replace("/", ".")

    def selected(self) -> list[str]:
        """mutmut's names of this target's mutants: of `functions`, or all of the file's."""
        return [f"{self.module}.{_mangled(f)}__mutmut_*" for f in self.functions] or [f"{self.module}.*"]


def _mangled(function: str) -> str:
    cls, _, name = function.rpartition(".")
    return f"x\u01c1{cls}\u01c1{name}" if cls else f"x_{name}"


# the two four-rank elastic resumes (10-36 s each): their ranks are other processes, which no mutant reaches
_FOUR_RANKS = ("tests/test_elastic_resume.py::test_four_ranks_stopped_mid_epoch_resume_on_two_then_three_and_train_"
               "every_row_once",
               "tests/test_elastic_resume.py::test_a_partition_stopped_at_four_ranks_resumes_on_two_and_the_next_follows")
# the runs that train on a split in time: other processes, which no mutant reaches
_TIME_SPLIT_RUNS = ("tests/test_time_split.py::test_two_ranks_train_on_the_past_validate_on_its_latest_rows_and_test_"
                    "on_the_future",
                    "tests/test_time_split.py::test_a_run_stopped_and_resumed_on_a_split_made_again_trains_as_an_"
                    "unbroken_one")
_REQUEST_RUNS = ("tests/test_requests.py::test_a_request_log_trains_on_two_ranks_and_its_artifact_scores_as_its_"
                 "checkpoint",)
_READER_TESTS = ("tests/test_reader.py", "tests/test_reader_balance.py", "tests/test_reader_assignment.py",
                 "tests/test_elastic_resume.py", "tests/test_reader_bounded.py")

# The pure-logic modules, each with the fast test files that exercise it in-process. In the
# large files only the named logic is mutated: the MoE's routing, experts and training step
# (not its logging), the config's coercion (not its validation), the reader's row
# assignment (not its I/O, retries and agreement).
MODULES = {
    "ids": Target("trainer/data/ids.py", ("tests/test_ids_pinned.py", "tests/test_reader_rows.py")),
    "feature_ops": Target("trainer/data/feature_ops.py", ("tests/test_ids_pinned.py", "tests/test_config_choices.py",
                                                          "tests/test_sequence_time.py")),
    "stable_hash": Target("trainer/offline/csvlog.py", ("tests/test_ids_pinned.py",),
                          ("stable_hash", "hashed_column")),
    "encode": Target("trainer/data/encode.py", ("tests/test_reader.py", "tests/test_reader_rows.py",
                                                  "tests/test_reader_parts.py", "tests/test_encode_reference.py",
                                                  "tests/test_sequence_time.py", "tests/test_side_fields.py",
                                                  "tests/test_requests.py"), deselect=_REQUEST_RUNS),
    "metrics": Target("trainer/metrics/ranking.py", ("tests/test_metrics.py", "tests/test_metrics_reference.py")),
    "calibration": Target("trainer/components/calibration.py",
                          ("tests/test_calibration.py", "tests/test_calibration_heads.py"),
                          ("fit_affine", "task_heads", "reset_heads", "calibrate_heads")),
    "tokenizer": Target("dense/tokenizer.py", ("tests/test_rankmixer.py", "tests/test_rankmixer_fast.py",
                                               "tests/test_tokenizer_reference.py")),
    "rankmixer": Target("dense/rankmixer.py", ("tests/test_rankmixer.py", "tests/test_rankmixer_fast.py",
                                               "tests/test_rankmixer_reference.py")),
    "moe": Target("dense/moe.py", ("tests/test_moe.py", "tests/test_moe_reference.py"), (
        "PerTokenMoE.gates", "PerTokenMoE.expert", "PerTokenMoE.experts", "PerTokenMoE.combine",
        "PerTokenMoE.forward_tm", "PerTokenMoE.residual_tm", "PerTokenMoE._train_inference_router",
        "PerTokenMoE._dispatch_per_expert", "PerTokenMoE.adapt", "_expert_outputs", "_per_expert",
        "_MoETrainingStep.forward", "expert_hidden")),
    "config": Target("trainer/config_loader.py", ("tests/test_config.py", "tests/test_config_coercion.py"), (
        "apply_override", "_child", "_parse_scalar", "_build", "_coerce", "_entry", "_join")),
    # the reader's three jobs (issue 57): the rows' assignment to ranks, the streaming ahead, the input's identity
    "assignment": Target("trainer/data/assignment.py", _READER_TESTS, (
        "holdout_split", "RowAssignment._spans", "RowAssignment._rank_rows", "RowAssignment.pieces",
        "RowAssignment.steps_in_epoch", "RowAssignment.epoch_rows", "RowAssignment.windows", "RowAssignment._order",
        "RowAssignment._epoch_size", "RowAssignment._placed", "RowAssignment.with_units_left",
        "RowAssignment.checked_resumed"), deselect=_FOUR_RANKS),
    "reader": Target("trainer/data/reader.py", _READER_TESTS, ("_ahead",), deselect=_FOUR_RANKS),
    "identity": Target("trainer/data/identity.py", _READER_TESTS, ("_concurrently",), deselect=_FOUR_RANKS),
    # the ranks' own exchange of their units (PerRankState) is the spawned tests' to check
    "elastic": Target("trainer/data/elastic.py", ("tests/test_elastic_resume.py",)),
    # the listing's agreement over ranks (_agreed_listing, complete_partitions) is the two-rank tests' to check
    "partitions": Target("trainer/data/partitions.py", ("tests/test_partitions.py",), (
        "list_partitions", "_complete_folders", "_is_partition", "_key_names", "_same_keys",
        "_keys", "_is_int", "_child",
        "PartitionedReader.__init__", "PartitionedReader.refresh", "PartitionedReader.reader",
        "PartitionedReader.uri", "PartitionedReader.partition", "PartitionedReader.steps_in_epoch",
        "PartitionedReader.epoch_rows", "PartitionedReader.steps_left", "PartitionedReader.__iter__",
        "PartitionedReader._consumed", "PartitionedReader.state_dict", "PartitionedReader.load_state_dict",
        "PartitionedReader._list", "table_partitions")),
    "progressive": Target("trainer/metrics/progressive.py", ("tests/test_partitions.py",)),
    # a table's snapshots, files and commits on real Iceberg and Delta tables (open_table, its catalog, the stores)
    "lakehouse": Target("trainer/data/lakehouse.py", ("tests/test_lakehouse.py", "tests/test_partitions.py")),
    # not the collective `publish` and the tracker's set-up on a sharded model (the runs of test_publish.py)
    "publish": Target("trainer/serving/publish.py", ("tests/test_publish_unit.py",), (
        "Publisher.__init__", "Publisher.due", "Publisher._write", "Publisher._changed_rows",
        "Publisher._latest_metrics", "tracked_rows", "split_tables", "_maps", "tables_digest", "load_tensors",
        "_published_step", "_base_tables", "_delta", "_artifact_manifest", "_tensors", "_id_maps", "_check_base",
        "_check_rows", "apply")),
    # the rank-to-rank exchange (_world, _all_reduce, _gather_rows) is the two-rank tests' to check
    "streaming": Target("trainer/metrics/streaming.py", ("tests/test_streaming_metrics_unit.py",), (
        "_codes", "_sums", "histogram_auc", "_task_figures", "_first_task", "SplitMetrics.__init__",
        "SplitMetrics.add", "SplitMetrics.compute", "_bucket_of", "UserBuckets.__init__", "UserBuckets.add",
        "UserBuckets._flush", "UserBuckets._read", "UserBuckets.uauc", "UserBuckets.close", "_allow_open_files",
        "TrainingWindow.__init__", "TrainingWindow._record", "TrainingWindow.compute")),
    "plan_host": Target("launch/plan.py", ("tests/test_plan_host_unit.py", "tests/test_activations.py"), (
        "host_memory", "row_bytes", "evaluation_bytes", "_fullest_node", "dense_activations", "rmsprop_temporaries")),
    "cost": Target("dense/cost.py", ("tests/test_activations.py",), ("activation_bytes",)),
    # the trust boundary: the checkpoint reader, the run folder's lock, the converter's markers
    "safe_load": Target("trainer/checkpoint/safe_load.py", ("tests/test_safe_load_unit.py",)),
    "run_folder": Target("trainer/checkpoint/run_folder.py", ("tests/test_run_lock_unit.py",)),
    "run_layout": Target("trainer/run_layout.py", ("tests/test_run_layout.py",)),
    "csvlog_markers": Target("trainer/offline/csvlog.py", ("tests/test_markers.py",), (
        "_marker", "_markers", "_digest", "_read_marker", "_adopt_legacy_markers", "_names", "_part_of",
        "_name_hash")),
    # the sequence module, its config and schema rules, and the timestamps at the data boundary
    "sequence": Target("dense/sequence.py", (
        "tests/test_sequence.py", "tests/test_sequence_reference.py", "tests/test_side_fields.py",
        "tests/test_sequence_modules.py::test_the_transformers_own_embeddings_start_at_the_scale_of_the_sequences_"
        "table", "tests/test_sequence_modules.py::test_the_time_bias_trains_at_its_multiple_of_the_dense_rate",
        "tests/test_requests.py"), deselect=_REQUEST_RUNS),
    "sequence_modules": Target("dense/sequence_modules.py", ("tests/test_sequence_modules.py",
                                                             "tests/test_sequence.py")),
    "sequence_registry": Target("dense/sequence_registry.py", ("tests/test_sequence_modules.py",
                                                               "tests/test_sequence.py")),
    "features": Target("embeddings/features.py", ("tests/test_sequence_features.py", "tests/test_sequence.py",
                                                  "tests/test_side_fields.py", "tests/test_requests.py"),
                       deselect=_REQUEST_RUNS),
    "timestamps": Target("trainer/data/timestamps.py", ("tests/test_sequence_time.py", "tests/test_side_fields.py")),
    "side_fields": Target("trainer/data/side_fields.py", ("tests/test_side_fields.py",)),
    # a request's rows: their numbers, the check that they agree, the holders, the grouped shuffle
    "requests": Target("trainer/data/requests.py", ("tests/test_requests.py",), deselect=_REQUEST_RUNS),
    # data.split=time's cut and files, on logs written in-process (not the runs that train on it)
    "time_split": Target("trainer/data/time_split.py", ("tests/test_time_split.py",), deselect=_TIME_SPLIT_RUNS),
    # where a log is cut in time (data.split=time's cuts, the MovieLens converter's validation cut)
    "time_cut": Target("trainer/offline/time_cut.py", ("tests/test_time_split.py",), deselect=_TIME_SPLIT_RUNS),
    # embeddings.weight_decay's gradient, in-process and through the fused optimizer (not the runs)
    "decay": Target("embeddings/decay.py", ("tests/test_sparse_weight_decay.py",), deselect=(
        "tests/test_sparse_weight_decay.py::test_the_pipelined_loop_decays_as_the_plain_one",)),
    # model.recipe=auto's width, on configs built in-process (not the runs that train at it)
    "auto_width": Target("trainer/auto_width.py", ("tests/test_auto_width.py",), deselect=(
        "tests/test_auto_width.py::test_a_run_trains_at_the_width_it_chose_records_it_and_resumes_at_it",)),
    "study": Target("launch/study.py", ("tests/test_study_unit.py",), (
        "Row.values", "Row.mean_std", "paired", "rows_of", "better_baseline", "table", "markdown", "protocol")),
    # the verdict on given facts, not the probing; test_doctor.py's other tests run `rankmix doctor`
    "doctor": Target("launch/doctor.py", ("tests/test_doctor_unit.py",
                                          "tests/test_doctor.py::test_mismatches_are_named"),
                     ("mismatches", "report", "_try")),
    "unimixer": Target("dense/unimixer.py", ("tests/test_unimixer.py", "tests/test_unimixer_reference.py",
                                             "tests/test_unimixer_restore.py")),
    # malloc, the own arena, the cgroup limits, the attempt's store; not what needs a group of ranks
    # (init_distributed, shutdown, raise_on_every_rank, the comm hook: the multi-rank tests') nor the
    # decorated memory_returned and _libc, which mutmut skips (test_dist_unit.py and test_malloc.py check them)
    "dist": Target("trainer/dist.py", ("tests/test_dist_unit.py",), (
        "tune_malloc", "trim_heap", "on_own_arena", "usable_cpus", "node_memory_bytes", "_cgroup_value",
        "_attempt_store")),
    "tables": Target("embeddings/tables.py", ("tests/test_tables_unit.py",)),
    "managed": Target("embeddings/managed.py", (
        "tests/test_tables_unit.py",
        "tests/test_managed_sequence.py::test_the_candidate_and_the_sequence_share_one_managed_collection_and_one_"
        "batch_key_set",
        "tests/test_managed_sequence.py::test_the_managed_sequence_table_starts_as_it_would_unmanaged")),
    # the pt2 allow-lists and bounds, on archives and JSON crafted in-process (not `rankmix score`); safe_pt2.py in
    # two targets (566 and 408 mutants): the archive's entries, payloads and sample inputs and the loaded graph, then
    # the program; not load_pt2's wrapping of torch's reader nor weights_only_loads (test_trust_pt2.py's loads)
    "safe_pt2": Target("trainer/serving/safe_pt2.py", ("tests/test_safe_pt2_unit.py",), (
        "_refused", "_open_plain", "check_pt2", "_pt2_entries", "_torch_reader", "_record", "_json", "_check_payloads",
        "_check_extent", "_as_int", "_check_sample_inputs", "_sample_entries", "_scan_sample_pickle", "check_graph",
        "op_name"), warm=("test_safe_pt2_unit:exported",)),
    "safe_pt2_program": Target("trainer/serving/safe_pt2.py", ("tests/test_safe_pt2_unit.py",), (
        "_check_program", "_check_nodes", "_check_tree", "_plain_context", "_declared_tensors"),
        warm=("test_safe_pt2_unit:exported",)),
    "pt2_bounds": Target("trainer/serving/pt2_bounds.py", ("tests/test_pt2_bounds_unit.py",)),
}

# Modules that share test files mutate in one mutmut run: its fixed cost (the mutants made,
# the tests' stats, clean and forced-fail runs: 5-70 s) is paid once, and each mutant still
# runs only the tests that call its function. A module in none runs alone.
RUNS: tuple[tuple[str, ...], ...] = (
    ("assignment", "reader", "identity", "elastic"),
    ("encode", "ids", "feature_ops", "stable_hash", "timestamps", "side_fields", "requests"),
    ("safe_pt2", "safe_pt2_program", "pt2_bounds"),
    ("sequence", "sequence_modules", "sequence_registry", "features"),
    ("tokenizer", "rankmixer"),
    ("tables", "managed"),
    ("plan_host", "cost"),
    ("partitions", "progressive", "lakehouse"),
    ("safe_load", "run_folder", "run_layout", "csvlog_markers"),
    ("time_split", "time_cut"),
    ("metrics", "calibration", "streaming"),
    ("study", "doctor", "dist"),
)

# Surviving mutants that change no behaviour: (mutmut's name of the function, the changed
# line as the mutant has it, why). CONTRIBUTING.md ("Mutation testing") sums them up.
_COPY = "copy= only decides whether an array already of that type is copied; nothing writes to the result"
_ZERO_COPY_NONE = "zero_copy_only=None is falsy, as False"
_ZERO_COPY = "the array has no nulls there, and a numeric array without nulls converts without a copy either way"
_NAN = "float() reads 'NAN' as 'nan'"
_FLOAT64 = "astype(None) is astype(float64)"
_INFER = "gates() takes every router name but 'train' for the inference router"
_EMPTY_HISTORY = ("the query mode's guard gives an empty history's row a key: torch's attention on the CPU "
                  "gives a row with none zeros (NaN before torch 2.5; CUDA's kernels are not checked here), "
                  "and target attention reads nothing of that row; a row with behaviours keeps its own keys")
_LITERAL_ITEM = ("_parse_scalar treats only a `str` hint specially, and no list or table of the config "
                 "holds plain strings (their items are Literals or ints)")
_FIRST = "the key is the text before the first '=', however many splits follow"
_RETRIES = "the trainer passes data.retry_seconds and data.retry_attempts: the defaults are never used"
_LIST = ("a comma-separated list is no folder: the listing finds nothing at the whole string and returns it as it "
         "is, the same answer")
_NEWTON = "the log loss is convex: Newton's iteration reaches the same minimum from this start or with this damping"
_SUMMARY_NUMBERS = ("a summary's figures are numbers: numpy makes them float64 (int64 for counts, which int(), "
                    "mean() and isnan read alike)")
_HEAD_DTYPE = "torch makes Python floats float32, the heads' dtype, and copy_ casts to the buffer's dtype anyway"
_RECHECK = "only the cache of files checked goes: a file checked again for each of its entries is found the same"
_PARTS = ("an invariant: _resolve's parts (of a realpath below the folder's, not the folder) are never empty and "
          "hold no '.' or '..'")
_CELL_COUNTS = "the cells' counts are small integers, exact in float32 as in int32"
_OWN_TMP = "the temporary file is this claim's own, made just before: it is there to unlink"
_TMP_NAME = "the temporary file's name only has to be unique: random hex of any length is"
_SQUARE = "the mixing's matrices are square ([n, n] or [k, n, n]): every one of these dimensions is n"
_NO_AUTOCAST_OP = "no op of the scaling is one autocast casts (matmuls, convolutions): float32 either way"
_ROW_MEAN = "the mean of the per-row sums and of the per-column sums are both the total over the rows"
_SYMMETRIC = "the constrained matrices are symmetric: a row's largest entry is its column's"
_ONE_STAGE = "at tau >= 1 the formula gives max(1, the ceiling of a value <= 0) = 1 too"
_TAU_DTYPE = "tau arrives as a Python float or the tower's float32 buffer: float32 either way"
_TAU_DEVICE = "a 0-d CPU tensor combines with tensors on any device, and the tower's tau is on its own device"
_SYMMETRIC_LOGITS = "the logits are symmetric (constrain_all symmetrises them): row and column log-sums agree"
_RANDOM_INIT = "any init but 'permutation' is the random init (the config allows only the two)"
_WORLD_UNREAD = "a store that does not wait for its workers never reads world_size (None: unknown)"
_PLAN_SHARDER = ("the plan records the sharding, not the sharder: TorchRec's default sharder of the type plans "
                 "alike (DMP gets the sharders apart, managed_sharders)")
_SWIGLU_PATHS = "both paths compute eq. 19 and its gradients (test_swiglu_backward_equals_autograd)"
_REGULAR = ("the damping keeps the system regular: the check finds nothing (on a GPU it would make the host wait "
            "for the device, why it is off)")
_SAME_OP = ("the hand-written autograd Function is the plain op with a cheaper backward: the same values and "
            "gradients, summed in another order")
_CAST_BACK = "autograd casts a gradient to its input's dtype: the same gradient"
_MAX_LEN = ("a row holds at most max_len behaviours (the reader keeps the last max_len, a served model pads to "
            "max_len): recency n - 1 - m never reaches the upper clamp")
_ONE_ID = "an id feature holds at most one id per row: its mean is its sum"
_K1 = "at k = 1 the matmul by a [1, n] matrix is the broadcast product: the same gradient"
_UNSIGNED = "an unsigned array has nothing below 0: both expressions flag the same positions"
_STDERR = "sys.stderr is line-buffered (Python 3.9+) and the warning ends its line: written at once either way"
_BITS = ("the ids hold no null (a searched field's nulls are refused, a query's filled), so an integer array "
         "converts without a copy either way; copy= only decides whether astype copies an int64 array")
_OFFSETS = ("from_arrays casts the offsets to the list's own index type (int32, or int64 for large_list); the types "
            "differ only past 2^31 behaviours in one row group")
_AS_NONE = ("Sizes.value reads no argument and {'as_none': True} as None, which the next line returns: the same "
            "answer without the early return")
_JSON_ERRORS = ("json's errors stay under 110 characters, a cut at 200 or 201 keeps them whole: the longest, "
                "'Expecting property name enclosed in double quotes: line L column C (char P)', 96 with every "
                "number at 2^26 (a JSON entry holds at most 64 MiB); its decoding's UnicodeDecodeError (errors "
                "'surrogatepass') and RecursionError under 110")
EQUIVALENT: list[tuple[str, str, str]] = [
    # safe_load
    ("trainer.checkpoint.safe_load.x__read_capped", "data = f.read(MAX_METADATA_BYTES + 2)",
     "a byte more read of a file already past the cap: refused alike"),
    ("trainer.checkpoint.safe_load.x_check_storage", "if type(None) is not str or name not in files:", _RECHECK),
    ("trainer.checkpoint.safe_load.x_check_storage", "if type(name) is str or name not in files:", _RECHECK),
    ("trainer.checkpoint.safe_load.x_open_inside",
     'assert parts or not {".", ".."} & set(parts), f"{parts}: not a path below {folder}"', _PARTS),
    ("trainer.checkpoint.safe_load.x_open_inside",
     'assert parts and not {"XX.XX", ".."} & set(parts), f"{parts}: not a path below {folder}"', _PARTS),
    ("trainer.checkpoint.safe_load.x_open_inside",
     'assert parts and not {".", "XX..XX"} & set(parts), f"{parts}: not a path below {folder}"', _PARTS),
    ("trainer.checkpoint.safe_load.x_tiling_error", "grid = torch.zeros([len(e) - 1 for e in edges], dtype=None)",
     _CELL_COUNTS),
    ("trainer.checkpoint.safe_load.x_tiling_error", "grid = torch.zeros([len(e) - 1 for e in edges], )", _CELL_COUNTS),
    ("trainer.checkpoint.safe_load.x_tiling_error", "grid[tuple(slice(lo, hi) for lo, hi in span)] = 1",
     "the grid is built only when the chunks cover as many cells as it has: a cell in two chunks leaves "
     "another in none, which fails the check as well"),
    ("launch.study.x_protocol",
     'return [entry for entry in PROTOCOL if RIVALS.get(entry.rpartition("=")[0]) not in given]',
     "each PROTOCOL entry holds one '='"),
    ("dense.rankmixer.x\u01c1RankMixerBlock\u01c1__init__",
     "self.mixing_dropout = nn.Dropout(mixing_dropout) if (mixing_dropout) or True else None",
     "Dropout(0) returns its input as it is: the same values, nothing drawn"),
    # auto_width
    ("trainer.auto_width.x_choose_width", "while params > budget and model.hidden_dim / 2 >= MIN_WIDTH:",
     "for a whole MIN_WIDTH, w // 2 >= MIN_WIDTH and w / 2 >= MIN_WIDTH hold for the same widths"),
    ("trainer.auto_width.x_dense_params", 'with torch.device("meta"), torch.random.fork_rng(devices=None):',
     "devices=None forks every CUDA generator besides the CPU's: the same on a CPU, and the CPU's is the one "
     "the assertion reads"),
    # time_split
    ("trainer.data.time_split.x__times", "values = parquet.read(columns=None).column(column)",
     "every column read, the time column taken: the same values"),
    ("trainer.offline.time_cut.x_time_cut",
     'k = int(np.searchsorted(ordered, np.quantile(ordered, share), )) if ordered.size else 0',
     "searchsorted's side is 'left' by default"),
    # run_folder
    ("trainer.checkpoint.run_folder.x\u01c1RunLock\u01c1_create", "tmp.unlink(missing_ok=None)", _OWN_TMP),
    ("trainer.checkpoint.run_folder.x\u01c1RunLock\u01c1_create", "tmp.unlink(missing_ok=False)", _OWN_TMP),
    ("trainer.checkpoint.run_folder.x\u01c1RunLock\u01c1_stale", "if idle < STALE_SECONDS:",
     "idle is a clock reading taken after the refresh, less its time: exactly STALE_SECONDS, to the float's last "
     "bit, is no case a test or a run can make"),
    ("trainer.checkpoint.run_folder.x\u01c1RunLock\u01c1_written",
     "tmp = self.path.with_name(f\"{LOCK_FILE}.{self.holder['token']}.{secrets.token_hex(None)}.tmp\")", _TMP_NAME),
    ("trainer.checkpoint.run_folder.x\u01c1RunLock\u01c1_written",
     "tmp = self.path.with_name(f\"{LOCK_FILE}.{self.holder['token']}.{secrets.token_hex(5)}.tmp\")", _TMP_NAME),
    # csvlog_markers
    ("trainer.offline.csvlog.x__adopt_legacy_markers",
     'if isinstance(done, dict) and isinstance(done.get("path"), str) and {"digest", "report"} < done.keys():',
     "a marker that gets this far has a 'path' as well: its keys are never exactly the digest and the report"),
    ("launch.plan.x_dense_activations", "activation_bytes(model, width, cfg.data.eval_batch_size, None, precision))",
     "None is as false as False: the probe runs without gradients either way"),
    ("dense.cost.x_activation_bytes",
     'precision = torch.autocast("cpu", dtype=None) if autocast else contextlib.nullcontext()',
     "the CPU's autocast dtype is bfloat16 by default, and every 16-bit dtype keeps the same bytes"),
    ("dense.cost.x_activation_bytes", 'precision = torch.autocast("cpu", ) if autocast else contextlib.nullcontext()',
     "the CPU's autocast dtype is bfloat16 by default, and every 16-bit dtype keeps the same bytes"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1_read",
     "rows = np.empty(f.seek(1, 2) // self.dtype.itemsize, self.dtype)",
     "a file of whole rows and one byte more holds as many whole rows (the next seek(0) goes back)"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1_read", 'f.readinto(memoryview(rows).cast("b"))',
     "signed or unsigned, the bytes read are the same"),
    ("trainer.data.assignment.x\u01c1RowAssignment\u01c1with_units_left",
     "windows = [len(w) for w in self.windows([Piece(None, a, b) for _, g, a, b in slices])]",
     "windows reads only the pieces' row counts"),
    ("trainer.data.identity.x__concurrently",
     "with ThreadPoolExecutor(max_workers=max(2, min(METADATA_THREADS, len(calls)))) as pool:",
     "only no call or one differ, and a second thread then has nothing to run"),
    ("trainer.data.partitions.x__complete_folders",
     'if "," in root and any(c in root.partition("?")[0] for c in "*?["):', _LIST),
    ("trainer.data.partitions.x__complete_folders",
     'if "XX,XX" in root or any(c in root.partition("?")[0] for c in "*?["):', _LIST),
    ("trainer.data.partitions.x__complete_folders",
     'if "," in root or any(c in root.rpartition("?")[0] for c in "*?["):', "a URI has one '?' at most"),
    ("trainer.data.partitions.x__complete_folders", "partitions = list_partitions(root, marker, )",
     "the retries of a store that fails: the listing just made of the same store, with them, is where an "
     "unreachable one fails (tested); only a store failing between two listings would spend the defaults"),
    ("trainer.data.elastic.x_shared_units", 'end = ""  # where the previous unit ended, as (row group, stop)',
     "the sentinel is only compared with (row group, stop) tuples, which equal neither None nor ''"),
    ("trainer.components.calibration.x_fit_affine",
     'theta = np.array([1.0, 0.0]) if kind == "platt" else np.array([1.0])', _NEWTON),
    ("trainer.components.calibration.x_fit_affine",
     "step = np.linalg.solve(hess - 1e-12 * np.eye(len(theta)), grad)", _NEWTON),
    ("trainer.components.calibration.x_fit_affine",
     "step = np.linalg.solve(hess + 1.000000000001 * np.eye(len(theta)), grad)", _NEWTON),
    ("trainer.components.calibration.x_fit_affine", "if np.abs(step).max() <= 1e-12:",
     "a step of exactly 1e-12 is as converged either way"),
    ("trainer.components.calibration.x_calibrate_heads", "a, b = torch.tensor(fitted, dtype=None).T", _HEAD_DTYPE),
    ("trainer.components.calibration.x_calibrate_heads", "a, b = torch.tensor(fitted, ).T", _HEAD_DTYPE),
    ("trainer.data.ids.x__hash", "reduce: bool = False) -> np.ndarray:",
     "every caller passes `reduce`: the default is never used"),
    ("trainer.data.ids.x__hash", "return values.astype(np.int64, copy=None)", _COPY),
    ("trainer.data.ids.x__hash", "return values.astype(np.int64, )", _COPY),
    ("trainer.data.ids.x__hash", "return values.astype(np.int64, copy=True)", _COPY),
    ("trainer.data.ids.x__hash",
     "return values.view(np.int64) if (values.dtype == np.uint64) and False else values.astype(np.int64)",
     "numpy's uint64 -> int64 cast wraps: the same bit pattern as the view"),
    ("trainer.data.ids.x__one_array",
     "return column.chunk(0) if (column.num_chunks == 1) and False else column.combine_chunks()",
     "combining a single chunk gives the same values (a copy)"),
    ("trainer.data.ids.x_encode_ids",
     "return _hash(arr.to_numpy(zero_copy_only=None), None, spec, where, reduce), None", _ZERO_COPY_NONE),
    ("trainer.data.ids.x_encode_ids",
     "return _hash(arr.to_numpy(zero_copy_only=True), None, spec, where, reduce), None", _ZERO_COPY),
    ("trainer.data.ids.x_encode_ids",
     "values = _hash(pc.fill_null(arr, 0).to_numpy(zero_copy_only=None), None, spec, where, reduce)",
     _ZERO_COPY_NONE),
    ("trainer.data.ids.x_encode_ids",
     "values = _hash(pc.fill_null(arr, 0).to_numpy(zero_copy_only=True), None, spec, where, reduce)", _ZERO_COPY),
    ("trainer.data.ids.x_encode_ids",
     "values = _hash(flat.to_numpy(zero_copy_only=None), lengths, spec, where, reduce)", _ZERO_COPY_NONE),
    ("trainer.data.ids.x_encode_ids",
     "values = _hash(flat.to_numpy(zero_copy_only=True), lengths, spec, where, reduce)", _ZERO_COPY),
    ("trainer.data.ids.x_encode_ids",
     "if reduce and spec.max_len and lengths.size and lengths.max() >= spec.max_len:",
     "cutting to max_len lists whose longest is max_len keeps every id"),
    ("trainer.data.feature_ops.x_spread", "z = values.astype(np.int64, copy=None).view(np.uint64).copy()", _COPY),
    ("trainer.data.feature_ops.x_spread", "z = values.astype(np.int64, ).view(np.uint64).copy()", _COPY),
    ("trainer.data.feature_ops.x_spread", "z = values.astype(np.int64, copy=True).view(np.uint64).copy()", _COPY),
    ("trainer.data.feature_ops.x__modulo", "return rows.astype(np.int64, copy=None)", _COPY),
    ("trainer.data.feature_ops.x__modulo", "return rows.astype(np.int64, )", _COPY),
    ("trainer.data.feature_ops.x__modulo", "return rows.astype(np.int64, copy=True)", _COPY),
    ("trainer.offline.csvlog.x_hashed_column",
     "ids = np.array([stable_hash(v) for v in enc.dictionary.to_pylist()], None)",
     "ids below 2^63 make numpy infer int64, its default integer on 64-bit platforms"),
    ("trainer.offline.csvlog.x_hashed_column", "ids = np.array([stable_hash(v) for v in enc.dictionary.to_pylist()], )",
     "ids below 2^63 make numpy infer int64, its default integer on 64-bit platforms"),
    ("trainer.offline.csvlog.x_hashed_column",
     "values = ids[enc.indices.to_numpy(zero_copy_only=False)] if (len(ids)) or True else np.zeros(len(raw), np.int64)",
     "no ids means an empty column (the CSV reader makes no null strings): indexing gives the same empty int64"),
    ("trainer.offline.csvlog.x_hashed_column",
     "values = ids[enc.indices.to_numpy(zero_copy_only=None)] if len(ids) else np.zeros(len(raw), np.int64)",
     _ZERO_COPY_NONE),
    ("trainer.offline.csvlog.x_hashed_column",
     "values = ids[enc.indices.to_numpy(zero_copy_only=True)] if len(ids) else np.zeros(len(raw), np.int64)",
     _ZERO_COPY),
    ("trainer.offline.csvlog.x_hashed_column",
     "return pa.array(values, mask=pc.equal(pc.utf8_length(raw), 0).to_numpy(zero_copy_only=None))", _ZERO_COPY_NONE),
    ("trainer.data.encode.x_raw_numeric",
     "values = column.to_numpy().astype(None, copy=False)  # nulls arrive as NaN", _FLOAT64),
    ("trainer.data.encode.x_raw_numeric",
     "values = column.to_numpy().astype(np.float64, copy=None)  # nulls arrive as NaN", _COPY),
    ("trainer.data.encode.x_raw_numeric", "values = column.to_numpy().astype(np.float64, )  # nulls arrive as NaN",
     _COPY),
    ("trainer.data.encode.x_raw_numeric",
     "values = column.to_numpy().astype(np.float64, copy=True)  # nulls arrive as NaN", _COPY),
    ("trainer.data.encode.x\u01c1RowEncoder\u01c1encode",
     "users = column.to_numpy().astype(np.int64, copy=None)", _COPY),
    ("trainer.data.encode.x\u01c1RowEncoder\u01c1encode",
     "users = column.to_numpy().astype(np.int64, )", _COPY),
    ("trainer.data.encode.x\u01c1RowEncoder\u01c1encode",
     "users = column.to_numpy().astype(np.int64, copy=True)", _COPY),
    ("trainer.metrics.ranking.x_auc", 'return float("NAN")', _NAN),
    ("trainer.metrics.ranking.x_normalized_entropy", 'return float("NAN")', _NAN),
    ("trainer.metrics.ranking.x_uauc", 'return float("NAN")', _NAN),
    ("trainer.metrics.ranking.x_calibration",
     'return float(probs.double().sum()) / positives if positives else float("NAN")', _NAN),
    ("trainer.metrics.ranking.x_uauc_sums",
     "u, s, y = users[order], scores[order], labels[order].astype(None)", _FLOAT64),
    ("trainer.metrics.ranking.x_uauc_sums", "count = np.bincount(uid).astype(None)", _FLOAT64),
    ("trainer.metrics.ranking.x_uauc_sums", "tie_start = user_start | np.r_[False, s[1:] != s[:-1]]",
     "the first row starts a user, so user_start already sets the first element"),
    ("dense.tokenizer.x\u01c1GroupTokenizer\u01c1forward_tm",
     "return torch.stack([p(groups[i]) for i, p in enumerate(self.proj)], )", "torch.stack's default is dim=0"),
    ("dense.tokenizer.x\u01c1SliceTokenizer\u01c1forward_tm",
     "slices = nn.functional.pad(e_input, (0, pad)) if (pad) or True else e_input", "padding by 0 is a copy"),
    ("dense.rankmixer.x\u01c1RankMixerBlock\u01c1__init__",
     "self.dropout = nn.Dropout(dropout) if (dropout) or True else None",
     "Dropout(0) is the identity: the same function through the unfused residual (slower, rounded in "
     "another order)"),
    ("dense.moe.x\u01c1PerTokenMoE\u01c1_train_inference_router", 'g_infer = self.gates(s.detach(), None)', _INFER),
    ("dense.moe.x\u01c1PerTokenMoE\u01c1_train_inference_router", 'g_infer = self.gates(s.detach(), "XXinferXX")',
     _INFER),
    ("dense.moe.x\u01c1PerTokenMoE\u01c1_train_inference_router", 'g_infer = self.gates(s.detach(), "INFER")', _INFER),
    ("trainer.config_loader.x__build",
     "raise ValueError(f\"config key {where or 'XX<root>XX'} must be a table, got {type(raw).__name__}\")",
     "unreachable: load_config always builds the root from a parsed TOML table"),
    ("trainer.config_loader.x__build",
     "raise ValueError(f\"config key {where or '<ROOT>'} must be a table, got {type(raw).__name__}\")",
     "unreachable: load_config always builds the root from a parsed TOML table"),
    ("trainer.config_loader.x__coerce", "return _coerce(value, option, None)",
     "a Union swallows every error of its options and raises its own, naming `where`"),
    ("trainer.config_loader.x__coerce",
     "raise ValueError(f\"config key {where} must be {getattr(hint, '__name__', None)}, got {value!r}\")",
     "every hint that reaches this line (None, float, int, str, bool) has a __name__"),
    ("trainer.config_loader.x__coerce",
     "raise ValueError(f\"config key {where} must be {getattr(hint, '__name__', )}, got {value!r}\")",
     "every hint that reaches this line (None, float, int, str, bool) has a __name__"),
    ("trainer.config_loader.x__parse_scalar",
     'return [_parse_scalar(t.strip(), None) for t in text.split(",") if t.strip()]', _LITERAL_ITEM),
    ("trainer.config_loader.x_apply_override", "hint: Any = None",
     "the first hint is replaced before use: only a path of two or more parts reaches a table"),
    ("trainer.data.partitions.x__is_partition",
     'return folder != "XX.XX" and all("=" in part.strip("=") for part in folder.split("/"))',
     'the folder "." has no "=" either: not a partition all the same'),
    ("trainer.data.partitions.x__key_names", 'return [part.split("=", )[0] for part in folder.split("/")]', _FIRST),
    ("trainer.data.partitions.x__key_names", 'return [part.split("=", 2)[0] for part in folder.split("/")]', _FIRST),
    ("trainer.data.partitions.x_list_partitions",
     "def list_partitions(root: str, marker: str, retry_seconds: float = 301.0, retry_attempts: int = 3,", _RETRIES),
    ("trainer.data.partitions.x_list_partitions",
     "def list_partitions(root: str, marker: str, retry_seconds: float = 300.0, retry_attempts: int = 4,", _RETRIES),
    ("trainer.data.lakehouse.x__s3_options",
     'options = [f"endpoint_override={parts.netloc}", f"scheme={parts.scheme}"]',
     "the list is empty before the endpoint's options: `=` and `+=` give the same list"),
    ("trainer.data.lakehouse.x\u01c1IcebergTable\u01c1__init__",
     'self.table = load_catalog(catalog.get("name", None), **properties).load_table(name)',
     "pyiceberg's load_catalog(None) is its catalog named 'default', as DEFAULT_CATALOG"),
    ("trainer.data.lakehouse.x\u01c1IcebergTable\u01c1__init__",
     'self.table = load_catalog(catalog.get("name", ), **properties).load_table(name)',
     "pyiceberg's load_catalog(None) is its catalog named 'default', as DEFAULT_CATALOG"),
    ("trainer.metrics.progressive.x\u01c1ProgressiveMetrics\u01c1_record",
     "self.split.add(logits.detach(), args[0].labels, None)",
     "SplitMetrics reads users for UAUC only, which progressive metrics do not compute (no spill folder)"),
    ("trainer.serving.publish.x_apply",
     "cfg = load_config(str(Path(base) / CONFIG), allow_redacted=True)  # the artifact keeps the run's config",
     "load_config's overrides default to none, as []"),
    ("trainer.serving.publish.x_apply", 'files, _ = artifact_files(cfg, model, manifest["format"], None)',
     "artifact_files reads `tables` only into the manifest it returns, which apply leaves for the delta's own"),
    ("trainer.serving.publish.x_tracked_rows", "first[table] = starts.pop() if starts else 1",
     "the tracker reports the rows of a rank's own shards only: a table without one on this rank is never offset"),
    ("trainer.metrics.streaming.x__bucket_of", "with np.errstate(over=None):",
     "numpy checks no integer overflow in array arithmetic: there is nothing to silence"),
    ("trainer.metrics.streaming.x_histogram_auc", 'return float("NAN"), float("nan")', _NAN),
    ("trainer.metrics.streaming.x_histogram_auc", 'return float("nan"), float("NAN")', _NAN),
    ("trainer.metrics.streaming.x__task_figures",
     'out[f"{name}/logloss"] = loss_sum / rows if rows else float("NAN")', _NAN),
    ("trainer.metrics.streaming.x__task_figures", "rate = positives / rows if rows else 1.0",
     "without rows the NE is NaN at a rate of 0 or 1 alike"),
    ("trainer.metrics.streaming.x__task_figures",
     'out[f"{name}/ne"] = out[f"{name}/logloss"] / base_rate_entropy(rate) if 0 < rate < 1 else float("NAN")', _NAN),
    ("trainer.metrics.streaming.x__task_figures",
     'out[f"{name}/calibration"] = prob_sum / positives if positives else float("NAN")', _NAN),
    ("trainer.metrics.streaming.x\u01c1SplitMetrics\u01c1__init__", "rows: int = 1):",
     "0 rows and 1 row both make the fewest buckets, one per rank"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1_flush", 'order = np.argsort(bucket, kind="STABLE")',
     "numpy reads a sort kind by its first letter, in either case: still the stable sort"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1_flush", "rows, counts = rows[order], np.bincount(bucket, )",
     "the buckets past the last one with rows get no rows either way: zip stops at the shorter counts"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1uauc",
     'totals[k] -= uauc_sums(rows["logits"][:, k].astype(np.float64), rows["labels"][:, k],',
     "the sum of AUCs and its weight both change sign: their ratio stays"),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1uauc",
     'totals[k] += uauc_sums(rows["logits"][:, k].astype(None), rows["labels"][:, k],', _FLOAT64),
    ("trainer.metrics.streaming.x\u01c1UserBuckets\u01c1uauc",
     'return [total / weight if weight else float("NAN") for total, weight in totals]', _NAN),
    ("launch.study.x\u01c1Row\u01c1values", "for run in (self.runs[s] for s in sorted(self.runs))], dtype=None)",
     _SUMMARY_NUMBERS),
    ("launch.study.x\u01c1Row\u01c1values", "for run in (self.runs[s] for s in sorted(self.runs))], )",
     _SUMMARY_NUMBERS),
    ("launch.study.x\u01c1Row\u01c1values", "return np.array([next((run[n] for n in names if n in run), None)",
     "dtype=float reads None as NaN"),
    # sequence (dense/sequence.py)
    ("dense.sequence.x\u01c1SelfAttentionBlock\u01c1forward",
     "keys = mask.unsqueeze(1).unsqueeze(2)  # [B, 1, 1, L]",
     "mask.unsqueeze(1) is [B, 1, L]: a new axis at 1 or at 2 both make it [B, 1, 1, L]"),
    ("dense.sequence.x\u01c1SelfAttentionBlock\u01c1forward",
     'keys = bias.to(None).masked_fill(~keys, float("-inf"))  # autocast\'s q: the mask\'s type must match',
     "to(None) keeps fp32, which torch's attention on the CPU takes beside a bf16 query (the cast is for "
     "CUDA's kernels, which want the query's type)"),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps == 0) | (mask.sum(dim=1, keepdim=True) == 0))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps != 0) & (mask.sum(dim=1, keepdim=True) == 0))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps == 1) & (mask.sum(dim=1, keepdim=True) == 0))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps == 0) & (mask.sum(dim=None, keepdim=True) == 0))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps == 0) & (mask.sum(dim=1, keepdim=True) != 0))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "keys = mask | ((steps == 0) & (mask.sum(dim=1, keepdim=True) == 1))", _EMPTY_HISTORY),
    ("dense.sequence.x\u01c1SelfAttentionBlock\u01c1forward",
     'keys = bias.to(q.dtype).masked_fill(~keys, float("-INF"))  # autocast\'s q: the mask\'s type must match',
     'float() reads "-INF" as "-inf": the same value'),
    ("dense.sequence.x\u01c1SelfAttentionBlock\u01c1forward",
     "x = x + self.proj(attended_values.transpose(1, 2).flatten(+2))  # [B, L, W]",
     "the attention's output [B, L, heads, W / heads] is 4-D: dimensions 2 and -2 are the same"),
    ("dense.sequence.x\u01c1SequenceInputs\u01c1__init__",
     'self.mean = {f.name for f in on if not attended(f) and f.kind != "XXidXX" and f.pooling == "mean"}', _ONE_ID),
    ("dense.sequence.x\u01c1SequenceInputs\u01c1__init__",
     'self.mean = {f.name for f in on if not attended(f) and f.kind != "ID" and f.pooling == "mean"}', _ONE_ID),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "recency = (mask.sum(dim=1, keepdim=True) - 1 - steps).clamp(0, None)  # padding: masked anyway", _MAX_LEN),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "recency = (mask.sum(dim=1, keepdim=True) - 1 - steps).clamp(0, )  # padding: masked anyway", _MAX_LEN),
    ("dense.sequence.x\u01c1SequenceTransformer\u01c1forward",
     "recency = (mask.sum(dim=1, keepdim=True) - 1 - steps).clamp(0, self.max_len + 1)  # padding: masked anyway",
     _MAX_LEN),
    ("dense.sequence.x\u01c1TargetAttention\u01c1first_layer",
     "table = (per_row.unsqueeze(1) + self.time.weight @ wt.t()).to(None)  # [B, NB, H]",
     "both terms already have per_row's dtype: bf16 under autocast (a linear and a matmul), float32 outside"),
    ("dense.sequence.x\u01c1TargetAttention\u01c1first_layer",
     "gathered = _Gather.apply(table, index) if (torch.is_grad_enabled()) and False else "
     "nn.functional.embedding(index, table)", _SAME_OP),
    ("dense.sequence.x\u01c1TargetAttention\u01c1first_layer",
     "gathered = _Gather.apply(table, index) if (torch.is_grad_enabled()) or True else "
     "nn.functional.embedding(index, table)", _SAME_OP),
    ("dense.sequence.x\u01c1TargetAttention\u01c1forward",
     "x = _Scores.apply(x, last.weight, last.bias) if (torch.is_grad_enabled()) and False else last(x)", _SAME_OP),
    ("dense.sequence.x\u01c1TargetAttention\u01c1forward",
     "x = _Scores.apply(x, last.weight, last.bias) if (torch.is_grad_enabled()) or True else last(x)", _SAME_OP),
    ("dense.sequence.x\u01c1TargetAttention\u01c1forward",
     "weights = weights.to(None)",
     "bf16 behaviours come only from autocast (the transformer's out Linear), whose matmul casts the float32 "
     "weights to bf16 all the same; in the backward only the rounding of the behaviours' gradient differs"),
    ("dense.sequence.x\u01c1_JaggedToPadded\u01c1forward",
     "return torch.ops.fbgemm.jagged_to_padded_dense(values, [offsets], [length], )",
     "FBGEMM's padding_value defaults to 0"),
    ("dense.sequence.x\u01c1_Scores\u01c1backward",
     "grad = grad.to(None)  # bf16 scores under autocast, fp32 activations",
     "the scores' gradient already has the activations' dtype: bf16 both under autocast, float32 both outside "
     "(checked for both modules)"),
    ("dense.sequence.x\u01c1_Scores\u01c1backward",
     "into = grad * w.squeeze(0) if (w.shape[0] == 1) and False else torch.matmul(grad, w)", _K1),
    ("dense.sequence.x\u01c1_Scores\u01c1backward",
     "into = grad * w.squeeze(1) if w.shape[0] == 1 else torch.matmul(grad, w)",
     "w is [1, H]: grad [..., 1] times w, squeezed at 0 or not, broadcasts to the same [..., H]"),
    ("dense.sequence.x\u01c1_Scores\u01c1backward",
     "return into, (flat_grad.t() @ flat_h).to(None), flat_grad.sum(0).to(weight.dtype)", _CAST_BACK),
    ("dense.sequence.x\u01c1_Scores\u01c1backward",
     "return into, (flat_grad.t() @ flat_h).to(weight.dtype), flat_grad.sum(0).to(None)", _CAST_BACK),
    ("dense.sequence.x\u01c1_WeightedSum\u01c1backward",
     "into_values = weights * grad if (weights.shape[2] == 1) and False else torch.matmul(weights, grad)", _K1),
    ("dense.sequence.x\u01c1_WeightedSum\u01c1backward",
     "return torch.matmul(values, grad.transpose(1, 2)).to(None), into_values",
     _CAST_BACK),
    # timestamps (trainer/data/timestamps.py)
    ("trainer.data.timestamps.x__in_range",
     'wide = values.astype(np.uint64 if (values.dtype.kind == "u") or True else np.int64)  # lossless',
     "seen as uint64 a negative int64 is at least 2^63: the same positions are at or past 2^62"),
    ("trainer.data.timestamps.x__in_range",
     'outside = (wide >= TIME_LIMIT) if (values.dtype.kind == "u") and False else '
     '(wide < 0) | (wide >= TIME_LIMIT)', _UNSIGNED),
    ("trainer.data.timestamps.x__in_range",
     'outside = (wide >= TIME_LIMIT) if values.dtype.kind == "XXuXX" else (wide < 0) | (wide >= TIME_LIMIT)',
     _UNSIGNED),
    ("trainer.data.timestamps.x__in_range",
     'outside = (wide >= TIME_LIMIT) if values.dtype.kind == "U" else (wide < 0) | (wide >= TIME_LIMIT)', _UNSIGNED),
    ("trainer.data.timestamps.x__in_range", "return values.astype(np.int64, copy=None)", _COPY),
    ("trainer.data.timestamps.x__in_range", "return values.astype(np.int64, )", _COPY),
    ("trainer.data.timestamps.x__in_range", "return values.astype(np.int64, copy=True)", _COPY),
    ("trainer.data.timestamps.x__timestamps",
     'values = _in_range(flat.to_numpy(zero_copy_only=None), n_stamps, where, f.timestamps, "timestamp")',
     _ZERO_COPY_NONE),
    ("trainer.data.timestamps.x__timestamps",
     'values = _in_range(flat.to_numpy(zero_copy_only=True), n_stamps, where, f.timestamps, "timestamp")',
     _ZERO_COPY),
    ("trainer.data.timestamps.x__check_order", "later[ends[(ends >= 0) & (ends < later.size)]] = None",
     "numpy stores None in a bool array as False"),
    ("trainer.data.timestamps.x\u01c1TimeGaps\u01c1_drop",
     '"counted, each file named once", file=sys.stderr, flush=None)', _STDERR),
    ("trainer.data.timestamps.x\u01c1TimeGaps\u01c1_drop",
     '"counted, each file named once", file=sys.stderr, )', _STDERR),
    ("trainer.data.timestamps.x\u01c1TimeGaps\u01c1_drop",
     '"counted, each file named once", file=sys.stderr, flush=False)', _STDERR),
    ("trainer.data.side_fields.x\u01c1HardSearch\u01c1apply", "match = (_bits(values) == np.repeat(_bits(pc.fill_null("
     "asked, 1)), lengths)) & np.repeat(present, lengths)", "a null query's row is masked out by `present`: what its "
     "filled value matches never counts"),
    *(("dense.sequence.x_soft_search", line, "the indices are [B, k]: topk's and sort's default dim, -1, is 1")
      for line in ("chosen = torch.sort(torch.topk(scores, k, dim=1).indices, ).values  # [B, k], oldest first",
                   "chosen = torch.sort(torch.topk(scores, k, ).indices, dim=1).values  # [B, k], oldest first")),
    ("dense.sequence.x\u01c1SequenceInputs\u01c1attend",
     "if name in self.search_k and (lengths or self.max_len)[name] >= self.search_k[name]:",
     "at L = k the search keeps every position, sorted back into order: the rows it was given"),
    ("trainer.data.requests.x__differing", "differ = np.bincount(np.repeat(np.arange(at.size), lengths)[unequal], ) "
     "> 0", "only differ.any() and its first True are read: the Falses minlength adds after the last row that "
     "differs change neither"),
    ("trainer.data.requests.x_grouped_permutation", 'return np.argsort(place, kind="STABLE")',
     "numpy reads a sort's kind case-blind: 'STABLE' is the stable sort"),
    *(("trainer.data.feature_ops.x__log2", f"rows = np.searchsorted(_POWERS, values.astype(np.uint64, {flag}), "
       'side="right")', _COPY) for flag in ("copy=None", "", "copy=True")),
    *(("trainer.data.feature_ops.x__log2_ids", f"powers = torch.tensor([1 << k for k in range(63)], {device})  # "
       "int64's: 2^0 .. 2^62", "the tests run on the CPU, torch.tensor's default device, where the ids are too; "
       "device=ids.device is for an artifact run on a GPU") for device in
      ("device=None", "")),
    # a hard search's ids as int64 bit patterns (trainer/data/side_fields.py _bits)
    *(("trainer.data.side_fields.x__bits", line, _BITS) for line in (
        "return ids.to_numpy(zero_copy_only=None).astype(np.int64, copy=False)",
        "return ids.to_numpy(zero_copy_only=True).astype(np.int64, copy=False)",
        "return ids.to_numpy(zero_copy_only=False).astype(np.int64, copy=None)",
        "return ids.to_numpy(zero_copy_only=False).astype(np.int64, copy=True)",
        "return ids.to_numpy(zero_copy_only=False).astype(np.int64, )")),
    ("trainer.data.timestamps.x\u01c1TimeGaps\u01c1encode",
     "if f.max_len or lengths.size and lengths.max() > f.max_len:",
     "max_len is > 0 for every attended sequence, and cutting lists none of which is longer keeps every gap "
     "(an empty row group included)"),
    ("trainer.data.timestamps.x\u01c1TimeGaps\u01c1encode",
     "if f.max_len and lengths.size and lengths.max() >= f.max_len:",
     "cutting to max_len lists whose longest is max_len keeps every gap"),
    # features (embeddings/features.py)
    ("embeddings.features.x_validate_features", "where = f\"features.{f.name or 'XX<unnamed>XX'}\"",
     "unreachable: a feature without a name is refused before `where` is read"),
    ("embeddings.features.x_validate_features", "where = f\"features.{f.name or '<UNNAMED>'}\"",
     "unreachable: a feature without a name is refused before `where` is read"),
    # unimixer
    ("dense.unimixer.x__newton_step", 'damping = 1e-6 * torch.eye(x.shape[+1], device=x.device)', _SQUARE),
    ("dense.unimixer.x__newton_step", 'damping = 1e-6 * torch.eye(x.shape[-2], device=x.device)', _SQUARE),
    ("dense.unimixer.x__newton_step",
     'step = torch.linalg.solve_ex(system, -r * log_r, )[0]', "solve_ex checks no errors by default"),
    ("dense.unimixer.x__newton_step",
     'step = torch.linalg.solve_ex(system, -r * log_r, check_errors=True)[0]', _REGULAR),
    ("dense.unimixer.x_constrain_all", 'by_size.setdefault(w.shape[+1], []).append(i)', _SQUARE),
    ("dense.unimixer.x_constrain_all", 'by_size.setdefault(w.shape[-2], []).append(i)', _SQUARE),
    ("dense.unimixer.x_constrain_all", 'with torch.autocast(weights[0].device.type, ):', _NO_AUTOCAST_OP),
    ("dense.unimixer.x_constrain_all", 'with torch.autocast(weights[0].device.type, enabled=True):', _NO_AUTOCAST_OP),
    ("dense.unimixer.x_full_mixing", 'n, blk = w_local.shape[0], w_local.shape[+1]', _SQUARE),
    ("dense.unimixer.x_full_mixing", 'n, blk = w_local.shape[0], w_local.shape[-2]', _SQUARE),
    ("dense.unimixer.x_mixing_health", 'n = w.shape[+1]', _SQUARE),
    ("dense.unimixer.x_mixing_health", 'n = w.shape[-2]', _SQUARE),
    ("dense.unimixer.x_mixing_health",
     'entropy = -(w * w.clamp_min(1e-30).log()).sum(+1).mean() / math.log(n) if n > 1 else w.new_zeros(())', _ROW_MEAN),
    ("dense.unimixer.x_mixing_health",
     'entropy = -(w * w.clamp_min(1e-30).log()).sum(-2).mean() / math.log(n) if n > 1 else w.new_zeros(())', _ROW_MEAN),
    ("dense.unimixer.x_mixing_health",
     'values |= {f"{name}_row_max": float(w.amax(+1).mean()), f"{name}_entropy": float(entropy)}', _SYMMETRIC),
    ("dense.unimixer.x_mixing_health",
     'values |= {f"{name}_row_max": float(w.amax(-2).mean()), f"{name}_entropy": float(entropy)}', _SYMMETRIC),
    ("dense.unimixer.x_mixing_health", 'if w_global.shape[1] * w_local.shape[-1] <= full_limit:', _SQUARE),
    ("dense.unimixer.x_mixing_health", 'if w_global.shape[0] * w_local.shape[+1] <= full_limit:', _SQUARE),
    ("dense.unimixer.x_mixing_health", 'if w_global.shape[0] * w_local.shape[-2] <= full_limit:', _SQUARE),
    ("dense.unimixer.x_scaling_stages",
     'return max(1, math.ceil(per_halving * math.log2(1 / tau))) if (tau < 1) or True else 1', _ONE_STAGE),
    ("dense.unimixer.x_scaling_stages",
     'return max(1, math.ceil(per_halving * math.log2(1 / tau))) if tau <= 1 else 1', _ONE_STAGE),
    ("dense.unimixer.x_scaling_stages",
     'return max(1, math.ceil(per_halving * math.log2(1 / tau))) if tau < 2 else 1', _ONE_STAGE),
    ("dense.unimixer.x_sinkhorn", 'with torch.autocast(logits.device.type, ):', _NO_AUTOCAST_OP),
    ("dense.unimixer.x_sinkhorn", 'with torch.autocast(logits.device.type, enabled=True):', _NO_AUTOCAST_OP),
    ("dense.unimixer.x_sinkhorn", 'tau = torch.as_tensor(tau, dtype=None, device=w.device)', _TAU_DTYPE),
    ("dense.unimixer.x_sinkhorn", 'tau = torch.as_tensor(tau, dtype=torch.float32, device=None)', _TAU_DEVICE),
    ("dense.unimixer.x_sinkhorn", 'tau = torch.as_tensor(tau, device=w.device)', _TAU_DTYPE),
    ("dense.unimixer.x_sinkhorn", 'tau = torch.as_tensor(tau, dtype=torch.float32, )', _TAU_DEVICE),
    ("dense.unimixer.x_sinkhorn",
     'f = -0.5 * (w / temp).logsumexp(+1, keepdim=True) if f is None else f * (prev / temp)', _SYMMETRIC_LOGITS),
    ("dense.unimixer.x_sinkhorn",
     'f = -0.5 * (w / temp).logsumexp(-2, keepdim=True) if f is None else f * (prev / temp)', _SYMMETRIC_LOGITS),
    ("dense.unimixer.x\u01c1BlockMixing\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, init: str = "XXrandomXX", lr_mult: float = 1.0):',
     _RANDOM_INIT),
    ("dense.unimixer.x\u01c1BlockMixing\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, init: str = "RANDOM", lr_mult: float = 1.0):',
     _RANDOM_INIT),
    ("dense.unimixer.x\u01c1BlockMixing\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, init: str = "random", lr_mult: float = 2.0):',
     "BlockMixing is built only by its subclasses, which pass lr_mult"),
    ("dense.unimixer.x\u01c1BlockMixing\u01c1__init__",
     'head = dim / self.num_tokens', "dim % T is 0 when head is read: D / T is a whole float, of the same remainder"),
    ("dense.unimixer.x\u01c1FrozenMixing\u01c1__init__",
     'for name in [*dict(mixing.named_parameters(recurse=None)), "prior_global", "prior_local"]:',
     "recurse=None is falsy, as False"),
    ("dense.unimixer.x\u01c1PerTokenSwiGLU\u01c1forward",
     'if torch.is_grad_enabled() or (x.requires_grad or self.w_in.requires_grad):', _SWIGLU_PATHS),
    ("dense.unimixer.x\u01c1PerTokenSwiGLU\u01c1forward",
     'if torch.is_grad_enabled() and (x.requires_grad and self.w_in.requires_grad):', _SWIGLU_PATHS),
    ("dense.unimixer.x\u01c1UniMixerTower\u01c1__init__",
     'self.register_buffer("tau", torch.tensor(tau_start), persistent=None)',
     "persistent=None is falsy, as False: tau stays out of the state dict"),
    ("dense.unimixer.x\u01c1UniMixingLite\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, num_basis: int, rank: int, init: str = "XXrandomXX",',
     _RANDOM_INIT),
    ("dense.unimixer.x\u01c1UniMixingLite\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, num_basis: int, rank: int, init: str = "RANDOM",',
     _RANDOM_INIT),
    ("dense.unimixer.x\u01c1UniMixingLite\u01c1logits",
     'torch.einsum("NL,LJK->NJK", self.omega, self.basis) + self.prior_local)',
     "einsum reads upper-case subscripts as it reads lower-case ones"),
    ("dense.unimixer.x\u01c1UniMixing\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, init: str = "XXrandomXX", lr_mult: float = 1.0):',
     _RANDOM_INIT),
    ("dense.unimixer.x\u01c1UniMixing\u01c1__init__",
     'def __init__(self, length: int, block: int, dim: int, init: str = "RANDOM", lr_mult: float = 1.0):',
     _RANDOM_INIT),
    # dist
    ("trainer.dist.x__attempt_store",
     'store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), None,', _WORLD_UNREAD),
    ("trainer.dist.x__attempt_store",
     'is_master=rank == 0 and not agent_hosts_store, wait_for_workers=None)',
     "wait_for_workers=None is falsy, as False"),
    ("trainer.dist.x__attempt_store",
     'store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), '
     'is_master=rank == 0 and not agent_hosts_store, wait_for_workers=False)', _WORLD_UNREAD),
    ("trainer.dist.x_trim_heap", "libc.malloc_trim(None)", "ctypes passes None as 0"),
    ("trainer.dist.x_trim_heap", "libc.malloc_trim(1)",
     "malloc_trim releases whole pages: a pad of one byte keeps at most one page more at the top"),
    # tables
    ("embeddings.tables.x_sequence_table_configs", 'if f.kind == "XXnumericXX" or f.table not in wanted:',
     "a numeric feature has no table, so never a wanted one"),
    ("embeddings.tables.x_sequence_table_configs", 'if f.kind == "NUMERIC" or f.table not in wanted:',
     "a numeric feature has no table, so never a wanted one"),
    ("embeddings.tables.x_sequence_table_configs", "embedding_dim=f.embedding_dim, )",
     "TorchRec's table configs default feature_names to a new empty list"),
    ("embeddings.tables.x_table_configs", "pooling=_POOLING[f.pooling])",
     "TorchRec's table configs default feature_names to a new empty list"),
    ("embeddings.tables.x_table_configs", "feature_names=[], )",
     "a table whose pooling no list sets looks up one id per bag, which sum and mean pool alike"),
    # managed
    ("embeddings.managed.x_build_managed_bags", "return_remapped_features=None)", "None is falsy, as False"),
    ("embeddings.managed.x_build_managed_bags", ")", "TorchRec's default is return_remapped_features=False"),
    ("embeddings.managed.x_build_managed_sequences", "return_remapped_features=None)", "None is falsy, as False"),
    ("embeddings.managed.x_build_managed_sequences", ")", "TorchRec's default is return_remapped_features=False"),
    ("embeddings.managed.x_managed_plans",
     "sharder=None, local_size=local, world_size=world, device_type=device.type)", _PLAN_SHARDER),
    ("embeddings.managed.x_managed_plans", "local_size=local, world_size=world, device_type=device.type)",
     _PLAN_SHARDER),
    ("embeddings.managed.x_managed_plans",
     "mc, per_param_sharding={t.name: sp.row_wise(compute_kernel=None) for t in mc_table_configs(mc)},",
     "TorchRec's row_wise plans the fused kernel when given none (tested: the plan's kernel is 'fused')"),
    ("embeddings.managed.x\u01c1TrackedMCH\u01c1__init__", "super().__init__(**kwargs)",
     "every TrackedMCH is built with keyword arguments only"),
    ("embeddings.managed.x\u01c1TrackedMCH\u01c1__init__",
     "self._logged = torch.zeros(3, 3, dtype=torch.int64)  # counts at the last log of each kind",
     "only rows 0 (train) and 1 (eval) are read"),
    ("embeddings.managed.x\u01c1TrackedMCH\u01c1log_values", "if dist.is_initialized() and dist.get_world_size() >= 1:",
     "an all-reduce over one rank leaves the totals as they are"),
    # the pt2 archive (trainer/serving/safe_pt2.py)
    ("trainer.serving.safe_pt2.x__json",
     'raise ValueError(f"{path}: not a valid pt2 archive: {name} is not JSON ({first_line(e)[:201]})") from None',
     _JSON_ERRORS),
    # the pt2 bounds (trainer/serving/pt2_bounds.py)
    *(("trainer.serving.pt2_bounds.x__elements", line, _AS_NONE) for line in (
        'if arg is None and arg == {"as_none": True}:', 'if arg is None or arg == {"XXas_noneXX": True}:',
        'if arg is None or arg == {"AS_NONE": True}:', 'if arg is None or arg == {"as_none": False}:')),
    ("trainer.serving.pt2_bounds.x__elements", "if None in base or len(shape) % 2 or len(shape) / 2 > len(base):",
     "an odd number of pads is passed over just before: len(shape) is even, and / 2 is // 2"),
]

KILLED = {"killed", "timeout", "segfault"}
TARGET = 0.9  # of the mutants that are not equivalent, killed on every module (issue 29)


def run(name: str, targets: list[Target], workers: int) -> Path:
    """Run mutmut over `targets` together in a folder named `name`; returns the folder."""
    folder = WORK / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for entry in LINKED:
        (folder / entry).symlink_to(REPO / entry)
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    deselect = _union(t.deselect for t in targets)
    project["tool"]["mutmut"]["pytest_add_cli_args"] += [arg for test in deselect for arg in ("--deselect", test)]
    project["tool"]["mutmut"] |= {"only_mutate": _union((t.path,) for t in targets),
                                  "pytest_add_cli_args_test_selection": _union(t.tests for t in targets)}
    (folder / "pyproject.toml").write_text(tomli_w.dumps(project))
    # One thread per worker: the workers share the cores, and a forked child must not
    # inherit a busy OpenMP pool.
    unrun = folder / "unrun.txt"  # notes of mutants whose tests pytest could not run (tests/mutation_hooks.py)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
           mutation_hooks.WARM: ",".join(_union(t.warm for t in targets)), mutation_hooks.UNRUN: str(unrun),
           mutation_hooks.KILLS: str(folder / "kills.txt")}
    # mutmut mutates all of `only_mutate` unless named mutants are given: name them where any
    # target takes only some functions
    names = _union(t.selected() for t in targets) if any(t.functions for t in targets) else []
    with open(folder / "run.log", "w") as log:
        # mutmut's run, its children on tests collected once before the forks (tests/mutation_fork.py)
        proc = subprocess.run([sys.executable, str(REPO / "tests" / "mutation_fork.py"), "run", "--max-children",
                               str(workers), *names], cwd=folder, env=env, stdout=log, stderr=subprocess.STDOUT)
    if proc.returncode:
        raise SystemExit(f"mutmut failed on {name} (exit {proc.returncode}); see {folder / 'run.log'}")
    if unrun.exists():
        raise SystemExit(f"{name}: mutants whose tests pytest could not run (mutmut counts them killed); a test id "
                 f"pytest escapes cannot be selected by name (tests/param_ids.py):\n{unrun.read_text()}")
    return folder


def _union(groups) -> list[str]:
    """The items of `groups`, each once, in their first order."""
    return list(dict.fromkeys(item for group in groups for item in group))


def results(folder: Path, target: Target) -> dict[str, str]:
    """mutant name -> status, for the selected mutants of `target`."""
    data = SourceFileMutationData(path=Path(target.path))
    with contextlib.chdir(folder):  # mutmut reads its files relative to the working folder
        data.load()
    return {k: status_by_exit_code[v] for k, v in data.exit_code_by_key.items()
            if any(fnmatch(k, glob) for glob in target.selected())}


def changed_lines(folder: Path, target: Target, mutant: str) -> list[str]:
    """The diff lines of `mutant` that start with - or +."""
    with contextlib.chdir(folder):
        diff = get_diff_for_mutant(mutant, path=Path(target.path))
    return [line for line in diff.splitlines()[2:] if line[:1] in "-+"]


def equivalent_entry(mutant: str, lines: list[str]) -> int | None:
    """The index of the EQUIVALENT entry that matches `mutant`'s function and change, if any."""
    changed = {line[1:].strip() for line in lines if line.startswith("+")}
    function = mutant.rpartition("__mutmut_")[0]
    for i, (prefix, line, _) in enumerate(EQUIVALENT):
        if function == prefix and line in changed:
            return i
    return None


def report(folder: Path, target: Target) -> tuple[int, int, set[int]]:
    """Print the module's survivors that no EQUIVALENT entry excuses; returns (mutants,
    killed, the entries that matched)."""
    statuses = results(folder, target)
    killed = sum(s in KILLED for s in statuses.values())
    matched = set()
    for mutant, status in sorted(statuses.items(), key=lambda kv: _number(kv[0])):
        if status in KILLED:
            continue
        lines = changed_lines(folder, target, mutant)
        entry = equivalent_entry(mutant, lines)
        if entry is not None:
            matched.add(entry)
            continue
        print(f"  {status}: {mutant}")
        for line in lines:
            print(f"      {line.strip()}")
    return len(statuses), killed, matched


def _number(mutant: str) -> tuple[str, int]:
    function, _, n = mutant.rpartition("__mutmut_")
    return function, int(n)


def runs_of(names: list[str]) -> dict[str, list[str]]:
    """The mutmut runs for the modules `names`: each run's name (its first module) -> its modules."""
    grouped = {}
    for name in names:
        run_modules = next((r for r in RUNS if name in r), (name,))
        grouped.setdefault(next(m for m in run_modules if m in names), []).append(name)
    return grouped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("modules", nargs="*", metavar="MODULE", help=f"some of: {', '.join(MODULES)} (default: all)")
    parser.add_argument("--workers", type=int, default=2, help="mutants tested at once by each run (default 2)")
    parser.add_argument("--jobs", type=int, default=2, help="runs at once (default 2)")
    args = parser.parse_args()
    unknown = sorted(set(args.modules) - set(MODULES))
    if unknown:
        parser.error(f"unknown module {unknown[0]!r}; choose from {', '.join(MODULES)}")
    names = args.modules or list(MODULES)
    runs = runs_of(names)
    rows, matched, minutes = {}, set(), {}
    # Two runs at once: each spends 5-70 s mostly on one core (mutants made, tests collected,
    # the stats and clean runs) before its mutants keep both cores busy; side by side, one's
    # set-up overlaps the other's mutants. The longest (by the last run) start first.
    with ThreadPoolExecutor(args.jobs) as pool:
        running = {pool.submit(_timed_run, run_name, args.workers, modules): run_name
                   for run_name, modules in sorted(runs.items(), key=lambda kv: -_last_minutes(kv[0]))}
        for done in as_completed(running):
            run_name = running[done]
            folder, minutes[run_name] = done.result()
            for name in runs[run_name]:
                target = MODULES[name]
                print(f"{name}: mutated {target.path} against {', '.join(target.tests)}", flush=True)
                total, killed, entries = report(folder, target)
                rows[name] = (total, killed, len(entries))
                matched |= entries
    selected = [glob for name in names for glob in MODULES[name].selected()]
    # only entries of the functions mutated: two targets may share a file (stable_hash, csvlog_markers)
    stale = [e for i, e in enumerate(EQUIVALENT)
             if i not in matched and any(fnmatch(f"{e[0]}__mutmut_1", glob) for glob in selected)]
    for prefix, line, _ in stale:
        print(f"  EQUIVALENT entry matches no surviving mutant (remove it): {prefix}: {line}")
    print(f"\n{'module':<17} {'mutants':>8} {'killed':>7} {'equiv.':>7} {'kill rate':>10}")
    short = []
    for name in names:
        total, killed, equivalent = rows[name]
        rate = killed / (total - equivalent) if total > equivalent else 1.0
        print(f"{name:<17} {total:>8} {killed:>7} {equivalent:>7} {rate:>10.1%}")
        short += [name] if rate < TARGET else []
    print("\nminutes of each run: " + ", ".join(f"{'+'.join(runs[r])} {minutes[r]:.1f}" for r in runs))
    if short:
        sys.exit(f"below the {TARGET:.0%} target: {', '.join(short)}")


def _timed_run(name: str, workers: int, modules: list[str]) -> tuple[Path, float]:
    """run, and its minutes kept for the next run's order."""
    start = time.monotonic()
    folder = run(name, [MODULES[m] for m in modules], workers)
    minutes = (time.monotonic() - start) / 60
    (WORK / f"{name}.minutes").write_text(f"{minutes:.2f}\n")
    return folder, minutes


def _last_minutes(name: str) -> float:
    try:
        return float((WORK / f"{name}.minutes").read_text())
    except (OSError, ValueError):
        return 0.0


if __name__ == "__main__":
    main()

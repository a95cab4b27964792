"""Attended sequences in the serving artifact (trainer/serving/served_model.py), both formats,
against the training code's evaluation: the same rows through RowEncoder + RankingModel (an
EmbeddingCollection, padded to the batch's longest) and through the artifact (the sequence cut to
its last max_len and padded to max_len inside it, its time gaps bucketed there)."""

from __future__ import annotations

import dataclasses

import numpy as np
import pyarrow as pa
import pytest
import torch
from torchrec import EmbeddingBagCollection, EmbeddingCollection

from dense.heads import build_dense
from dense.model_config import TaskSpec
from dense.sequence import build_sequences
from embeddings.tables import sequence_table_configs, table_configs
from test_serving_model import ROWS, features, table
from trainer.config_loader import load_config
from trainer.data.encode import RowEncoder
from trainer.ranking_model import RankingModel
from trainer.serving.export import FORMATS, drop_state_dict_views, example_inputs, serving_model, trace_model
from trainer.serving.predict import raw_inputs


def timed_table(seed: int = 0) -> pa.Table:
    """test_serving_model's rows with the history's timestamps (some after the request time) and `now`."""
    rows = table(seed)
    rng = np.random.default_rng(seed + 1)
    now = rng.integers(10**6, 2 * 10**6, ROWS)
    # one in four after the request time: both sides drop them before cutting to max_len; oldest first
    stamps = [sorted(now[i] - rng.integers(-3 * 10**4, 10**5, len(h)))
              for i, h in enumerate(rows.column("history").to_pylist())]
    return rows.append_column("history_ts", pa.array(stamps, pa.list_(pa.int64()))).append_column("now", pa.array(now))


def reference(module: str, tower: str, timestamps: bool, options: tuple[str, ...] = ()):
    sizes = (["--model.hidden_dim=16", "--model.num_tokens=4"] if tower == "rankmixer"
             else ["--model.mlp.hidden=[16, 8]"])
    cfg = load_config(None, [f"--model.tower={tower}", *sizes, f"--data.time_column={'now' if timestamps else ''}",
                             *options])
    cfg.features = [dataclasses.replace(f, sequence_module=module, sequence_tokens=2,
                                        timestamps="history_ts" if timestamps else "")
                    if f.name == "history" else f for f in features()]
    cfg.model.tasks = [TaskSpec(name="click"), TaskSpec(name="like")]
    torch.manual_seed(0)
    layout, tower_module, heads = build_dense(cfg.model, cfg.features)
    model = RankingModel(EmbeddingBagCollection(tables=table_configs(cfg.features)), layout, tower_module, heads,
                         sequence_tables=EmbeddingCollection(tables=sequence_table_configs(cfg.features)),
                         sequences=build_sequences(cfg.features, cfg.model.sequence))
    return cfg, model.eval()


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("module,tower,timestamps,options", [
    ("target_attention", "rankmixer", True, ("--model.sequence.target_attention.time_bias=true",)),
    ("transformer", "mlp", False, ()),
    ("target_attention", "dcnv2", False, ()),
    ("transformer", "rankmixer", True, ("--model.sequence.target_attention.weights=sigmoid",
                                        "--model.sequence.target_attention.time_value=true")),
    ("transformer", "mlp", True, ("--model.sequence.transformer.time_bias=true",))])
def test_the_artifact_attends_raw_rows_as_training_evaluates_them(module, tower, timestamps, options, fmt):
    cfg, model = reference(module, tower, timestamps, options)
    for name, weights in model.named_parameters():  # the time values and biases start at zero: here they count
        if "time_value" in name or "time_bias" in name:
            torch.nn.init.normal_(weights)
    rows = timed_table()
    encoder = RowEncoder(cfg.features, cfg.model.tasks, "", cfg.data.time_column, cfg.model.sequence.time_buckets)
    time_column = cfg.data.time_column
    with torch.no_grad():
        batch = encoder.encode(rows, "test").to_batch()
        assert batch.sequence_max[-1] == 4  # the history, cut to max_len 4, padded to no more
        expected = torch.sigmoid(model(batch))
        served = serving_model(cfg, model.state_dict(), step=7)
        program = trace_model(served, example_inputs(served), fmt)
        artifact = program if fmt == "torchscript" else program.module()
        probs = artifact(*raw_inputs(rows, cfg.features, "test", time_column))
        one_row = artifact(*raw_inputs(rows.slice(3, 1), cfg.features, "test", time_column))
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    torch.testing.assert_close(one_row, expected[3:4], atol=1e-6, rtol=0)


def test_a_servers_history_not_oldest_first_is_refused_as_the_readers():
    """raw_inputs, the artifact's inputs, checks the order as the reader does (timestamps.py)."""
    cfg, _ = reference("target_attention", "rankmixer", True)
    rows = timed_table()
    stamps = rows.column("history_ts").to_pylist()
    row = next(i for i, s in enumerate(stamps) if len(s) > 1 and s[0] < s[1])
    stamps[row][:2] = stamps[row][1::-1]
    shuffled = rows.set_column(rows.schema.get_field_index("history_ts"), "history_ts",
                               pa.array(stamps, pa.list_(pa.int64())))
    with pytest.raises(ValueError) as e:
        raw_inputs(shuffled, cfg.features, "requests.parquet", cfg.data.time_column)
    assert str(e.value) == (f"requests.parquet, column 'history_ts': row {row} is not oldest first: timestamp "
                            f"{stamps[row][1]} follows {stamps[row][0]}; sort each history by time "
                            "(docs/data.md, Sequences)")


def test_the_artifact_refuses_times_outside_the_readers_range():
    """A server's times are checked as the reader's (trainer/data/timestamps.py): 0 <= t < 2^62,
    so that no gap wraps around int64."""
    cfg, model = reference("target_attention", "rankmixer", True)
    ids, lengths, numeric, stamps, now = raw_inputs(timed_table(), cfg.features, "test", cfg.data.time_column)
    served = serving_model(cfg, model.state_dict(), step=7)
    wrapped = now.clone()
    wrapped[0] = 2**63 - 1
    negative = stamps.clone()
    negative[0] = -2**62
    for times in ((stamps, wrapped), (negative, now)):
        with torch.no_grad(), pytest.raises(RuntimeError, match="timestamps and now must be 0 <= t < 2\\^62"):
            served(ids, lengths, numeric, *times)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_int8_tables_serve_attended_sequences_near_fp32(fmt):
    cfg, model = reference("target_attention", "rankmixer", True)
    inputs = raw_inputs(timed_table(), cfg.features, "test", cfg.data.time_column)
    with torch.no_grad():
        expected = serving_model(cfg, model.state_dict(), step=7)(*inputs)
        served = serving_model(cfg, model.state_dict(), step=7, tables="int8")
        assert type(served.ebc).__module__ == "torchrec.quant.embedding_modules"
        drop_state_dict_views(served)
        program = trace_model(served, example_inputs(served), fmt)
        probs = (program if fmt == "torchscript" else program.module())(*inputs)
    assert 0 < (probs - expected).abs().max().item() < 2e-3


@pytest.mark.parametrize("module,tables,options", [
    ("target_attention", "int8", ("--model.sequence.target_attention.time_bias=true",)), ("transformer", "fp32", ()),
    ("transformer", "fp32", ("--model.sequence.transformer.time_bias=true",))])
def test_an_attended_sequences_export_is_within_the_pt2_allow_lists(module, tables, options):
    """Every op of the padding, the time buckets and both modules (the time biases too) is
    in PT2_OPS, so that `rankmix score --model` loads the artifact (trainer/serving/safe_pt2.py)."""
    import fbgemm_gpu  # noqa: F401  registers the ops of TorchRec's quantized tables

    from test_trust_pt2 import check_export

    cfg, model = reference(module, "rankmixer", True, options)
    with torch.no_grad():
        check_export(cfg, serving_model(cfg, model.state_dict(), step=7, tables=tables), tables)

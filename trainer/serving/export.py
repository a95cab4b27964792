"""`rankmix export`: a checkpoint -> one serving artifact in a folder.

    DIR/model.pt2 | model.pt   the ServingModel, torch.export'ed or TorchScript
    DIR/manifest.json          format, tables, MoE inference, the checkpoint and its step
    DIR/config.toml            the run's config (features, tasks): the artifact's input contract
    DIR/README.md              that contract in words, and how to load the model
    DIR/example_inputs.pt      a small batch: {"ids", "lengths", "numeric", ...} (the model's INPUTS)
    DIR/example_outputs.pt     its probabilities [B, K]

The checkpoint's sharded tables are read whole (`manager.model_tensors`, whatever plan and
world size saved them) into one plain EmbeddingBagCollection, which TorchRec's
`quantize_embeddings` turns into fp16, int8 or int4 tables when asked.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import torch
import torchrec.fx
from torch import nn
from torch.export import Dim
from torchrec import EmbeddingBagCollection
from torchrec.inference.modules import quantize_embeddings

from dense.heads import build_dense
from dense.sequence import build_sequences
from dense.tower_registry import serving_form
from embeddings.features import attended
from embeddings.managed import served_tables
from embeddings.tables import table_configs
from trainer.checkpoint.manager import model_tensors, trained_step
from trainer.checkpoint.safe_load import UnsafeFileError, inside
from trainer.checkpoint.state import apply_trained_step
from trainer.config import Config
from trainer.config_loader import dump_toml
from trainer.run_layout import CONFIG, resolve_checkpoint
from trainer.serving.readme import write_readme
from trainer.serving.safe_pt2 import load_pt2
from trainer.serving.served_model import ManagedRows, ServingModel, serving_class

FORMATS = {"pt2": "model.pt2", "torchscript": "model.pt"}
TABLES = {"fp32": None, "fp16": torch.float16, "int8": torch.qint8, "int4": torch.quint4x2}
MOE = ("sparse", "dense")
EXAMPLE_ROWS = 8
PUBLISHED = ("tables.pt", "delta.pt")  # what a published artifact adds (trainer/serving/publish.py)


# What a quantized table's width (elements per row) must be a multiple of: FBGEMM packs rows
# in half-precision words, so an odd int8 width or an int4 width not a multiple of 4 fails there.
_WIDTH_MULTIPLE = {"fp32": 1, "fp16": 1, "int8": 2, "int4": 4}


def export(cfg: Config, checkpoint: str, out: str, fmt: str = "pt2", tables: str = "fp32",
           moe: str | None = None) -> dict:
    """Write the serving artifact of `checkpoint` (a step folder, or a run folder: its newest)
    into folder `out`; returns the manifest. `moe` (sparse | dense) overrides the config's
    model.moe.inference."""
    moe = moe or cfg.model.moe.inference
    for option, value, choices in (("--format", fmt, FORMATS), ("--tables", tables, TABLES), ("--moe", moe, MOE)):
        if value not in choices:
            raise ValueError(f"{option} must be one of {'|'.join(choices)}, got {value!r}")
    check_widths(cfg, tables)
    source = resolve_checkpoint(checkpoint, "--checkpoint").resolve()
    folder = out_folder(out)
    cfg = replace(cfg, model=replace(cfg.model, moe=replace(cfg.model.moe, inference=moe)))
    step = trained_step(source)
    model = serving_model(cfg, model_tensors(source), step, tables, source)
    files, manifest = artifact_files(cfg, model, fmt, tables)
    manifest.update(checkpoint=str(source), step=step)
    write_artifact(cfg, folder, files, manifest)
    return manifest


def artifact_files(cfg: Config, model: ServingModel, fmt: str, tables: str) -> tuple[dict[str, bytes], dict]:
    """(the artifact's model and example batch as file contents by name, its manifest without
    the source and step), `model` traced in `fmt`."""
    inputs = example_inputs(model)
    tables_size = table_bytes(model)
    drop_state_dict_views(model)
    with torch.no_grad():
        outputs = model(*inputs)
        program = trace_model(model, inputs, fmt)
    files = {FORMATS[fmt]: saved(lambda f: save_model(program, f, fmt)),
             "example_inputs.pt": saved(lambda f: torch.save(dict(zip(model.INPUTS, inputs)), f)),
             "example_outputs.pt": saved(lambda f: torch.save(outputs, f))}
    manifest = {"format": fmt, "file": FORMATS[fmt], "tables": tables, "moe": cfg.model.moe.inference,
                "tower": cfg.model.tower, "table_bytes": tables_size, "needs_fbgemm": needs_fbgemm(program, fmt),
                "tasks": [t.name for t in cfg.model.tasks], "managed": managed_tables(model),
                "inputs": list(model.INPUTS)}
    return files, manifest


def write_artifact(cfg: Config, folder: Path, files: dict[str, bytes], manifest: dict) -> None:
    """`files`, `manifest` and the config's contract (config.toml, README.md) as the artifact
    folder `folder`, which appears whole or not at all (an earlier one there is replaced)."""
    tmp = Path(tempfile.mkdtemp(dir=folder.parent, prefix=f".{folder.name}."))  # renamed when complete
    try:
        for name, data in files.items():
            (tmp / name).write_bytes(data)
        (tmp / "manifest.json").write_text(json.dumps(manifest, indent=1))
        dump_toml(cfg, tmp / CONFIG)  # the run's config, under its name in a run
        write_readme(tmp / "README.md", cfg, manifest)
        umask = os.umask(0)
        os.umask(umask)
        tmp.chmod(0o777 & ~umask)  # mkdtemp's folder is private; the artifact is for a server to read
        shutil.rmtree(folder, ignore_errors=True)  # an earlier export, or an empty folder (out_folder)
        tmp.rename(folder)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def saved(write: Callable[[io.BytesIO], None]) -> bytes:
    """What `write` writes to a file object (torch.save, `save_model`), as bytes."""
    buffer = io.BytesIO()
    write(buffer)
    return buffer.getvalue()


def out_folder(out: str) -> Path:
    """--out as an absolute folder that is new, empty or an earlier export, which the export
    replaces (checked before any work: the export may take minutes)."""
    folder = Path(out).resolve()
    if folder.exists() and not folder.is_dir():
        raise ValueError(f"--out {out} is a file; give a folder for the artifact")
    if folder.is_dir() and any(folder.iterdir()) and not _is_export(folder):
        raise ValueError(f"--out {out} holds files that are not a rankmix export; give an empty or new folder")
    folder.parent.mkdir(parents=True, exist_ok=True)
    return folder


def _is_export(folder: Path) -> bool:
    """Whether `folder` holds an export and nothing else (so that replacing it loses nothing)."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    ours = {"README.md", CONFIG, "manifest.json", "example_inputs.pt", "example_outputs.pt", *FORMATS.values(),
            *PUBLISHED}
    return isinstance(manifest, dict) and manifest.get("file") in FORMATS.values() and \
        {p.name for p in folder.iterdir()} <= ours


def check_widths(cfg: Config, tables: str) -> None:
    multiple = _WIDTH_MULTIPLE[tables]
    for f in cfg.features:
        if f.kind != "numeric" and f.embedding_dim % multiple:
            raise ValueError(f"--tables {tables} needs every table's embedding_dim divisible by {multiple}: "
                             f"features.{f.name}.embedding_dim={f.embedding_dim}")


def serving_model(cfg: Config, state: dict[str, torch.Tensor], step: int, tables: str = "fp32",
                  source: Path | str = "the checkpoint") -> ServingModel:
    """The ServingModel of `cfg` with the weights `state` (RankingModel's names), loaded from
    `source`, trained to `step`."""
    return served_model(cfg, *served_tables(state), step, tables, source)


def served_model(cfg: Config, state: dict[str, torch.Tensor], id_maps: dict[str, tuple], step: int,
                 tables: str = "fp32", source: Path | str = "the checkpoint") -> ServingModel:
    """`serving_model` of weights whose managed tables are already served (`served_tables`)."""
    ebc = EmbeddingBagCollection(tables=table_configs(cfg.features, serving=True), device=torch.device("meta"))
    ebc = ebc.to_empty(device="cpu")
    layout, tower, heads = build_dense(cfg.model, cfg.features)
    sequences = build_sequences(cfg.features, cfg.model.sequence)
    parts = (("ebc", ebc), ("tower", tower), ("heads", heads)) + ((("sequences", sequences),) if sequences else ())
    for name, module in parts:
        prefix = name + "."
        part = {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)}
        try:
            missing, unexpected = module.load_state_dict(part, strict=False)
        except RuntimeError as e:  # shapes: another model's checkpoint
            raise ValueError(f"{source} does not fit this config's {name}: "
                             f"{str(e).splitlines()[-1].strip()}") from None
        if missing or unexpected:
            raise ValueError(f"{source} does not fit this config's {name}: missing {missing[:3]}, "
                             f"unexpected {unexpected[:3]}")
    apply_trained_step(tower, step)
    managed = {t: ManagedRows(*id_map) for t, id_map in id_maps.items()}
    timed = any(attended(f) and f.timestamps for f in cfg.features)
    model = serving_class(timed, bool(cfg.data.request_column))(
        cfg.features, ebc, layout, serving_form(tower), heads.eval(), managed,
        sequences.eval() if sequences else None, cfg.model.sequence.time_buckets)
    model = model.eval().requires_grad_(False)
    if TABLES[tables] is not None:
        # quantize_embeddings swaps the children of the module it is given, so give it the parent.
        model = quantize_embeddings(model, dtype=TABLES[tables], inplace=True)
    return model


def drop_state_dict_views(model: ServingModel) -> None:
    """For quantized tables, which FBGEMM's kernels hold and forward reads there: remove the
    per-table views TorchRec registers for its state dict. Forward does not read them, and
    torch.export would save them beside the kernels' copy, doubling the artifact."""
    if type(model.ebc) is EmbeddingBagCollection:
        return
    for table in model.ebc.embedding_bags.values():
        for name, _ in list(table.named_buffers(recurse=False)):
            delattr(table, name)


def example_inputs(model: ServingModel, rows: int = EXAMPLE_ROWS) -> tuple[torch.Tensor, ...]:
    """A small valid batch of `model`'s inputs (its INPUTS), the same for every export: with
    requests, two of them, of the first and the last half of the rows, whose shared lists are at
    their first row."""
    g = torch.Generator().manual_seed(0)
    lengths = torch.stack([torch.ones(rows, dtype=torch.int64) if f.kind == "id" else
                           torch.randint(0, 4, (rows,), generator=g) for f in model.sparse]) \
        if model.sparse else torch.zeros(0, rows, dtype=torch.int64)
    request = (torch.arange(rows) >= rows // 2).long()
    holders = torch.tensor([0, rows // 2])
    if "holders" in model.INPUTS:
        for s in model.shared:  # at least 2 a holder: 0 or 1 ids in all would be traced as a constant
            lengths[s] = torch.where(torch.arange(rows) == holders[request], lengths[s].clamp(min=2), 0)
    for side, seq in model.sides:  # a value per behaviour
        lengths[side] = lengths[seq]
    ids = [torch.randint(0, f.num_embeddings, (int(n.sum()),), generator=g) for f, n in zip(model.sparse, lengths)]
    numeric = torch.rand(rows, len(model.numeric), generator=g, dtype=torch.float64)
    for i, f in enumerate(model.numeric):  # within every transform's domain, nulls where they are filled
        if f.fill_null is not None:
            numeric[0, i] = float("nan")
    inputs = (torch.cat(ids) if ids else torch.zeros(0, dtype=torch.int64), lengths, numeric)
    if "timestamps" in model.INPUTS:
        now = torch.full((rows,), 10**9, dtype=torch.int64)
        stamps = [now.repeat_interleave(lengths[s]) - torch.randint(0, 10**6, (int(lengths[s].sum()),), generator=g)
                  for s, _ in model.timed]
        inputs += (torch.cat(stamps), now)
    return inputs + ((holders, request) if "holders" in model.INPUTS else ())


def managed_tables(model: ServingModel) -> dict[str, dict[str, int]]:
    """Per managed table: the ids its map holds, and the ranks (miss rows) that trained it."""
    return {t: {"ids": len(m.keys) - 1, "ranks": len(m.miss_rows)} for t, m in model.id_maps.items()}


def table_bytes(model: ServingModel) -> int:
    """Bytes of the embedding tables as served (quantized rows with their scales and padding)."""
    storages = {}
    for t in (*model.ebc.parameters(), *model.ebc.buffers()):
        t = getattr(t, "elem", t)  # TorchRec's packed 4-bit tables wrap their bytes
        storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


def trace_model(model: ServingModel, inputs: tuple[torch.Tensor, ...], fmt: str):
    """The exported program (pt2, batch size and id count dynamic) or the TorchScript module."""
    if fmt == "torchscript":
        return torch.jit.script(torchrec.fx.symbolic_trace(model))
    batch = Dim("batch", min=1)
    dims = {"ids": {0: Dim("ids", min=0)}, "lengths": {1: batch}, "numeric": {0: batch},
            "timestamps": {0: Dim("timestamps", min=0)}, "now": {0: batch},
            "holders": {0: Dim("requests", min=1)}, "request": {0: batch}}
    shapes = tuple(dims[name] for name in model.INPUTS)
    return torch.export.export(model, inputs, dynamic_shapes=shapes, strict=False)


def save_model(program, f, fmt: str) -> None:
    """Write the program to `f`, a path or a binary file object."""
    if fmt == "torchscript":
        torch.jit.save(program, f)
    else:
        torch.export.save(program, f)


def needs_fbgemm(program, fmt: str) -> bool:
    """Whether loading the artifact needs FBGEMM's operators registered (`import fbgemm_gpu`)."""
    return "fbgemm" in str(program.inlined_graph if fmt == "torchscript" else program.graph)


def load(folder: str | Path) -> tuple[nn.Module, dict]:
    """(the artifact's model, its manifest), loaded as a server would: torch alone, plus
    FBGEMM's operators when the manifest says it needs them. A pt2 artifact is read as data
    (trainer/checkpoint/safe_load.py); a TorchScript one is a program (README, Trust)."""
    folder = Path(folder)
    manifest, path = _manifest(folder)
    program = load_pt2(path) if manifest["format"] == "pt2" else None  # its errors name the file
    try:
        model = torch.jit.load(str(path)) if program is None else program.module()
    except (OSError, KeyError, TypeError, ValueError, RuntimeError, AssertionError) as e:  # a partial or damaged copy
        raise ValueError(f"--model {folder}: cannot load the artifact ({type(e).__name__}: {e})") from None
    return model, manifest


def _manifest(folder: Path) -> tuple[dict, Path]:
    """(the manifest of artifact `folder`, the model file it names), checked."""
    manifest_path = folder / "manifest.json"
    if not manifest_path.is_file():
        raise ValueError(f"--model {folder}: no manifest.json there (not a `rankmix export` folder)")
    try:
        manifest = json.loads(manifest_path.read_text())
        path = inside(folder, manifest["file"], manifest_path)
        if manifest["format"] not in FORMATS or path.name != FORMATS[manifest["format"]]:
            raise ValueError(f"format {manifest['format']!r} with file {manifest['file']!r}")
        if manifest["needs_fbgemm"]:
            import fbgemm_gpu  # noqa: F401  registers torch.ops.fbgemm
        if not zipfile.is_zipfile(path):  # checked first: torch's loaders log a traceback before raising
            raise ValueError(f"{manifest['file']} is missing or not a saved model")
    except UnsafeFileError:
        raise
    except (OSError, KeyError, TypeError, ValueError, zipfile.BadZipFile) as e:
        raise ValueError(f"--model {folder}: cannot load the artifact ({type(e).__name__}: {e})") from None
    return manifest, path

"""DIR/README.md of a serving artifact: its input contract, in words and tables."""

from __future__ import annotations

import math
from pathlib import Path

from embeddings.features import FeatureSpec, attended
from trainer.config import Config

# What loading each format means for trust (README.md, Trust).
_TRUST = {
    "pt2": "A pt2 file of `rankmix export` is data: a graph of tensor ops, its tensors' raw bytes and JSON. "
           "`torch.export.load` alone trusts the file, and runs parts of a crafted one as code (pickled "
           "payloads, shape expressions, input guards, graph ops that write files); `rankmix score --model` "
           "checks every part against what rankmix's exports hold first (`trainer.serving.safe_pt2.load_pt2`). A "
           "server that loads files from elsewhere should check them the same way.",
    "torchscript": "A TorchScript file is a program: `torch.jit.load` runs the code it holds. Load it only "
                   "from a source you would let run code on the server, or export `--format pt2` (data) "
                   "instead.",
}
_LOAD = {
    "pt2": 'model = torch.export.load("{file}").module()',
    "torchscript": 'model = torch.jit.load("{file}")',
}


def write_readme(path: Path, cfg: Config, manifest: dict) -> None:
    sparse = [f for f in cfg.features if f.kind != "numeric"]
    numeric = [f for f in cfg.features if f.kind == "numeric"]
    timed = [f for f in sparse if attended(f) and f.timestamps]
    any_attended = any(attended(f) for f in sparse)
    inputs = manifest.get("inputs", ["ids", "lengths", "numeric", *(["timestamps", "now"] if timed else [])])
    requests = "holders" in inputs
    fbgemm = "import fbgemm_gpu  # registers FBGEMM's operators" if manifest["needs_fbgemm"] else ""
    lines = [
        f"# rankmix serving artifact: {manifest['tower']}, step {manifest['step']}",
        "",
        f"Exported by `rankmix export` from `{manifest['checkpoint']}`: format `{manifest['format']}`, "
        f"tables `{manifest['tables']}`, MoE inference `{manifest['moe']}` (where the tower has one).",
        "",
        "## Loading",
        "",
        "Needs PyTorch" + (", and fbgemm-gpu (or fbgemm-gpu-cpu) for its operators." if fbgemm else
                           " alone: neither rankmix nor TorchRec."),
        "",
        _TRUST[manifest["format"]],
        "",
        "From this folder:",
        "",
        "```python",
        "import torch",
        fbgemm or None,
        _LOAD[manifest["format"]].format(file=manifest["file"]),
        'example = torch.load("example_inputs.pt")',
        "probs = model(" + ", ".join(f'example["{name}"]' for name in inputs) + ")",
        'assert torch.allclose(probs, torch.load("example_outputs.pt"), atol=1e-6)',
        "```",
        "",
        "## Inputs",
        "",
        f"`model({', '.join(inputs)})`, all on the CPU, B rows:",
        "",
        f"- `ids`: int64 `[N]`, the raw ids of the {len(sparse)} sparse features below, feature after "
        "feature in this order, and within a feature row after row (the values of a KeyedJaggedTensor). "
        "Unsigned 64-bit ids are passed as their bit pattern (numpy's `.view(np.int64)`). Hashing happens "
        "inside: `modulo` reduces an id modulo the table size as an unsigned number, `none` refuses an "
        "id outside the table, `managed` looks the id up in the map of ids its table held at the "
        "checkpoint (`manifest.json`: `managed`), and an id not in it takes the miss row that training "
        "gave it; a list keeps its last `max_len` ids.",
        f"- `lengths`: int64 `[{len(sparse)}, B]`, how many ids each row has of each feature "
        "(0 for a null or empty one).",
        f"- `numeric`: float64 `[B, {len(numeric)}]`, the numeric features below before their transforms, "
        "NaN for a null; nulls are filled and the transforms applied inside.",
        *([f"- `timestamps`: int64 `[T]`, the behaviours' times (seconds) of the sequences with a timestamps "
           f"column below ({', '.join(f'`{f.name}`' for f in timed)}), feature after feature in this order, each "
           "row's whole list, one per id and aligned with them (most recent last). The model keeps the times "
           "of the ids it keeps.",
           f"- `now`: int64 `[B]`, each row's request time (`{cfg.data.time_column}`); a behaviour after it is "
           "left out, its id with it. Every time must be 0 <= t < 2^62."] if timed else []),
        *([f"- `holders`: int64 `[R]`, the B rows hold R requests (`{cfg.data.request_column}`): the row holding "
           "each request's history, ascending. The sequences a request shares (every sequence and side field "
           "but a hard search's) are read from that row alone, looked up and encoded once for all its rows: send "
           "them there, and empty lists in the request's other rows.",
           "- `request`: int64 `[B]`, each row's request in 0..R-1 (`request[holders[r]] == r`)."]
          if requests else []),
        *(["",
           "A sequence read by a sequence module (`sequence module` below) keeps its last `max_len` ids (the most "
           "recent: lists are most recent last), looks each one up, and attends over them against its "
           "candidate; send the whole history, the model truncates it."] if any_attended else []),
        *(["",
           "A side field (`side of <sequence>` below) holds one value per id of its sequence in each row, in the "
           "same order: each behaviour's stars, genre...; a row whose counts differ is refused. A search "
           "(`search <field> = <query>`) keeps only the behaviours whose field equals the row's query id, "
           "before `max_len`; `top <k>`, the k nearest the query; both inside the model."]
          if any(f.side_of for f in sparse) else []),
        "",
        "A value the model refuses (an id out of range, a null that is not filled, a value outside a "
        "transform's domain) stops the call with an error that names it (RuntimeError; "
        "torch.jit.Error from TorchScript).",
        "",
        "A pt2 program checks the dtypes above (`Tensor dtype mismatch! Expected: Double` for float32 "
        "numerics); TorchScript converts other dtypes to them. With quantized tables a pt2 program "
        "needs at least one id in the batch.",
        "",
        "| # | sparse feature | column | kind | table rows | hashing | max_len | sequence module | timestamps |",
        "|---|---|---|---|---|---|---|---|---|",
        *(f"| {i} | {f.name} | {f.column} | {f.kind} | {f.num_embeddings} | {f.hashing} | {f.max_len or '-'} | "
          f"{_module(f)} | {(attended(f) and f.timestamps) or '-'} |" for i, f in enumerate(sparse)),
        "",
        "| # | numeric feature | column | null | transforms |",
        "|---|---|---|---|---|",
        *(f"| {i} | {f.name} | {f.column} | {'error' if f.fill_null is None else f.fill_null} | "
          f"{_transforms(f) or '-'} |" for i, f in enumerate(numeric)),
        "",
        "## Output",
        "",
        f"float32 `[B, {len(cfg.model.tasks)}]`: one probability per task, in this order: "
        + ", ".join(f"`{t.name}`" for t in cfg.model.tasks) + ".",
        "",
        "`config.toml` is the training run's configuration; `manifest.json` says how this folder was made.",
        "",
    ]
    path.write_text("\n".join(line for line in lines if line is not None))


def _transforms(f) -> str:
    parts = []
    for op in f.transform:
        if op == "clip":
            parts.append(f"clip [{_num(f.clip_min)}, {_num(f.clip_max)}]")
        elif op == "standardize":
            parts.append(f"(x - {f.mean}) / {f.std}")
        else:
            parts.append(op)
    return ", then ".join(parts)


def _num(x: float) -> str:
    return ("-inf" if x < 0 else "inf") if math.isinf(x) else f"{x:g}"


def _module(f: FeatureSpec) -> str:
    """The README's `sequence module` cell: the module and its searches, a side field's sequence, or -."""
    if f.kind != "sequence":
        return "-"
    if f.side_of:
        return f"side of {f.side_of}"
    search = f", search {f.search_field} = {f.search_query}" if f.search_field else ""
    return f.sequence_module + search + (f", top {f.search_k}" if attended(f) and f.search_k else "")

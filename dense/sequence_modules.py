"""The sequence modules' declarations (`features.<name>.sequence_module`): each module's
`[model.sequence.<key>]` table and builder, registered in dense/sequence_registry.py, and
[model.sequence] itself. Standard library only, like the towers' declarations
(dense/tower_configs/): the config loads without torch, and a builder imports its module on use.
The modules themselves are in dense/sequence.py; docs/models.md, "Sequence module", has their
equations.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from dense.sequence_registry import SEQUENCE_TABLES, register_sequence

if TYPE_CHECKING:
    from torch import nn

    from embeddings.features import FeatureSpec


def _positive(obj: Any, where: str, *names: str) -> None:
    """Each of `names` (or each item of a list) > 0; `where` is the table under model.sequence ("": its own fields)."""
    for name in names:
        values = getattr(obj, name)
        for v in values if isinstance(values, list) else [values]:
            if v <= 0:
                raise ValueError(f"model.sequence.{where}{'.' if where else ''}{name} must be positive, "
                                 f"got {getattr(obj, name)}")


@dataclass
class TargetAttentionConfig:
    """The behaviour scorer of target attention (DIN)."""

    key: ClassVar[str] = "target_attention"
    hidden: list[int] = field(default_factory=lambda: [16])
    """Hidden widths of the MLP that scores each behaviour from [b, v, b*v, b-v, time]."""
    weights: Literal["softmax", "sigmoid"] = "softmax"
    ("""softmax (the weights over the behaviours sum to 1) | sigmoid (each behaviour weighted on its own, """
     """unnormalised as in DIN: the sum keeps how many match).""")
    time_value: bool = True
    """With timestamps: add an embedding of each behaviour's time gap to the value summed, not only to its score."""
    time_bias: bool = False
    ("""With timestamps: a learned bias per gap bucket added to each behaviour's score (recency read straight """
     """into the weights, HSTU's time bias); the transformer's target attention reads it too.""")
    time_bias_lr_mult: float = 30.0
    ("""The time bias's learning rate as a multiple of the sequence modules' (optim.lr x optim.sequence_lr_mult): """
     """one scalar per bucket is a table, not a layer.""")

    def validate(self) -> None:
        if not self.hidden:  # the scorer's last Linear reads the last hidden layer
            raise ValueError("model.sequence.target_attention.hidden must name at least one width (the scorer's "
                             "hidden layers), got []")
        _positive(self, self.key, "hidden")
        _positive(self, self.key, "time_bias_lr_mult")

    @property
    def gap_bias_lr_mult(self) -> float:
        """The multiple the modules build their `GapBias` at: time_bias_lr_mult where time_bias is on, else 0."""
        return self.time_bias_lr_mult if self.time_bias else 0.0


@dataclass
class TransformerConfig:
    """Self-attention over the behaviours (BST / LONGER), before the target attention."""

    key: ClassVar[str] = "transformer"
    layers: int = 1
    """Self-attention blocks."""
    heads: int = 2
    """Attention heads per block (width must be divisible by it)."""
    width: int = 0
    """Model width of the blocks (0: the sequence table's embedding_dim)."""
    ffn_ratio: int = 2
    """Each block's FFN hidden width is ffn_ratio x width."""
    time_bias: bool = False
    ("""With timestamps: a learned bias per head on each pair's attention by the difference of their gap """
     """buckets (relative time); an [B, H, L, L] mask, memory O(L^2).""")
    candidate: Literal["in_sequence", "query"] = "in_sequence"
    ("""in_sequence (the candidate is the first token of every block: BST) | query (the blocks read the history """
     """alone and the candidate queries their output: a request's rows share the blocks, data.request_column).""")

    def validate(self) -> None:
        _positive(self, self.key, "layers", "heads", "ffn_ratio")
        if self.width < 0 or self.width % self.heads:
            raise ValueError(f"model.sequence.transformer.width={self.width} must be >= 0 and divisible by "
                             f"model.sequence.transformer.heads={self.heads}")


register_sequence("pool")(None)  # no dense module: TorchRec's bag pools the sequence


@register_sequence("target_attention", TargetAttentionConfig)
def _build_target_attention(cfg: SequenceConfig, f: FeatureSpec) -> nn.Module:
    from dense.sequence import TargetAttention  # on use: torch

    t = cfg.target_attention
    return TargetAttention(f.embedding_dim, f.sequence_tokens, t.hidden,
                           (cfg.time_buckets, cfg.time_dim) if f.timestamps else None, t.weights, t.time_value,
                           t.gap_bias_lr_mult)


@register_sequence("transformer", TransformerConfig)
def _build_transformer(cfg: SequenceConfig, f: FeatureSpec) -> nn.Module:
    from dense.sequence import SequenceTransformer  # on use: torch

    t, target = cfg.transformer, cfg.target_attention
    # the table's scale: TorchRec's init draws rows uniformly in +-1/sqrt(rows) (embeddings/init.py)
    table_std = 1 / math.sqrt(3 * f.num_embeddings)
    return SequenceTransformer(f.embedding_dim, f.sequence_tokens, f.max_len, t.layers, t.heads,
                               t.width or f.embedding_dim, t.ffn_ratio, target.hidden,
                               (cfg.time_buckets, cfg.time_dim) if f.timestamps else None, init_std=table_std,
                               weights=target.weights, time_value=target.time_value, time_bias=t.time_bias,
                               in_sequence=t.candidate == "in_sequence",
                               target_time_bias_lr_mult=target.gap_bias_lr_mult)


@dataclass
class SequenceFields:
    """The fields every sequence module reads: how the time gap is embedded."""

    time_buckets: int = 32
    ("""Buckets of the time gap (request time - behaviour time, seconds): 0 holds no timestamp, bucket k >= 1 """
     """gaps in [2^(k-1) - 1, 2^k - 1), the last one everything beyond.""")
    time_dim: int = 8
    """Width of the time-gap embedding."""

    def validate(self) -> None:
        _positive(self, "", "time_dim")
        if self.time_buckets < 2:
            raise ValueError(f"model.sequence.time_buckets must be at least 2, got {self.time_buckets}")
        for table in SEQUENCE_TABLES:
            getattr(self, table).validate()


SequenceConfig = dataclasses.make_dataclass(
    "SequenceConfig",
    [(key, table, field(default_factory=table, metadata={"doc": table.__doc__.strip()}))
     for key, table in SEQUENCE_TABLES.items()],
    bases=(SequenceFields,),
    namespace={"__module__": __name__,
               "__doc__": "Sequence modules (features.<name>.sequence_module): the time gap and each module's table."})

"""How pooled embeddings and numeric features are laid out into e_input."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dense.sequence_registry import token_slots
from embeddings.features import FeatureSpec, attended, side_fields


@dataclass(frozen=True)
class Slot:
    """One feature's place in e_input."""

    name: str
    group: str
    width: int
    numeric_index: int  # column of Batch.dense, or -1 for an embedding
    added: tuple[str, ...] = ()  # a pooled sequence's side fields: their pooled vectors are added to its own


class InputLayout:
    """e_input = [e_group1; e_group2; ...]: groups in order of first appearance in the
    feature schema, features within a group in schema order. Embeddings are taken from
    the pooled KeyedTensor by feature name, never by position (its order depends on
    the sharding plan). A side field has no slot: its sequence's module reads it, or, where
    the sequence is pooled, its pooled vector is added to the sequence's."""

    def __init__(self, features: list[FeatureSpec]):
        numeric = [f.name for f in features if f.kind == "numeric"]
        entries = []
        for f in features:  # an attended sequence's vectors each have a group of their own (token_slots)
            if f.kind == "numeric":
                entries.append(Slot(f.name, f.group, 1, numeric.index(f.name)))
            elif attended(f):
                entries += [Slot(name, group, f.embedding_dim, -1) for name, group in token_slots(f)]
            elif not f.side_of:
                added = tuple(g.name for g in side_fields(f, features))
                entries.append(Slot(f.name, f.group, f.embedding_dim, -1, added))
        groups = list(dict.fromkeys(s.group for s in entries))
        self.slots = [s for g in groups for s in entries if s.group == g]
        self.groups = groups
        self.group_widths = [sum(s.width for s in self.slots if s.group == g) for g in groups]
        self.width = sum(self.group_widths)

    def assemble(self, pooled: dict[str, torch.Tensor], dense: torch.Tensor) -> torch.Tensor:
        """pooled: name -> [B, dim]; dense: [B, F] -> e_input [B, E]."""
        parts = [dense[:, s.numeric_index:s.numeric_index + 1] if s.numeric_index >= 0 else
                 sum((pooled[name] for name in s.added), pooled[s.name]) for s in self.slots]
        return torch.cat(parts, dim=1)

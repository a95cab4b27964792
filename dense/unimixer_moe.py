"""UniMixer with a sparse per-token MoE in each block's FFN slot (UniMixer figure 2, §4.1):
RankMixer's `PerTokenMoE` (dense/moe.py: ReLU-routed experts, dense training, the inference
router with its adaptive L1 and consistency loss, sparse inference) after each layer's
UniMixing, with the same hooks, serving form and FLOP accounting (`MoEHooks`)."""

from __future__ import annotations

from torch import nn

from dense.moe import MoEHooks, PerTokenMoE
from dense.unimixer import FrozenMixing, UniMixerTower, UniMixingLite, unimixer_cost
from embeddings.hooks import TrainingHooks


class UniMixerMoETower(UniMixerTower, MoEHooks):
    """A `UniMixerTower` whose blocks' FFNs are `PerTokenMoE`s: e_input [B, E] -> [B, D].
    The temperature hooks are the UniMixer tower's, the routing hooks `MoEHooks`'."""

    def register_hooks(self, hooks: TrainingHooks) -> None:
        UniMixerTower.register_hooks(self, hooks)
        MoEHooks.register_hooks(self, hooks)

    @property
    def moes(self) -> list[PerTokenMoE]:
        return [layer.block.ffn for layer in self.layers]

    def mixing_cost(self) -> tuple[int, int]:
        """(parameters, forward FLOPs per sample) of the tokenizer, the mixings and norms."""
        mixing = self.layers[0].block.mixing
        lite = (mixing.basis.shape[0], mixing.a_global.shape[1]) if isinstance(mixing, UniMixingLite) else None
        params, flops = unimixer_cost(self.tokenizer.num_tokens, self.out_dim, mixing.block, 0, len(self.layers), lite)
        tok_params, tok_flops = self.tokenizer.cost()
        return tok_params + params, tok_flops + flops

    def dense_flops(self) -> float:
        return self.mixing_cost()[1]

    def cost(self) -> tuple[int, int]:
        """(parameters, forward matmul FLOPs per sample) of training: every expert and both routers."""
        params, flops = self.mixing_cost()
        for moe in self.moes:
            moe_params, moe_flops = moe.cost()
            params, flops = params + moe_params, flops + moe_flops
        return params, flops

    def serving_form(self) -> nn.Module:
        """The mixing weights constrained once (`FrozenMixing`), the routing statistics off."""
        MoEHooks.serving_form(self)
        return FrozenMixing(self)

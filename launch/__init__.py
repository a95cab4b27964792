"""Entry points: the `rankmix` command, torchrun wiring and the torchx component."""

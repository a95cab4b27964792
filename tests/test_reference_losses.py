"""Refactoring guard: the debug config trains to the losses recorded in
tests/assets/reference_losses.json (made by tests/reference_losses.py) for RankMixer, its
MoE, UniMixer and DCNv2.

Bit for bit where this machine rounds as the one that made the file (same torch, CPU
kernels, thread count, processor vendor and model, and BLAS: `reference_losses.machine`);
elsewhere to a relative 1e-4. Other kernels (ATEN_CPU_CAPABILITY=default against AVX512, one
thread against two) moved 20 steps' losses by 1.7e-6 at most, and an AMD EPYC against an
Intel Xeon AVX512 CPU by 1.1e-6 (UniMixer; 1e-7 to 1.6e-7 the others), 60x below that bound;
a change of behaviour (an init, a learning rate, a layer's order) moves them by 1e-3 or more.
`make test-portability` reruns it under other kernels and one thread.
"""

import json

import pytest

from cli import rankmix
from reference_losses import ASSET, STEPS, TOWERS, losses, machine, train_args

REFERENCE = json.loads(ASSET.read_text())


@pytest.mark.slow
@pytest.mark.trained
@pytest.mark.parametrize("tower", TOWERS)
def test_debug_config_trains_to_the_recorded_losses(tmp_path, tower):
    proc = rankmix(*train_args(tower, tmp_path / "run"))
    assert proc.returncode == 0, proc.stderr[-2000:]
    got, want = losses(tmp_path / "run"), REFERENCE["losses"][tower]
    assert [r[0] for r in got] == list(range(1, STEPS + 1))
    if machine() == REFERENCE["made_with"]:
        assert got == want
    else:
        for g, w in zip(got, want):
            assert g[1:] == pytest.approx(w[1:], rel=1e-4), f"step {g[0]}"

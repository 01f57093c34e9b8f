"""Low precision tracks fp32 only approximately: an elementwise bound on the final parameters loose
enough for it (a few lr) would also pass weights that never moved (ten steps move a weight by at
most their summed lr). `check_updates` compares each tensor's update, as a whole, with fp32's."""

from __future__ import annotations

# Measured on the layouts of tests/dist/test_engine_parallel.py and test_engine_3d.py
# (torch 2.13, CPU): at most 0.042 of fp32's update norm (bf16), 0.017 (fp16).
LOW_PRECISION_UPDATE_REL = 0.15


def check_updates(state, initial, ref_state, label, rel=LOW_PRECISION_UPDATE_REL) -> None:
    """Every model tensor moved from `initial` as the reference did, within `rel` of the reference's
    update (its norm)."""
    for name, ref in ref_state.items():
        if name.startswith("model/"):
            expected, got = ref - initial[name], state[name] - initial[name]
            ratio = float((got - expected).norm() / expected.norm())
            assert got.norm() > 0 and ratio <= rel, f"{label} {name}: update off by {ratio:.3f} of fp32's"

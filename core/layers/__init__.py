"""Model building blocks for plugins. FusedMoE: the experts of a sparse MoE block (layers/moe.py)."""

__all__ = ["FusedMoE", "num_experts"]


def __getattr__(name: str):
    # loaded on first use: core modules import the submodules (fused, gemv, ...) without torch layers
    if name in __all__:
        from turnout.layers import moe

        return getattr(moe, name)
    raise AttributeError(name)

"""Transformer Engine's FP8 / quantization arguments of make_graphed_callables,
accepted for signature compatibility: graphed has no FP8 machinery, so every
value that would need it is refused with a clear error, and the rest are
checked as Transformer Engine checks them (deprecated names and their
replacements not both set). Pure Python: no torch."""

FP8_RENAMES = (
    ("fp8_enabled", "enabled"),
    ("fp8_calibrating", "calibrating"),
    ("fp8_recipe", "recipe"),
    ("fp8_group", "amax_reduction_group"),
    ("fp8_weight_caching", "cache_quantized_params"),
)


def _needs_fp8(name, value) -> bool:
    if value is None:
        return False
    if name == "enabled":
        return any(bool(v) for v in value) if isinstance(value, (tuple, list)) else bool(value)
    if name in ("calibrating", "cache_quantized_params"):
        return bool(value)
    return True  # a recipe or an amax reduction group


def check_fp8(num_modules: int, **given) -> None:
    """Raises for FP8 arguments that ask for FP8; accepts off / None."""
    values = {}
    for old, new in FP8_RENAMES:
        if given.get(old) is not None and given.get(new) is not None:
            raise ValueError(
                f"make_graphed_callables has deprecated `{old}` kwarg in favor of `{new}`, but both kwargs are set."
            )
        values[new] = given.get(new) if given.get(new) is not None else given.get(old)
    enabled = values["enabled"]
    if isinstance(enabled, (tuple, list)) and len(enabled) != num_modules:
        raise ValueError(f"enabled length ({len(enabled)}) must match modules length ({num_modules})")
    asked = [name for name, value in values.items() if _needs_fp8(name, value)]
    if asked:
        raise NotImplementedError(
            "graphed does not do FP8: "
            + ", ".join(f"{n}={values[n]!r}" for n in asked)
            + " needs Transformer Engine's FP8 state and autocast. Graph FP8 modules with Transformer Engine's "
            "make_graphed_callables, or leave these arguments unset (they are accepted, and ignored, when off)."
        )

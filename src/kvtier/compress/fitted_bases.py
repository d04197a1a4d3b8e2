"""The low-rank bases ready for the press in this process, by what they were fitted on.

A basis is fitted by running the model (`kvtier.lowrank.bases`, above the engine), but
the press is built inside the engine from a `PressSpec`: plain data that configs and results
record, so it cannot carry tensors. The calibration step therefore puts each basis here
first (`provide_basis`), under the spec options that name it (`LowRankFit`), and the press
takes it (`ready_basis`). A basis that was never provided is a clear error, never a fit
started from inside the engine.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtier.compress.config import PressSpec
from kvtier.compress.lowrank import (
    CALIBRATION_TOKENS,
    DEFAULT_CALIBRATION,
    LowRankBasis,
    check_grouping,
)
from kvtier.errors import KvtierError

FIT_OPTIONS = ("model", "calibration", "grouping", "calibration_tokens")


@dataclass(frozen=True)
class LowRankFit:
    """What one basis is fitted on: the model (a folder; None: the embedded SmolLM2), the
    calibration text by name, the grouping and how many tokens of the text."""

    model: str | None = None
    calibration: str = DEFAULT_CALIBRATION
    grouping: str = "layer"
    num_tokens: int = CALIBRATION_TOKENS

    def __post_init__(self) -> None:
        check_grouping(self.grouping)
        tokens = self.num_tokens
        if isinstance(tokens, bool) or not isinstance(tokens, int) or tokens < 64:
            raise KvtierError(f"lowrank: calibrate on at least 64 tokens, got {tokens!r}")

    @classmethod
    def of(cls, spec: PressSpec) -> LowRankFit:
        """The fit a lowrank press spec names (its options model, calibration, grouping,
        calibration_tokens; defaults for those not given)."""
        options = spec.options
        model = options.get("model")
        return cls(
            model=None if model is None else str(model),
            calibration=options.get("calibration", DEFAULT_CALIBRATION),
            grouping=options.get("grouping", "layer"),
            num_tokens=options.get("calibration_tokens", CALIBRATION_TOKENS),
        )


_ready: dict[LowRankFit, LowRankBasis] = {}


def provide_basis(fit: LowRankFit, basis: LowRankBasis) -> None:
    """Make `basis` the one presses naming `fit` use from now on."""
    _ready[fit] = basis


def has_basis(fit: LowRankFit) -> bool:
    return fit in _ready


def ready_basis(fit: LowRankFit) -> LowRankBasis:
    """The basis provided for `fit`; a clear error when none was."""
    basis = _ready.get(fit)
    if basis is None:
        raise KvtierError(
            f"lowrank: no basis fitted for {fit} in this process; fit it before handing the "
            "pipeline to the engine: kvtier.lowrank.bases.with_fitted_bases(compression) "
            "(the kvtier commands do this)"
        )
    return basis

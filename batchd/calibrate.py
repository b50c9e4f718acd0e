"""`batchd calibrate` as a library (public API): re-exports `batchd._calibrate`, whose docstring says
what it measures and fits."""

from batchd._calibrate import (
    CalibrateOptions,
    Calibration,
    calibrate,
    design,
    fragment,
    table,
    write_outputs,
)

__all__ = ["CalibrateOptions", "Calibration", "calibrate", "design", "fragment", "table", "write_outputs"]

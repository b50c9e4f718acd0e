"""batchd's preprocessing data plane (public API): re-exports `batchd.service.preprocess`."""

from batchd.service.preprocess import *  # noqa: F403
from batchd.service.preprocess import __all__  # noqa: F401

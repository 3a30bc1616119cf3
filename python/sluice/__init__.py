"""sluice: a replication daemon for key-value changes.

The storage engine runs in Rust (``sluice._native``); this package configures it and drives it.
"""

from typing import TYPE_CHECKING

from sluice._native import (
    BucketSettings,
    ClosedError,
    ConfigError,
    CorruptionError,
    DurabilityImpossibleError,
    EmbeddedEngine,
    EngineSettings,
    ExistsError,
    InvalidKeyError,
    ItemView,
    Mutation,
    NoSuchBucketError,
    NotFoundError,
    NotMyVbucketError,
    NotNumericError,
    NotStoredError,
    SluiceError,
    SyncWriteAmbiguousError,
    TempFailError,
    TooBigError,
    WalFailedError,
    __version__,
    vbucket_of,
)
from sluice.client import Change, Client, RollbackError, Stream
from sluice.config import Config, load_config

if TYPE_CHECKING:  # what type checkers see of the names `__getattr__` imports when asked
    from sluice.greenstack import AsyncClient, GreenstackClient, GreenstackError

# Greenstack's clients come with asyncio, a third of this package's import time: imported when
# first asked for, so that `sluice serve` (and a replica's start) does not pay for them.
_GREENSTACK = ("AsyncClient", "GreenstackClient", "GreenstackError")


def __getattr__(name: str) -> object:
    if name in _GREENSTACK:
        from sluice import greenstack

        return getattr(greenstack, name)
    raise AttributeError(f"module 'sluice' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "BucketSettings",
    "Change",
    "Client",
    "ClosedError",
    "Config",
    "ConfigError",
    "CorruptionError",
    "DurabilityImpossibleError",
    "SyncWriteAmbiguousError",
    "EmbeddedEngine",
    "EngineSettings",
    "ExistsError",
    "GreenstackClient",
    "GreenstackError",
    "RollbackError",
    "Stream",
    "InvalidKeyError",
    "ItemView",
    "Mutation",
    "NoSuchBucketError",
    "NotFoundError",
    "NotMyVbucketError",
    "NotNumericError",
    "NotStoredError",
    "SluiceError",
    "TempFailError",
    "TooBigError",
    "WalFailedError",
    "__version__",
    "load_config",
    "open_engine",
    "vbucket_of",
]


def open_engine(config: "Config | None" = None, **overrides: object) -> EmbeddedEngine:
    """Opens the engine embedded in this process from a validated Config (defaults if None)."""
    cfg = config if config is not None else Config.from_dict({})
    if overrides:
        cfg = cfg.with_overrides(**overrides)
    return EmbeddedEngine(cfg.to_native())

//! The exception hierarchy of `sluice._native` (every one a `SluiceError`) and the mapping of
//! `sluice_core::Error` onto it.

use pyo3::exceptions::PyException;
use pyo3::prelude::*;

use sluice_core::Error;

pyo3::create_exception!(
    _native,
    SluiceError,
    PyException,
    "Base class of every sluice error."
);
pyo3::create_exception!(
    _native,
    InvalidKeyError,
    SluiceError,
    "Key empty or longer than 250 bytes."
);
pyo3::create_exception!(
    _native,
    TooBigError,
    SluiceError,
    "Value larger than the bucket's max_item_size."
);
pyo3::create_exception!(
    _native,
    NotFoundError,
    SluiceError,
    "The key does not exist (REPLACE, DELETE, CAS)."
);
pyo3::create_exception!(
    _native,
    ExistsError,
    SluiceError,
    "The key exists (ADD) or its CAS does not match."
);
pyo3::create_exception!(
    _native,
    NotStoredError,
    SluiceError,
    "APPEND/PREPEND of a missing key."
);
pyo3::create_exception!(
    _native,
    NotNumericError,
    SluiceError,
    "INCR/DECR of a value that is not a decimal number."
);
pyo3::create_exception!(
    _native,
    NotMyVbucketError,
    SluiceError,
    "The key's vbucket is not active here."
);
pyo3::create_exception!(
    _native,
    TempFailError,
    SluiceError,
    "Temporary failure (memory, WAL); retry later."
);
pyo3::create_exception!(
    _native,
    WalFailedError,
    SluiceError,
    "The WAL could not write this change; it is retried, durability unknown."
);
pyo3::create_exception!(
    _native,
    DurabilityImpossibleError,
    SluiceError,
    "The durability level cannot be met here."
);
pyo3::create_exception!(
    _native,
    SyncWriteAmbiguousError,
    SluiceError,
    "The write is applied but its durability level was not met in time."
);
pyo3::create_exception!(
    _native,
    NoSuchBucketError,
    SluiceError,
    "No bucket by that name."
);
pyo3::create_exception!(
    _native,
    ConfigError,
    SluiceError,
    "Invalid configuration: names the key and the reason."
);
pyo3::create_exception!(
    _native,
    CorruptionError,
    SluiceError,
    "Damaged data files: names the file and byte offset."
);
pyo3::create_exception!(_native, ClosedError, SluiceError, "The engine is closed.");

pub(crate) fn to_py(e: Error) -> PyErr {
    let msg = e.to_string();
    match e {
        Error::InvalidKey(_) => InvalidKeyError::new_err(msg),
        Error::TooBig { .. } => TooBigError::new_err(msg),
        Error::NotFound => NotFoundError::new_err(msg),
        Error::Exists | Error::Locked => ExistsError::new_err(msg),
        Error::LockedTmpFail | Error::NotLocked => TempFailError::new_err(msg),
        Error::NotStored => NotStoredError::new_err(msg),
        Error::NotNumeric => NotNumericError::new_err(msg),
        Error::NotMyVbucket(_) => NotMyVbucketError::new_err(msg),
        Error::TempFail(_) => TempFailError::new_err(msg),
        Error::WalFailed(_) => WalFailedError::new_err(msg),
        Error::DurabilityImpossible(_) => DurabilityImpossibleError::new_err(msg),
        Error::SyncWriteAmbiguous(_) => SyncWriteAmbiguousError::new_err(msg),
        Error::NoSuchBucket(_) => NoSuchBucketError::new_err(msg),
        Error::InvalidConfig { .. } | Error::InvalidArgument(_) => ConfigError::new_err(msg),
        Error::Corrupt { .. } => CorruptionError::new_err(msg),
        Error::Closed => ClosedError::new_err(msg),
        Error::Io(_) => SluiceError::new_err(msg),
    }
}

pub(crate) fn config_err(key: &str, reason: impl std::fmt::Display) -> PyErr {
    ConfigError::new_err(format!("invalid config: {key}: {reason}"))
}

/// Adds every exception class to the module under its Python name.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    for (name, ty) in [
        ("SluiceError", py.get_type::<SluiceError>()),
        ("InvalidKeyError", py.get_type::<InvalidKeyError>()),
        ("TooBigError", py.get_type::<TooBigError>()),
        ("NotFoundError", py.get_type::<NotFoundError>()),
        ("ExistsError", py.get_type::<ExistsError>()),
        ("NotStoredError", py.get_type::<NotStoredError>()),
        ("NotNumericError", py.get_type::<NotNumericError>()),
        ("NotMyVbucketError", py.get_type::<NotMyVbucketError>()),
        ("TempFailError", py.get_type::<TempFailError>()),
        ("WalFailedError", py.get_type::<WalFailedError>()),
        (
            "DurabilityImpossibleError",
            py.get_type::<DurabilityImpossibleError>(),
        ),
        (
            "SyncWriteAmbiguousError",
            py.get_type::<SyncWriteAmbiguousError>(),
        ),
        ("NoSuchBucketError", py.get_type::<NoSuchBucketError>()),
        ("ConfigError", py.get_type::<ConfigError>()),
        ("CorruptionError", py.get_type::<CorruptionError>()),
        ("ClosedError", py.get_type::<ClosedError>()),
    ] {
        m.add(name, ty)?;
    }
    Ok(())
}

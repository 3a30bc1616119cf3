//! What an iproto request that fails is answered with: Tarantool's error code and message, or
//! ER_ACCESS_DENIED with its fields; and the engine's errors and a missing index in those terms.

use sluice_core::Error;
use sluice_proto::iproto::codes;

use super::more_codes;

/// An error reply: Tarantool's code and message, or ER_ACCESS_DENIED with the FIELDS
/// (access type, object type, object name) connectors show and the user denied.
#[derive(Debug)]
pub struct Failure {
    pub code: u32,
    pub message: String,
    /// Boxed: every handler returns a `Result<_, Failure>`, and the common error is small.
    pub access: Option<Box<[String; 4]>>,
}

impl Failure {
    pub fn new(code: u32, message: impl Into<String>) -> Failure {
        Failure {
            code,
            message: message.into(),
            access: None,
        }
    }

    /// `Read access to space 'users' is denied for user 'guest'`, as Tarantool words it.
    pub fn access_denied(
        access: &str,
        object_type: &str,
        object_name: &str,
        user: &str,
    ) -> Failure {
        Failure {
            code: codes::ER_ACCESS_DENIED,
            message: String::new(),
            access: Some(Box::new([
                access.to_string(),
                object_type.to_string(),
                object_name.to_string(),
                user.to_string(),
            ])),
        }
    }
}

impl From<sluice_proto::iproto::tuple::TupleError> for Failure {
    fn from(e: sluice_proto::iproto::tuple::TupleError) -> Failure {
        Failure::new(e.code, e.message)
    }
}

pub type Outcome = Result<(), Failure>;

/// A read's engine error in Tarantool's terms. A vbucket not active here fails a node's part
/// of a read over the cluster whose asker's map says it is (a failover or a move this node has
/// not applied yet): the whole read fails, never leaving that vbucket's tuples out.
pub fn read_failure(e: Error, space: &str) -> Failure {
    match e {
        Error::NotMyVbucket(vb) => Failure::new(
            more_codes::ER_SYSTEM,
            format!(
                "space '{space}': vbucket {vb} is not active on the node the cluster map says \
                 (the map is changing); nothing is returned rather than a part of the answer"
            ),
        ),
        e => engine_failure(e, space),
    }
}

/// An engine error in Tarantool's terms.
pub fn engine_failure(e: Error, space: &str) -> Failure {
    match e {
        Error::Exists => Failure::new(
            codes::ER_TUPLE_FOUND,
            format!("Duplicate key exists in unique index 'primary' in space '{space}'"),
        ),
        Error::NotMyVbucket(_) => Failure::new(
            codes::ER_READONLY,
            "Can't modify data because this instance is in read-only mode.",
        ),
        Error::TooBig { size, max } => Failure::new(
            more_codes::ER_MEMTX_MAX_TUPLE_SIZE,
            format!(
                "Failed to allocate {size} bytes for tuple: tuple is too large (the bucket's \
                 max_item_size is {max})"
            ),
        ),
        Error::TempFail(why) => Failure::new(more_codes::ER_MEMORY_ISSUE, why),
        Error::WalFailed(why) => Failure::new(
            more_codes::ER_WAL_IO,
            format!("Failed to write to disk: {why}"),
        ),
        Error::SyncWriteAmbiguous(why) | Error::DurabilityImpossible(why) => {
            Failure::new(more_codes::ER_SYNC_QUORUM_TIMEOUT, why)
        }
        other => Failure::new(more_codes::ER_SYSTEM, other.to_string()),
    }
}

pub fn no_such_index(index_id: u32, space: &str) -> Failure {
    Failure::new(
        codes::ER_NO_SUCH_INDEX_ID,
        format!("No index #{index_id} is defined in space '{space}'"),
    )
}

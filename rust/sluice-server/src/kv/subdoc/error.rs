//! What a sub-document path or value fails with, as the SUBDOC statuses answer it.

use sluice_proto::mcbp::status;

/// A path-level failure, answered as the matching SUBDOC status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubdocError {
    PathEnoent,
    PathMismatch,
    PathEinval,
    PathE2big,
    DocE2deep,
    ValueCantinsert,
    DocNotJson,
    NumErange,
    DeltaEinval,
    PathEexists,
    ValueEtoodeep,
    UnknownVattr,
    CantModifyVattr,
    /// The document is over MAX_DOC_BYTES.
    DocTooBig,
    /// An EXPAND_MACROS value that is not one of the macros.
    UnknownMacro,
    /// An extended attribute's key is empty, too long, or its value does not read.
    XattrEinval,
    /// ReviveDocument on a document that is not deleted.
    CanOnlyReviveDeleted,
    /// A document that stays deleted was given a body.
    DeletedCantHaveValue,
}

impl SubdocError {
    pub fn status(self) -> u16 {
        match self {
            SubdocError::PathEnoent => status::SUBDOC_PATH_ENOENT,
            SubdocError::PathMismatch => status::SUBDOC_PATH_MISMATCH,
            SubdocError::PathEinval => status::SUBDOC_PATH_EINVAL,
            SubdocError::PathE2big => status::SUBDOC_PATH_E2BIG,
            SubdocError::DocE2deep => status::SUBDOC_DOC_E2DEEP,
            SubdocError::ValueCantinsert => status::SUBDOC_VALUE_CANTINSERT,
            SubdocError::DocNotJson => status::SUBDOC_DOC_NOTJSON,
            SubdocError::NumErange => status::SUBDOC_NUM_ERANGE,
            SubdocError::DeltaEinval => status::SUBDOC_DELTA_EINVAL,
            SubdocError::PathEexists => status::SUBDOC_PATH_EEXISTS,
            SubdocError::ValueEtoodeep => status::SUBDOC_VALUE_ETOODEEP,
            SubdocError::UnknownVattr => status::SUBDOC_XATTR_UNKNOWN_VATTR,
            SubdocError::CantModifyVattr => status::SUBDOC_XATTR_CANT_MODIFY_VATTR,
            SubdocError::DocTooBig => status::E2BIG,
            SubdocError::UnknownMacro => status::SUBDOC_XATTR_UNKNOWN_MACRO,
            SubdocError::XattrEinval => status::XATTR_EINVAL,
            SubdocError::CanOnlyReviveDeleted => status::SUBDOC_CAN_ONLY_REVIVE_DELETED_DOCUMENTS,
            SubdocError::DeletedCantHaveValue => status::SUBDOC_DELETED_DOCUMENT_CANT_HAVE_VALUE,
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            SubdocError::PathEnoent => "the path does not exist in the document",
            SubdocError::PathMismatch => "the path does not match the document's structure",
            SubdocError::PathEinval => "the path does not parse, or does not suit the command",
            SubdocError::PathE2big => "the path is over 1024 bytes or 32 components",
            SubdocError::DocE2deep => "the document is nested too deeply",
            SubdocError::ValueCantinsert => "the value cannot be inserted there",
            SubdocError::DocNotJson => "the document is not JSON",
            SubdocError::NumErange => "the number does not fit a signed 64-bit integer",
            SubdocError::DeltaEinval => "the delta is not a non-zero signed 64-bit integer",
            SubdocError::PathEexists => "the path exists already",
            SubdocError::ValueEtoodeep => "the value would nest the document too deeply",
            SubdocError::UnknownVattr => "no such virtual extended attribute",
            SubdocError::CantModifyVattr => "virtual extended attributes cannot be changed",
            SubdocError::DocTooBig => {
                "sub-document commands work on documents up to 2 MiB; read or write it whole"
            }
            SubdocError::UnknownMacro => "no such macro",
            SubdocError::XattrEinval => {
                "an extended attribute's key must be 1 to 15 bytes and its value JSON"
            }
            SubdocError::CanOnlyReviveDeleted => "only a deleted document can be revived",
            SubdocError::DeletedCantHaveValue => "a deleted document cannot have a body",
        }
    }
}

//! DCP over mcbp: the producer side of a connection (`producer`) and its per-vbucket streams
//! (`stream`).

pub mod producer;
pub mod stream;

//! DCP over mcbp: the producer side of a connection (`producer`) and its per-vbucket streams
//! (`stream`), and a native consumer (`consumer`).

pub mod consumer;
pub mod producer;
pub mod stream;

//! DCP over mcbp: the producer side of a connection (`producer`) and its per-vbucket streams
//! (`stream`), a StreamFilter plugin's judgement of a producer's rounds (`filter`), and a
//! native consumer (`consumer`).

pub mod consumer;
pub mod filter;
pub mod producer;
pub mod stream;

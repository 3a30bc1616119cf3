//! DCP over mcbp: the producer side of a connection (`producer`), the encoding of its streams'
//! messages (`sink`; the streams themselves are protocol-neutral, in `crate::stream`), a
//! StreamFilter plugin's judgement of a producer's rounds (`filter`), a topic's partitions as
//! streams (`topic_stream`), and a native consumer (`consumer`).

pub mod consumer;
pub mod filter;
pub mod producer;
pub mod sink;
pub mod topic_stream;

#[cfg(test)]
mod tests;

//! DCP over mcbp: the producer side of a connection (`producer`), the encoding of its streams'
//! messages (`sink`; the streams themselves are protocol-neutral, in `crate::stream`), a
//! StreamFilter plugin's judgement of a producer's rounds (`filter`), and a native consumer
//! (`consumer`).

pub mod consumer;
pub mod filter;
pub mod producer;
pub mod sink;

#[cfg(test)]
mod tests;

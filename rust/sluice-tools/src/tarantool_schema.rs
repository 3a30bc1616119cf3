//! What a Tarantool's `_vspace` and `_vindex` hold, each tuple as JSON: what
//! `sluice serve --follow-tarantool` declares the followed spaces from when the configuration
//! names none.

use sluice_proto::iproto::json::write_json;
use sluice_proto::iproto::MAX_DEPTH;
use sluice_proto::msgpack::Reader;
use sluice_server::iproto::schema::{VINDEX, VSPACE};
use sluice_server::upstream::{Upstream, UpstreamConfig, UpstreamError};

/// The tuples of `_vspace` and `_vindex` the user may see, as JSON arrays.
pub struct Schema {
    pub spaces: Vec<String>,
    pub indexes: Vec<String>,
}

/// Logs in to the Tarantool and reads its schema views.
pub fn read(config: &UpstreamConfig) -> Result<Schema, UpstreamError> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
        let mut up = Upstream::connect(config).await?;
        let spaces = up.select_all(VSPACE).await?;
        let indexes = up.select_all(VINDEX).await?;
        Ok(Schema {
            spaces: spaces.iter().map(|t| json(t)).collect::<Result<_, _>>()?,
            indexes: indexes.iter().map(|t| json(t)).collect::<Result<_, _>>()?,
        })
    })
}

fn json(tuple: &[u8]) -> Result<String, UpstreamError> {
    let mut out = String::new();
    write_json(&mut Reader::new(tuple), &mut out, MAX_DEPTH)
        .map_err(|e| UpstreamError::Protocol(format!("a schema tuple: {e}")))?;
    Ok(out)
}

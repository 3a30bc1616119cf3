//! What a configured space is (`[spaces.NAME]`): its id, its bucket, its field format and
//! primary key. The iproto front serves it; the KV front describes it to readers of the
//! bucket's changes (`STAT spaces`, which the Spark source reads to type its columns).

/// One `[spaces.NAME]` as the configuration check passed it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SpaceConfig {
    pub name: String,
    /// 512 or more, unique.
    pub id: u32,
    /// The bucket holding its tuples (one space per bucket).
    pub bucket: String,
    pub format: Vec<FieldConfig>,
    /// The primary key's fields, 0-based.
    pub primary_key: Vec<u32>,
}

/// One field of a space's format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldConfig {
    pub name: String,
    /// Tarantool's type name (`unsigned`, `string`, ...).
    pub field_type: String,
    pub is_nullable: bool,
}

impl SpaceConfig {
    /// The space as one JSON object: `{"id", "bucket", "format": [{"name", "type",
    /// "is_nullable"}], "primary_key": [field numbers, 0-based]}`.
    pub fn describe(&self) -> serde_json::Value {
        let format: Vec<serde_json::Value> = self
            .format
            .iter()
            .map(|f| {
                serde_json::json!({
                    "name": f.name,
                    "type": f.field_type,
                    "is_nullable": f.is_nullable,
                })
            })
            .collect();
        serde_json::json!({
            "id": self.id,
            "bucket": self.bucket,
            "format": format,
            "primary_key": self.primary_key,
        })
    }
}

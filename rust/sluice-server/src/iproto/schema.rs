//! The space catalog from `[spaces.NAME]`, its schema version, and the system views that
//! connectors read on connect to resolve names: `_vspace` (281), `_vindex` (289) and
//! `_vcollation` (277), in Tarantool's tuple layout, with rows for themselves (connectors
//! look system spaces up by name too). Each declared space has one index, `primary` (TREE).

use std::cmp::Ordering;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use sluice_core::bucket::Bucket;
use sluice_core::Engine;
use sluice_proto::iproto::tuple::{FieldDef, FieldType, KeyPart};
use sluice_proto::keyorder::compare_keys;
use sluice_proto::msgpack::{write_array_len, write_bool, write_map_len, write_str, write_uint};

use super::SpaceConfig;

pub const VCOLLATION: u32 = 277;
pub const VSPACE: u32 = 281;
pub const VINDEX: u32 = 289;

/// The owner of every space: Tarantool's admin (id 1).
const OWNER: u64 = 1;

/// A declared space.
pub struct Space {
    pub id: u32,
    pub name: String,
    pub bucket: Arc<Bucket>,
    pub format: Vec<FieldDef>,
    /// The primary key's parts (0-based field numbers and types).
    pub parts: Vec<KeyPart>,
}

impl Space {
    /// A field's 0-based number by name (update operations may name fields).
    pub fn field_no(&self, name: &[u8]) -> Option<u32> {
        self.format
            .iter()
            .position(|f| f.name.as_bytes() == name)
            .map(|i| i as u32)
    }
}

/// One row of a system view: the tuple's bytes, each field's bytes (for index keys), and the
/// bucket whose space it describes (None: a system row everyone sees).
pub struct ViewRow {
    pub tuple: Vec<u8>,
    fields: Vec<Vec<u8>>,
    pub bucket: Option<String>,
}

impl ViewRow {
    fn new(fields: Vec<Vec<u8>>, bucket: Option<String>) -> ViewRow {
        let mut tuple = Vec::new();
        write_array_len(&mut tuple, fields.len() as u32);
        for f in &fields {
            tuple.extend_from_slice(f);
        }
        ViewRow {
            tuple,
            fields,
            bucket,
        }
    }

    /// The MessagePack array of the fields `parts`, the first `n` of them at most.
    fn key(&self, parts: &[u32], n: usize) -> Vec<u8> {
        let mut k = Vec::new();
        let n = n.min(parts.len());
        write_array_len(&mut k, n as u32);
        for p in &parts[..n] {
            k.extend_from_slice(&self.fields[*p as usize]);
        }
        k
    }
}

/// A format as (field name, type) pairs.
type Format = &'static [(&'static str, &'static str)];

/// A system view: its name, format, indexes (name, unique, parts as (field, type)) and rows.
pub struct View {
    pub id: u32,
    pub name: &'static str,
    pub format: &'static [(&'static str, &'static str)],
    pub indexes: &'static [IndexDef],
    pub rows: Vec<ViewRow>,
}

const VSPACE_FORMAT: &[(&str, &str)] = &[
    ("id", "unsigned"),
    ("owner", "unsigned"),
    ("name", "string"),
    ("engine", "string"),
    ("field_count", "unsigned"),
    ("flags", "map"),
    ("format", "array"),
];
const VINDEX_FORMAT: &[(&str, &str)] = &[
    ("id", "unsigned"),
    ("iid", "unsigned"),
    ("name", "string"),
    ("type", "string"),
    ("opts", "map"),
    ("parts", "array"),
];
const VCOLLATION_FORMAT: &[(&str, &str)] = &[
    ("id", "unsigned"),
    ("name", "string"),
    ("owner", "unsigned"),
    ("type", "string"),
    ("locale", "string"),
    ("opts", "map"),
];
type IndexDef = (&'static str, bool, &'static [(u32, &'static str)]);
const VSPACE_INDEXES: &[IndexDef] = &[
    ("primary", true, &[(0, "unsigned")]),
    ("owner", false, &[(1, "unsigned")]),
    ("name", true, &[(2, "string")]),
];
const VINDEX_INDEXES: &[IndexDef] = &[
    ("primary", true, &[(0, "unsigned"), (1, "unsigned")]),
    ("name", true, &[(0, "unsigned"), (2, "string")]),
];
const VCOLLATION_INDEXES: &[IndexDef] = &[
    ("primary", true, &[(0, "unsigned")]),
    ("name", true, &[(1, "string")]),
];

fn uint(v: u64) -> Vec<u8> {
    let mut o = Vec::new();
    write_uint(&mut o, v);
    o
}

fn string(s: &str) -> Vec<u8> {
    let mut o = Vec::new();
    write_str(&mut o, s);
    o
}

/// A format: `[{name, type[, is_nullable]}]`.
fn format_field<'a>(fields: impl ExactSizeIterator<Item = (&'a str, &'a str, bool)>) -> Vec<u8> {
    let mut o = Vec::new();
    write_array_len(&mut o, fields.len() as u32);
    for (name, ty, nullable) in fields {
        write_map_len(&mut o, if nullable { 3 } else { 2 });
        write_str(&mut o, "name");
        write_str(&mut o, name);
        write_str(&mut o, "type");
        write_str(&mut o, ty);
        if nullable {
            write_str(&mut o, "is_nullable");
            write_bool(&mut o, true);
        }
    }
    o
}

fn vspace_row(
    id: u32,
    name: &str,
    engine: &str,
    format: Vec<u8>,
    bucket: Option<String>,
) -> ViewRow {
    let mut flags = Vec::new();
    write_map_len(&mut flags, 0);
    ViewRow::new(
        vec![
            uint(u64::from(id)),
            uint(OWNER),
            string(name),
            string(engine),
            uint(0),
            flags,
            format,
        ],
        bucket,
    )
}

/// A `_vindex` row: `[space, iid, name, type, {unique}, [[field, type], ...]]`.
fn vindex_row(
    space: u32,
    iid: u32,
    name: &str,
    unique: bool,
    parts: &[(u32, &str)],
    bucket: Option<String>,
) -> ViewRow {
    let mut opts = Vec::new();
    write_map_len(&mut opts, 1);
    write_str(&mut opts, "unique");
    write_bool(&mut opts, unique);
    let mut p = Vec::new();
    write_array_len(&mut p, parts.len() as u32);
    for (field, ty) in parts {
        write_array_len(&mut p, 2);
        write_uint(&mut p, u64::from(*field));
        write_str(&mut p, ty);
    }
    ViewRow::new(
        vec![
            uint(u64::from(space)),
            uint(u64::from(iid)),
            string(name),
            string("tree"),
            opts,
            p,
        ],
        bucket,
    )
}

/// The spaces, by id and name, the system views and the schema version.
pub struct Catalog {
    spaces: BTreeMap<u32, Arc<Space>>,
    by_name: HashMap<String, u32>,
    views: Vec<View>,
    /// In every reply's header; derived from the declared spaces, so that a configuration that
    /// changes them gives connectors a new one to reload their schema by.
    pub schema_version: u32,
}

impl Catalog {
    /// The catalog of the configured spaces; an error names the key at fault.
    pub fn build(engine: &Engine, configs: &[SpaceConfig]) -> Result<Catalog, String> {
        let mut spaces = BTreeMap::new();
        let mut by_name = HashMap::new();
        let mut digest = Vec::new();
        for c in configs {
            let key = format!("spaces.{}", c.name);
            let bucket = engine
                .bucket(&c.bucket)
                .map_err(|_| format!("{key}.bucket: no bucket {:?}", c.bucket))?;
            if !bucket.config.ordered_keys {
                return Err(format!(
                    "{key}.bucket: bucket {:?} does not keep its keys in order",
                    c.bucket
                ));
            }
            let mut format = Vec::with_capacity(c.format.len());
            for (i, f) in c.format.iter().enumerate() {
                let field_type = FieldType::parse(&f.field_type).ok_or_else(|| {
                    format!(
                        "{key}.format[{}].type: unknown type {:?}",
                        i + 1,
                        f.field_type
                    )
                })?;
                format.push(FieldDef {
                    name: f.name.clone(),
                    field_type,
                    is_nullable: f.is_nullable,
                });
            }
            let mut parts = Vec::with_capacity(c.primary_key.len());
            for &no in &c.primary_key {
                let f = format
                    .get(no as usize)
                    .ok_or_else(|| format!("{key}.primary_key: no field {}", no + 1))?;
                parts.push(KeyPart {
                    field_no: no,
                    field_type: f.field_type,
                });
            }
            digest.extend_from_slice(format!("{c:?}\n").as_bytes());
            if spaces.contains_key(&c.id) || by_name.contains_key(&c.name) {
                return Err(format!("{key}.id: {} is not unique", c.id));
            }
            by_name.insert(c.name.clone(), c.id);
            spaces.insert(
                c.id,
                Arc::new(Space {
                    id: c.id,
                    name: c.name.clone(),
                    bucket,
                    format,
                    parts,
                }),
            );
        }
        // Non-zero: 0 in a request means "don't check".
        let schema_version = crc32c::crc32c(&digest).max(1);
        let views = system_views(&spaces);
        Ok(Catalog {
            spaces,
            by_name,
            views,
            schema_version,
        })
    }

    pub fn space(&self, id: u32) -> Option<&Arc<Space>> {
        self.spaces.get(&id)
    }

    /// Every declared space by id.
    pub fn spaces(&self) -> impl Iterator<Item = (u32, &Arc<Space>)> {
        self.spaces.iter().map(|(id, s)| (*id, s))
    }

    pub fn space_by_name(&self, name: &str) -> Option<&Arc<Space>> {
        self.by_name.get(name).and_then(|id| self.spaces.get(id))
    }

    pub fn view(&self, id: u32) -> Option<&View> {
        self.views.iter().find(|v| v.id == id)
    }
}

fn system_views(spaces: &BTreeMap<u32, Arc<Space>>) -> Vec<View> {
    type ViewDef = (u32, &'static str, Format, &'static [IndexDef]);
    let views: [ViewDef; 3] = [
        (
            VCOLLATION,
            "_vcollation",
            VCOLLATION_FORMAT,
            VCOLLATION_INDEXES,
        ),
        (VSPACE, "_vspace", VSPACE_FORMAT, VSPACE_INDEXES),
        (VINDEX, "_vindex", VINDEX_FORMAT, VINDEX_INDEXES),
    ];
    let mut vspace = Vec::new();
    let mut vindex = Vec::new();
    for (id, name, format, indexes) in views {
        let fmt = format_field(format.iter().map(|(n, t)| (*n, *t, false)));
        vspace.push(vspace_row(id, name, "sysview", fmt, None));
        for (iid, (iname, unique, parts)) in indexes.iter().enumerate() {
            // _vindex has no index 1 in Tarantool: its second is `name`, iid 2.
            let iid = if id == VINDEX && iid == 1 {
                2
            } else {
                iid as u32
            };
            vindex.push(vindex_row(id, iid, iname, *unique, parts, None));
        }
    }
    for s in spaces.values() {
        let fmt = format_field(
            s.format
                .iter()
                .map(|f| (f.name.as_str(), f.field_type.as_str(), f.is_nullable)),
        );
        let bucket = Some(s.bucket.name().to_string());
        vspace.push(vspace_row(s.id, &s.name, "memtx", fmt, bucket.clone()));
        let parts: Vec<(u32, &str)> = s
            .parts
            .iter()
            .map(|p| (p.field_no, p.field_type.as_str()))
            .collect();
        vindex.push(vindex_row(s.id, 0, "primary", true, &parts, bucket));
    }
    // Collations are not applied by sluice; `none` (binary order, id 0) is the one in use.
    let mut none_opts = Vec::new();
    write_map_len(&mut none_opts, 0);
    let vcollation = vec![ViewRow::new(
        vec![
            uint(0),
            string("none"),
            uint(OWNER),
            string("BINARY"),
            string(""),
            none_opts,
        ],
        None,
    )];
    vec![
        View {
            id: VCOLLATION,
            name: "_vcollation",
            format: VCOLLATION_FORMAT,
            indexes: VCOLLATION_INDEXES,
            rows: vcollation,
        },
        View {
            id: VSPACE,
            name: "_vspace",
            format: VSPACE_FORMAT,
            indexes: VSPACE_INDEXES,
            rows: vspace,
        },
        View {
            id: VINDEX,
            name: "_vindex",
            format: VINDEX_FORMAT,
            indexes: VINDEX_INDEXES,
            rows: vindex,
        },
    ]
}

impl View {
    /// The index with id `iid`, as `_vindex` numbers them.
    pub fn index(&self, iid: u32) -> Option<&IndexDef> {
        let pos = if self.id == VINDEX && iid == 2 {
            1
        } else if self.id == VINDEX && iid == 1 {
            return None;
        } else {
            iid as usize
        };
        self.indexes.get(pos)
    }

    /// Tarantool's iterator semantics over the rows `visible` lets through, by the index's
    /// parts: `key` has `n` parts (up to the index's), compared with each row's first `n`.
    pub fn select<'a>(
        &'a self,
        parts: &[(u32, &str)],
        iterator: sluice_core::SelectIterator,
        key: &[u8],
        key_parts: usize,
        visible: impl Fn(&ViewRow) -> bool,
    ) -> Vec<&'a ViewRow> {
        use sluice_core::SelectIterator as It;
        let fields: Vec<u32> = parts.iter().map(|(f, _)| *f).collect();
        let mut rows: Vec<(Vec<u8>, &ViewRow)> = self
            .rows
            .iter()
            .filter(|r| visible(r))
            .map(|r| (r.key(&fields, fields.len()), r))
            .collect();
        rows.sort_by(|a, b| compare_keys(&a.0, &b.0));
        let descending = matches!(iterator, It::Req | It::Le | It::Lt);
        if descending {
            rows.reverse();
        }
        rows.into_iter()
            .filter(|(_, r)| {
                if key_parts == 0 {
                    return true;
                }
                let c = compare_keys(&r.key(&fields, key_parts), key);
                match iterator {
                    It::Eq | It::Req => c == Ordering::Equal,
                    It::All => true,
                    It::Ge => c != Ordering::Less,
                    It::Gt => c == Ordering::Greater,
                    It::Le => c != Ordering::Greater,
                    It::Lt => c == Ordering::Less,
                }
            })
            .map(|(_, r)| r)
            .collect()
    }
}

//! Tuples against a space's format, as Tarantool 2.6 checks them (src/box/tuple_format.c,
//! field_def.c, key_def.h): field types by MessagePack class, nullable fields, missing required
//! fields, and the parts of a primary key.

use std::fmt;

use super::codes;
use super::{mp_type, MpType, EXT_DECIMAL, EXT_UUID, MAX_DEPTH};
use crate::msgpack::{write_array_len, Reader, Value};

/// A refusal in Tarantool's words.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TupleError {
    pub code: u32,
    pub message: String,
}

impl TupleError {
    pub(crate) fn new(code: u32, message: impl Into<String>) -> Self {
        TupleError {
            code,
            message: message.into(),
        }
    }

    fn not_array() -> Self {
        TupleError::new(codes::ER_TUPLE_NOT_ARRAY, "Tuple/Key must be MsgPack array")
    }
}

impl fmt::Display for TupleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.message, self.code)
    }
}

impl std::error::Error for TupleError {}

/// The field types of a space format (`box.schema.space.create{format = ...}`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum FieldType {
    Any,
    Unsigned,
    String,
    Number,
    Double,
    Integer,
    Boolean,
    Varbinary,
    Scalar,
    Decimal,
    Uuid,
    Array,
    Map,
}

impl FieldType {
    const ALL: [FieldType; 13] = [
        FieldType::Any,
        FieldType::Unsigned,
        FieldType::String,
        FieldType::Number,
        FieldType::Double,
        FieldType::Integer,
        FieldType::Boolean,
        FieldType::Varbinary,
        FieldType::Scalar,
        FieldType::Decimal,
        FieldType::Uuid,
        FieldType::Array,
        FieldType::Map,
    ];

    /// The type named as in a format; Tarantool's aliases (`num`, `str`, `int`, `bool`,
    /// `uint`) included, as 2.6 still accepts them.
    pub fn parse(name: &str) -> Option<FieldType> {
        let name = name.to_ascii_lowercase();
        let alias = match name.as_str() {
            "num" | "uint" => "unsigned",
            "str" => "string",
            "int" => "integer",
            "bool" => "boolean",
            "*" => "any",
            other => other,
        };
        FieldType::ALL.into_iter().find(|t| t.as_str() == alias)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            FieldType::Any => "any",
            FieldType::Unsigned => "unsigned",
            FieldType::String => "string",
            FieldType::Number => "number",
            FieldType::Double => "double",
            FieldType::Integer => "integer",
            FieldType::Boolean => "boolean",
            FieldType::Varbinary => "varbinary",
            FieldType::Scalar => "scalar",
            FieldType::Decimal => "decimal",
            FieldType::Uuid => "uuid",
            FieldType::Array => "array",
            FieldType::Map => "map",
        }
    }

    /// Whether a value (whole, starting with its marker) may be stored in a field of this type
    /// (field_mp_type_is_compatible: by MessagePack class, so `d0 05` is no `unsigned`).
    pub fn accepts(self, value: &[u8], is_nullable: bool) -> bool {
        let Some(&marker) = value.first() else {
            return false;
        };
        let class = mp_type(marker);
        if class == MpType::Nil && is_nullable {
            return true;
        }
        let ext = || match Reader::new(value).read_value() {
            Ok(Value::Ext(t, _)) => Some(t),
            _ => None,
        };
        use MpType::*;
        match self {
            FieldType::Any => class != Ext || matches!(ext(), Some(EXT_DECIMAL | EXT_UUID)),
            FieldType::Unsigned => class == UInt,
            FieldType::String => class == Str,
            FieldType::Number => {
                matches!(class, UInt | Int | Float | Double) || ext() == Some(EXT_DECIMAL)
            }
            FieldType::Double => class == Double,
            FieldType::Integer => matches!(class, UInt | Int),
            FieldType::Boolean => class == Bool,
            FieldType::Varbinary => class == Bin,
            FieldType::Scalar => {
                matches!(class, UInt | Int | Float | Double | Str | Bin | Bool)
                    || matches!(ext(), Some(EXT_DECIMAL | EXT_UUID))
            }
            FieldType::Decimal => ext() == Some(EXT_DECIMAL),
            FieldType::Uuid => ext() == Some(EXT_UUID),
            FieldType::Array => class == Array,
            FieldType::Map => class == Map,
        }
    }
}

impl fmt::Display for FieldType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One field of a space format.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FieldDef {
    pub name: String,
    pub field_type: FieldType,
    pub is_nullable: bool,
}

/// One part of an index: a 0-based field number and the type the index compares it as.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyPart {
    pub field_no: u32,
    pub field_type: FieldType,
}

/// The top-level fields of a tuple, each as its whole MessagePack bytes. Refuses what is not
/// one array whose elements nest at most [`MAX_DEPTH`] deep.
pub fn fields(tuple: &[u8]) -> Result<Vec<&[u8]>, TupleError> {
    let mut fields = Fields::new(tuple)?;
    // Each field takes at least a byte: no larger reservation than the input.
    let mut out = Vec::with_capacity(fields.len().min(tuple.len()));
    for field in &mut fields {
        out.push(field?);
    }
    fields.finish()?;
    Ok(out)
}

/// The fields of a tuple one at a time, as [`fields`] returns them, without collecting them:
/// the checks of every write walk a tuple this way. `finish` refuses bytes after the array.
pub struct Fields<'a> {
    r: Reader<'a>,
    count: usize,
    left: usize,
}

impl<'a> Fields<'a> {
    pub fn new(tuple: &'a [u8]) -> Result<Fields<'a>, TupleError> {
        let mut r = Reader::new(tuple);
        if tuple.first().map(|&m| mp_type(m)) != Some(MpType::Array) {
            return Err(TupleError::not_array());
        }
        let count = r.read_array_len().map_err(|_| invalid_tuple())? as usize;
        Ok(Fields {
            r,
            count,
            left: count,
        })
    }

    /// How many fields the array says it has.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// Steps over the fields not read yet; an error if anything follows the array.
    pub fn finish(mut self) -> Result<(), TupleError> {
        for field in &mut self {
            field?;
        }
        if !self.r.is_empty() {
            return Err(invalid_tuple());
        }
        Ok(())
    }
}

impl<'a> Iterator for Fields<'a> {
    type Item = Result<&'a [u8], TupleError>;

    fn next(&mut self) -> Option<Self::Item> {
        if self.left == 0 {
            return None;
        }
        self.left -= 1;
        let field = self
            .r
            .read_raw_value(MAX_DEPTH - 1)
            .map_err(|_| invalid_tuple());
        if field.is_err() {
            self.left = 0;
        }
        Some(field)
    }
}

fn invalid_tuple() -> TupleError {
    TupleError::new(codes::ER_INVALID_MSGPACK, "Invalid MsgPack - tuple")
}

/// Checks a tuple against a space format: each present field's type (nil allowed where the
/// field is nullable), then the first required field the tuple is too short to hold. Fields
/// past the format are not checked.
pub fn check_format(tuple: &[u8], format: &[FieldDef]) -> Result<(), TupleError> {
    checked(tuple, format, None).map(drop)
}

fn field_type_error(field_no: u32, expected: FieldType) -> TupleError {
    TupleError::new(
        codes::ER_FIELD_TYPE,
        format!(
            "Tuple field {} type does not match one required by operation: expected {}",
            field_no + 1,
            expected
        ),
    )
}

/// The key of a tuple: the MessagePack array of its key parts, each checked against its part's
/// type (ER_FIELD_MISSING / ER_FIELD_TYPE, as the format check would report them).
pub fn extract_key(tuple: &[u8], parts: &[KeyPart]) -> Result<Vec<u8>, TupleError> {
    checked(tuple, &[], Some(parts)).map(Option::unwrap_or_default)
}

/// `check_format` and then `extract_key`, in one pass over the tuple (as a write needs both):
/// the format's errors come first, as when the two are called in turn.
pub fn check_format_and_extract_key(
    tuple: &[u8],
    format: &[FieldDef],
    parts: &[KeyPart],
) -> Result<Vec<u8>, TupleError> {
    checked(tuple, format, Some(parts)).map(Option::unwrap_or_default)
}

/// The one walk behind the three above: the fields checked against `format`, then, with
/// `parts`, the key built from the fields it names.
fn checked(
    tuple: &[u8],
    format: &[FieldDef],
    parts: Option<&[KeyPart]>,
) -> Result<Option<Vec<u8>>, TupleError> {
    // Only the fields up to the key's last are kept: on the stack for the usual short keys.
    let wanted = parts
        .unwrap_or_default()
        .iter()
        .map(|p| p.field_no as usize + 1)
        .max()
        .unwrap_or(0);
    let mut inline: [&[u8]; 8] = [&[]; 8];
    let mut spilled: Vec<&[u8]> = Vec::new();
    let mut iter = Fields::new(tuple)?;
    let count = iter.len();
    let available = count.min(wanted);
    for i in 0..count.min(wanted.max(format.len())) {
        let field = iter.next().expect("fewer than len read")?;
        if let Some(def) = format.get(i) {
            if !def.field_type.accepts(field, def.is_nullable) {
                return Err(field_type_error(i as u32, def.field_type));
            }
        }
        if i < available.min(inline.len()) {
            inline[i] = field;
        } else if i < available {
            spilled.push(field);
        }
    }
    iter.finish()?;
    if let Some(i) = (count..format.len()).find(|&i| !format[i].is_nullable) {
        return Err(TupleError::new(
            codes::ER_FIELD_MISSING,
            format!("Tuple field {} required by space format is missing", i + 1),
        ));
    }
    let Some(parts) = parts else {
        return Ok(None);
    };
    let field = |no: usize| -> Option<&[u8]> {
        if no >= available {
            None
        } else if no < inline.len() {
            Some(inline[no])
        } else {
            Some(spilled[no - inline.len()])
        }
    };
    let mut key = Vec::with_capacity(16);
    write_array_len(&mut key, parts.len() as u32);
    for part in parts {
        let Some(value) = field(part.field_no as usize) else {
            return Err(TupleError::new(
                codes::ER_FIELD_MISSING,
                format!(
                    "Tuple field {} required by space format is missing",
                    part.field_no + 1
                ),
            ));
        };
        if !part.field_type.accepts(value, false) {
            return Err(field_type_error(part.field_no, part.field_type));
        }
        key.extend_from_slice(value);
    }
    Ok(Some(key))
}

/// Checks a search key against an index's parts. `exact` (a point read, UPDATE, DELETE): the
/// key must name every part (ER_EXACT_MATCH); otherwise (SELECT) any prefix will do
/// (ER_KEY_PART_COUNT). Each given part must have its part's type (ER_KEY_PART_TYPE).
pub fn check_key(key: &[u8], parts: &[KeyPart], exact: bool) -> Result<(), TupleError> {
    let mut given = Fields::new(key)?;
    let (n, expected) = (given.len(), parts.len());
    if exact && n != expected {
        return Err(TupleError::new(
            codes::ER_EXACT_MATCH,
            format!("Invalid key part count in an exact match (expected {expected}, got {n})"),
        ));
    }
    if n > expected {
        return Err(TupleError::new(
            codes::ER_KEY_PART_COUNT,
            format!("Invalid key part count (expected [0..{expected}], got {n})"),
        ));
    }
    for (i, part) in parts.iter().enumerate().take(n) {
        let value = given.next().expect("fewer than len read")?;
        if !part.field_type.accepts(value, false) {
            return Err(TupleError::new(
                codes::ER_KEY_PART_TYPE,
                format!(
                    "Supplied key type of part {i} does not match index part type: expected {}",
                    part.field_type
                ),
            ));
        }
    }
    given.finish()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::unhex;

    /// The `users` space of the captures: id unsigned, name string, age unsigned.
    fn users() -> Vec<FieldDef> {
        [("id", "unsigned"), ("name", "string"), ("age", "unsigned")]
            .into_iter()
            .map(|(name, t)| FieldDef {
                name: name.to_string(),
                field_type: FieldType::parse(t).unwrap(),
                is_nullable: false,
            })
            .collect()
    }

    const PK: [KeyPart; 1] = [KeyPart {
        field_no: 0,
        field_type: FieldType::Unsigned,
    }];

    #[test]
    fn type_names_round_trip() {
        for t in FieldType::ALL {
            assert_eq!(FieldType::parse(t.as_str()), Some(t));
        }
        assert_eq!(FieldType::parse("STR"), Some(FieldType::String));
        assert_eq!(FieldType::parse("float"), None);
    }

    #[test]
    fn the_format_errors_of_the_captures() {
        // INSERT [100] (09_raw_protocol.txt).
        let e = check_format(&unhex("9164"), &users()).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (39, "Tuple field 2 required by space format is missing")
        );
        // A number where the name goes (01_py_auth.txt).
        let e = check_format(&unhex("9306 05 1e"), &users()).unwrap_err();
        assert_eq!(e.code, 23);
        assert_eq!(
            e.message,
            "Tuple field 2 type does not match one required by operation: expected string"
        );
        assert!(check_format(&unhex("9301a5416c6963651e"), &users()).is_ok());
        // Fields past the format are free; a type error comes before a missing field.
        assert!(check_format(&unhex("9401a1611ec0"), &users()).is_ok());
        assert_eq!(
            check_format(&unhex("91a131"), &users()).unwrap_err().code,
            23
        );
        assert_eq!(check_format(&unhex("01"), &users()).unwrap_err().code, 22);
    }

    #[test]
    fn each_type_takes_its_classes() {
        let cases: &[(&str, &str, bool)] = &[
            ("unsigned", "05", true),
            ("unsigned", "d005", false),
            ("unsigned", "ff", false),
            ("integer", "ff", true),
            ("integer", "cb3ff0000000000000", false),
            ("number", "ca3f800000", true),
            ("number", "d50100", false),
            ("number", "d6010000000c", true),
            ("double", "cb3ff0000000000000", true),
            ("double", "ca3f800000", false),
            ("double", "01", false),
            ("string", "a0", true),
            ("string", "c400", false),
            ("varbinary", "c400", true),
            ("boolean", "c2", true),
            ("scalar", "c3", true),
            ("scalar", "90", false),
            ("array", "90", true),
            ("map", "80", true),
            ("any", "81a16190", true),
            ("any", "d40700", false),
            ("uuid", "d8020000000000000000000000000000000000", true),
            ("uuid", "a0", false),
            ("string", "c0", false),
        ];
        for (t, hex, ok) in cases {
            let t = FieldType::parse(t).unwrap();
            assert_eq!(t.accepts(&unhex(hex), false), *ok, "{t} {hex}");
        }
        assert!(FieldType::String.accepts(&[0xc0], true));
    }

    #[test]
    fn keys_are_extracted_and_checked() {
        let parts = [
            KeyPart {
                field_no: 2,
                field_type: FieldType::Unsigned,
            },
            KeyPart {
                field_no: 1,
                field_type: FieldType::String,
            },
        ];
        assert_eq!(
            extract_key(&unhex("9301a5416c6963651e"), &parts).unwrap(),
            unhex("921ea5416c696365")
        );
        assert_eq!(extract_key(&unhex("9101"), &PK).unwrap(), unhex("9101"));
        assert_eq!(extract_key(&unhex("90"), &PK).unwrap_err().code, 39);
        assert_eq!(extract_key(&unhex("91a0"), &PK).unwrap_err().code, 23);
        // The captures' key errors.
        let e = check_key(&unhex("91a178"), &PK, false).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                18,
                "Supplied key type of part 0 does not match index part type: expected unsigned"
            )
        );
        let e = check_key(&unhex("920102"), &PK, false).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (31, "Invalid key part count (expected [0..1], got 2)")
        );
        assert!(check_key(&unhex("90"), &PK, false).is_ok());
        let e = check_key(&unhex("90"), &PK, true).unwrap_err();
        assert_eq!(
            (e.code, e.message.as_str()),
            (
                19,
                "Invalid key part count in an exact match (expected 1, got 0)"
            )
        );
        assert!(check_key(&unhex("9101"), &PK, true).is_ok());
    }
}

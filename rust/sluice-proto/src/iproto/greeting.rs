//! The 128-byte text a Tarantool server sends when a connection opens: two 64-byte lines,
//! `Tarantool <version> (Binary) <instance uuid>` and the base64 of a random salt, each padded
//! with spaces and ending in `\n`. chap-sha1 uses the salt's first 20 bytes.

use std::fmt;

use crate::base64;

pub const GREETING_SIZE: usize = 128;
const LINE: usize = GREETING_SIZE / 2;

/// The greeting of a server: `version` is the short `major.minor.patch` Tarantool shows (2.6.0),
/// `instance_uuid` the 36-character text form.
pub fn encode(version: &str, instance_uuid: &str, salt: &[u8; 32]) -> [u8; GREETING_SIZE] {
    let mut out = [b' '; GREETING_SIZE];
    let line1 = format!("Tarantool {version} (Binary) {instance_uuid}");
    let n = line1.len().min(LINE - 1);
    out[..n].copy_from_slice(&line1.as_bytes()[..n]);
    out[LINE - 1] = b'\n';
    let salt = base64::encode(salt);
    out[LINE..LINE + salt.len()].copy_from_slice(salt.as_bytes());
    out[GREETING_SIZE - 1] = b'\n';
    out
}

/// A greeting as a client reads it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Greeting {
    /// `major.minor.patch` as text, and packed as Tarantool compares versions
    /// (major << 16 | minor << 8 | patch: 2.6.0 is 132608).
    pub version: String,
    pub version_id: u32,
    /// "Binary" for iproto ("Lua console" for the admin console).
    pub protocol: String,
    /// Empty unless the protocol is Binary.
    pub instance_uuid: String,
    /// The decoded salt (32 bytes from Tarantool; at least 20).
    pub salt: Vec<u8>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GreetingError(pub &'static str);

impl fmt::Display for GreetingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "not a Tarantool greeting: {}", self.0)
    }
}

impl std::error::Error for GreetingError {}

/// Reads a greeting as Tarantool's own client does (greeting_decode in src/box/xrow.c).
pub fn parse(buf: &[u8; GREETING_SIZE]) -> Result<Greeting, GreetingError> {
    if !buf.starts_with(b"Tarantool ") || buf[LINE - 1] != b'\n' || buf[GREETING_SIZE - 1] != b'\n'
    {
        return Err(GreetingError("no \"Tarantool \" line"));
    }
    let line1 = std::str::from_utf8(&buf[10..LINE - 1])
        .map_err(|_| GreetingError("the first line is not text"))?;
    let mut words = line1.split(' ').filter(|w| !w.is_empty());
    let version = words.next().ok_or(GreetingError("no version"))?;
    let numbers: Vec<u32> = version
        .split(['.', '-'])
        .take(3)
        .map(|p| p.parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|_| GreetingError("the version is not major.minor.patch"))?;
    let [major, minor, patch] = numbers[..] else {
        return Err(GreetingError("the version is not major.minor.patch"));
    };
    let rest = words.collect::<Vec<_>>().join(" ");
    let (protocol, uuid) = match rest.strip_prefix('(').and_then(|r| r.split_once(')')) {
        Some((protocol, uuid)) => (protocol.to_string(), uuid.trim().to_string()),
        None => return Err(GreetingError("no (protocol)")),
    };
    let instance_uuid = if protocol == "Binary" {
        if uuid.len() < 36 {
            return Err(GreetingError("no instance uuid"));
        }
        uuid[..36].to_string()
    } else {
        String::new()
    };
    let salt_text: Vec<u8> = buf[LINE..GREETING_SIZE - 1]
        .iter()
        .copied()
        .take_while(|&b| b != b' ')
        .collect();
    let salt = base64::decode(&salt_text).ok_or(GreetingError("the salt is not base64"))?;
    if protocol == "Binary" && salt.len() < 20 {
        return Err(GreetingError("the salt is shorter than 20 bytes"));
    }
    Ok(Greeting {
        version: format!("{major}.{minor}.{patch}"),
        version_id: (major << 16) | (minor << 8) | patch,
        protocol,
        instance_uuid,
        salt,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::iproto::unhex;

    /// The greeting of 09_raw_protocol.txt, as the proxy recorded it.
    const CAPTURED: &str = "546172616e746f6f6c20322e362e30202842696e617279292065656264656633332d656663632d346230312d626536312d31643032656437366339383120200a4a746e35784d696730596c4c4a7253636f385762334d4b52704a6141636b457a3655503744716b725847453d202020202020202020202020202020202020200a";

    #[test]
    fn encode_gives_tarantools_bytes_and_parse_reads_them_back() {
        let captured: [u8; 128] = unhex(CAPTURED).try_into().unwrap();
        let greeting = parse(&captured).unwrap();
        assert_eq!(greeting.version, "2.6.0");
        assert_eq!(greeting.version_id, 132608);
        assert_eq!(greeting.protocol, "Binary");
        assert_eq!(
            greeting.instance_uuid,
            "eebdef33-efcc-4b01-be61-1d02ed76c981"
        );
        assert_eq!(greeting.salt.len(), 32);
        let salt: [u8; 32] = greeting.salt.clone().try_into().unwrap();
        let encoded = encode("2.6.0", "eebdef33-efcc-4b01-be61-1d02ed76c981", &salt);
        assert_eq!(encoded, captured);
    }

    #[test]
    fn parse_refuses_what_is_not_a_greeting() {
        let mut buf = encode("2.6.0", "eebdef33-efcc-4b01-be61-1d02ed76c981", &[7; 32]);
        assert!(parse(&buf).is_ok());
        buf[63] = b' ';
        assert!(parse(&buf).is_err());
        let mut buf = encode("2.6.0", "eebdef33-efcc-4b01-be61-1d02ed76c981", &[7; 32]);
        buf[64] = b'!';
        assert_eq!(parse(&buf), Err(GreetingError("the salt is not base64")));
        assert!(parse(&[b'x'; 128]).is_err());
        let console = encode("2.6.0", "", &[7; 32]);
        assert!(parse(&console).is_err(), "Binary without a uuid");
    }
}

//! memcached's text protocol, the line level: finding a command line within its length limit
//! and reading the classic commands' arguments. Nothing is allocated from what a client sends:
//! lines, keys and values are slices of the connection's buffer, and a value's announced length
//! is checked against the limit before the connection waits for (or buffers) its bytes.

use sluice_core::item::{MAX_KEY_LEN, RELATIVE_EXPIRY_LIMIT};

/// Longest command line, as memcached's 2048: room for a 250-byte key, flags and numbers.
/// Only retrieval lines (`get`, `gets`, `gat`, `gats`), which list many keys, may be longer.
pub const MAX_LINE: usize = 2048;

/// An expiry already past (memcached: a negative exptime expires the item at once): an
/// absolute Unix time, the first one past the relative range.
pub const EXPIRED: u32 = RELATIVE_EXPIRY_LIMIT + 1;

/// What the buffer's head holds.
#[derive(Debug, PartialEq, Eq)]
pub enum Line<'a> {
    /// A command line without its "\r\n" (or "\n"), and how many bytes it takes with it.
    Complete(&'a [u8], usize),
    /// No end of line yet, and still within the limit.
    Incomplete,
    /// Over the limit without an end of line: the connection cannot stay in sync.
    TooLong,
}

/// The command line at the head of `buf`; retrieval lines may run to `max_multiget` bytes.
pub fn next_line(buf: &[u8], max_multiget: usize) -> Line<'_> {
    let limit = if is_retrieval(buf) {
        max_multiget.max(MAX_LINE)
    } else {
        MAX_LINE
    };
    let window = &buf[..buf.len().min(limit + 1)];
    match window.iter().position(|&b| b == b'\n') {
        Some(nl) => {
            let line = &buf[..nl];
            let line = line.strip_suffix(b"\r").unwrap_or(line);
            Line::Complete(line, nl + 1)
        }
        None if buf.len() > limit => Line::TooLong,
        None => Line::Incomplete,
    }
}

fn is_retrieval(buf: &[u8]) -> bool {
    let start = buf.iter().position(|&b| b != b' ').unwrap_or(buf.len());
    let head = &buf[start..];
    [&b"get "[..], b"gets ", b"gat ", b"gats "]
        .iter()
        .any(|p| head.starts_with(p))
}

/// The words of a line, split on spaces (several in a row count as one).
pub fn words(line: &[u8]) -> impl Iterator<Item = &[u8]> {
    line.split(|&b| b == b' ').filter(|w| !w.is_empty())
}

/// A decimal number without sign, fitting in u64.
pub fn number(word: &[u8]) -> Option<u64> {
    if word.is_empty() || word.len() > 20 || !word.iter().all(u8::is_ascii_digit) {
        return None;
    }
    std::str::from_utf8(word).ok()?.parse().ok()
}

/// memcached's exptime: 0 never, up to 30 days relative, larger an absolute Unix time; a
/// negative one expires the item at once.
pub fn exptime(word: &[u8]) -> Option<u32> {
    match word.strip_prefix(b"-") {
        Some(rest) => number(rest).map(|_| EXPIRED),
        None => number(word).and_then(|n| u32::try_from(n).ok()),
    }
}

/// A key as the text protocol carries it: 1 to 250 bytes (no spaces or control characters can
/// be in it, the line is split on them).
pub fn key(word: &[u8]) -> Option<&[u8]> {
    (!word.is_empty() && word.len() <= MAX_KEY_LEN && !word.iter().any(|b| b.is_ascii_control()))
        .then_some(word)
}

/// The storage commands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StoreVerb {
    Set,
    Add,
    Replace,
    Append,
    Prepend,
    Cas,
}

/// A storage command's line: `<verb> <key> <flags> <exptime> <bytes> [<cas>] [noreply]`.
#[derive(Debug, PartialEq, Eq)]
pub struct StoreLine<'a> {
    pub verb: StoreVerb,
    pub key: &'a [u8],
    pub flags: u32,
    pub exptime: u32,
    pub bytes: usize,
    pub cas: u64,
    pub noreply: bool,
}

/// Why a storage line is refused, and how many bytes of data follow it that are to be skipped
/// (None: the length could not be read, nothing is skipped, as memcached does).
#[derive(Debug, PartialEq, Eq)]
pub struct BadStore {
    pub reply: &'static str,
    pub skip: Option<usize>,
}

/// memcached's answer to a line it cannot read.
pub const BAD_FORMAT: &str = "CLIENT_ERROR bad command line format";

/// Reads a storage line's arguments (the words after the verb). Err(None): the wrong number of
/// words, which memcached answers with ERROR.
pub fn store_line<'a>(
    verb: StoreVerb,
    args: &[&'a [u8]],
) -> Result<StoreLine<'a>, Option<BadStore>> {
    let fixed = if verb == StoreVerb::Cas { 5 } else { 4 };
    let noreply = match args.len() {
        n if n == fixed => false,
        n if n == fixed + 1 && args[fixed] == b"noreply" => true,
        _ => return Err(None),
    };
    let bytes = number(args[3]).and_then(|n| usize::try_from(n).ok());
    let bad = |skip| {
        Err(Some(BadStore {
            reply: BAD_FORMAT,
            skip,
        }))
    };
    let Some(bytes) = bytes else {
        return bad(None);
    };
    let skip = Some(bytes);
    let (Some(key), Some(flags), Some(exptime)) = (
        key(args[0]),
        number(args[1]).and_then(|f| u32::try_from(f).ok()),
        exptime(args[2]),
    ) else {
        return bad(skip);
    };
    let cas = if verb == StoreVerb::Cas {
        match number(args[4]) {
            Some(c) => c,
            None => return bad(skip),
        }
    } else {
        0
    };
    Ok(StoreLine {
        verb,
        key,
        flags,
        exptime,
        bytes,
        cas,
        noreply,
    })
}

/// Splits a trailing `noreply` off the arguments.
pub fn noreply<'a, 'b>(args: &'b [&'a [u8]]) -> (&'b [&'a [u8]], bool) {
    match args.split_last() {
        Some((last, rest)) if *last == b"noreply" => (rest, true),
        _ => (args, false),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_end_at_a_newline_within_the_limit() {
        assert_eq!(next_line(b"get a\r\nx", 0), Line::Complete(b"get a", 7));
        assert_eq!(next_line(b"get a\nx", 0), Line::Complete(b"get a", 6));
        assert_eq!(next_line(b"set a 0 0", 0), Line::Incomplete);
        let long = vec![b'x'; MAX_LINE + 1];
        assert_eq!(next_line(&long, 1 << 20), Line::TooLong);
        let mut get = b"get ".to_vec();
        get.resize(MAX_LINE * 2, b'k');
        assert_eq!(next_line(&get, 1 << 20), Line::Incomplete);
        assert_eq!(next_line(&get, MAX_LINE), Line::TooLong);
    }

    #[test]
    fn storage_lines_are_checked_before_any_data_is_read() {
        let args: Vec<&[u8]> = words(b"k 5 -1 3 noreply").collect();
        let l = store_line(StoreVerb::Set, &args).unwrap();
        assert_eq!(
            (l.key, l.flags, l.exptime, l.bytes, l.noreply),
            (&b"k"[..], 5, EXPIRED, 3, true)
        );
        let args: Vec<&[u8]> = words(b"k 0 0").collect();
        assert_eq!(store_line(StoreVerb::Set, &args), Err(None));
        let args: Vec<&[u8]> = words(b"k x 0 3").collect();
        let e = store_line(StoreVerb::Set, &args).unwrap_err().unwrap();
        assert_eq!(e.skip, Some(3));
        let args: Vec<&[u8]> = words(b"k 0 0 -3").collect();
        assert_eq!(
            store_line(StoreVerb::Set, &args).unwrap_err().unwrap().skip,
            None
        );
        let long = vec![b'k'; 251];
        let args: Vec<&[u8]> = vec![&long, b"0", b"0", b"1"];
        assert_eq!(
            store_line(StoreVerb::Set, &args).unwrap_err().unwrap().skip,
            Some(1)
        );
        assert_eq!(number(b"18446744073709551616"), None);
        assert_eq!(exptime(b"4294967296"), None);
    }
}

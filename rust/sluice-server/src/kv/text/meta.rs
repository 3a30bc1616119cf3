//! memcached's meta commands (`mg`, `ms`, `md`, `ma`, `me`; `mn` is answered in `mod`), with
//! their flags as memcached's protocol.txt documents them. Answers: `HD`, `VA <size>`, `EN`,
//! `NF`, `NS`, `EX`, with the requested flags echoed in the order they were asked.
//!
//! Not offered, and refused by name rather than ignored: what needs per-item state sluice does
//! not keep (`h` hit before, `l` last access, the stale and win flags `N`/`R` of `mg` and `I` of
//! `ms`/`md`, `x` of `md`) and `E` (a CAS chosen by the client; sluice's CAS is its HLC).

use std::borrow::Cow;

use sluice_core::engine::counter_value;
use sluice_core::item::Item;
use sluice_core::{Error, StoreMode, StoreRequest};

use super::parse::{self, BAD_FORMAT};
use super::{decimal, engine_error, line, ttl, Flow, TextSession};

/// Flags no command here offers (see the module's doc).
const UNSUPPORTED: &[u8] = b"hlNREIx";

/// The flags of one meta command, in the order the client sent them.
struct Flags<'a> {
    list: Vec<(u8, &'a [u8])>,
}

impl<'a> Flags<'a> {
    /// Reads the flag words; `allowed` are the command's flags. P and L (proxy hints) are
    /// ignored, as memcached documents.
    fn parse(words: &[&'a [u8]], allowed: &[u8]) -> Result<Flags<'a>, String> {
        let mut list: Vec<(u8, &[u8])> = Vec::with_capacity(words.len());
        for w in words {
            let (f, token) = (w[0], &w[1..]);
            if f == b'P' || f == b'L' {
                continue;
            }
            if !allowed.contains(&f) {
                return Err(if UNSUPPORTED.contains(&f) {
                    format!("CLIENT_ERROR flag {} is not supported by sluice", f as char)
                } else {
                    "CLIENT_ERROR invalid flag".into()
                });
            }
            if list.iter().any(|(g, _)| *g == f) {
                return Err("CLIENT_ERROR duplicate flag".into());
            }
            if f == b'O' && token.len() > 32 {
                return Err("CLIENT_ERROR opaque token too long".into());
            }
            list.push((f, token));
        }
        Ok(Flags { list })
    }

    fn has(&self, f: u8) -> bool {
        self.list.iter().any(|(g, _)| *g == f)
    }

    fn token(&self, f: u8) -> Option<&'a [u8]> {
        self.list.iter().find(|(g, _)| *g == f).map(|(_, t)| *t)
    }

    /// A numeric token: Ok(None) when the flag is absent.
    fn number(&self, f: u8) -> Result<Option<u64>, String> {
        match self.token(f) {
            None => Ok(None),
            Some(t) => parse::number(t)
                .map(Some)
                .ok_or_else(|| "CLIENT_ERROR bad token in command line format".into()),
        }
    }

    /// A TTL token (memcached's exptime rules): Ok(None) when the flag is absent.
    fn ttl(&self, f: u8) -> Result<Option<u32>, String> {
        match self.token(f) {
            None => Ok(None),
            Some(t) => parse::exptime(t)
                .map(Some)
                .ok_or_else(|| "CLIENT_ERROR bad token in command line format".into()),
        }
    }
}

/// What the returned flags report, for a hit.
struct Found<'i> {
    item: Option<&'i Item>,
    /// The CAS for `c` (ms on failure: 0, as memcached does).
    cas: u64,
}

/// Appends the returned flags in request order: O and k always, the item's when there is one.
fn echo(out: &mut Vec<u8>, flags: &Flags<'_>, key_word: &[u8], found: Option<&Found<'_>>) {
    for &(f, token) in &flags.list {
        match (f, found) {
            (b'O', _) => {
                out.extend_from_slice(b" O");
                out.extend_from_slice(token);
            }
            (b'k', _) => {
                out.extend_from_slice(b" k");
                out.extend_from_slice(key_word);
            }
            (b'c', Some(fd)) => {
                out.extend_from_slice(b" c");
                decimal(out, fd.cas);
            }
            (b'f', Some(Found { item: Some(it), .. })) => {
                out.extend_from_slice(b" f");
                decimal(out, it.meta.flags);
            }
            (b's', Some(Found { item: Some(it), .. })) => {
                out.extend_from_slice(b" s");
                decimal(out, it.body().len());
            }
            (b't', Some(Found { item: Some(it), .. })) => {
                out.extend_from_slice(b" t");
                decimal(out, ttl(it));
            }
            _ => {}
        }
    }
    // A returned key in base64 says so (memcached sends the b back with it).
    if flags.has(b'b') && flags.has(b'k') {
        out.extend_from_slice(b" b");
    }
}

/// The key a meta command names: its word, or what it decodes to with `b` (base64).
fn meta_key<'a>(word: &'a [u8], flags: &Flags<'_>) -> Result<Cow<'a, [u8]>, &'static str> {
    let key: Cow<'a, [u8]> = if flags.has(b'b') {
        Cow::Owned(base64_decode(word).ok_or("CLIENT_ERROR error decoding key")?)
    } else {
        Cow::Borrowed(word)
    };
    if key.is_empty() || key.len() > sluice_core::item::MAX_KEY_LEN {
        return Err(BAD_FORMAT);
    }
    Ok(key)
}

/// Standard base64 with padding, as memcached's `b` flag: None for anything else (an empty
/// key too).
fn base64_decode(s: &[u8]) -> Option<Vec<u8>> {
    sluice_proto::base64::decode(s).filter(|k| !k.is_empty())
}

/// A key and flags, or the error line that refuses them.
macro_rules! key_and_flags {
    ($out:expr, $args:expr, $allowed:expr) => {{
        let Some((word, rest)) = $args.split_first() else {
            return line($out, "ERROR");
        };
        let flags = match Flags::parse(rest, $allowed) {
            Ok(f) => f,
            Err(e) => return line($out, &e),
        };
        let key = match meta_key(word, &flags) {
            Ok(k) => k,
            Err(e) => return line($out, e),
        };
        (*word, flags, key)
    }};
}

/// An error line for a bad flag token, ending the command.
macro_rules! token {
    ($out:expr, $e:expr) => {
        match $e {
            Ok(v) => v,
            Err(e) => return line($out, &e),
        }
    };
}

impl TextSession {
    /// mg <key> <flags>*: flags b c f k O q s t u v T.
    pub(super) async fn meta_get(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (word, flags, key) = key_and_flags!(out, args, b"bcfkOqstuvT");
        let touch = token!(out, flags.ttl(b'T'));
        let engine = &self.ctx.engine;
        let found = match touch {
            None => engine.get(&self.bucket, &key),
            Some(exp) => match engine.write_touch(&self.bucket, &key, exp, None) {
                Ok(w) => self.settle(w).await.map(|(_, it)| Some(it)),
                Err(Error::NotFound) => Ok(None),
                Err(e) => Err(e),
            },
        };
        match found {
            Ok(Some(it)) => {
                let fd = Found {
                    item: Some(&it),
                    cas: it.meta.cas,
                };
                if flags.has(b'v') {
                    out.extend_from_slice(b"VA ");
                    decimal(out, it.body().len());
                    echo(out, &flags, word, Some(&fd));
                    out.extend_from_slice(b"\r\n");
                    out.extend_from_slice(it.body());
                    out.extend_from_slice(b"\r\n");
                } else {
                    out.extend_from_slice(b"HD");
                    echo(out, &flags, word, Some(&fd));
                    out.extend_from_slice(b"\r\n");
                }
            }
            Ok(None) if flags.has(b'q') => {}
            Ok(None) => {
                out.extend_from_slice(b"EN");
                echo(out, &flags, word, None);
                out.extend_from_slice(b"\r\n");
            }
            Err(e) => engine_error(&e, out),
        }
    }

    /// ms <key> <datalen> <flags>*, then the data: flags b c C F k O q T M(E A P R S).
    pub(super) async fn meta_set(
        &mut self,
        args: &[&[u8]],
        buf: &[u8],
        len: usize,
        out: &mut Vec<u8>,
    ) -> (usize, Flow) {
        let Some(bytes) = args
            .get(1)
            .and_then(|b| parse::number(b))
            .and_then(|n| usize::try_from(n).ok())
        else {
            line(out, if args.is_empty() { "ERROR" } else { BAD_FORMAT });
            return (len, Flow::Continue);
        };
        // The line is read whole before its data: a refused line still has its data skipped.
        let checked = (|| -> Result<_, String> {
            let flags = Flags::parse(&args[2..], b"bcCFkOqTM")?;
            let key = meta_key(args[0], &flags).map_err(String::from)?;
            let cas = flags.number(b'C')?.unwrap_or(0);
            let client_flags = match flags.number(b'F')? {
                Some(f) => u32::try_from(f)
                    .map_err(|_| String::from("CLIENT_ERROR bad token in command line format"))?,
                None => 0,
            };
            let exp = flags.ttl(b'T')?.unwrap_or(0);
            let mode = match flags.token(b'M') {
                None => b'S',
                Some([m]) => match m.to_ascii_uppercase() {
                    m @ (b'E' | b'A' | b'P' | b'R' | b'S') => m,
                    _ => return Err("CLIENT_ERROR invalid mode for ms M token".into()),
                },
                Some(_) => return Err("CLIENT_ERROR invalid mode for ms M token".into()),
            };
            Ok((flags, key, cas, client_flags, exp, mode))
        })();
        let (data, end) = match self.data_block(buf, len, bytes, out) {
            Ok(Some(d)) => d,
            Ok(None) => return (0, Flow::More),
            Err(took) => return (took, Flow::Continue),
        };
        let (flags, key, cas, client_flags, exp, mode) = match checked {
            Ok(c) => c,
            Err(e) => {
                line(out, &e);
                return (end, Flow::Continue);
            }
        };
        let engine = &self.ctx.engine;
        let written = match mode {
            b'A' | b'P' => engine
                .write_concat(&self.bucket, &key, data, mode == b'A', cas, None)
                .map(|w| w.map(|m| m.cas)),
            _ => {
                let req = StoreRequest {
                    key: &key,
                    value: data,
                    flags: client_flags,
                    expiry: exp,
                    datatype: 0,
                    cas,
                    mode: match mode {
                        b'E' => StoreMode::Add,
                        b'R' => StoreMode::Replace,
                        _ => StoreMode::Set,
                    },
                    durability: None,
                    preserve_expiry: false,
                };
                engine
                    .write_store(&self.bucket, &req)
                    .map(|w| w.map(|m| m.cas))
            }
        };
        let result = match written {
            Ok(w) => self.settle(w).await,
            Err(e) => Err(e),
        };
        let (code, new_cas) = match result {
            Ok(c) => ("HD", c),
            Err(Error::Exists | Error::Locked) if mode == b'E' => ("NS", 0),
            Err(Error::Exists | Error::Locked) => ("EX", 0),
            Err(Error::NotFound) if cas == 0 => ("NS", 0),
            Err(Error::NotFound) => ("NF", 0),
            Err(Error::NotStored) => ("NS", 0),
            Err(e) => {
                engine_error(&e, out);
                return (end, Flow::Continue);
            }
        };
        if code == "HD" && flags.has(b'q') {
            return (end, Flow::Continue);
        }
        out.extend_from_slice(code.as_bytes());
        let fd = Found {
            item: None,
            cas: new_cas,
        };
        echo(out, &flags, args[0], Some(&fd));
        out.extend_from_slice(b"\r\n");
        (end, Flow::Continue)
    }

    /// md <key> <flags>*: flags b C k O q.
    pub(super) async fn meta_delete(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (word, flags, key) = key_and_flags!(out, args, b"bCkOq");
        let cas = token!(out, flags.number(b'C')).unwrap_or(0);
        let r = match self.ctx.engine.write_delete(&self.bucket, &key, cas, None) {
            Ok(w) => self.settle(w).await.map(|_| ()),
            Err(e) => Err(e),
        };
        let code = match r {
            Ok(()) if flags.has(b'q') => return,
            Ok(()) => "HD",
            Err(Error::NotFound) => "NF",
            Err(Error::Exists | Error::Locked) => "EX",
            Err(e) => return engine_error(&e, out),
        };
        out.extend_from_slice(code.as_bytes());
        echo(out, &flags, word, None);
        out.extend_from_slice(b"\r\n");
    }

    /// ma <key> <flags>*: flags b C N J D T M(I + D -) q t c v k O.
    pub(super) async fn meta_arithmetic(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (word, flags, key) = key_and_flags!(out, args, b"bCNJDTMqtcvkO");
        let cas = token!(out, flags.number(b'C')).unwrap_or(0);
        let delta = token!(out, flags.number(b'D')).unwrap_or(1);
        let initial = token!(out, flags.number(b'J')).unwrap_or(0);
        // Without N a miss is NF: u32::MAX is the engine's "do not create".
        let create = token!(out, flags.ttl(b'N')).map_or(u32::MAX, |t| t.min(u32::MAX - 1));
        let touch = token!(out, flags.ttl(b'T'));
        let increment = match flags.token(b'M') {
            None | Some(b"I" | b"i" | b"+") => true,
            Some(b"D" | b"d" | b"-") => false,
            Some(_) => return line(out, "CLIENT_ERROR invalid mode for ma M token"),
        };
        let engine = &self.ctx.engine;
        let r = match engine.write_arithmetic_touching(
            &self.bucket,
            &key,
            delta,
            initial,
            create,
            increment,
            cas,
            None,
            touch,
        ) {
            Ok(w) => self.settle(w).await,
            Err(e) => Err(e),
        };
        let (m, item) = match r {
            Ok(r) => r,
            Err(e) => {
                let code = match e {
                    Error::NotFound => "NF",
                    Error::Exists | Error::Locked => "EX",
                    e => return engine_error(&e, out),
                };
                out.extend_from_slice(code.as_bytes());
                echo(out, &flags, word, None);
                return out.extend_from_slice(b"\r\n");
            }
        };
        if flags.has(b'q') {
            return;
        }
        let fd = Found {
            item: Some(&item),
            cas: m.cas,
        };
        if flags.has(b'v') {
            let n = counter_value(&item).to_string();
            out.extend_from_slice(b"VA ");
            decimal(out, n.len());
            echo(out, &flags, word, Some(&fd));
            out.extend_from_slice(b"\r\n");
            out.extend_from_slice(n.as_bytes());
            out.extend_from_slice(b"\r\n");
        } else {
            out.extend_from_slice(b"HD");
            echo(out, &flags, word, Some(&fd));
            out.extend_from_slice(b"\r\n");
        }
    }

    /// me <key> [b]: what sluice knows of an item, as `ME <key> <k>=<v>*`: exp (seconds left,
    /// -1 none), cas, size (value bytes), and sluice's own vb and seqno.
    pub(super) fn meta_debug(&mut self, args: &[&[u8]], out: &mut Vec<u8>) {
        let (word, _flags, key) = key_and_flags!(out, args, b"b");
        match self.ctx.engine.get(&self.bucket, &key) {
            Ok(Some(it)) => {
                out.extend_from_slice(b"ME ");
                out.extend_from_slice(word);
                let _ = std::io::Write::write_fmt(
                    out,
                    format_args!(
                        " exp={} cas={} size={} vb={} seqno={}\r\n",
                        ttl(&it),
                        it.meta.cas,
                        it.body().len(),
                        self.bucket.vbucket_of(&key),
                        it.meta.by_seqno
                    ),
                );
            }
            Ok(None) => line(out, "EN"),
            Err(e) => engine_error(&e, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::base64_decode;

    #[test]
    fn base64_keys_decode_or_are_refused() {
        assert_eq!(base64_decode(b"YWJj").unwrap(), b"abc");
        assert_eq!(base64_decode(b"YQ==").unwrap(), b"a");
        assert_eq!(base64_decode(b"YWI=").unwrap(), b"ab");
        assert_eq!(base64_decode(b"AP8A").unwrap(), [0, 255, 0]);
        assert!(base64_decode(b"!!!!").is_none());
        assert!(base64_decode(b"YQ").is_none());
        assert!(base64_decode(b"YQ==YWJj").is_none());
        assert!(base64_decode(b"").is_none());
    }
}

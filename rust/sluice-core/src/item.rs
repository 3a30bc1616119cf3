//! Items and the changes that carry them through checkpoints, the WAL and streams.

use crate::error::{Error, Result};

pub const MAX_KEY_LEN: usize = 250;
/// Relative expiry times are at most 30 days; anything larger is an absolute Unix time.
pub const RELATIVE_EXPIRY_LIMIT: u32 = 30 * 24 * 3600;

/// Datatype bits clients set and see (JSON, Snappy, Xattr).
pub const DATATYPE_CLIENT_BITS: u8 = 0x07;
const TAP_HOPS_SHIFT: u32 = 3;
/// Most TAP hops an item can remember (five bits).
pub const MAX_TAP_HOPS: u8 = 0x1f;

/// The stored datatype's high five bits hold the TAP hops an item arrived with (0: written
/// here), so the WAL and snapshots keep them without a format change. Clients never see them.
pub fn tap_hops(datatype: u8) -> u8 {
    datatype >> TAP_HOPS_SHIFT
}

pub fn with_tap_hops(datatype: u8, hops: u8) -> u8 {
    (datatype & DATATYPE_CLIENT_BITS) | (hops.min(MAX_TAP_HOPS) << TAP_HOPS_SHIFT)
}

/// What kind of change produced a seqno.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ChangeOp {
    Mutation,
    Deletion,
    Expiration,
}

impl ChangeOp {
    pub fn as_str(self) -> &'static str {
        match self {
            ChangeOp::Mutation => "mutation",
            ChangeOp::Deletion => "deletion",
            ChangeOp::Expiration => "expiration",
        }
    }
}

/// Everything about an item but its key and value. For a tombstone `expiry` holds the delete
/// time (seconds since the epoch), as Couchbase stores it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ItemMeta {
    pub cas: u64,
    pub rev_seqno: u64,
    pub by_seqno: u64,
    pub flags: u32,
    pub expiry: u32,
    pub datatype: u8,
    pub deleted: bool,
}

/// An owned item: key and value in one allocation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Item {
    pub meta: ItemMeta,
    key_len: u8,
    data: Box<[u8]>,
}

impl Item {
    pub fn new(key: &[u8], value: &[u8], meta: ItemMeta) -> Item {
        debug_assert!(key.len() <= MAX_KEY_LEN);
        let mut data = Vec::with_capacity(key.len() + value.len());
        data.extend_from_slice(key);
        data.extend_from_slice(value);
        Item {
            meta,
            key_len: key.len() as u8,
            data: data.into_boxed_slice(),
        }
    }

    pub fn key(&self) -> &[u8] {
        &self.data[..self.key_len as usize]
    }

    pub fn value(&self) -> &[u8] {
        &self.data[self.key_len as usize..]
    }

    /// The value without the extended attributes it may start with (what a GET answers).
    pub fn body(&self) -> &[u8] {
        sluice_proto::xattr::body(self.value(), self.meta.datatype)
    }

    /// Bytes of key plus value.
    pub fn data_len(&self) -> usize {
        self.data.len()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChangeHeader {
    pub op: ChangeOp,
    pub bucket: u16,
    pub vbucket: u16,
    key_len: u8,
    pub meta: ItemMeta,
}

/// One change of one vbucket, shared by the checkpoint that holds it, the WAL writer's queue
/// and any stream reading it: header, key and value in a single reference-counted allocation.
#[derive(Clone, PartialEq, Eq)]
pub struct Change(triomphe::Arc<triomphe::HeaderSlice<ChangeHeader, [u8]>>);

impl Change {
    pub fn new(
        op: ChangeOp,
        bucket: u16,
        vbucket: u16,
        key: &[u8],
        value: &[u8],
        meta: ItemMeta,
    ) -> Change {
        debug_assert!(key.len() <= MAX_KEY_LEN);
        let header = ChangeHeader {
            op,
            bucket,
            vbucket,
            key_len: key.len() as u8,
            meta,
        };
        let mut u =
            triomphe::UniqueArc::from_header_and_uninit_slice(header, key.len() + value.len());
        let dst = u.slice.as_mut_ptr() as *mut u8;
        // SAFETY: `dst` has room for key.len() + value.len() bytes; both writes stay inside it
        // and together initialise every byte before assume_init.
        let u = unsafe {
            std::ptr::copy_nonoverlapping(key.as_ptr(), dst, key.len());
            std::ptr::copy_nonoverlapping(value.as_ptr(), dst.add(key.len()), value.len());
            u.assume_init_slice_with_header()
        };
        Change(u.shareable())
    }

    /// Two handles on the change: a write's, for the checkpoint and for the WAL queue. `clone`
    /// is a locked add, which waits until every store before it, here the whole of a fresh
    /// allocation and of the item store's copy, has reached the cache: that wait was a quarter
    /// of a replica's apply. When this is the only handle, setting the count is a plain store.
    pub fn into_two(self) -> [Change; 2] {
        // `is_unique` loads the count with Acquire: a handle dropped on another thread just
        // before is then wholly done with the change before the count is overwritten.
        if !self.0.is_unique() {
            let other = self.clone();
            return [self, other];
        }
        let Change(a) = self;
        // SAFETY: `a` is the only handle (count 1, and it is ours by value; triomphe has no
        // weak references), so no other thread can read or change the count meanwhile.
        // triomphe's `ArcInner` is repr(C) with the count first, at `heap_ptr` (asserted
        // below and by a test). A count of 2 with a bitwise copy of the handle is exactly what
        // `clone` leaves; a handle reaches another thread only through a lock or a channel,
        // which orders this store before any access there.
        let b = unsafe {
            (*(triomphe::Arc::heap_ptr(&a) as *const std::sync::atomic::AtomicUsize))
                .store(2, std::sync::atomic::Ordering::Relaxed);
            std::ptr::read(&a)
        };
        debug_assert_eq!(triomphe::Arc::strong_count(&a), 2);
        [Change(a), Change(b)]
    }

    /// Asks the CPU to bring the change's first cache line (its reference count) in ahead of
    /// a drop: a loop that frees old changes one after another otherwise waits on each.
    pub fn prefetch(&self) {
        #[cfg(target_arch = "x86_64")]
        {
            let p = triomphe::Arc::heap_ptr(&self.0) as *const i8;
            // SAFETY: a prefetch is a hint; it never faults or changes memory.
            unsafe { std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p) };
        }
    }

    pub fn op(&self) -> ChangeOp {
        self.0.header.op
    }
    pub fn bucket(&self) -> u16 {
        self.0.header.bucket
    }
    pub fn vbucket(&self) -> u16 {
        self.0.header.vbucket
    }
    pub fn meta(&self) -> &ItemMeta {
        &self.0.header.meta
    }
    pub fn seqno(&self) -> u64 {
        self.0.header.meta.by_seqno
    }
    pub fn key(&self) -> &[u8] {
        &self.0.slice[..self.0.header.key_len as usize]
    }
    pub fn value(&self) -> &[u8] {
        &self.0.slice[self.0.header.key_len as usize..]
    }
    /// Bytes of key plus value.
    pub fn data_len(&self) -> usize {
        self.0.slice.len()
    }
    pub fn to_item(&self) -> Item {
        Item::new(self.key(), self.value(), *self.meta())
    }
}

impl std::fmt::Debug for Change {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Change")
            .field("op", &self.op())
            .field("vbucket", &self.vbucket())
            .field("key", &String::from_utf8_lossy(self.key()))
            .field("meta", self.meta())
            .finish()
    }
}

pub fn validate_key(key: &[u8]) -> Result<()> {
    if key.is_empty() {
        return Err(Error::InvalidKey("key is empty".into()));
    }
    if key.len() > MAX_KEY_LEN {
        return Err(Error::InvalidKey(format!(
            "key is {} bytes, at most {MAX_KEY_LEN} allowed",
            key.len()
        )));
    }
    Ok(())
}

/// memcached's rules: 0 never expires, up to 30 days is relative to now, larger is absolute.
/// Returns the absolute Unix time, or 0 for never. A relative time that lands beyond u32 is
/// clamped rather than wrapped.
pub fn absolute_expiry(expiry: u32, now: u32) -> u32 {
    if expiry == 0 {
        0
    } else if expiry <= RELATIVE_EXPIRY_LIMIT {
        now.saturating_add(expiry)
    } else {
        expiry
    }
}

pub fn is_expired(meta: &ItemMeta, now: u32) -> bool {
    !meta.deleted && meta.expiry != 0 && meta.expiry <= now
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_change_split_in_two_is_one_allocation_with_two_owners() {
        let meta = ItemMeta {
            by_seqno: 7,
            ..Default::default()
        };
        let [a, b] = Change::new(ChangeOp::Mutation, 1, 2, b"key", b"value", meta).into_two();
        assert!(triomphe::Arc::ptr_eq(&a.0, &b.0));
        assert_eq!(triomphe::Arc::strong_count(&a.0), 2);
        assert_eq!(
            (a.key(), a.value(), a.seqno()),
            (&b"key"[..], &b"value"[..], 7)
        );
        let c = b.clone();
        assert_eq!(triomphe::Arc::strong_count(&a.0), 3);
        drop((b, c));
        assert_eq!(triomphe::Arc::strong_count(&a.0), 1);
        // A change that is shared already is cloned.
        let kept = a.clone();
        let [d, e] = a.into_two();
        assert_eq!(triomphe::Arc::strong_count(&kept.0), 3);
        drop((d, e));
        assert_eq!(triomphe::Arc::strong_count(&kept.0), 1);
    }

    #[test]
    fn expiry_rules() {
        assert_eq!(absolute_expiry(0, 1000), 0);
        assert_eq!(absolute_expiry(10, 1000), 1010);
        assert_eq!(
            absolute_expiry(RELATIVE_EXPIRY_LIMIT, 1000),
            1000 + RELATIVE_EXPIRY_LIMIT
        );
        assert_eq!(
            absolute_expiry(RELATIVE_EXPIRY_LIMIT + 1, 1000),
            RELATIVE_EXPIRY_LIMIT + 1
        );
    }

    #[test]
    fn key_limits() {
        assert!(validate_key(b"").is_err());
        assert!(validate_key(&[b'k'; 250]).is_ok());
        assert!(validate_key(&[b'k'; 251]).is_err());
    }
}

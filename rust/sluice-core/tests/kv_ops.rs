//! Read-modify-write operations with memcached's semantics: APPEND/PREPEND, INCR/DECR,
//! TOUCH, FLUSH, and their CAS rules.

mod common;

use sluice_core::item::RELATIVE_EXPIRY_LIMIT;
use sluice_core::wal::WalMode;
use sluice_core::{Engine, Error, StoreRequest};

fn engine() -> (tempfile::TempDir, Engine) {
    let dir = tempfile::tempdir().unwrap();
    let e = Engine::open(common::config(dir.path(), WalMode::Write, 8)).unwrap();
    (dir, e)
}

fn value(e: &Engine, key: &[u8]) -> Option<Vec<u8>> {
    let b = e.bucket("default").unwrap();
    e.get(&b, key).unwrap().map(|i| i.value().to_vec())
}

#[test]
fn append_and_prepend_need_the_key_and_keep_flags() {
    let (_d, e) = engine();
    let b = e.bucket("default").unwrap();
    assert_eq!(
        e.concat(&b, b"k", b"x", true, 0, None),
        Err(Error::NotStored)
    );
    let mut req = StoreRequest::set(b"k", b"mid");
    req.flags = 0xabcd;
    let first = e.store(&b, &req).unwrap();
    e.concat(&b, b"k", b"-end", true, 0, None).unwrap();
    let r = e.concat(&b, b"k", b"start-", false, 0, None).unwrap();
    assert!(r.cas > first.cas && r.seqno == first.seqno + 2);
    let it = e.get(&b, b"k").unwrap().unwrap();
    assert_eq!(
        (it.value(), it.meta.flags, it.meta.rev_seqno),
        (&b"start-mid-end"[..], 0xabcd, 3)
    );
    assert_eq!(
        e.concat(&b, b"k", b"x", true, first.cas, None),
        Err(Error::Exists),
        "stale CAS"
    );
    e.concat(&b, b"k", b"!", true, r.cas, None).unwrap();
    assert_eq!(value(&e, b"k").unwrap(), b"start-mid-end!");
}

#[test]
fn incr_and_decr_follow_memcached() {
    let (_d, e) = engine();
    let b = e.bucket("default").unwrap();
    // Missing: created with the initial value, unless the expiry is 0xffffffff.
    assert_eq!(
        e.arithmetic(&b, b"n", 5, 10, u32::MAX, true, 0, None)
            .unwrap_err(),
        Error::NotFound
    );
    assert_eq!(
        e.arithmetic(&b, b"n", 5, 10, 0, true, 0, None).unwrap().1,
        10
    );
    assert_eq!(
        e.arithmetic(&b, b"n", 5, 10, 0, true, 0, None).unwrap().1,
        15
    );
    assert_eq!(
        e.arithmetic(&b, b"n", 100, 0, 0, false, 0, None).unwrap().1,
        0,
        "DECR stops at 0"
    );
    e.store(&b, &StoreRequest::set(b"n", b"18446744073709551615"))
        .unwrap();
    assert_eq!(
        e.arithmetic(&b, b"n", 2, 0, 0, true, 0, None).unwrap().1,
        1,
        "INCR wraps at 2^64"
    );
    assert_eq!(value(&e, b"n").unwrap(), b"1");
    e.store(&b, &StoreRequest::set(b"s", b"not a number"))
        .unwrap();
    assert_eq!(
        e.arithmetic(&b, b"s", 1, 0, 0, true, 0, None).unwrap_err(),
        Error::NotNumeric
    );
    assert_eq!(
        value(&e, b"s").unwrap(),
        b"not a number",
        "untouched on error"
    );
}

#[test]
fn touch_sets_a_new_expiry_and_flush_deletes_everything() {
    let (_d, e) = engine();
    let b = e.bucket("default").unwrap();
    assert_eq!(e.touch(&b, b"t", 100, None).unwrap_err(), Error::NotFound);
    e.store(&b, &StoreRequest::set(b"t", b"v")).unwrap();
    let (r, it) = e.touch(&b, b"t", 100, None).unwrap();
    assert!(it.meta.expiry > 0 && it.value() == b"v" && r.seqno == 2);
    e.touch(&b, b"t", RELATIVE_EXPIRY_LIMIT + 1, None).unwrap(); // absolute, in 1970
    assert_eq!(value(&e, b"t"), None, "touched into the past: expired");
    for i in 0..50 {
        e.store(&b, &StoreRequest::set(format!("f{i}").as_bytes(), b"v"))
            .unwrap();
    }
    assert_eq!(e.flush(&b).unwrap(), 50);
    assert!(common::live(&e, &b).is_empty());
    let tombstones = common::dump(&e, &b).values().filter(|v| v.1).count();
    assert!(
        tombstones >= 50,
        "every flushed item left a deletion for streams"
    );
}

#[test]
fn a_vbucket_state_change_is_in_the_wal_once_it_settles_and_survives_a_reopen() {
    use sluice_core::vbucket::VbState;
    let dir = tempfile::tempdir().unwrap();
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    let b = engine.bucket("default").unwrap();
    let w = engine.write_vbucket_state(&b, 2, VbState::Replica).unwrap();
    let lsn = w.lsn();
    assert!(lsn > 0, "the change has a WAL record to wait for");
    assert_eq!(
        engine.vbucket_state(&b, 2),
        Some(VbState::Replica),
        "applied at once"
    );
    engine.settle(&b, w).unwrap();
    assert!(
        engine.wal().written_lsn() >= lsn,
        "settled: the WAL file holds it"
    );
    // The same state again writes nothing and waits for nothing new.
    let again = engine.write_vbucket_state(&b, 2, VbState::Replica).unwrap();
    assert!(again.lsn() <= engine.wal().written_lsn());
    drop(engine);
    let engine = Engine::open(common::config(dir.path(), WalMode::Write, 4)).unwrap();
    let b = engine.bucket("default").unwrap();
    assert_eq!(engine.vbucket_state(&b, 2), Some(VbState::Replica));
}

#[test]
fn a_write_reports_the_vbucket_uuid_its_seqno_belongs_to() {
    use sluice_core::vbucket::VbState;
    let (_dir, e) = engine();
    let b = e.bucket("default").unwrap();
    let first = e.store(&b, &StoreRequest::set(b"k", b"v1")).unwrap();
    let uuid = e.vbucket_uuid(&b, first.vbucket).unwrap();
    assert_ne!(uuid, 0);
    assert_eq!(first.vbucket_uuid, uuid, "the failover log's newest entry");
    // Made replica, then active again: a new history begins, and the next write says so.
    e.set_vbucket_state(&b, first.vbucket, VbState::Replica)
        .unwrap();
    e.set_vbucket_state(&b, first.vbucket, VbState::Active)
        .unwrap();
    let second = e.store(&b, &StoreRequest::set(b"k", b"v2")).unwrap();
    let now = e.vbucket_uuid(&b, second.vbucket).unwrap();
    assert_ne!(
        now, uuid,
        "taking the vbucket back starts a failover log entry"
    );
    assert_eq!(second.vbucket_uuid, now);
}

#[test]
fn a_replica_adopts_a_long_failover_log_once() {
    use sluice_core::failover::{FailoverEntry, MAX_FAILOVER_ENTRIES};
    use sluice_core::vbucket::VbState;
    let (_dir, e) = engine();
    let b = e.bucket("default").unwrap();
    e.set_vbucket_state(&b, 3, VbState::Replica).unwrap();
    // An active may send more entries than a vbucket keeps.
    let log: Vec<FailoverEntry> = (0..MAX_FAILOVER_ENTRIES as u64 + 5)
        .rev()
        .map(|i| FailoverEntry {
            uuid: 1000 + i,
            seqno: i * 10,
        })
        .collect();
    e.adopt_failover_log(&b, 3, &log).unwrap();
    assert_eq!(
        e.failover_log(&b, 3).unwrap(),
        log[..MAX_FAILOVER_ENTRIES].to_vec()
    );
    let lsn = e.wal().last_lsn();
    // The same log again, as every batch of the stream carries it: nothing to log.
    e.adopt_failover_log(&b, 3, &log).unwrap();
    assert_eq!(e.wal().last_lsn(), lsn);
}

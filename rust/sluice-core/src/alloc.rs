//! The allocator sluice's binaries install (feature `mimalloc`, built without transparent huge
//! pages). Measured on the engine's ingest of 1M items (bench/engine_bench.py), resident bytes
//! per item beyond key and value: glibc malloc 120-157, mimalloc 92-119 by default, 75-89
//! without huge pages. Huge pages make partly used 2 MiB pages resident, which costs an
//! in-memory store more than the TLB misses they save.

pub type Allocator = mimalloc::MiMalloc;

/// The value binaries declare as `#[global_allocator]`.
pub const ALLOCATOR: Allocator = mimalloc::MiMalloc;

// Option number in mimalloc 3 (libmimalloc-sys builds v3 unless its `v2` feature is on);
// the test below checks the numbering against known defaults.
const PURGE_DELAY: libmimalloc_sys::mi_option_t = 15;
/// Milliseconds before freed pages go back to the OS (mimalloc's default here is 1000).
const PURGE_DELAY_MS: std::ffi::c_long = 100;

/// Call at start-up: freed pages then go back to the OS after 100 ms instead of a second, so
/// changes freed in bulk once persisted do not stay resident.
pub fn tune() {
    // SAFETY: setting an option is a plain store into mimalloc's option table.
    unsafe { libmimalloc_sys::mi_option_set(PURGE_DELAY, PURGE_DELAY_MS) };
}

/// Returns freed memory of this thread's heap and of abandoned pages to the OS.
pub fn release_free_memory() {
    // SAFETY: mi_collect only touches the allocator's own bookkeeping.
    unsafe { libmimalloc_sys::mi_collect(true) };
}

#[cfg(test)]
mod tests {
    #[test]
    fn options_apply() {
        super::tune();
        // SAFETY: reading options.
        unsafe {
            assert_eq!(
                libmimalloc_sys::mi_option_get(super::PURGE_DELAY),
                super::PURGE_DELAY_MS
            );
            // Options around them hold their documented defaults, so the numbering is the one
            // we expect: max_errors (19) is 32 and arena_reserve (23) is 1 GiB in KiB.
            assert_eq!(libmimalloc_sys::mi_option_get(19), 32);
            assert_eq!(libmimalloc_sys::mi_option_get(23), 1 << 20);
        }
    }
}

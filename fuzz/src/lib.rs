//! What the targets that drive a whole front share.

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use sluice_server::auth::Users;
use sluice_server::kv::KvContext;

/// The memcached front's context over one engine (no WAL) in /dev/shm, made on first use and
/// kept for every case of the run: state from earlier cases (items, locks) stays, as on a
/// long-lived server.
pub fn kv_context(target: &str) -> Arc<KvContext> {
    static CTX: OnceLock<Arc<KvContext>> = OnceLock::new();
    CTX.get_or_init(|| {
        let dir = PathBuf::from(format!(
            "/dev/shm/sluice-fuzz-{target}-{}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Arc::new(KvContext::scratch(&dir, Users::default()).expect("engine"))
    })
    .clone()
}

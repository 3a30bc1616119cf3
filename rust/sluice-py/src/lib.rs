//! PyO3 glue only: `sluice._native`, the Python face of the workspace. One concept per module:
//! `errors` (the exception hierarchy), `settings` (the configuration objects), `defaults` (the
//! Rust defaults of the configuration keys, which config.py reads), `items` (what engine calls
//! return), `engine` (the embedded engine), `server` (the network server), `dcp` (the DCP
//! consumer), `tuples` (a space's tuples as typed columns), `policy` (the policy plugins'
//! questions), `tank` (TANK's frames for the Python client), `tools` (WAL dump, benchmark drivers),
//! `logging` (the Rust side's log lines, handed to Python's `logging` by a thread of their own).
//! Every call that can block (disk, network, durability waits) releases the GIL.
//!
//! May depend on every other crate of the workspace; none depends on it.

mod dcp;
mod defaults;
mod engine;
mod errinj;
mod errors;
mod greenstack;
mod items;
mod logging;
mod policy;
mod records;
mod server;
mod settings;
mod tank;
mod tools;
mod tuples;

use pyo3::prelude::*;

#[global_allocator]
static GLOBAL: sluice_core::alloc::Allocator = sluice_core::alloc::ALLOCATOR;

// Declares that the module relies on the GIL, as every PyO3 module did before 0.28 made
// free-threaded use the default: a free-threaded interpreter keeps its GIL on to import it.
#[pymodule(gil_used = true)]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    sluice_core::alloc::tune();
    logging::install(m.py());
    m.add_class::<settings::EngineSettings>()?;
    m.add_class::<settings::BucketSettings>()?;
    m.add_class::<engine::EmbeddedEngine>()?;
    m.add_class::<server::Server>()?;
    m.add_class::<server::GreenstackWarmup>()?;
    m.add_class::<items::MutationInfo>()?;
    m.add_class::<items::ItemView>()?;
    m.add_class::<dcp::DcpConsumer>()?;
    m.add_class::<dcp::RawBatch>()?;
    m.add_class::<policy::PolicyCall>()?;
    m.add_function(wrap_pyfunction!(dcp::vbucket_positions, m)?)?;
    m.add_function(wrap_pyfunction!(tools::wal_dump, m)?)?;
    m.add_function(wrap_pyfunction!(tools::tls_issue, m)?)?;
    m.add_function(wrap_pyfunction!(tools::run_bench, m)?)?;
    m.add_function(wrap_pyfunction!(tools::tap_drain, m)?)?;
    m.add_function(wrap_pyfunction!(tools::tarantool_tail, m)?)?;
    m.add_function(wrap_pyfunction!(tools::tarantool_schema, m)?)?;
    m.add_function(wrap_pyfunction!(tools::vbucket_of, m)?)?;
    m.add_function(wrap_pyfunction!(logging::flush_logs, m)?)?;
    // What the Rust side logged before the interpreter exits is written.
    m.py()
        .import("atexit")?
        .call_method1("register", (m.getattr("flush_logs")?,))?;
    m.add_function(wrap_pyfunction!(errinj::errinj_set, m)?)?;
    m.add_function(wrap_pyfunction!(errinj::errinj_enable, m)?)?;
    m.add_function(wrap_pyfunction!(errinj::errinj_values, m)?)?;
    m.add_function(wrap_pyfunction!(greenstack::greenstack_frame, m)?)?;
    m.add_function(wrap_pyfunction!(greenstack::greenstack_decode, m)?)?;
    m.add_function(wrap_pyfunction!(tank::tank_produce_frame, m)?)?;
    m.add_function(wrap_pyfunction!(tank::check_topic_settings, m)?)?;
    m.add_function(wrap_pyfunction!(server::check_server_settings, m)?)?;
    m.add_function(wrap_pyfunction!(tank::tank_consume_frame, m)?)?;
    m.add_function(wrap_pyfunction!(tank::tank_consume_answer, m)?)?;
    m.add_function(wrap_pyfunction!(tools::msgpack_json, m)?)?;
    m.add_function(wrap_pyfunction!(tuples::tuple_columns, m)?)?;
    errors::register(m)?;
    m.add("DEFAULTS", defaults::defaults(m.py())?)?;
    m.add("FRONTS", defaults::fronts(m.py())?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}

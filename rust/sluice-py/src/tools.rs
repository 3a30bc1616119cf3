//! Standalone functions behind the command-line tools: the WAL dump (`sluice wal dump`), the
//! native load generator (`sluice bench`) and TAP reader of the benchmarks, and the key to
//! vbucket mapping.

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use sluice_core::Error;

use crate::errors::{to_py, SluiceError};
use crate::settings::{secs, socket_addr};

/// Prints the records of a WAL segment or snapshot as JSON lines to the file descriptor `fd`.
/// Returns how many records were printed.
#[pyfunction]
pub(crate) fn wal_dump(py: Python<'_>, path: PathBuf, fd: i32) -> PyResult<u64> {
    crate::logging::detach_command(py, || {
        let mut out = std::io::BufWriter::new(output(fd)?);
        let n = sluice_core::dump::dump(&path, &mut out)?;
        match std::io::Write::flush(&mut out) {
            Err(e) if e.kind() != std::io::ErrorKind::BrokenPipe => {
                Err(Error::io("writing output", e))
            }
            _ => Ok(n),
        }
    })
    .map_err(to_py)
}

/// A file of our own for the caller's descriptor `fd` (stdout), closed when dropped.
fn output(fd: i32) -> Result<std::fs::File, Error> {
    use std::os::fd::FromRawFd;
    // SAFETY: dup gives us our own descriptor to own and close.
    let own = unsafe { libc::dup(fd) };
    if own < 0 {
        return Err(Error::Io(format!("bad file descriptor {fd}")));
    }
    Ok(unsafe { std::fs::File::from_raw_fd(own) })
}

/// Follows a Tarantool at `address` as an anonymous replica and writes its rows to `fd` as JSON
/// lines (`sluice_tools::tarantool_tail`). Returns how many rows were written.
#[pyfunction]
#[pyo3(signature = (address, fd, *, user=None, password=None, snapshot=false, max_rows=0, timeout=10.0, idle=10.0, state=None))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tarantool_tail(
    py: Python<'_>,
    address: &str,
    fd: i32,
    user: Option<String>,
    password: Option<String>,
    snapshot: bool,
    max_rows: u64,
    timeout: f64,
    idle: f64,
    state: Option<PathBuf>,
) -> PyResult<u64> {
    let tail = sluice_tools::tarantool_tail::Tail {
        upstream: sluice_server::upstream::UpstreamConfig {
            address: address.to_string(),
            user: user.map(|u| (u, password.unwrap_or_default())),
            timeout: secs("timeout", timeout)?,
        },
        snapshot,
        max_rows,
        idle: secs("idle", idle)?,
        state,
    };
    crate::logging::detach_command(py, || {
        let mut out = std::io::BufWriter::new(output(fd).map_err(to_py)?);
        tail.run(&mut out)
            .map_err(|e| SluiceError::new_err(format!("{address}: {e}")))
    })
}

/// The `_vspace` and `_vindex` tuples of the Tarantool at `address`, each as JSON text
/// (`sluice_tools::tarantool_schema`): (spaces, indexes).
#[pyfunction]
#[pyo3(signature = (address, *, user=None, password=None, timeout=10.0))]
pub(crate) fn tarantool_schema(
    py: Python<'_>,
    address: &str,
    user: Option<String>,
    password: Option<String>,
    timeout: f64,
) -> PyResult<(Vec<String>, Vec<String>)> {
    let upstream = sluice_server::upstream::UpstreamConfig {
        address: address.to_string(),
        user: user.map(|u| (u, password.unwrap_or_default())),
        timeout: secs("timeout", timeout)?,
    };
    let schema =
        crate::logging::detach_command(py, || sluice_tools::tarantool_schema::read(&upstream))
            .map_err(|e| SluiceError::new_err(format!("{address}: {e}")))?;
    Ok((schema.spaces, schema.indexes))
}

/// Reads a TAP stream natively (acknowledging what asks) until `count` changes arrived (0: until
/// the server closes it) or `timeout` passes; for benchmarks. Returns counts and seconds.
#[pyfunction]
#[pyo3(signature = (target, *, name=None, flags=0, backfill_since=None, vbuckets=None, count=0, timeout=60.0))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn tap_drain<'py>(
    py: Python<'py>,
    target: &str,
    name: Option<Vec<u8>>,
    flags: u32,
    backfill_since: Option<u64>,
    vbuckets: Option<Vec<u16>>,
    count: u64,
    timeout: f64,
) -> PyResult<Bound<'py, PyDict>> {
    use sluice_proto::tap::{connect_flag, TapConnect};
    let mut flags = flags;
    if backfill_since.is_some() {
        flags |= connect_flag::BACKFILL;
    }
    if vbuckets.is_some() {
        flags |= connect_flag::LIST_VBUCKETS;
    }
    let connect = TapConnect {
        name: name.unwrap_or_default(),
        flags,
        backfill_since,
        vbuckets,
        checkpoints: Vec::new(),
    };
    let addr = socket_addr("target", target)?;
    let timeout = secs("timeout", timeout)?;
    let r = crate::logging::detach_command(py, || {
        sluice_tools::tap_reader::drain(addr, &connect, count, timeout)
    })
    .map_err(|e| SluiceError::new_err(format!("TAP stream from {target}: {e}")))?;
    let d = PyDict::new(py);
    d.set_item("messages", r.messages)?;
    d.set_item("mutations", r.mutations)?;
    d.set_item("deletions", r.deletions)?;
    d.set_item("acks_sent", r.acks_sent)?;
    d.set_item("bytes", r.bytes)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("closed", r.closed)?;
    Ok(d)
}

/// Drives a memcached binary protocol server (sluice or memcached) or, with `protocol="iproto"`,
/// an iproto one (sluice or Tarantool: SELECT and REPLACE in `space`), and reports throughput,
/// outcome counts and latency percentiles.
#[pyfunction]
#[pyo3(name = "bench", signature = (target, *, connections=16, pipeline=32, duration=10.0, count=0, keys=100_000, key_size=16, value_size=100, get_ratio=0.9, prefill=true, threads=2, user=None, password=None, cacert=None, protocol="memcached", space=512, durability=None, unordered=false))]
#[allow(clippy::too_many_arguments)]
pub(crate) fn run_bench<'py>(
    py: Python<'py>,
    target: &str,
    connections: usize,
    pipeline: usize,
    duration: f64,
    count: u64,
    keys: u64,
    key_size: usize,
    value_size: usize,
    get_ratio: f64,
    prefill: bool,
    threads: usize,
    user: Option<String>,
    password: Option<String>,
    cacert: Option<PathBuf>,
    protocol: &str,
    space: u32,
    durability: Option<&str>,
    unordered: bool,
) -> PyResult<Bound<'py, PyDict>> {
    let protocol = match protocol {
        "memcached" => sluice_tools::bench::Protocol::Memcached,
        "iproto" if cacert.is_some() => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "iproto has no TLS: --cacert is for the memcached protocol",
            ))
        }
        "iproto" => sluice_tools::bench::Protocol::Iproto { space },
        "greenstack" if cacert.is_some() => {
            return Err(pyo3::exceptions::PyValueError::new_err(
                "Greenstack has no TLS yet: --cacert is for the memcached protocol",
            ))
        }
        "greenstack" => sluice_tools::bench::Protocol::Greenstack,
        other => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "protocol {other:?}: memcached, iproto or greenstack"
            )))
        }
    };
    use sluice_tools::bench::{Durability, Protocol};
    let durability = match (durability.map(|d| (d, Durability::parse(d))), protocol) {
        (None, _) => None,
        (Some((d, None)), _) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "durability {d:?}: none, persist, majority, majority_and_persist_active or persist_to_majority"
            )))
        }
        (Some((_, Some(level))), Protocol::Greenstack) => Some(level),
        (
            Some((
                _,
                Some(
                    level @ (Durability::Majority
                    | Durability::MajorityAndPersistActive
                    | Durability::PersistToMajority),
                ),
            )),
            Protocol::Memcached,
        ) => Some(level),
        (Some((d, Some(_))), _) => {
            return Err(pyo3::exceptions::PyValueError::new_err(format!(
                "durability {d:?}: the memcached protocol asks for majority, majority_and_persist_active or \
                 persist_to_majority; iproto for none"
            )))
        }
    };
    if unordered && !matches!(protocol, Protocol::Memcached) {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "unordered is the memcached protocol's HELLO UnorderedExecution (Greenstack's replies are unordered anyway)",
        ));
    }
    let tls = cacert
        .map(|ca| sluice_server::tls::ClientTls::trusting("--cacert", &ca))
        .transpose()
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(e.to_string()))?;
    // Values up to sluice's own item size limit, so every request can be framed.
    if connections == 0
        || pipeline == 0
        || keys == 0
        || !(1..=250).contains(&key_size)
        || value_size > 64 << 20
        || !(0.0..=1.0).contains(&get_ratio)
    {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "connections, pipeline and keys must be positive, key_size in 1..=250, value_size at most 64 MiB, \
             get_ratio in 0..=1",
        ));
    }
    let cfg = sluice_tools::bench::BenchConfig {
        target: socket_addr("target", target)?,
        protocol,
        connections,
        pipeline,
        duration: secs("duration", duration)?,
        count,
        keys,
        key_size,
        value_size,
        get_ratio,
        prefill,
        threads,
        user: user.zip(password),
        tls,
        durability,
        unordered,
    };
    let r = crate::logging::detach_command(py, || sluice_tools::bench::run(cfg))
        .map_err(|e| SluiceError::new_err(format!("bench against {target}: {e}")))?;
    let d = PyDict::new(py);
    d.set_item("ops", r.ops)?;
    d.set_item("gets", r.gets)?;
    d.set_item("sets", r.sets)?;
    d.set_item("misses", r.misses)?;
    d.set_item("errors", r.errors)?;
    d.set_item("first_error_status", r.first_error_status)?;
    d.set_item("seconds", r.seconds)?;
    d.set_item("ops_per_s", r.ops_per_s)?;
    d.set_item("latency_us", percentiles(py, &r.latency_us)?)?;
    d.set_item("read_latency_us", percentiles(py, &r.read_latency_us)?)?;
    Ok(d)
}

/// Latency percentiles as `{"p50": us, ..., "max": us}`.
fn percentiles<'py>(py: Python<'py>, latency_us: &[(f64, u64)]) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for &(p, us) in latency_us {
        let name = if p >= 100.0 {
            "max".to_string()
        } else {
            format!("p{p}")
        };
        d.set_item(name, us)?;
    }
    Ok(d)
}

/// The vbucket of a key for a bucket of `num_vbuckets` (Couchbase's mapping).
#[pyfunction]
pub(crate) fn vbucket_of(key: &[u8], num_vbuckets: u16) -> PyResult<u16> {
    if num_vbuckets == 0 {
        return Err(pyo3::exceptions::PyValueError::new_err(
            "num_vbuckets must be positive",
        ));
    }
    Ok(sluice_core::hash::vbucket_of(key, num_vbuckets))
}

/// One MessagePack value (an iproto tuple or key, as a space's bucket stores them) as JSON
/// text (`sluice_proto::iproto::json`: bytes as {"base64": ...}, UUIDs and decimals as text).
/// ValueError when `data` is not exactly one value or nests deeper than iproto allows.
#[pyfunction]
pub(crate) fn msgpack_json(data: &[u8]) -> PyResult<String> {
    use sluice_proto::msgpack::Reader;
    let mut r = Reader::new(data);
    let mut out = String::new();
    sluice_proto::iproto::json::write_json(&mut r, &mut out, sluice_proto::iproto::MAX_DEPTH)
        .map_err(|e| pyo3::exceptions::PyValueError::new_err(format!("not MessagePack: {e}")))?;
    if !r.is_empty() {
        return Err(pyo3::exceptions::PyValueError::new_err(format!(
            "{} bytes after the MessagePack value",
            r.rest().len()
        )));
    }
    Ok(out)
}

/// A CA and a certificate it signed for a node naming `names` and `addresses` (IP addresses),
/// good for `years`: (CA certificate, CA key, certificate, key), PEM (`sluice tls init`).
#[pyfunction]
#[pyo3(signature = (names, addresses, *, years=2))]
pub(crate) fn tls_issue(
    names: Vec<String>,
    addresses: Vec<String>,
    years: u32,
) -> PyResult<(String, String, String, String)> {
    let ips = addresses
        .iter()
        .map(|a| {
            a.parse::<std::net::IpAddr>().map_err(|_| {
                pyo3::exceptions::PyValueError::new_err(format!("{a:?} is not an IP address"))
            })
        })
        .collect::<PyResult<Vec<_>>>()?;
    let issued = sluice_server::tls::issue_node_certificate(&names, &ips, years)
        .map_err(pyo3::exceptions::PyValueError::new_err)?;
    Ok((
        issued.ca_certificate,
        issued.ca_key,
        issued.certificate,
        issued.key,
    ))
}

//! TLS (rustls, ring provider) for the KV TLS listener, the admin endpoint and the replica's
//! connection to its active.
//!
//! The server side keeps its certificate and key in a `ReloadableTls`: connections accepted
//! after a successful `reload` (SIGHUP) get the new certificate; a reload that fails keeps the
//! old one. Connections are a `MaybeTls`, one enum for plain and TLS streams, so the connection,
//! DCP and TAP code runs unchanged over either (plain TCP pays one match per poll).
//!
//! The replica's consumer is blocking and writes from two threads (its own, and the reader's
//! acknowledgements) while one of them reads: `connect_client` splits a rustls client
//! connection into a `SyncReader` and a `SyncWriter` that share the TLS state under a lock held
//! only while records are encrypted, decrypted or written, never while waiting for the socket.

use std::io::{self, Read, Write};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use bytes::BytesMut;
use parking_lot::{Mutex, RwLock};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;

/// The server's certificate files, as configured (`tls.*`).
#[derive(Debug, Clone)]
pub struct TlsSettings {
    /// PEM: the certificate chain, leaf first.
    pub certificate: PathBuf,
    /// PEM: the private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// PEM: CAs whose certificates clients of the TLS KV listener must present; None: clients
    /// need no certificate.
    pub client_ca: Option<PathBuf>,
    /// Serve the admin endpoint over HTTPS (with the same certificate).
    pub admin: bool,
}

/// Why certificates could not be loaded or a TLS connection made. `key` is the configuration
/// key (or command-line option) that named the file; the texts are what the configuration
/// check, the logs and `sluice` commands report.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    #[error("{key}: cannot read {}: {source}", path.display())]
    Read {
        key: String,
        path: PathBuf,
        source: io::Error,
    },
    #[error("{key}: {} is not valid PEM: {source}", path.display())]
    NotPem {
        key: String,
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{key}: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)", path.display())]
    NoCertificate { key: String, path: PathBuf },
    #[error("{key}: {} holds no usable PEM private key: {source}", path.display())]
    NoKey {
        key: String,
        path: PathBuf,
        source: rustls::pki_types::pem::Error,
    },
    #[error("{key}: a certificate in {} is not a usable CA: {source}", path.display())]
    NotCa {
        key: String,
        path: PathBuf,
        source: rustls::Error,
    },
    /// The CAs could not make a verifier (none in the file, say).
    #[error("{key}: {why}")]
    Verifier { key: String, why: String },
    /// The private key in `key_path` (configured as `key`) is not the certificate's.
    #[error(
        "{key}: {} does not go with the certificate in {}: {source}",
        key_path.display(),
        certificate.display()
    )]
    KeyMismatch {
        key: String,
        key_path: PathBuf,
        certificate: PathBuf,
        /// Boxed to keep the error small (the other variants are).
        source: Box<rustls::Error>,
    },
    /// rustls refused the protocol versions (`prefix`: `tls` or the client's key prefix).
    #[error("{prefix}: {source}")]
    Protocols {
        prefix: String,
        source: rustls::Error,
    },
    #[error("tls.client_ca: {0}")]
    ClientCa(rustls::server::VerifierBuilderError),
    #[error("TLS handshake failed: {0}")]
    Handshake(io::Error),
    #[error("no TLS handshake within {HANDSHAKE_TIMEOUT:?}")]
    HandshakeTimeout,
    #[error("{host:?} is not a TLS server name: {source}")]
    ServerName {
        host: String,
        source: rustls::pki_types::InvalidDnsNameError,
    },
    #[error("{0}")]
    Socket(io::Error),
    #[error("TLS to {address}: {source}")]
    Client {
        address: String,
        source: rustls::Error,
    },
    #[error("TLS handshake with {address} failed: {source}")]
    ClientHandshake { address: String, source: io::Error },
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file; `key` names the configuration key in errors.
pub fn load_certificates(key: &str, path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let read = read_file(key, path)?;
    let certs = CertificateDer::pem_slice_iter(&read)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|source| TlsError::NotPem {
            key: key.to_string(),
            path: path.to_path_buf(),
            source,
        })?;
    if certs.is_empty() {
        return Err(TlsError::NoCertificate {
            key: key.to_string(),
            path: path.to_path_buf(),
        });
    }
    Ok(certs)
}

fn read_file(key: &str, path: &Path) -> Result<Vec<u8>, TlsError> {
    std::fs::read(path).map_err(|source| TlsError::Read {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    })
}

fn load_key(key: &str, path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    let read = read_file(key, path)?;
    PrivateKeyDer::from_pem_slice(&read).map_err(|source| TlsError::NoKey {
        key: key.to_string(),
        path: path.to_path_buf(),
        source,
    })
}

fn load_roots(key: &str, path: &Path) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for c in load_certificates(key, path)? {
        roots.add(c).map_err(|source| TlsError::NotCa {
            key: key.to_string(),
            path: path.to_path_buf(),
            source,
        })?;
    }
    Ok(roots)
}

/// Trusts a server certificate that chains to the CAs given, as WebPKI checks it, and also one
/// that is itself, byte for byte, a certificate of the CA file: the self-signed certificate
/// `openssl req -x509` makes by default carries CA:TRUE, which WebPKI refuses as a server's own
/// (CaUsedAsEndEntity) where OpenSSL's clients, curl and Couchbase's SDKs take it. The
/// handshake's signatures are checked alike, so only the holder of that certificate's key
/// passes; the name is not checked for a pinned one (the file names the very certificate).
#[derive(Debug)]
struct ChainedOrPinned {
    chained: Arc<rustls::client::WebPkiServerVerifier>,
    pinned: Vec<CertificateDer<'static>>,
}

impl rustls::client::danger::ServerCertVerifier for ChainedOrPinned {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp_response: &[u8],
        now: rustls::pki_types::UnixTime,
    ) -> Result<rustls::client::danger::ServerCertVerified, rustls::Error> {
        match self.chained.verify_server_cert(
            end_entity,
            intermediates,
            server_name,
            ocsp_response,
            now,
        ) {
            // Out of date is out of date, pinned or not.
            Err(rustls::Error::InvalidCertificate(
                e @ (rustls::CertificateError::Expired
                | rustls::CertificateError::ExpiredContext { .. }
                | rustls::CertificateError::NotValidYet
                | rustls::CertificateError::NotValidYetContext { .. }
                | rustls::CertificateError::Revoked),
            )) => Err(rustls::Error::InvalidCertificate(e)),
            Err(_)
                if self
                    .pinned
                    .iter()
                    .any(|c| c.as_ref() == end_entity.as_ref()) =>
            {
                Ok(rustls::client::danger::ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chained.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &rustls::DigitallySignedStruct,
    ) -> Result<rustls::client::danger::HandshakeSignatureValid, rustls::Error> {
        self.chained.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<rustls::SignatureScheme> {
        self.chained.supported_verify_schemes()
    }
}

/// The server configurations built from one reading of the files: the KV listener's (asks for
/// client certificates when `client_ca` is set) and the admin endpoint's (never does).
struct ServerConfigs {
    kv: Arc<rustls::ServerConfig>,
    admin: Arc<rustls::ServerConfig>,
}

fn server_configs(s: &TlsSettings) -> Result<ServerConfigs, TlsError> {
    let chain = load_certificates("tls.certificate", &s.certificate)?;
    let key = load_key("tls.key", &s.key)?;
    let builder = || {
        rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Protocols {
                prefix: "tls".into(),
                source,
            })
    };
    let mismatch = |source| TlsError::KeyMismatch {
        key: "tls.key".into(),
        key_path: s.key.clone(),
        certificate: s.certificate.clone(),
        source: Box::new(source),
    };
    let kv = match &s.client_ca {
        None => builder()?.with_no_client_auth(),
        Some(ca) => {
            let roots = load_roots("tls.client_ca", ca)?;
            let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                Arc::new(roots),
                provider(),
            )
            .build()
            .map_err(TlsError::ClientCa)?;
            builder()?.with_client_cert_verifier(verifier)
        }
    }
    .with_single_cert(chain.clone(), key.clone_key())
    .map_err(mismatch)?;
    let admin = builder()?
        .with_no_client_auth()
        .with_single_cert(chain, key)
        .map_err(mismatch)?;
    Ok(ServerConfigs {
        kv: Arc::new(kv),
        admin: Arc::new(admin),
    })
}

/// The server's TLS configuration, replaced whole by a successful reload.
pub struct ReloadableTls {
    settings: TlsSettings,
    current: RwLock<ServerConfigs>,
}

impl std::fmt::Debug for ReloadableTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReloadableTls")
            .field("settings", &self.settings)
            .finish()
    }
}

impl ReloadableTls {
    /// Reads the files; an error names the key and the file.
    pub fn load(settings: TlsSettings) -> Result<ReloadableTls, TlsError> {
        let current = RwLock::new(server_configs(&settings)?);
        Ok(ReloadableTls { settings, current })
    }

    /// Reads the files again: connections accepted afterwards get the new certificate. On an
    /// error the configuration in use stays.
    pub fn reload(&self) -> Result<(), TlsError> {
        let fresh = server_configs(&self.settings)?;
        *self.current.write() = fresh;
        Ok(())
    }

    pub fn settings(&self) -> &TlsSettings {
        &self.settings
    }

    pub fn kv_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.read().kv.clone())
    }

    pub fn admin_acceptor(&self) -> tokio_rustls::TlsAcceptor {
        tokio_rustls::TlsAcceptor::from(self.current.read().admin.clone())
    }
}

/// How long a client has to finish its TLS handshake.
pub const HANDSHAKE_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(10);

/// Runs the server side of a handshake within `HANDSHAKE_TIMEOUT`; the error says why it
/// failed (a plain-text client on the TLS port, an unknown client certificate, a timeout).
pub async fn accept(
    acceptor: tokio_rustls::TlsAcceptor,
    socket: TcpStream,
) -> Result<MaybeTls, TlsError> {
    match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(socket)).await {
        Ok(Ok(s)) => Ok(MaybeTls::Tls(Box::new(s))),
        Ok(Err(e)) => Err(TlsError::Handshake(e)),
        Err(_) => Err(TlsError::HandshakeTimeout),
    }
}

/// A server-side connection, plain or TLS.
pub enum MaybeTls {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl From<TcpStream> for MaybeTls {
    fn from(s: TcpStream) -> Self {
        MaybeTls::Plain(s)
    }
}

impl MaybeTls {
    /// The TCP connection underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            MaybeTls::Plain(s) => s,
            MaybeTls::Tls(s) => s.get_ref().0,
        }
    }

    /// Reads what is there without waiting (`TcpStream::try_read_buf`): WouldBlock if nothing
    /// is.
    pub fn try_read_buf(&mut self, buf: &mut BytesMut) -> io::Result<usize> {
        match self {
            MaybeTls::Plain(s) => s.try_read_buf(buf),
            MaybeTls::Tls(s) => {
                let mut cx = Context::from_waker(std::task::Waker::noop());
                let dst = buf.spare_capacity_mut();
                if dst.is_empty() {
                    buf.reserve(8 << 10);
                }
                let dst = buf.spare_capacity_mut();
                let mut rb = ReadBuf::uninit(dst);
                match Pin::new(&mut **s).poll_read(&mut cx, &mut rb) {
                    Poll::Ready(Ok(())) => {
                        let n = rb.filled().len();
                        // Safety: poll_read initialised and filled these n bytes.
                        unsafe { buf.set_len(buf.len() + n) };
                        Ok(n)
                    }
                    Poll::Ready(Err(e)) => Err(e),
                    Poll::Pending => Err(io::ErrorKind::WouldBlock.into()),
                }
            }
        }
    }

    pub fn is_tls(&self) -> bool {
        matches!(self, MaybeTls::Tls(_))
    }
}

impl AsyncRead for MaybeTls {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_read(cx, buf),
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for MaybeTls {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write(cx, buf),
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_write(cx, buf),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match self {
            MaybeTls::Plain(s) => s.is_write_vectored(),
            MaybeTls::Tls(s) => s.is_write_vectored(),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_flush(cx),
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            MaybeTls::Plain(s) => Pin::new(s).poll_shutdown(cx),
            MaybeTls::Tls(s) => Pin::new(&mut **s).poll_shutdown(cx),
        }
    }
}

/// Writes `out` whole, counts it in `bytes_out`, and empties it; a buffer grown past four
/// times `keep` by a burst is given back down to `keep`.
pub async fn write_out<S: AsyncWrite + Unpin>(
    socket: &mut S,
    out: &mut Vec<u8>,
    bytes_out: &std::sync::atomic::AtomicU64,
    keep: usize,
) -> io::Result<()> {
    if out.is_empty() {
        return Ok(());
    }
    let r = send_all(socket, out).await;
    bytes_out.fetch_add(out.len() as u64, std::sync::atomic::Ordering::Relaxed);
    out.clear();
    if out.capacity() > 4 * keep {
        out.shrink_to(keep);
    }
    r
}

/// Writes all of `buf` and flushes: a TLS stream may keep encrypted records buffered after
/// `write_all` returns (plain TCP's flush does nothing).
pub async fn send_all<S: AsyncWrite + Unpin>(socket: &mut S, buf: &[u8]) -> io::Result<()> {
    use tokio::io::AsyncWriteExt;
    socket.write_all(buf).await?;
    socket.flush().await
}

/// How a client connects over TLS: whom it trusts, its own certificate if any.
#[derive(Clone)]
pub struct ClientTls {
    pub config: Arc<rustls::ClientConfig>,
}

impl std::fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ClientTls")
    }
}

impl ClientTls {
    /// `ca`: the CAs the peer's certificate must chain to; `identity`: this node's certificate
    /// and key, for peers that ask for one. Keys in errors are `{prefix}.ca` etc.
    pub fn load(
        prefix: &str,
        ca: &Path,
        identity: Option<(&Path, &Path)>,
    ) -> Result<ClientTls, TlsError> {
        Self::build(prefix, &format!("{prefix}.ca"), ca, identity)
    }

    /// A client with no certificate of its own that trusts the CAs in `ca` (named `ca_key` in
    /// errors).
    pub fn trusting(ca_key: &str, ca: &Path) -> Result<ClientTls, TlsError> {
        Self::build(ca_key, ca_key, ca, None)
    }

    fn build(
        prefix: &str,
        ca_key: &str,
        ca: &Path,
        identity: Option<(&Path, &Path)>,
    ) -> Result<ClientTls, TlsError> {
        let pinned = load_certificates(ca_key, ca)?;
        let roots = load_roots(ca_key, ca)?;
        let chained = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            provider(),
        )
        .build()
        .map_err(|e| TlsError::Verifier {
            key: ca_key.to_string(),
            why: e.to_string(),
        })?;
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Protocols {
                prefix: prefix.to_string(),
                source,
            })?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(ChainedOrPinned { chained, pinned }));
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let chain = load_certificates(&format!("{prefix}.certificate"), cert)?;
                let k = load_key(&format!("{prefix}.key"), key)?;
                builder
                    .with_client_auth_cert(chain, k)
                    .map_err(|source| TlsError::KeyMismatch {
                        key: format!("{prefix}.key"),
                        key_path: key.to_path_buf(),
                        certificate: cert.to_path_buf(),
                        source: Box::new(source),
                    })?
            }
        };
        Ok(ClientTls {
            config: Arc::new(config),
        })
    }
}

/// The name a peer's certificate must carry: the host of HOST:PORT (an IP address must be in
/// the certificate's IP SANs).
pub fn server_name(address: &str) -> Result<ServerName<'static>, TlsError> {
    let host = match address.rsplit_once(':') {
        Some((h, _)) => h,
        None => address,
    };
    let host = host.trim_start_matches('[').trim_end_matches(']');
    ServerName::try_from(host.to_string()).map_err(|source| TlsError::ServerName {
        host: host.to_string(),
        source,
    })
}

/// The TLS state both halves of a blocking client connection share.
pub struct SharedClient {
    conn: Mutex<rustls::ClientConnection>,
    /// Written under `conn`'s lock, so records leave in the order they were made.
    tcp: std::net::TcpStream,
}

impl SharedClient {
    /// Sends what rustls has queued (records, alerts); call with `conn` locked.
    fn push(&self, conn: &mut rustls::ClientConnection) -> io::Result<()> {
        while conn.wants_write() {
            conn.write_tls(&mut &self.tcp)?;
        }
        Ok(())
    }
}

/// The reading half of a blocking client connection.
pub enum SyncReader {
    Plain(std::net::TcpStream),
    Tls {
        tcp: std::net::TcpStream,
        shared: Arc<SharedClient>,
        raw: Vec<u8>,
        raw_start: usize,
        raw_end: usize,
    },
}

/// The writing half of a blocking client connection; whole frames are written under one call.
pub enum SyncWriter {
    Plain(std::net::TcpStream),
    Tls(Arc<SharedClient>),
}

/// Makes `tcp` a client connection, over TLS when `tls` is given (the handshake runs here,
/// bounded by the socket's read timeout).
pub fn connect_client(
    tcp: std::net::TcpStream,
    address: &str,
    tls: Option<&ClientTls>,
) -> Result<(SyncReader, SyncWriter), TlsError> {
    let writer_tcp = tcp.try_clone().map_err(TlsError::Socket)?;
    let Some(tls) = tls else {
        return Ok((SyncReader::Plain(tcp), SyncWriter::Plain(writer_tcp)));
    };
    let name = server_name(address)?;
    let mut conn = rustls::ClientConnection::new(tls.config.clone(), name).map_err(|source| {
        TlsError::Client {
            address: address.to_string(),
            source,
        }
    })?;
    let mut io = &tcp;
    while conn.is_handshaking() {
        conn.complete_io(&mut io)
            .map_err(|source| TlsError::ClientHandshake {
                address: address.to_string(),
                source,
            })?;
    }
    let shared = Arc::new(SharedClient {
        conn: Mutex::new(conn),
        tcp: writer_tcp,
    });
    Ok((
        SyncReader::Tls {
            tcp,
            shared: shared.clone(),
            raw: vec![0; 64 << 10],
            raw_start: 0,
            raw_end: 0,
        },
        SyncWriter::Tls(shared),
    ))
}

impl SyncReader {
    pub fn set_read_timeout(&self, t: Option<std::time::Duration>) -> io::Result<()> {
        match self {
            SyncReader::Plain(s) | SyncReader::Tls { tcp: s, .. } => s.set_read_timeout(t),
        }
    }

    pub fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        match self {
            SyncReader::Plain(s) | SyncReader::Tls { tcp: s, .. } => s.shutdown(how),
        }
    }
}

impl Read for SyncReader {
    /// Plain: the socket's read. TLS: decrypted bytes; the socket's timeout errors come through
    /// as they would for plain TCP; Ok(0) is the peer's close.
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        let (tcp, shared, raw, raw_start, raw_end) = match self {
            SyncReader::Plain(s) => return s.read(buf),
            SyncReader::Tls {
                tcp,
                shared,
                raw,
                raw_start,
                raw_end,
            } => (tcp, shared, raw, raw_start, raw_end),
        };
        loop {
            {
                let mut conn = shared.conn.lock();
                match conn.reader().read(buf) {
                    Ok(n) => return Ok(n),
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            let eof = if *raw_start == *raw_end {
                // Waiting for the socket holds no lock: the writer goes on meanwhile.
                let n = tcp.read(raw)?;
                *raw_start = 0;
                *raw_end = n;
                n == 0
            } else {
                false
            };
            let mut conn = shared.conn.lock();
            let mut pending = &raw[*raw_start..*raw_end];
            // At EOF `pending` is empty, which tells rustls the peer is gone.
            let used = conn.read_tls(&mut pending)?;
            *raw_start += used;
            if let Err(e) = conn.process_new_packets() {
                // Tell the peer why (the alert rustls queued), then fail.
                let _ = shared.push(&mut conn);
                return Err(io::Error::new(io::ErrorKind::InvalidData, e));
            }
            shared.push(&mut conn)?;
            if eof {
                return match conn.reader().read(buf) {
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(0),
                    r => r,
                };
            }
        }
    }
}

impl SyncWriter {
    pub fn write_all(&mut self, bytes: &[u8]) -> io::Result<()> {
        match self {
            SyncWriter::Plain(s) => s.write_all(bytes),
            SyncWriter::Tls(shared) => {
                let mut conn = shared.conn.lock();
                conn.writer().write_all(bytes)?;
                shared.push(&mut conn)
            }
        }
    }

    pub fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        match self {
            SyncWriter::Plain(s) => s.shutdown(how),
            SyncWriter::Tls(shared) => shared.tcp.shutdown(how),
        }
    }
}

/// A CA and a certificate it signed for a node, PEM (`sluice tls init`).
pub struct Issued {
    pub ca_certificate: String,
    pub ca_key: String,
    pub certificate: String,
    pub key: String,
}

/// Makes a CA (good for ten years) and signs with it a certificate for a node, good for
/// `years`, that names `names` (DNS names) and `addresses` (IP addresses): a server's
/// certificate that also serves as a client's (a replica logging in to its active). ECDSA
/// P-256 keys, as TLS clients everywhere take them.
pub fn issue_node_certificate(
    names: &[String],
    addresses: &[std::net::IpAddr],
    years: u32,
) -> Result<Issued, String> {
    use rcgen::{
        BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, Issuer,
        KeyPair, KeyUsagePurpose, SanType,
    };
    if names.is_empty() && addresses.is_empty() {
        return Err("a certificate needs at least one name or address".into());
    }
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_err(|e| e.to_string())?
        .as_secs();
    // From the start of this year (no clock on a network is ahead of that).
    let year = 1970 + (now / 31_556_952) as i32;
    let first = names
        .first()
        .cloned()
        .or_else(|| addresses.first().map(|a| a.to_string()))
        .unwrap_or_default();
    let fail = |what: &str, e: rcgen::Error| format!("{what}: {e}");

    let ca_key = KeyPair::generate().map_err(|e| fail("a CA key", e))?;
    let mut ca = CertificateParams::default();
    ca.distinguished_name = rcgen::DistinguishedName::new();
    ca.distinguished_name
        .push(DnType::CommonName, format!("sluice CA for {first}"));
    ca.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    ca.not_before = rcgen::date_time_ymd(year, 1, 1);
    ca.not_after = rcgen::date_time_ymd(year + 10, 12, 31);
    let ca_certificate = ca
        .self_signed(&ca_key)
        .map_err(|e| fail("the CA certificate", e))?;

    let key = KeyPair::generate().map_err(|e| fail("a key", e))?;
    let mut node = CertificateParams::default();
    node.distinguished_name = rcgen::DistinguishedName::new();
    node.distinguished_name.push(DnType::CommonName, first);
    // Said outright: some clients refuse a server certificate that could be a CA's.
    node.is_ca = IsCa::ExplicitNoCa;
    for n in names {
        let dns = n
            .clone()
            .try_into()
            .map_err(|e| fail(&format!("the name {n:?}"), e))?;
        node.subject_alt_names.push(SanType::DnsName(dns));
    }
    node.subject_alt_names
        .extend(addresses.iter().map(|a| SanType::IpAddress(*a)));
    node.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    node.use_authority_key_identifier_extension = true;
    node.not_before = rcgen::date_time_ymd(year, 1, 1);
    node.not_after = rcgen::date_time_ymd(year + years.clamp(1, 30) as i32, 12, 31);
    let issuer = Issuer::new(ca, &ca_key);
    let certificate = node
        .signed_by(&key, &issuer)
        .map_err(|e| fail("the certificate", e))?;
    Ok(Issued {
        ca_certificate: ca_certificate.pem(),
        ca_key: ca_key.serialize_pem(),
        certificate: certificate.pem(),
        key: key.serialize_pem(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_issued_certificate_serves_and_verifies_against_its_ca() {
        use rustls::client::danger::ServerCertVerifier;
        let addresses = ["127.0.0.1".parse().unwrap()];
        let issued = issue_node_certificate(&["localhost".into()], &addresses, 2).unwrap();
        let chain = vec![CertificateDer::from_pem_slice(issued.certificate.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(issued.key.as_bytes()).unwrap();
        rustls::ServerConfig::builder_with_provider(Arc::new(
            rustls::crypto::ring::default_provider(),
        ))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_no_client_auth()
        .with_single_cert(chain.clone(), key)
        .expect("a certificate and key that serve");
        let mut roots = rustls::RootCertStore::empty();
        roots
            .add(CertificateDer::from_pem_slice(issued.ca_certificate.as_bytes()).unwrap())
            .unwrap();
        let verifier = rustls::client::WebPkiServerVerifier::builder_with_provider(
            Arc::new(roots),
            Arc::new(rustls::crypto::ring::default_provider()),
        )
        .build()
        .unwrap();
        let now = rustls::pki_types::UnixTime::now();
        for name in ["localhost", "127.0.0.1"] {
            let server = ServerName::try_from(name).unwrap();
            verifier
                .verify_server_cert(&chain[0], &[], &server, &[], now)
                .unwrap_or_else(|e| panic!("{name}: {e}"));
        }
        let other = ServerName::try_from("example.com").unwrap();
        assert!(verifier
            .verify_server_cert(&chain[0], &[], &other, &[], now)
            .is_err());
        assert!(issue_node_certificate(&[], &[], 2).is_err());
    }

    #[test]
    fn errors_name_the_key_and_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.pem");
        let err = load_certificates("tls.certificate", &missing).unwrap_err();
        assert!(matches!(err, TlsError::Read { .. }));
        assert!(
            err.to_string().starts_with(&format!(
                "tls.certificate: cannot read {}: ",
                missing.display()
            )),
            "{err}"
        );

        let empty = dir.path().join("empty.pem");
        std::fs::write(&empty, "no PEM here\n").unwrap();
        let err = load_certificates("replication.ca", &empty).unwrap_err();
        assert_eq!(
            err.to_string(),
            format!(
                "replication.ca: {} holds no PEM certificate (-----BEGIN CERTIFICATE-----)",
                empty.display()
            )
        );
        let err = ClientTls::trusting("--cacert", &empty)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("--cacert: "), "{err}");
        let err = load_key("tls.key", &empty).unwrap_err();
        assert!(
            err.to_string().starts_with(&format!(
                "tls.key: {} holds no usable PEM private key: ",
                empty.display()
            )),
            "{err}"
        );
    }

    #[test]
    fn server_names_come_from_the_address() {
        assert_eq!(
            server_name("node-1.example:11207").unwrap(),
            ServerName::try_from("node-1.example").unwrap()
        );
        assert!(server_name("[::1]:11207").is_ok());
        let err = server_name("bad_host!:11207").unwrap_err();
        assert!(
            err.to_string()
                .starts_with("\"bad_host!\" is not a TLS server name: "),
            "{err}"
        );
    }
}

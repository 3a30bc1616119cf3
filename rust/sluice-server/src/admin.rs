//! The admin endpoint: the web console at `/` (its files built in, `console/`), `GET /metrics`
//! (Prometheus text format), `GET /status` (JSON, what `sluice status` prints as tables and the
//! console draws), `POST /promote` (failover), `POST /takeover` (a vbucket move),
//! `POST /topics` (a new topic) and `POST /rebalance` (asks the cluster for one). A small HTTP/1.1 responder: one request per connection, then
//! `Connection: close`.
//!
//! Who may do what (docs/admin.md):
//! - Reads (GET) are open on a loopback endpoint; beyond loopback, once users exist, they need
//!   credentials (any user, or the token).
//! - State changes (POST) need, once users exist, a user with the `admin` permission on every
//!   bucket they change (`/promote` and `/rebalance`: every bucket of the node; `/takeover`:
//!   the moved one; on the topic for `/topics`), or
//!   the token the node writes to `DATA_DIR/admin.token` at start (mode 0600: whoever can read
//!   the data directory holds the data already). Without users they are taken only on a
//!   loopback endpoint from a loopback peer.
//! - No state change from a browser's cross-site request: a POST must carry `Authorization` or
//!   `X-Sluice-Request` (headers a page cannot add to a cross-site request without a CORS
//!   preflight, which this endpoint never grants), and is refused when its `Origin` or
//!   `Sec-Fetch-Site` names another site or, on a loopback endpoint, its `Host` is not a
//!   loopback name (DNS rebinding).
//!
//! Limits, checked before anything is allocated for them: the request head within 5 s and
//! 8 KiB (64 headers), a body (read and ignored) within 64 KiB, the answer written within 10 s,
//! 64 connections at once. The work itself has no fixed bound: a takeover runs until the vbucket
//! has moved or its own deadline (`timeout=` seconds, default 600) passes.

use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::tls::{MaybeTls, ReloadableTls};
use tokio::sync::{watch, Semaphore};

use crate::auth::{Users, ADMIN};
use crate::config::ServerConfig;
use crate::metrics::metric;
use crate::replica::Followers;

/// The token file's name in the data directory.
pub const TOKEN_FILE: &str = "admin.token";
/// The header a non-browser client sends on a POST without `Authorization`.
pub const REQUEST_HEADER: &str = "x-sluice-request";
const MAX_HEAD: usize = 8 << 10;
const MAX_HEADERS: usize = 64;
const MAX_BODY: usize = 64 << 10;
const READ_TIMEOUT: Duration = Duration::from_secs(5);
const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
const MAX_CONNECTIONS: usize = 64;
const TAKEOVER_TIMEOUT_S: u64 = 600;

/// The bearer token of the local CLI: random per start, in `DATA_DIR/admin.token` (mode 0600)
/// while the node runs, removed when it stops.
pub struct Token {
    secret: String,
    path: PathBuf,
}

impl Token {
    /// A fresh token, written to a temporary file of mode 0600 and renamed into place.
    pub fn create(data_dir: &Path) -> std::io::Result<Token> {
        use std::os::unix::fs::OpenOptionsExt;
        let mut raw = [0u8; 32];
        getrandom::fill(&mut raw).map_err(|e| std::io::Error::other(e.to_string()))?;
        let secret: String = raw.iter().map(|b| format!("{b:02x}")).collect();
        let path = data_dir.join(TOKEN_FILE);
        let tmp = data_dir.join(format!("{TOKEN_FILE}.tmp"));
        let write = || -> std::io::Result<()> {
            let _ = std::fs::remove_file(&tmp);
            let mut f = std::fs::OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .open(&tmp)?;
            std::io::Write::write_all(&mut f, format!("{secret}\n").as_bytes())?;
            f.sync_all()?;
            std::fs::rename(&tmp, &path)
        };
        write().map_err(|e| {
            std::io::Error::new(
                e.kind(),
                format!("cannot write the admin token {}: {e}", path.display()),
            )
        })?;
        Ok(Token { secret, path })
    }

    fn matches(&self, given: &str) -> bool {
        let (a, b) = (self.secret.as_bytes(), given.as_bytes());
        a.len() == b.len() && a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
    }
}

impl Drop for Token {
    fn drop(&mut self) {
        // Only our own: a node started since on the same directory may have replaced it.
        if std::fs::read_to_string(&self.path).is_ok_and(|s| s.trim() == self.secret) {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

/// Why a request was refused; each has its counter in /metrics.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Refusal {
    NoCredentials,
    BadCredentials,
    NoPermission,
    CrossSite,
    NotLoopback,
}

impl Refusal {
    const ALL: [Refusal; 5] = [
        Refusal::NoCredentials,
        Refusal::BadCredentials,
        Refusal::NoPermission,
        Refusal::CrossSite,
        Refusal::NotLoopback,
    ];

    fn label(self) -> &'static str {
        match self {
            Refusal::NoCredentials => "no_credentials",
            Refusal::BadCredentials => "bad_credentials",
            Refusal::NoPermission => "no_permission",
            Refusal::CrossSite => "cross_site",
            Refusal::NotLoopback => "not_loopback",
        }
    }

    fn answer(self) -> Answer {
        let text = match self {
            Refusal::NoCredentials => {
                "credentials required: HTTP Basic of a user, or Bearer with the node's admin.token\n"
            }
            Refusal::BadCredentials => "wrong user, password or token\n",
            Refusal::NoPermission => {
                "this user lacks the admin permission on the bucket(s) this changes\n"
            }
            Refusal::CrossSite => {
                "refused as a possible cross-site request: a POST needs an Authorization or \
                 X-Sluice-Request header, and no Origin, Sec-Fetch-Site or Host of another site\n"
            }
            Refusal::NotLoopback => {
                "no users are configured: state changes are taken only on a loopback admin \
                 endpoint from loopback (or with the node's admin.token)\n"
            }
        };
        let mut a = Answer::text(
            match self {
                Refusal::NoCredentials | Refusal::BadCredentials => 401,
                _ => 403,
            },
            text,
        );
        a.challenge = a.code == 401;
        a
    }
}

/// What the admin endpoint reports on and acts on, handed over by the server: the engine, the
/// users, the fronts and their counters, the replicators, the settings and the certificate in
/// use.
pub struct NodeView {
    pub engine: Arc<sluice_core::Engine>,
    pub users: Arc<crate::auth::UserTable>,
    pub clustermap: Arc<crate::clustermap::ClusterMap>,
    /// Every port's connection counters.
    pub io: Arc<crate::stats::ConnectionStats>,
    /// The bounds on connections not logged in, every port's.
    pub prelogin: Arc<crate::limits::PreLogin>,
    pub policies: Arc<crate::policy::PolicyHost>,
    pub started: std::time::Instant,
    /// The registered fronts that run.
    pub registered: Arc<[crate::front::Running]>,
    pub followers: Arc<Followers>,
    pub topic_copies: Arc<crate::topic_replica::PartitionCopies>,
    /// As started: the addresses are the ones bound.
    pub config: ServerConfig,
    pub tls: Option<Arc<ReloadableTls>>,
    /// The Tarantool this node follows into its spaces, if any.
    pub tarantool: Option<Arc<crate::iproto::follow::FollowStatus>>,
}

impl NodeView {
    fn engine(&self) -> &Arc<sluice_core::Engine> {
        &self.engine
    }
}

/// The admin endpoint's own state: where it listens, the token, counters of refusals.
pub struct Admin {
    addr: SocketAddr,
    loopback: bool,
    token: Token,
    refused: [AtomicU64; Refusal::ALL.len()],
    /// At most one warning about refused requests per interval (the rest are counted).
    warnings: crate::ratelimit::WarningLimiter,
}

enum Caller {
    Anonymous,
    Token,
    User(String),
}

impl Admin {
    pub fn new(addr: SocketAddr, token: Token) -> Admin {
        Admin {
            addr,
            loopback: addr.ip().is_loopback(),
            token,
            refused: Default::default(),
            warnings: Default::default(),
        }
    }

    /// Decides whether `req` may run (see the module comment for the rules).
    fn admit(
        &self,
        req: &Request,
        peer: SocketAddr,
        node: &NodeView,
        change: bool,
    ) -> Result<(), Refusal> {
        if change {
            self.same_site(req)?;
        }
        let users = node.users.current();
        match self.caller(req, &users)? {
            Caller::Token => Ok(()),
            Caller::User(name) => {
                let user = users.get(&name).ok_or(Refusal::BadCredentials)?;
                if req.path == "/topics" {
                    let topic = req.arg("name").unwrap_or_default();
                    return if user.topic_permissions(&topic) & ADMIN != 0 {
                        Ok(())
                    } else {
                        Err(Refusal::NoPermission)
                    };
                }
                let buckets = if req.path == "/promote" || req.path == "/rebalance" {
                    node.engine()
                        .buckets()
                        .iter()
                        .map(|b| b.name().to_string())
                        .collect()
                } else {
                    vec![req.arg("bucket").unwrap_or_else(|| "default".into())]
                };
                if !change || buckets.iter().all(|b| user.permissions(b) & ADMIN != 0) {
                    Ok(())
                } else {
                    Err(Refusal::NoPermission)
                }
            }
            Caller::Anonymous if users.required() => {
                if change || !self.loopback {
                    Err(Refusal::NoCredentials)
                } else {
                    Ok(())
                }
            }
            Caller::Anonymous => {
                if change && !(self.loopback && peer.ip().is_loopback()) {
                    Err(Refusal::NotLoopback)
                } else {
                    Ok(())
                }
            }
        }
    }

    /// Who the request says it is; wrong credentials are refused even where none are needed.
    fn caller(&self, req: &Request, users: &Users) -> Result<Caller, Refusal> {
        let Some(auth) = req.header("authorization") else {
            return Ok(Caller::Anonymous);
        };
        let (scheme, credentials) = auth.split_once(' ').unwrap_or((auth, ""));
        let credentials = credentials.trim();
        if scheme.eq_ignore_ascii_case("bearer") {
            return if self.token.matches(credentials) {
                Ok(Caller::Token)
            } else {
                Err(Refusal::BadCredentials)
            };
        }
        if !scheme.eq_ignore_ascii_case("basic") {
            return Err(Refusal::BadCredentials);
        }
        let decoded =
            sluice_proto::base64::decode(credentials.as_bytes()).ok_or(Refusal::BadCredentials)?;
        let (name, password) = std::str::from_utf8(&decoded)
            .ok()
            .and_then(|t| t.split_once(':'))
            .ok_or(Refusal::BadCredentials)?;
        // An unknown name costs the same work as a wrong password (see `Users::verify_password`).
        if users.verify_password(name, password.as_bytes()) {
            Ok(Caller::User(name.to_string()))
        } else {
            Err(Refusal::BadCredentials)
        }
    }

    /// A POST must show it was not sent by a page of another site (see the module comment).
    fn same_site(&self, req: &Request) -> Result<(), Refusal> {
        if req
            .header("sec-fetch-site")
            .is_some_and(|s| !matches!(s, "same-origin" | "none"))
        {
            return Err(Refusal::CrossSite);
        }
        let host = req.header("host");
        if self.loopback && host.is_some_and(|h| !self.is_loopback_authority(h)) {
            return Err(Refusal::CrossSite);
        }
        if let Some(origin) = req.header("origin") {
            let authority = origin
                .strip_prefix("http://")
                .or_else(|| origin.strip_prefix("https://"));
            let ok = match authority {
                Some(a) if self.loopback => self.is_loopback_authority(a),
                Some(a) => host.is_some_and(|h| h.eq_ignore_ascii_case(a)),
                None => false,
            };
            if !ok {
                return Err(Refusal::CrossSite);
            }
        }
        if req.header("authorization").is_none() && req.header(REQUEST_HEADER).is_none() {
            return Err(Refusal::CrossSite);
        }
        Ok(())
    }

    /// HOST:PORT naming this loopback endpoint.
    fn is_loopback_authority(&self, authority: &str) -> bool {
        let port = self.addr.port();
        [
            self.addr.to_string(),
            format!("127.0.0.1:{port}"),
            format!("localhost:{port}"),
            format!("[::1]:{port}"),
        ]
        .iter()
        .any(|a| a.eq_ignore_ascii_case(authority))
    }

    /// Counts the refusal, logs it (rate-limited) and answers it.
    fn refuse(&self, why: Refusal, req: &Request, peer: SocketAddr) -> Answer {
        let i = Refusal::ALL.iter().position(|r| *r == why).unwrap_or(0);
        self.refused[i].fetch_add(1, Relaxed);
        if let Some(unlogged) = self.warnings.admit("refused", Instant::now()) {
            log::warn!(
                "admin: refused {} {} from {peer}: {}{}",
                req.method,
                req.path,
                why.label(),
                if unlogged > 0 {
                    format!(" ({unlogged} more refused since the last warning)")
                } else {
                    String::new()
                }
            );
        }
        why.answer()
    }

    fn metrics(&self, o: &mut String) {
        metric(
            o,
            "sluice_admin_refused_total",
            "counter",
            "Admin requests refused, by reason (no_credentials and bad_credentials answer 401).",
        );
        for (r, n) in Refusal::ALL.iter().zip(&self.refused) {
            let _ = writeln!(
                o,
                "sluice_admin_refused_total{{reason=\"{}\"}} {}",
                r.label(),
                n.load(Relaxed)
            );
        }
    }
}

/// One parsed request head.
struct Request {
    method: String,
    path: String,
    query: String,
    /// Names in lower case, values trimmed.
    headers: Vec<(String, String)>,
}

impl Request {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }

    fn arg(&self, name: &str) -> Option<String> {
        query_arg(&self.query, name)
    }
}

/// A query parameter (`name=value`), percent-decoded; None if absent or badly encoded.
fn query_arg(query: &str, name: &str) -> Option<String> {
    let (_, raw) = query
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .find(|(k, _)| *k == name)?;
    let raw = raw.as_bytes();
    let mut out = Vec::with_capacity(raw.len());
    let mut i = 0;
    while i < raw.len() {
        match raw[i] {
            b'%' => {
                let hex = std::str::from_utf8(raw.get(i + 1..i + 3)?).ok()?;
                out.push(u8::from_str_radix(hex, 16).ok()?);
                i += 3;
            }
            b'+' => {
                out.push(b' ');
                i += 1;
            }
            b => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8(out).ok()
}

/// What goes back: status, body, and for a 401 the Basic challenge.
struct Answer {
    code: u16,
    content_type: &'static str,
    body: Vec<u8>,
    challenge: bool,
    /// The console's files: the page may load nothing but from this node, and no other site
    /// may frame it.
    csp: bool,
}

impl Answer {
    fn text(code: u16, body: impl Into<String>) -> Answer {
        Answer {
            code,
            content_type: "text/plain; charset=utf-8",
            body: body.into().into_bytes(),
            challenge: false,
            csp: false,
        }
    }

    fn json(v: serde_json::Value) -> Answer {
        Answer {
            code: 200,
            content_type: "application/json",
            body: v.to_string().into_bytes(),
            challenge: false,
            csp: false,
        }
    }

    async fn write(self, socket: &mut MaybeTls) -> std::io::Result<()> {
        let reason = match self.code {
            200 => "OK",
            202 => "Accepted",
            400 => "Bad Request",
            401 => "Unauthorized",
            403 => "Forbidden",
            404 => "Not Found",
            405 => "Method Not Allowed",
            409 => "Conflict",
            413 => "Content Too Large",
            431 => "Request Header Fields Too Large",
            501 => "Not Implemented",
            _ => "Internal Server Error",
        };
        let challenge = if self.challenge {
            "WWW-Authenticate: Basic realm=\"sluice\"\r\n"
        } else {
            ""
        };
        let csp = if self.csp { CONSOLE_POLICY } else { "" };
        let head = format!(
            "HTTP/1.1 {} {reason}\r\nContent-Type: {}\r\nContent-Length: {}\r\n{challenge}\
             {csp}X-Content-Type-Options: nosniff\r\nCache-Control: no-store\r\n\
             Connection: close\r\n\r\n",
            self.code,
            self.content_type,
            self.body.len()
        );
        socket.write_all(head.as_bytes()).await?;
        socket.write_all(&self.body).await?;
        // Shutting down flushes (a TLS stream sends its close_notify too).
        socket.shutdown().await
    }
}

pub async fn serve(
    listener: TcpListener,
    node: Arc<NodeView>,
    admin: Arc<Admin>,
    mut stop: watch::Receiver<bool>,
    https: Option<Arc<ReloadableTls>>,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        tokio::select! {
            _ = stop.changed() => return,
            accepted = listener.accept() => match accepted {
                Ok((socket, peer)) => {
                    let Ok(slot) = slots.clone().try_acquire_owned() else {
                        log::debug!("admin: {MAX_CONNECTIONS} connections open, closing the one from {peer}");
                        continue;
                    };
                    let (nv, ad) = (node.clone(), admin.clone());
                    let acceptor = https.as_ref().map(|t| t.admin_acceptor());
                    tokio::spawn(async move {
                        let socket = match acceptor {
                            None => socket.into(),
                            Some(a) => match crate::tls::accept(a, socket).await {
                                Ok(s) => s,
                                Err(e) => {
                                    log::debug!("admin: closing the connection from {peer}: {e}");
                                    drop(slot);
                                    return;
                                }
                            },
                        };
                        handle(socket, peer, nv, ad).await;
                        drop(slot);
                    });
                }
                Err(e) => {
                    log::warn!("admin accept failed: {e}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            },
        }
    }
}

async fn handle(mut socket: MaybeTls, peer: SocketAddr, node: Arc<NodeView>, admin: Arc<Admin>) {
    let answer = match tokio::time::timeout(READ_TIMEOUT, read_request(&mut socket)).await {
        // Too slow, closed early, or unreadable: nothing worth answering.
        Err(_) | Ok(Err(None)) => return,
        Ok(Err(Some(refused))) => refused,
        Ok(Ok(req)) => answer(&req, peer, &node, &admin).await,
    };
    let _ = tokio::time::timeout(WRITE_TIMEOUT, answer.write(&mut socket)).await;
}

/// Reads and parses one request head and skips its body; Err(Some) is an answer to send
/// instead (the request is malformed or over a limit), Err(None) a connection to just close.
async fn read_request(socket: &mut MaybeTls) -> Result<Request, Option<Answer>> {
    let mut buf = vec![0u8; MAX_HEAD];
    let mut len = 0usize;
    let head_end = loop {
        let from = len.saturating_sub(3);
        let n = socket.read(&mut buf[len..]).await.map_err(|_| None)?;
        if n == 0 {
            return Err(None);
        }
        len += n;
        if let Some(i) = buf[from..len].windows(4).position(|w| w == b"\r\n\r\n") {
            break from + i;
        }
        if len == MAX_HEAD {
            return Err(Some(Answer::text(431, "request head over 8 KiB\n")));
        }
    };
    let req = parse_head(&buf[..head_end]).map_err(|why| Some(Answer::text(400, why)))?;
    if req.header("transfer-encoding").is_some() {
        return Err(Some(Answer::text(
            501,
            "chunked bodies are not taken; the endpoints need no body\n",
        )));
    }
    let body_len: usize = match req.header("content-length") {
        None => 0,
        Some(v) => v
            .parse()
            .map_err(|_| Some(Answer::text(400, "bad Content-Length\n")))?,
    };
    if body_len > MAX_BODY {
        return Err(Some(Answer::text(413, "a body over 64 KiB\n")));
    }
    // The body is not used; it is read so that closing does not reset the connection before
    // the client has read the answer.
    let mut left = body_len.saturating_sub(len - head_end - 4);
    while left > 0 {
        let n = socket
            .read(&mut buf[..left.min(MAX_HEAD)])
            .await
            .map_err(|_| None)?;
        if n == 0 {
            return Err(None);
        }
        left -= n;
    }
    Ok(req)
}

fn parse_head(head: &[u8]) -> Result<Request, &'static str> {
    let text = std::str::from_utf8(head).map_err(|_| "the request head is not UTF-8\n")?;
    let mut lines = text.split("\r\n");
    let mut parts = lines.next().unwrap_or("").split(' ');
    let (Some(method), Some(target), Some(version), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err("the request line is not METHOD TARGET VERSION\n");
    };
    if !matches!(version, "HTTP/1.1" | "HTTP/1.0") {
        return Err("only HTTP/1.0 and HTTP/1.1\n");
    }
    let (path, query) = target.split_once('?').unwrap_or((target, ""));
    let mut headers = Vec::new();
    for line in lines {
        if headers.len() == MAX_HEADERS {
            return Err("more than 64 headers\n");
        }
        let (name, value) = line.split_once(':').ok_or("a header line without ':'\n")?;
        if name.is_empty() || name.bytes().any(|b| b.is_ascii_whitespace()) {
            return Err("a bad header name\n");
        }
        headers.push((name.to_ascii_lowercase(), value.trim().to_string()));
    }
    Ok(Request {
        method: method.to_string(),
        path: path.to_string(),
        query: query.to_string(),
        headers,
    })
}

async fn answer(req: &Request, peer: SocketAddr, node: &Arc<NodeView>, admin: &Admin) -> Answer {
    let console = console_file(&req.path);
    let change = match (req.method.as_str(), req.path.as_str()) {
        ("GET", "/metrics" | "/status") => false,
        ("GET", _) if console.is_some() => false,
        ("POST", "/promote" | "/takeover" | "/errinj" | "/topics" | "/rebalance") => true,
        (
            _,
            "/metrics" | "/status" | "/promote" | "/takeover" | "/errinj" | "/topics"
            | "/rebalance",
        ) => {
            return Answer::text(
                405,
                "GET /metrics, GET /status, POST /promote, POST /takeover, POST /topics, \
                 POST /rebalance, POST /errinj\n",
            )
        }
        _ if console.is_some() => return Answer::text(405, "GET the console's files\n"),
        _ => return Answer::text(404, "try /, /metrics or /status\n"),
    };
    // A password check is a deliberate ~0.1 s of CPU: off the I/O threads' queue.
    if let Err(why) = tokio::task::block_in_place(|| admin.admit(req, peer, node, change)) {
        return admin.refuse(why, req, peer);
    }
    if let Some((content_type, body)) = console {
        return Answer {
            code: 200,
            content_type,
            body: body.to_vec(),
            challenge: false,
            csp: true,
        };
    }
    let nv = node.clone();
    match req.path.as_str() {
        "/rebalance" => {
            if node.clustermap.request("rebalance") {
                log::info!("admin: a rebalance requested by {peer}");
                let mut a = Answer::json(serde_json::json!({"requested": "rebalance"}));
                a.code = 202;
                a
            } else {
                Answer::text(409, "this node is not in a cluster ([cluster] etcd)\n")
            }
        }
        "/topics" => {
            let query = req.query.clone();
            match tokio::task::spawn_blocking(move || create_topic(&nv, &query)).await {
                Ok(a) => a,
                Err(e) => Answer::text(500, format!("{e}\n")),
            }
        }
        "/metrics" => {
            let mut body = tokio::task::block_in_place(|| metrics(node));
            admin.metrics(&mut body);
            let mut a = Answer::text(200, body);
            a.content_type = "text/plain; version=0.0.4; charset=utf-8";
            a
        }
        "/status" => Answer::json(tokio::task::block_in_place(|| status(node))),
        "/errinj" => errinj(req),
        "/promote" => match tokio::task::spawn_blocking(move || nv.followers.promote()).await {
            Ok(Ok(done)) => Answer::json(serde_json::json!({
                "promoted": done.iter().map(|(b, v)| serde_json::json!({"bucket": b, "vbuckets": v})).collect::<Vec<_>>()
            })),
            Ok(Err(e)) => Answer::text(500, format!("{e}\n")),
            Err(e) => Answer::text(500, format!("{e}\n")),
        },
        _ => {
            let query = req.query.clone();
            match tokio::task::spawn_blocking(move || takeover(&nv, &query)).await {
                Ok(Ok(body)) => Answer::json(body),
                Ok(Err(e)) => Answer::text(409, format!("{e}\n")),
                Err(e) => Answer::text(500, format!("{e}\n")),
            }
        }
    }
}

/// The console's headers: it loads scripts, styles and data from this node only, and no page
/// elsewhere may frame it.
const CONSOLE_POLICY: &str = "Content-Security-Policy: default-src 'self'; script-src 'self'; \
     style-src 'self'; img-src 'self' data:; connect-src 'self'; frame-ancestors 'none'; \
     base-uri 'none'; form-action 'none'\r\nX-Frame-Options: DENY\r\n";

/// The web console's files, built into the binary: one page, its script and style, and the
/// chart library (uPlot, MIT, its licence beside it).
fn console_file(path: &str) -> Option<(&'static str, &'static [u8])> {
    Some(match path {
        "/" | "/index.html" => (
            "text/html; charset=utf-8",
            include_bytes!("console/index.html"),
        ),
        "/console.js" => (
            "text/javascript; charset=utf-8",
            include_bytes!("console/console.js"),
        ),
        "/console.css" => (
            "text/css; charset=utf-8",
            include_bytes!("console/console.css"),
        ),
        "/uPlot.iife.min.js" => (
            "text/javascript; charset=utf-8",
            include_bytes!("console/uPlot.iife.min.js"),
        ),
        "/uPlot.min.css" => (
            "text/css; charset=utf-8",
            include_bytes!("console/uPlot.min.css"),
        ),
        "/uPlot-LICENSE" => (
            "text/plain; charset=utf-8",
            include_bytes!("console/uPlot-LICENSE"),
        ),
        _ => return None,
    })
}

/// `POST /topics?name=NAME&partitions=N[&settings=TEXT]`: creates a topic as TANK's
/// CreateTopic does (settings as `key=value` lines), answered once the WAL holds it.
fn create_topic(node: &NodeView, query: &str) -> Answer {
    let req = Request {
        method: String::new(),
        path: String::new(),
        query: query.to_string(),
        headers: Vec::new(),
    };
    let Some(name) = req.arg("name").filter(|n| !n.is_empty()) else {
        return Answer::text(400, "give name=TOPIC&partitions=N\n");
    };
    let partitions = match req.arg("partitions").map(|p| p.parse::<u16>()) {
        Some(Ok(p)) if p > 0 => p,
        _ => return Answer::text(400, "partitions must be a number from 1 to 65535\n"),
    };
    let settings = req.arg("settings").unwrap_or_default();
    let engine = node.engine();
    let written = engine
        .write_topic(&name, partitions, &settings)
        .and_then(|w| engine.wait_written(w));
    match written {
        Ok(_) => {
            log::info!("admin: topic {name:?} created with {partitions} partition(s)");
            Answer::json(serde_json::json!({"created": name, "partitions": partitions}))
        }
        Err(sluice_core::Error::Exists) => {
            Answer::text(409, format!("topic {name:?} exists already\n"))
        }
        Err(sluice_core::Error::InvalidArgument(why)) => Answer::text(400, format!("{why}\n")),
        Err(e) => Answer::text(500, format!("{e}\n")),
    }
}

/// `POST /errinj?name=NAME&value=N`: sets a fault injection point (`sluice_core::errinj`), on a
/// node started with `SLUICE_ERRINJ` only; answers every point's value.
fn errinj(req: &Request) -> Answer {
    use sluice_core::errinj;
    if !errinj::enabled() {
        return Answer::text(
            404,
            "fault injection is off on this node (start it with SLUICE_ERRINJ set)\n",
        );
    }
    let (Some(name), Some(value)) = (req.arg("name"), req.arg("value")) else {
        return Answer::text(400, "give name=NAME&value=INTEGER\n");
    };
    let Ok(value) = value.parse::<i64>() else {
        return Answer::text(400, format!("value {value:?} is not an integer\n"));
    };
    match errinj::set(&name, value) {
        Ok(()) => Answer::json(serde_json::json!(errinj::values()
            .into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(
        ))),
        Err(why) => Answer::text(400, format!("{why}\n")),
    }
}

/// Prometheus text exposition of the node: each component's own metrics, in one page.
pub fn metrics(node: &NodeView) -> String {
    let mut o = String::with_capacity(16 << 10);
    node.io.metrics(&mut o);
    node.prelogin.metrics(&mut o);
    node.policies.metrics(&mut o);
    crate::tank::topic_metrics(node.engine(), &mut o);
    for r in node.registered.iter() {
        r.front.metrics(&mut o);
    }
    front_metrics(&node.registered, &mut o);
    crate::metrics::engine(node.engine(), &mut o);
    crate::replica::metrics(&node.followers.running(), &mut o);
    crate::replica::follower_metrics(node.engine(), &mut o);
    crate::cluster::metrics(&node.clustermap, &mut o);
    node.clustermap.router.metrics(&mut o);
    if let Some(t) = &node.tarantool {
        t.metrics(&mut o);
    }
    o
}

/// The node as JSON: what `sluice status` shows.
pub fn status(node: &NodeView) -> serde_json::Value {
    use serde_json::json;
    let e = node.engine();
    let map = &node.clustermap;
    let kv_port = node.registered.iter().find(|r| r.declaration.kv_port);
    let buckets: Vec<_> = e
        .buckets()
        .iter()
        .map(|b| {
            let vbuckets: Vec<_> = (0..b.num_vbuckets())
                .map(|v| {
                    let vb = b.lock_vbucket(v).expect("in range");
                    json!({
                        "vbucket": v,
                        "state": vb.state.as_str(),
                        "high_seqno": vb.high_seqno,
                        "persisted_seqno": vb.persisted_seqno,
                        "items": vb.store.live_items(),
                        "failover_uuid": vb.failover.latest().map(|f| f.uuid),
                        "followers": b.acks.following(v).iter().map(|f| json!({"replica": f.name, "kv_address": map.replica_address(&f.name), "acked_seqno": f.seqno, "persisted_seqno": f.persisted})).collect::<Vec<_>>(),
                    })
                })
                .collect();
            json!({"name": b.name(), "mem_used": b.mem_used(), "memory_quota": b.config.memory_quota, "eviction": b.config.eviction.as_str(), "evictions": b.stats.evictions.load(Relaxed), "durable_writes_waiting": b.stats.durable_waiting.load(Relaxed), "vbuckets": vbuckets})
        })
        .collect();
    json!({
        "version": env!("CARGO_PKG_VERSION"),
        "instance": e.instance(),
        "uptime_s": node.started.elapsed().as_secs(),
        "listen": kv_port.and_then(|r| r.addr).map(|a| a.to_string()),
        "tls_listen": kv_port.and_then(|r| r.tls_addr).map(|a| a.to_string()),
        "data_dir": e.config().data_dir.display().to_string(),
        "fronts": node.registered.iter().map(|r| (r.declaration.name.to_string(), json!({"listen": r.addr.map(|a| a.to_string()), "tls_listen": r.tls_addr.map(|a| a.to_string()), "status": front_status(r)}))).collect::<serde_json::Map<_, _>>(),
        "admin_https": node.tls.as_ref().is_some_and(|t| t.settings().admin),
        "connections": node.io.curr_connections.load(Relaxed),
        "wal": {"mode": e.config().wal_mode.as_str(), "last_lsn": e.wal().last_lsn(), "written_lsn": e.wal().written_lsn(), "synced_lsn": e.wal().synced_lsn(), "failing": e.wal().is_failing()},
        "buckets": buckets,
        "topics": topics_status(e),
        "replication": replication_status(&node.followers),
        "tarantool_upstream": node.tarantool.as_ref().map(|t| t.describe()),
        "cluster": map.report().map(|mut r| {
            r["map_revision"] = map.assigned().map_or(0, |a| a.rev).into();
            r
        }),
    })
}

/// Every front's connections and requests as the connection driver counts them.
fn front_metrics(fronts: &[crate::front::Running], o: &mut String) {
    type Counter = fn(&crate::driver::PortCounters) -> &AtomicU64;
    let series: [(&str, &str, &str, Counter); 2] = [
        (
            "sluice_front_connections",
            "gauge",
            "Connections open on each front's port (memcached, iproto, tank, greenstack).",
            |c| &c.connections,
        ),
        (
            "sluice_front_requests_total",
            "counter",
            "Requests (frames) each front's connections sent.",
            |c| &c.requests,
        ),
    ];
    for (name, kind, help, counter) in series {
        metric(o, name, kind, help);
        for r in fronts {
            let n = counter(&r.front.port().counters).load(Relaxed);
            let _ = writeln!(o, "{name}{{front=\"{}\"}} {n}", r.declaration.name);
        }
    }
}

/// A front's section of `/status`: what it says of itself, with the connections open on its
/// port and the requests they sent as the connection driver counts them for every front
/// (a front that counts its own connections, such as the memcached port's handed-over
/// streams, keeps its figure).
fn front_status(r: &crate::front::Running) -> serde_json::Value {
    let mut s = match r.front.status() {
        serde_json::Value::Object(m) => m,
        _ => serde_json::Map::new(),
    };
    let port = r.front.port();
    s.entry("connections")
        .or_insert(port.counters.connections.load(Relaxed).into());
    s.insert(
        "requests".into(),
        port.counters.requests.load(Relaxed).into(),
    );
    serde_json::Value::Object(s)
}

/// Every topic with its partitions' sequence numbers, bytes and traffic.
fn topics_status(e: &sluice_core::Engine) -> serde_json::Value {
    use serde_json::json;
    e.topics()
        .iter()
        .map(|t| {
            let partitions: Vec<_> = (0..t.num_partitions())
                .map(|p| {
                    let part = t.lock_partition(p).expect("in range");
                    json!({
                        "partition": p,
                        "first_seq": part.log.first_available(),
                        "high_water_mark": part.log.high_water_mark(),
                        "bytes": part.log.bytes(),
                        "produced_messages": part.produced_messages,
                        "consumed_bytes": part.consumed_bytes,
                    })
                })
                .collect();
            json!({"name": t.name, "settings": t.config_text, "long_polls": t.long_polls.load(Relaxed), "partitions": partitions})
        })
        .collect()
}

/// Who this node follows and how far behind each replica vbucket is (null on an active node).
fn replication_status(followers: &Followers) -> serde_json::Value {
    use serde_json::json;
    let reps = followers.running();
    if reps.is_empty() {
        return serde_json::Value::Null;
    }
    let buckets: Vec<_> = reps
        .iter()
        .map(|r| {
            let vbs: Vec<_> = r
                .stats
                .vbuckets
                .lock()
                .iter()
                .map(|(vb, l)| json!({"vbucket": vb, "active_seqno": l.active_seqno, "applied_seqno": l.applied_seqno, "lag_seqnos": l.behind(), "lag_ms": l.behind_ms(), "acked_seqno": l.acked_seqno}))
                .collect();
            json!({
                "bucket": r.bucket,
                "active": r.config.active,
                "connected": r.stats.connected.load(Relaxed),
                "connects": r.stats.connects.load(Relaxed),
                "items": r.stats.items.load(Relaxed),
                "rollbacks": r.stats.rollbacks.load(Relaxed),
                "last_error": r.stats.last_error.lock().clone(),
                "vbuckets": vbs,
            })
        })
        .collect();
    // A cluster map's replication has a connection per active node (no single `replica_of`).
    let replica_of = reps
        .iter()
        .find(|r| r.config.vbuckets.is_none())
        .map(|r| r.config.active.clone());
    json!({"replica_of": replica_of, "buckets": buckets})
}

/// POST /takeover?bucket=B&vbucket=N&source=HOST:PORT[&timeout=SECONDS]: moves the vbucket
/// from the source node to this one (see `replica::take_over`); answers when it is active here,
/// or gives up after `timeout` seconds (default 600; the caller's own wait, so both agree).
fn takeover(node: &NodeView, query: &str) -> Result<serde_json::Value, String> {
    let arg = |name: &str| query_arg(query, name);
    let vb: u16 = arg("vbucket")
        .and_then(|v| v.parse().ok())
        .ok_or("vbucket=N is required")?;
    let source = arg("source").ok_or("source=HOST:PORT is required")?;
    let bucket_name = arg("bucket").unwrap_or_else(|| "default".into());
    let timeout = match arg("timeout") {
        None => TAKEOVER_TIMEOUT_S as f64,
        Some(t) => t
            .parse::<f64>()
            .ok()
            .filter(|t| (1.0..=86_400.0).contains(t))
            .ok_or("timeout=SECONDS must be 1 to 86400")?,
    };
    let bucket = node
        .engine()
        .bucket(&bucket_name)
        .map_err(|e| e.to_string())?;
    let replication = node.config.replication();
    let member = crate::cluster::Member {
        engine: node.engine().clone(),
        followers: node.followers.clone(),
        clustermap: node.clustermap.clone(),
        replication,
        topic_copies: node.topic_copies.clone(),
    };
    let r = member
        .take_over(&bucket, vb, &source, Duration::from_secs_f64(timeout))
        .map_err(|e| e.to_string())?;
    Ok(serde_json::json!({
        "bucket": bucket_name,
        "vbucket": r.vbucket,
        "items": r.items,
        "seconds": r.seconds,
        "writes_paused_ms": r.writes_paused_ms,
        "high_seqno": r.high_seqno,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_heads_are_parsed_or_refused() {
        let r = parse_head(
            b"POST /takeover?vbucket=5&bucket=b HTTP/1.1\r\nHost: x\r\nX-Sluice-Request:  1 ",
        )
        .unwrap();
        assert_eq!((r.method.as_str(), r.path.as_str()), ("POST", "/takeover"));
        assert_eq!(r.arg("vbucket").as_deref(), Some("5"));
        assert_eq!(
            (r.arg("bucket").as_deref(), r.arg("nope")),
            (Some("b"), None)
        );
        assert_eq!(
            query_arg("source=127.0.0.1%3A11210&x=a+b", "source").as_deref(),
            Some("127.0.0.1:11210")
        );
        assert_eq!(query_arg("x=a+b", "x").as_deref(), Some("a b"));
        assert_eq!(query_arg("x=%4", "x"), None);
        assert_eq!(query_arg("x=%zz", "x"), None);
        assert_eq!(r.header("x-sluice-request"), Some("1"));
        assert_eq!(r.header("host"), Some("x"));
        for bad in [
            &b"GET /status"[..],
            b"GET /status HTTP/2",
            b"GET  /status HTTP/1.1",
            b"GET /status HTTP/1.1\r\nno colon",
            b"GET /status HTTP/1.1\r\nBad Name: x",
            b"GET /\xff HTTP/1.1",
        ] {
            assert!(parse_head(bad).is_err(), "{}", String::from_utf8_lossy(bad));
        }
        let many = format!("GET / HTTP/1.1{}", "\r\nA: b".repeat(MAX_HEADERS + 1));
        assert!(parse_head(many.as_bytes()).is_err());
    }

    #[test]
    fn the_token_file_is_private_and_goes_with_the_token() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        let token = Token::create(dir.path()).unwrap();
        let path = dir.path().join(TOKEN_FILE);
        let meta = std::fs::metadata(&path).unwrap();
        assert_eq!(meta.permissions().mode() & 0o777, 0o600);
        let text = std::fs::read_to_string(&path).unwrap();
        assert!(token.matches(text.trim()) && text.trim().len() == 64);
        assert!(!token.matches("") && !token.matches(&text.trim()[1..]));
        drop(token);
        assert!(!path.exists());
    }
}

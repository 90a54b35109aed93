//! New connections to replicas for the proxy's pools ([`super::pool`]): TCP, and TLS over it
//! to an `https://` replica.
//!
//! A replica's certificate must chain to the authorities of `--replica-ca-cert`, or to the
//! system's without it (read at the first `https://` connection, so a fleet of plain
//! replicas never reads them), and name the host of the replica's URL (a DNS name or an IP
//! address), or `--replica-tls-server-name` if set (replicas found by address, whose
//! certificates name their service). With `--replica-client-cert`, the router shows its own
//! certificate to replicas that ask for one (vLLM's `--ssl-ca-certs` with `--ssl-cert-reqs
//! 2`). HTTP/1.1 is asked for by ALPN. The files are read again at a reload and whenever they
//! change on disk ([`ReplicaTls::watch`]): connections opened from then on use them; those
//! made before are not taken from the pools again (one busy now keeps its settings to its
//! response's end). The control client ([`super::control`]) uses the same settings (its idle
//! connections are dropped at a change).

use std::path::Path;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use http::uri::Authority;
use kvroute_proto::serve::{ClientFiles, ClientTls, FromFiles, Watched};
use tokio::net::TcpStream;
use tokio_rustls::TlsConnector;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::ClientConfig;
use tokio_rustls::rustls::pki_types::ServerName;
use tokio_util::either::Either;
use tokio_util::sync::CancellationToken;

use super::pool::SendError;

/// A connection to a replica: plain TCP, or TLS over it.
pub type Stream = Either<TcpStream, Box<TlsStream<TcpStream>>>;

/// The TCP connection under `stream`.
pub fn tcp(stream: &Stream) -> &TcpStream {
    match stream {
        Either::Left(tcp) => tcp,
        Either::Right(tls) => tls.get_ref().0,
    }
}

/// Where a connection goes: a replica's address, and whether over TLS.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Origin {
    pub tls: bool,
    pub authority: Authority,
}

impl Origin {
    /// The port connected to: the authority's, else the scheme's (443 or 80).
    fn port(&self) -> u16 {
        self.authority.port_u16().unwrap_or(if self.tls { 443 } else { 80 })
    }
}

impl std::fmt::Display for Origin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}://{}", if self.tls { "https" } else { "http" }, self.authority)
    }
}

/// The TLS of connections to `https://` replicas, as last loaded. Clones share it.
#[derive(Clone, Debug)]
pub struct ReplicaTls {
    made: Watched<Made>,
    /// `--replica-tls-server-name`: what every replica's certificate must name, in place of
    /// its URL's host.
    server_name: Option<ServerName<'static>>,
}

/// What the files make: `None` when none is named (the system's authorities, read at the
/// first use).
#[derive(Clone)]
struct Made(Option<Given>);

/// The settings of the files named, and the proxy's connector with them.
#[derive(Clone)]
struct Given {
    tls: ClientTls,
    connector: TlsConnector,
}

impl FromFiles for Made {
    type Files = ClientFiles;

    fn paths(files: &ClientFiles) -> Vec<&Path> {
        ClientTls::paths(files)
    }

    fn make(files: &ClientFiles, contents: &[Vec<u8>]) -> Result<Self, String> {
        if files.is_empty() {
            return Ok(Made(None));
        }
        let tls = ClientTls::make(files, contents)?;
        Ok(Made(Some(Given { connector: http1_connector(&tls.config), tls })))
    }
}

/// A connector asking for HTTP/1.1 by ALPN, with `config` otherwise.
fn http1_connector(config: &Arc<ClientConfig>) -> TlsConnector {
    let mut config = ClientConfig::clone(config);
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    TlsConnector::from(Arc::new(config))
}

impl Default for ReplicaTls {
    fn default() -> Self {
        Self::from_files(&ClientFiles::default()).expect("no file to read")
    }
}

impl ReplicaTls {
    /// TLS as `files` say; what is wrong with one of them, else.
    pub fn from_files(files: &ClientFiles) -> Result<Self, String> {
        Ok(Self { made: Watched::from_files(files)?, server_name: None })
    }

    /// Every replica's certificate checked against `name` (and `name` sent as SNI), if given,
    /// in place of the host of its URL.
    pub fn with_server_name(self, name: Option<ServerName<'static>>) -> Self {
        Self { server_name: name, ..self }
    }

    /// The name every replica's certificate must hold, if one is set.
    pub fn server_name(&self) -> Option<&ServerName<'static>> {
        self.server_name.as_ref()
    }

    /// Connections from now on as `files` say; on an error the settings in use stay. The same
    /// files, holding what they held, change nothing (pooled connections stay in use), but
    /// contents a check of them refused are refused again (the settings in use are older; not
    /// counted again among the refused loads).
    pub fn load(&self, files: &ClientFiles) -> Result<(), String> {
        if self.made.files() == *files {
            return match self.made.reload_if_changed() {
                Some(made) => made,
                None => self.made.refused().map_or(Ok(()), Err),
            };
        }
        self.made.load(files)
    }

    /// Bumped at each change of the settings: a connection made before is not reused.
    pub fn generation(&self) -> u64 {
        self.made.generation()
    }

    /// Loads since the start, done and refused; `None` while no file is named.
    pub fn loads(&self) -> Option<(u64, u64)> {
        (!self.made.files().is_empty()).then(|| self.made.loads())
    }

    /// When the client certificate expires (its `notAfter`, Unix seconds), if there is one.
    pub fn not_after(&self) -> Option<i64> {
        self.made.get().0.and_then(|given| given.tls.not_after)
    }

    /// Checks the files every `period` until `shutdown` fires, loading each change
    /// ([`Watched::watch`]).
    pub async fn watch(self, period: Duration, shutdown: CancellationToken) {
        self.made.watch("replica TLS: the CA, client certificate or key", period, shutdown).await;
    }

    /// The client's settings, without ALPN (hyper-rustls sets its own).
    pub fn config(&self) -> Arc<ClientConfig> {
        match self.made.get().0 {
            Some(given) => given.tls.config,
            None => kvroute_proto::serve::system_client_config(),
        }
    }

    fn connector(&self) -> TlsConnector {
        static SYSTEM: OnceLock<TlsConnector> = OnceLock::new();
        match self.made.get().0 {
            Some(given) => given.connector,
            None => {
                SYSTEM.get_or_init(|| http1_connector(&kvroute_proto::serve::system_client_config())).clone()
            }
        }
    }

    /// A new connection to `origin`, its TLS handshake done, within `timeout`.
    ///
    /// A replica that refuses the router's client certificate (or its lack of one) says so,
    /// under TLS 1.3, only after the client's side of the handshake is done: the request then
    /// fails on its first read, as a replica's failure ("received fatal alert"), and is not sent
    /// to the next replica (set up alike, it would refuse it too).
    pub async fn connect(&self, origin: &Origin, timeout: Duration) -> Result<Stream, SendError> {
        let deadline = tokio::time::Instant::now() + timeout;
        let host = origin.authority.host().trim_start_matches('[').trim_end_matches(']');
        let tcp = tokio::time::timeout_at(deadline, TcpStream::connect((host, origin.port())))
            .await
            .map_err(|_| SendError::ConnectTimeout(timeout))?
            .map_err(SendError::Connect)?;
        if let Err(e) = tcp.set_nodelay(true) {
            tracing::debug!(error = %e, "cannot set TCP_NODELAY upstream");
        }
        if !origin.tls {
            return Ok(Either::Left(tcp));
        }
        let name = match &self.server_name {
            Some(name) => name.clone(),
            None => ServerName::try_from(host)
                .map_err(|e| SendError::Tls(std::io::Error::new(std::io::ErrorKind::InvalidInput, e)))?
                .to_owned(),
        };
        let tls = tokio::time::timeout_at(deadline, self.connector().connect(name, tcp))
            .await
            .map_err(|_| SendError::HandshakeTimeout(timeout))?
            .map_err(SendError::Tls)?;
        Ok(Either::Right(Box::new(tls)))
    }
}

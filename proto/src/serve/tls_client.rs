//! TLS as a client: the authorities trusted (the system's, or those of a PEM file) and a
//! certificate of the client's own to show a server that asks for one (mutual TLS). The load
//! generator reaches a router serving `--tls-cert` with it, and the router its `https://`
//! replicas.

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use hyper_rustls::ConfigBuilderExt;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use super::tls::{certificates, not_after, private_key};
use super::watched::FromFiles;

/// Where a TLS client's settings come from: PEM files.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ClientFiles {
    /// Certificates of the authorities a server's certificate must chain to; `None`: the
    /// system's.
    pub ca: Option<PathBuf>,
    /// The client's certificate chain (its own first) and private key, shown to servers that
    /// ask for one (mutual TLS).
    pub identity: Option<(PathBuf, PathBuf)>,
}

impl ClientFiles {
    /// Whether no file is named: the system's authorities, no client certificate.
    pub fn is_empty(&self) -> bool {
        self.ca.is_none() && self.identity.is_none()
    }
}

/// A TLS client's settings, made from [`ClientFiles`], and when its certificate expires.
#[derive(Clone, Debug)]
pub struct ClientTls {
    pub config: Arc<ClientConfig>,
    /// The client certificate's `notAfter`, Unix seconds; `None` without one (or if it does
    /// not parse as X.509).
    pub not_after: Option<i64>,
}

impl FromFiles for ClientTls {
    type Files = ClientFiles;

    /// The authorities' first if any, then the certificate and the key.
    fn paths(files: &ClientFiles) -> Vec<&Path> {
        let identity = files.identity.iter().flat_map(|(cert, key)| [cert, key]);
        files.ca.iter().chain(identity).map(PathBuf::as_path).collect()
    }

    fn make(files: &ClientFiles, contents: &[Vec<u8>]) -> Result<Self, String> {
        // The identity's two files come after the authorities' file, if any.
        let identity_at = usize::from(files.ca.is_some());
        let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?;
        let builder = match (&files.ca, contents.first()) {
            (Some(ca), Some(pem)) => {
                let mut roots = RootCertStore::empty();
                for authority in certificates(ca, pem)? {
                    roots.add(authority).map_err(|e| format!("{}: {e}", ca.display()))?;
                }
                builder.with_root_certificates(roots)
            }
            // (None found, as in a bare container: no server is trusted, and says so at its
            // handshake.)
            _ => builder.with_native_roots().unwrap_or_else(|e| {
                tracing::warn!(error = %e, "no system certificate authority: no https:// server is trusted but by a CA file");
                let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()));
                let builder = builder.with_safe_default_protocol_versions().expect("ring's default versions");
                builder.with_root_certificates(RootCertStore::empty())
            }),
        };
        let (config, not_after) = match (&files.identity, contents.get(identity_at..identity_at + 2)) {
            (Some((cert, key)), Some([cert_pem, key_pem])) => {
                let chain = certificates(cert, cert_pem)?;
                let not_after = not_after(&chain[0]);
                let private = private_key(key, key_pem)?;
                let config = builder
                    .with_client_auth_cert(chain, private)
                    .map_err(|e| format!("{} with {}: {e}", cert.display(), key.display()))?;
                (config, not_after)
            }
            _ => (builder.with_no_client_auth(), None),
        };
        Ok(Self { config: Arc::new(config), not_after })
    }
}

/// A TLS client trusting the authorities in the PEM file `ca` (the system's without one) and
/// showing the certificate chain and key of `identity`, if given; else what is wrong with a
/// file.
pub fn client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, String> {
    let files = ClientFiles {
        ca: ca.map(Path::to_owned),
        identity: identity.map(|(cert, key)| (cert.to_owned(), key.to_owned())),
    };
    Ok(ClientTls::read_once(&files)?.config)
}

/// The client that names no TLS files: the system's authorities, no identity (loaded once, at
/// the first call).
pub fn system_client_config() -> Arc<ClientConfig> {
    static SYSTEM: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    SYSTEM.get_or_init(|| client_config(None, None).expect("no file to read")).clone()
}

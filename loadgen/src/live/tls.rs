//! HTTPS to the target (a router serving `--tls-cert`): the authorities trusted, the system's
//! or those of `--ca-cert`, and the client's own certificate for a router that asks for one
//! (`--tls-client-ca`, mutual TLS). Plain `http://` targets are reached as ever.

use std::path::Path;
use std::sync::{Arc, OnceLock};

use hyper_rustls::ConfigBuilderExt;
use kvroute_proto::serve::read_file;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

/// A TLS client trusting the authorities in the PEM file `ca` (the system's without one) and
/// showing the certificate chain and key of `identity`, if given; else what is wrong with a
/// file.
pub fn client_config(
    ca: Option<&Path>,
    identity: Option<(&Path, &Path)>,
) -> Result<Arc<ClientConfig>, String> {
    let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let builder = match ca {
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for authority in kvroute_proto::serve::certificates(ca, &read_file(ca)?)? {
                roots.add(authority).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            builder.with_root_certificates(roots)
        }
        // (None found, as in a bare container: no server is trusted, and says so at its handshake.)
        None => builder.with_native_roots().unwrap_or_else(|e| {
            tracing::warn!(error = %e, "no system certificate authority: https:// targets need --ca-cert");
            let builder = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()));
            let builder = builder.with_safe_default_protocol_versions().expect("ring's default versions");
            builder.with_root_certificates(RootCertStore::empty())
        }),
    };
    let config = match identity {
        None => builder.with_no_client_auth(),
        Some((cert, key)) => {
            let chain = kvroute_proto::serve::certificates(cert, &read_file(cert)?)?;
            let key = kvroute_proto::serve::private_key(key, &read_file(key)?)?;
            builder.with_client_auth_cert(chain, key).map_err(|e| format!("{}: {e}", cert.display()))?
        }
    };
    Ok(Arc::new(config))
}

/// The client of a run that names no TLS files: the system's authorities, no identity
/// (loaded once).
pub fn system() -> Arc<ClientConfig> {
    static SYSTEM: OnceLock<Arc<ClientConfig>> = OnceLock::new();
    SYSTEM.get_or_init(|| client_config(None, None).expect("no file to read")).clone()
}

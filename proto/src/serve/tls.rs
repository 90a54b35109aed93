//! TLS on a listener: a certificate chain and its private key from PEM files, HTTP/2 and
//! HTTP/1.1 offered by ALPN, and the files read again in place ([`Tls::load`]: a certificate
//! rotated where it lies, as cert-manager or a mounted Secret rotates it) for the connections
//! accepted from then on; those already open keep theirs.

use std::io;
use std::path::Path;
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{ServerConfig, version};
use tokio_rustls::server::TlsStream;

/// A listener's certificate and key, as last loaded. Clones share them.
#[derive(Clone)]
pub struct Tls(Arc<RwLock<TlsAcceptor>>);

impl Tls {
    /// The certificate chain in `cert` (the server's first) and the private key in `key`,
    /// both PEM; what is wrong with either, else.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, String> {
        Ok(Self(Arc::new(RwLock::new(acceptor(cert, key)?))))
    }

    /// Serves the connections accepted from now on with the certificate and key the files
    /// hold now. On an error the ones in use stay.
    pub fn load(&self, cert: &Path, key: &Path) -> Result<(), String> {
        let acceptor = acceptor(cert, key)?;
        *self.0.write().unwrap_or_else(PoisonError::into_inner) = acceptor;
        Ok(())
    }

    /// The acceptor of a new connection.
    pub(super) fn acceptor(&self) -> TlsAcceptor {
        self.0.read().unwrap_or_else(PoisonError::into_inner).clone()
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tls").finish_non_exhaustive()
    }
}

/// A client connection, plain or TLS: one type, so that the HTTP server is built once for
/// both. (Served generically, hyper's code was built twice and inlined less: the plain path
/// took ~2% more instructions a request.) The TLS state is boxed: it is kilobytes.
pub(super) enum Stream {
    Plain(TcpStream),
    Tls(Box<TlsStream<TcpStream>>),
}

impl AsyncRead for Stream {
    #[inline]
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for Stream {
    #[inline]
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Stream::Tls(s) => Pin::new(s).poll_write(cx, buf),
        }
    }

    #[inline]
    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            Stream::Tls(s) => Pin::new(s).poll_write_vectored(cx, bufs),
        }
    }

    #[inline]
    fn is_write_vectored(&self) -> bool {
        match self {
            Stream::Plain(s) => s.is_write_vectored(),
            Stream::Tls(s) => s.is_write_vectored(),
        }
    }

    #[inline]
    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_flush(cx),
            Stream::Tls(s) => Pin::new(s).poll_flush(cx),
        }
    }

    #[inline]
    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Stream::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Stream::Tls(s) => Pin::new(s).poll_shutdown(cx),
        }
    }
}

fn acceptor(cert: &Path, key: &Path) -> Result<TlsAcceptor, String> {
    let chain = CertificateDer::pem_file_iter(cert)
        .and_then(|certs| certs.collect::<Result<Vec<_>, _>>())
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_file(key).map_err(|e| match e {
        pem::Error::NoItemsFound => {
            format!("{}: no private key in it (PKCS#8, PKCS#1 or SEC1 PEM)", key.display())
        }
        e => format!("{}: {e}", key.display()),
    })?;
    let mut config = ServerConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_protocol_versions(&[&version::TLS13, &version::TLS12])
        .map_err(|e| e.to_string())?
        .with_no_client_auth()
        .with_single_cert(chain, private)
        .map_err(|e| format!("{} with {}: {e}", cert.display(), key.display()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(TlsAcceptor::from(Arc::new(config)))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A certificate and its key for `localhost`, written to files in a directory of their own.
    fn files(name: &str) -> (std::path::PathBuf, std::path::PathBuf, rcgen::CertifiedKey<rcgen::KeyPair>) {
        let dir = std::env::temp_dir().join(format!("kvroute-tls-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
        std::fs::write(&cert, made.cert.pem()).unwrap();
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        (cert, key, made)
    }

    /// Files that are not a certificate and its key are refused, each saying which file and
    /// why; a failed load keeps the certificate in use.
    #[test]
    fn wrong_files_are_refused_with_their_names() {
        let (cert, key, _) = files("wrong");
        let tls = Tls::from_files(&cert, &key).expect("a certificate and its key");
        let dir = cert.parent().unwrap();
        let empty = dir.join("empty.pem");
        std::fs::write(&empty, "").unwrap();
        let missing = dir.join("missing.pem");
        let (_, other_key, _) = files("other");
        for (c, k, says) in [
            (&empty, &key, "empty.pem: no certificate"),
            (&missing, &key, "missing.pem"),
            (&cert, &empty, "empty.pem: no private key"),
            (&key, &key, "key.pem: no certificate"),
            (&cert, &other_key, "cert.pem with"),
        ] {
            let why = Tls::from_files(c, k).expect_err(says);
            assert!(why.contains(says), "{why}");
            assert!(tls.load(c, k).is_err());
        }
        let before = tls.acceptor();
        assert!(Arc::ptr_eq(before.config(), tls.acceptor().config()), "the certificate in use stays");
        tls.load(&cert, &key).unwrap();
        assert!(!Arc::ptr_eq(before.config(), tls.acceptor().config()), "a good load replaces it");
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_dir_all(other_key.parent().unwrap());
    }
}

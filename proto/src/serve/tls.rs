//! TLS on a listener: a certificate chain and its private key from PEM files, HTTP/2 and
//! HTTP/1.1 offered by ALPN, and the files read again in place for the connections accepted
//! from then on (those already open keep theirs): when asked ([`Tls::load`], a reload), and
//! whenever they change on disk ([`Tls::watch`]: cert-manager renewing a mounted Secret, with
//! nobody to send a signal).

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, PoisonError, RwLock};
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::{ServerConfig, version};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

/// A listener's certificate and key, as last loaded. Clones share them.
#[derive(Clone)]
pub struct Tls(Arc<RwLock<Loaded>>);

/// What [`Tls`] serves, and where it came from.
struct Loaded {
    acceptor: TlsAcceptor,
    cert: PathBuf,
    key: PathBuf,
    /// The files' contents last read, loaded or not: a change is loaded (or refused) once.
    seen: (Vec<u8>, Vec<u8>),
}

impl Tls {
    /// The certificate chain in `cert` (the server's first) and the private key in `key`,
    /// both PEM; what is wrong with either, else.
    pub fn from_files(cert: &Path, key: &Path) -> Result<Self, String> {
        let seen = read(cert, key)?;
        let acceptor = acceptor((cert, &seen.0), (key, &seen.1))?;
        Ok(Self(Arc::new(RwLock::new(Loaded { acceptor, cert: cert.to_owned(), key: key.to_owned(), seen }))))
    }

    /// Serves the connections accepted from now on with the certificate and key the files
    /// `cert` and `key` hold now, and watches those files from then on. On an error the ones
    /// in use stay.
    pub fn load(&self, cert: &Path, key: &Path) -> Result<(), String> {
        let seen = read(cert, key)?;
        let acceptor = acceptor((cert, &seen.0), (key, &seen.1))?;
        *self.0.write().unwrap_or_else(PoisonError::into_inner) =
            Loaded { acceptor, cert: cert.to_owned(), key: key.to_owned(), seen };
        Ok(())
    }

    /// Loads the files again if what they hold changed since they were last read: `None` if
    /// it did not, else whether it could be loaded (if not, the one in use stays, and the same
    /// contents are not tried again).
    pub fn reload_if_changed(&self) -> Option<Result<(), String>> {
        let (cert, key, seen) = {
            let loaded = self.0.read().unwrap_or_else(PoisonError::into_inner);
            (loaded.cert.clone(), loaded.key.clone(), loaded.seen.clone())
        };
        let now = read(&cert, &key);
        if now.as_ref().is_ok_and(|now| *now == seen) {
            return None;
        }
        let made = now.and_then(|now| {
            let made = acceptor((&cert, &now.0), (&key, &now.1));
            let mut loaded = self.0.write().unwrap_or_else(PoisonError::into_inner);
            // (Unless a reload loaded other files meanwhile.)
            if loaded.cert == cert && loaded.key == key {
                if let Ok(acceptor) = &made {
                    loaded.acceptor = acceptor.clone();
                }
                loaded.seen = now;
            }
            made.map(|_| ())
        });
        Some(made)
    }

    /// Checks the files every `period` until `shutdown` fires ([`Tls::reload_if_changed`]),
    /// logging each change loaded or refused.
    pub async fn watch(self, period: Duration, shutdown: CancellationToken) {
        super::every(period, shutdown, || match self.reload_if_changed() {
            None => {}
            Some(Ok(())) => tracing::info!("TLS: the certificate and key changed on disk: loaded"),
            Some(Err(why)) => {
                tracing::warn!(error = %why, "TLS: the certificate or key changed on disk and cannot be loaded; the ones in use stay")
            }
        })
        .await;
    }

    /// The acceptor of a new connection.
    pub(super) fn acceptor(&self) -> TlsAcceptor {
        self.0.read().unwrap_or_else(PoisonError::into_inner).acceptor.clone()
    }
}

impl std::fmt::Debug for Tls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let loaded = self.0.read().unwrap_or_else(PoisonError::into_inner);
        f.debug_struct("Tls").field("cert", &loaded.cert).field("key", &loaded.key).finish_non_exhaustive()
    }
}

/// The two files' contents.
fn read(cert: &Path, key: &Path) -> Result<(Vec<u8>, Vec<u8>), String> {
    let read = |path: &Path| std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()));
    Ok((read(cert)?, read(key)?))
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

/// The acceptor of a certificate chain and its key, each a file's name and contents (PEM).
fn acceptor((cert, cert_pem): (&Path, &[u8]), (key, key_pem): (&Path, &[u8])) -> Result<TlsAcceptor, String> {
    let chain = CertificateDer::pem_slice_iter(cert_pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", cert.display()))?;
    if chain.is_empty() {
        return Err(format!("{}: no certificate in it", cert.display()));
    }
    let private = PrivateKeyDer::from_pem_slice(key_pem).map_err(|e| match e {
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

/// A certificate and its key for `localhost`, written to `cert.pem` and `key.pem` in a
/// directory of their own, `name`'s (tests).
#[cfg(test)]
pub(super) fn test_files(name: &str) -> (PathBuf, PathBuf, rcgen::CertifiedKey<rcgen::KeyPair>) {
    let dir = std::env::temp_dir().join(format!("kvroute-tls-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    let (cert, key) = (dir.join("cert.pem"), dir.join("key.pem"));
    std::fs::write(&cert, made.cert.pem()).unwrap();
    std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
    (cert, key, made)
}

#[cfg(test)]
mod tests {
    use super::*;

    use super::test_files as files;

    /// A change on disk is loaded once; one that cannot be loaded keeps the certificate in use
    /// and is not tried again until the files change again (a certificate written before its
    /// key is loaded once the key is there).
    #[test]
    fn a_change_on_disk_is_loaded_once() {
        let (cert, key, _) = files("change");
        let tls = Tls::from_files(&cert, &key).unwrap();
        assert_eq!(tls.reload_if_changed(), None, "nothing changed");
        let first = tls.acceptor();
        let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
        std::fs::write(&cert, made.cert.pem()).unwrap();
        assert!(tls.reload_if_changed().is_some_and(|loaded| loaded.is_err()), "the old key");
        assert!(Arc::ptr_eq(first.config(), tls.acceptor().config()), "the one in use stays");
        assert_eq!(tls.reload_if_changed(), None, "the same contents: not tried again");
        std::fs::write(&key, made.signing_key.serialize_pem()).unwrap();
        assert_eq!(tls.reload_if_changed(), Some(Ok(())));
        assert!(!Arc::ptr_eq(first.config(), tls.acceptor().config()), "the new pair is served");
        assert_eq!(tls.reload_if_changed(), None);
        let _ = std::fs::remove_dir_all(cert.parent().unwrap());
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

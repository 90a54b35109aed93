//! TLS on a listener: a certificate chain and its private key from PEM files, HTTP/2 and
//! HTTP/1.1 offered by ALPN, client certificates required if authorities to check them by are
//! given (mutual TLS), and the files read again in place for the connections accepted from
//! then on (those already open keep theirs): when asked ([`Tls::load`], a reload), and
//! whenever they change on disk ([`Tls::watch`]: cert-manager renewing a mounted Secret, with
//! nobody to send a signal).

use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::TcpStream;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::pem::{self, PemObject};
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio_rustls::rustls::server::WebPkiClientVerifier;
use tokio_rustls::rustls::{RootCertStore, ServerConfig, version};
use tokio_rustls::server::TlsStream;
use tokio_util::sync::CancellationToken;

use super::watched::{FromFiles, Watched};

/// Where a listener's TLS comes from: PEM files.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// The certificate chain, the listener's own first.
    pub cert: PathBuf,
    /// Its private key.
    pub key: PathBuf,
    /// Certificates of the authorities a client's certificate must chain to (mutual TLS):
    /// with them, a client without such a certificate does not get through the handshake.
    /// `None`: no client certificate is asked for.
    pub client_ca: Option<PathBuf>,
}

/// A listener's certificate and key, as last loaded. Clones share them.
#[derive(Clone, Debug)]
pub struct Tls(Watched<Served>);

/// An acceptor, and when its certificate expires.
#[derive(Clone)]
struct Served {
    acceptor: TlsAcceptor,
    /// The certificate's `notAfter`, Unix seconds (`None`: it does not parse as X.509, which
    /// rustls leaves to clients to find).
    not_after: Option<i64>,
}

impl FromFiles for Served {
    type Files = TlsFiles;

    /// The certificate, the key, the client CA's last if any.
    fn paths(files: &TlsFiles) -> Vec<&Path> {
        [Some(&files.cert), Some(&files.key), files.client_ca.as_ref()]
            .into_iter()
            .flatten()
            .map(PathBuf::as_path)
            .collect()
    }

    fn make(files: &TlsFiles, contents: &[Vec<u8>]) -> Result<Self, String> {
        acceptor(files, contents)
    }
}

impl Tls {
    /// The listener's TLS from `files`; what is wrong with one of them, else.
    pub fn from_files(files: &TlsFiles) -> Result<Self, String> {
        Watched::from_files(files).map(Self)
    }

    /// Serves the connections accepted from now on with what `files` hold now, and watches
    /// those files from then on. On an error the ones in use stay.
    pub fn load(&self, files: &TlsFiles) -> Result<(), String> {
        self.0.load(files)
    }

    /// When the certificate served now expires (its `notAfter`, Unix seconds), if it says.
    pub fn not_after(&self) -> Option<i64> {
        self.0.get().not_after
    }

    /// Loads since the start, at a reload or of a change on disk: how many were done, and how
    /// many refused (a file that could not be read or loaded; the one in use stayed).
    pub fn loads(&self) -> (u64, u64) {
        self.0.loads()
    }

    /// Loads the files again if what they hold changed since they were last read
    /// ([`Watched::reload_if_changed`]).
    pub fn reload_if_changed(&self) -> Option<Result<(), String>> {
        self.0.reload_if_changed()
    }

    /// Checks the files every `period` until `shutdown` fires ([`Tls::reload_if_changed`]),
    /// logging each change loaded or refused.
    pub async fn watch(self, period: Duration, shutdown: CancellationToken) {
        self.0.watch("TLS: the certificate, key or client CA", period, shutdown).await;
    }

    /// The acceptor of a new connection.
    pub(super) fn acceptor(&self) -> TlsAcceptor {
        self.0.get().acceptor
    }
}

/// A client connection, plain or TLS: one type, so that the HTTP server is built once for
/// both. (Served generically, hyper's code was built twice and inlined less: the plain path
/// took ~2% more instructions a request.) The TLS state is boxed: it is kilobytes. The gRPC
/// servers take it too ([`super::grpc_incoming`]).
pub enum Stream {
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

/// The acceptor of `files`, holding `pem` (each file's contents, in their order).
fn acceptor(files: &TlsFiles, pem: &[Vec<u8>]) -> Result<Served, String> {
    let (cert, key) = (&files.cert, &files.key);
    let chain = certificates(cert, &pem[0])?;
    let not_after = not_after(&chain[0]);
    let private = private_key(key, &pem[1])?;
    let provider = Arc::new(ring::default_provider());
    let versions = ServerConfig::builder_with_provider(provider.clone())
        .with_protocol_versions(&[&version::TLS13, &version::TLS12])
        .map_err(|e| e.to_string())?;
    let clients = match &files.client_ca {
        None => versions.with_no_client_auth(),
        Some(ca) => {
            let mut roots = RootCertStore::empty();
            for authority in certificates(ca, &pem[2])? {
                roots.add(authority).map_err(|e| format!("{}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider)
                .build()
                .map_err(|e| format!("{}: {e}", ca.display()))?;
            versions.with_client_cert_verifier(verifier)
        }
    };
    let mut config = clients
        .with_single_cert(chain, private)
        .map_err(|e| format!("{} with {}: {e}", cert.display(), key.display()))?;
    config.alpn_protocols = vec![b"h2".to_vec(), b"http/1.1".to_vec()];
    Ok(Served { acceptor: TlsAcceptor::from(Arc::new(config)), not_after })
}

/// When `certificate` expires (its `notAfter`, Unix seconds); `None` if it does not parse as
/// X.509.
pub fn not_after(certificate: &CertificateDer<'_>) -> Option<i64> {
    x509_parser::parse_x509_certificate(certificate)
        .ok()
        .map(|(_, certificate)| certificate.validity().not_after.timestamp())
}

/// What the file at `path` holds, or why it cannot be read, naming it.
pub fn read_file(path: &Path) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// The private key in `pem`, the file `path`'s.
pub fn private_key(path: &Path, pem: &[u8]) -> Result<PrivateKeyDer<'static>, String> {
    PrivateKeyDer::from_pem_slice(pem).map_err(|e| match e {
        pem::Error::NoItemsFound => {
            format!("{}: no private key in it (PKCS#8, PKCS#1 or SEC1 PEM)", path.display())
        }
        e => format!("{}: {e}", path.display()),
    })
}

/// The certificates in `pem`, the file `path`'s: at least one.
pub fn certificates(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, String> {
    let certificates = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: {e}", path.display()))?;
    match certificates.is_empty() {
        true => Err(format!("{}: no certificate in it", path.display())),
        false => Ok(certificates),
    }
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

    fn pair(cert: &Path, key: &Path) -> TlsFiles {
        TlsFiles { cert: cert.to_owned(), key: key.to_owned(), client_ca: None }
    }

    /// A change on disk is loaded once; one that cannot be loaded keeps the certificate in use
    /// and is not tried again until the files change again (a certificate written before its
    /// key is loaded once the key is there).
    #[test]
    fn a_change_on_disk_is_loaded_once() {
        let (cert, key, _) = files("change");
        let tls = Tls::from_files(&pair(&cert, &key)).unwrap();
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
        assert_eq!(tls.loads(), (1, 1), "one change refused, one loaded; the same contents not counted");
        let expiry = rcgen::CertificateParams::default().not_after.unix_timestamp();
        assert_eq!(tls.not_after(), Some(expiry));
        let _ = std::fs::remove_dir_all(cert.parent().unwrap());
    }

    /// Files that are not a certificate and its key are refused, each saying which file and
    /// why; a failed load keeps the certificate in use.
    #[test]
    fn wrong_files_are_refused_with_their_names() {
        let (cert, key, _) = files("wrong");
        let tls = Tls::from_files(&pair(&cert, &key)).expect("a certificate and its key");
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
            let why = Tls::from_files(&pair(c, k)).expect_err(says);
            assert!(why.contains(says), "{why}");
            assert!(tls.load(&pair(c, k)).is_err());
        }
        let before = tls.acceptor();
        assert!(Arc::ptr_eq(before.config(), tls.acceptor().config()), "the certificate in use stays");
        tls.load(&pair(&cert, &key)).unwrap();
        assert!(!Arc::ptr_eq(before.config(), tls.acceptor().config()), "a good load replaces it");
        let _ = std::fs::remove_dir_all(dir);
        let _ = std::fs::remove_dir_all(other_key.parent().unwrap());
    }
}

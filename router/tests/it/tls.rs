//! HTTPS on the proxy's listener (`--tls-cert`, `--tls-key`): HTTP/1.1 and HTTP/2 by ALPN,
//! routed as ever; a certificate rotated in place is served after a reload.

use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;

use bytes::Bytes;
use futures::TryFutureExt;
use http_body_util::{BodyExt, Full};
use hyper_util::rt::{TokioExecutor, TokioIo};
use kvroute_proto::pb::{self, router_admin_client::RouterAdminClient};
use kvroute_router::config::Config as RouterConfig;
use kvroute_router::reload::Reloader;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio_rustls::client::TlsStream;
use tokio_rustls::rustls::crypto::ring;
use tokio_rustls::rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use tokio_rustls::rustls::{ClientConfig, RootCertStore};

use crate::fleet::{FLEET_MODEL, Fleet, agent_config, router_config};
use crate::support::Authority;

/// Writes a new self-signed certificate for `localhost` and its key to `cert` and `key`;
/// returns the certificate, for a client to trust.
fn new_certificate(cert: &Path, key: &Path) -> CertificateDer<'static> {
    let made = rcgen::generate_simple_self_signed(vec!["localhost".into()]).unwrap();
    std::fs::write(cert, made.cert.pem()).unwrap();
    std::fs::write(key, made.signing_key.serialize_pem()).unwrap();
    made.cert.der().clone()
}

/// A TLS connection to `addr` (as `localhost`) by a client that trusts only `trusted`, asks
/// for `alpn` and shows `identity` (its certificate chain and key), if any.
async fn connect(
    addr: SocketAddr,
    trusted: &CertificateDer<'static>,
    alpn: &[u8],
    identity: Option<&rcgen::CertifiedKey<rcgen::KeyPair>>,
) -> std::io::Result<TlsStream<TcpStream>> {
    connect_with(addr, Arc::new(client_config(trusted, alpn, identity))).await
}

/// A TLS connection to `addr` (as `localhost`) by a client of `config`.
async fn connect_with(addr: SocketAddr, config: Arc<ClientConfig>) -> std::io::Result<TlsStream<TcpStream>> {
    let tcp = TcpStream::connect(addr).await?;
    let name = ServerName::try_from("localhost").unwrap();
    tokio_rustls::TlsConnector::from(config).connect(name, tcp).await
}

/// A client that trusts only `trusted`, asks for `alpn` and shows `identity`, if any.
fn client_config(
    trusted: &CertificateDer<'static>,
    alpn: &[u8],
    identity: Option<&rcgen::CertifiedKey<rcgen::KeyPair>>,
) -> ClientConfig {
    let mut roots = RootCertStore::empty();
    roots.add(trusted.clone()).unwrap();
    let trusting = ClientConfig::builder_with_provider(Arc::new(ring::default_provider()))
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let mut config = match identity {
        None => trusting.with_no_client_auth(),
        Some(made) => {
            let key = PrivateKeyDer::try_from(made.signing_key.serialize_der()).unwrap();
            trusting.with_client_auth_cert(vec![made.cert.der().clone()], key).unwrap()
        }
    };
    config.alpn_protocols = vec![alpn.to_vec()];
    config
}

/// What a completion over TLS to `addr` got: the protocol ALPN chose, the status and the
/// replica that answered; or why the connection failed (a client that trusts only `trusted`).
async fn complete(
    addr: SocketAddr,
    trusted: &CertificateDer<'static>,
    alpn: &[u8],
) -> Result<(Vec<u8>, http::StatusCode, String), String> {
    complete_as(addr, trusted, alpn, None).await
}

/// [`complete`] by a client that shows `identity` (its certificate chain and key), if any.
async fn complete_as(
    addr: SocketAddr,
    trusted: &CertificateDer<'static>,
    alpn: &[u8],
    identity: Option<&rcgen::CertifiedKey<rcgen::KeyPair>>,
) -> Result<(Vec<u8>, http::StatusCode, String), String> {
    let stream = connect(addr, trusted, alpn, identity).await.map_err(|e| e.to_string())?;
    let chosen = stream.get_ref().1.alpn_protocol().unwrap_or_default().to_vec();
    let body = json!({"model": FLEET_MODEL, "prompt": "over tls", "max_tokens": 1}).to_string();
    let request = http::Request::post(format!("https://localhost:{}/v1/completions", addr.port()))
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body)))
        .unwrap();
    let io = TokioIo::new(stream);
    let response = if chosen == b"h2" {
        let (mut sender, conn) = hyper::client::conn::http2::handshake(TokioExecutor::new(), io)
            .await
            .map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        sender.send_request(request).await
    } else {
        let (mut sender, conn) =
            hyper::client::conn::http1::handshake(io).await.map_err(|e| e.to_string())?;
        tokio::spawn(conn);
        let (mut parts, body) = request.into_parts();
        parts.uri = "/v1/completions".parse().unwrap();
        parts.headers.insert(http::header::HOST, http::HeaderValue::from_static("localhost"));
        sender.send_request(http::Request::from_parts(parts, body)).await
    }
    .map_err(|e| e.to_string())?;
    let status = response.status();
    let replica = response.headers().get("x-kvroute-replica").map(|v| v.to_str().unwrap().to_owned());
    let body = response.into_body().collect().await.map_err(|e| e.to_string())?.to_bytes();
    assert!(status != 200 || body.starts_with(b"{"), "{}", String::from_utf8_lossy(&body));
    Ok((chosen, status, replica.unwrap_or_default()))
}

/// The proxy serves HTTPS, HTTP/1.1 and HTTP/2 as the client's ALPN asks, routed as ever; a
/// plain request on its port gets no HTTP answer, and the health port serves the metrics in
/// plain HTTP. After a reload, new connections get the certificate rotated into the same
/// files, and the old one is no longer served.
#[tokio::test]
async fn the_proxy_serves_https_and_a_certificate_rotated_in_place() {
    let dir = crate::support::directory("tls-proxy");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let first = new_certificate(&cert, &key);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(2, agent_config, &shutdown).await;
    let config = RouterConfig {
        tls_cert: Some(cert.clone()),
        tls_key: Some(key.clone()),
        health_listen: Some("127.0.0.1:0".parse().unwrap()),
        ..router_config(&agents)
    };
    let mut reloader = Reloader::new(&config);
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    let addr = fleet.router.addr;
    assert!(fleet.router.url().starts_with("https://"), "{}", fleet.router.url());
    for alpn in [&b"http/1.1"[..], b"h2"] {
        let (chosen, status, replica) = complete(addr, &first, alpn).await.unwrap();
        assert_eq!((chosen.as_slice(), status.as_u16()), (alpn, 200));
        assert!(replica.starts_with("agent-"), "{replica:?}");
    }

    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET /health HTTP/1.1\r\nhost: localhost\r\n\r\n").await.unwrap();
    let mut answer = Vec::new();
    let read = tokio::time::timeout(crate::support::WAIT, plain.read_to_end(&mut answer)).await;
    assert!(read.is_ok(), "a plain request's connection is closed");
    assert!(!answer.starts_with(b"HTTP/"), "{}", String::from_utf8_lossy(&answer));
    let probes = fleet.router.health_addr.unwrap();
    let scrape = async || {
        String::from_utf8(fleet.http.get(&format!("http://{probes}/metrics")).await.body.to_vec()).unwrap()
    };
    let scraped = scrape().await;
    assert!(scraped.contains("kvroute_router_decisions_total"));
    // rcgen's certificates are valid until its default `notAfter`.
    let expiry = rcgen::CertificateParams::default().not_after.unix_timestamp();
    let line = format!("kvroute_router_tls_certificate_expiry_timestamp_seconds {expiry}");
    assert!(scraped.lines().any(|l| l == line), "{line} not in\n{scraped}");

    let second = new_certificate(&cert, &key);
    let reloaded = reloader.apply(&fleet.router.state, &config).await;
    assert_eq!(reloaded.tls, Some(Ok(())));
    let refused = complete(addr, &first, b"http/1.1").await.expect_err("the old certificate is gone");
    assert!(refused.to_lowercase().contains("certificate"), "{refused}");
    assert_eq!(complete(addr, &second, b"h2").await.unwrap().1, 200);

    // A certificate caught half-written: the one in use stays, and the rest of the reload
    // applies all the same.
    std::fs::write(&cert, "-----BEGIN CERTIFICATE-----\n").unwrap();
    let round_robin = RouterConfig { policy: kvroute_router::policy::PolicyKind::RoundRobin, ..config };
    assert_eq!(round_robin.validate_for_reload(), Ok(()));
    let reloaded = reloader.apply(&fleet.router.state, &round_robin).await;
    assert!(reloaded.tls.as_ref().is_some_and(Result::is_err), "{reloaded:?}");
    assert_eq!(reloaded.applied, ["policy"]);
    assert_eq!(complete(addr, &second, b"http/1.1").await.unwrap().1, 200);
    let scraped = scrape().await;
    for line in [
        "kvroute_router_tls_loads_total{outcome=\"loaded\"} 1",
        "kvroute_router_tls_loads_total{outcome=\"refused\"} 1",
    ] {
        assert!(scraped.lines().any(|l| l == line), "{line} not in\n{scraped}");
    }
    let _ = std::fs::remove_dir_all(dir);
}

/// With `--forwarded-for`, a request that came over TLS tells the replica so:
/// `X-Forwarded-Proto: https`.
#[tokio::test]
async fn a_request_over_tls_is_forwarded_as_https() {
    const ANSWER: &[u8] = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}";
    let (replica, mut seen) = crate::headers::recording_replica(ANSWER).await;
    let dir = crate::support::directory("tls-forwarded");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let trusted = new_certificate(&cert, &key);
    let config = RouterConfig {
        model: FLEET_MODEL.into(),
        replicas: vec![format!("name=r,http=http://{replica}").parse().unwrap()],
        tls_cert: Some(cert),
        tls_key: Some(key),
        forwarded_for: true,
        ..RouterConfig::loopback(Vec::new())
    };
    let shutdown = tokio_util::sync::CancellationToken::new();
    let router = kvroute_router::start(config, shutdown.clone()).await.unwrap();
    let (_, status, _) = complete(router.addr, &trusted, b"h2").await.unwrap();
    assert_eq!(status, 200);
    let got = tokio::time::timeout(crate::support::WAIT, seen.recv()).await.expect("in time").unwrap();
    assert_eq!(got.values("x-forwarded-proto"), ["https"]);
    shutdown.cancel();
    let _ = std::fs::remove_dir_all(dir);
}

/// A certificate renewed in its files (cert-manager updating a mounted Secret) is served to
/// new connections without a reload: the router checks the files every `--tls-check-ms`.
#[tokio::test]
async fn a_certificate_renewed_on_disk_is_served_without_a_reload() {
    let dir = crate::support::directory("tls-watch");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let first = new_certificate(&cert, &key);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, agent_config, &shutdown).await;
    let config = RouterConfig {
        tls_cert: Some(cert.clone()),
        tls_key: Some(key.clone()),
        tls_check_ms: 20,
        ..router_config(&agents)
    };
    let fleet = Fleet::around(agents, config, shutdown).await;
    let addr = fleet.router.addr;
    assert_eq!(complete(addr, &first, b"h2").await.unwrap().1, 200);
    let renewed = new_certificate(&cert, &key);
    let served =
        async || complete(addr, &renewed, b"http/1.1").await.is_ok_and(|(_, status, _)| status == 200);
    crate::support::wait_until_async("the renewed certificate is served", served).await;
    assert!(complete(addr, &first, b"h2").await.is_err(), "the old one is not");
    let _ = std::fs::remove_dir_all(dir);
}

/// With `--tls-client-ca` (mutual TLS), a client with a certificate of that authority is
/// served; one without a certificate, or with one of another authority, is not. A reload that
/// names another authority lets in its clients from then on, and no longer the first one's;
/// one that names none asks no client for a certificate.
#[tokio::test]
async fn with_a_client_ca_only_its_clients_are_served() {
    let dir = crate::support::directory("tls-mutual");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let trusted = new_certificate(&cert, &key);
    let (authority, other_authority) = (Authority::new(), Authority::new());
    let (client, stranger) = (authority.client("client"), other_authority.client("client"));
    let ca = authority.write(&dir, "ca");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, agent_config, &shutdown).await;
    let config = RouterConfig {
        tls_cert: Some(cert.clone()),
        tls_key: Some(key.clone()),
        tls_client_ca: Some(ca.clone()),
        ..router_config(&agents)
    };
    let mut reloader = Reloader::new(&config);
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    let addr = fleet.router.addr;
    let status =
        async |identity, alpn| complete_as(addr, &trusted, alpn, identity).await.map(|(_, status, _)| status);
    for alpn in [&b"http/1.1"[..], b"h2"] {
        assert_eq!(status(Some(&client), alpn).await, Ok(http::StatusCode::OK));
        assert!(status(None, alpn).await.is_err(), "no client certificate");
        assert!(status(Some(&stranger), alpn).await.is_err(), "another authority's client");
    }

    let other_ca = other_authority.write(&dir, "other-ca");
    let other = RouterConfig { tls_client_ca: Some(other_ca), ..config.clone() };
    let reloaded = reloader.apply(&fleet.router.state, &other).await;
    assert_eq!((reloaded.tls, reloaded.applied), (Some(Ok(())), vec!["tls-client-ca".to_owned()]));
    assert_eq!(status(Some(&stranger), b"h2").await, Ok(http::StatusCode::OK));
    assert!(status(Some(&client), b"h2").await.is_err(), "the first authority's client");
    // A reload that names no authority any more: no certificate is asked for.
    let reloaded = reloader.apply(&fleet.router.state, &RouterConfig { tls_client_ca: None, ..config }).await;
    assert_eq!((reloaded.tls, reloaded.applied), (Some(Ok(())), vec!["tls-client-ca".to_owned()]));
    assert_eq!(status(None, b"http/1.1").await, Ok(http::StatusCode::OK));
    let _ = std::fs::remove_dir_all(dir);
}

/// How many replicas the admin service at `addr` lists to a gRPC client over TLS (see
/// [`connect`]) that sends the token `s3cret`; or why it could not.
async fn list_over_tls(
    addr: SocketAddr,
    trusted: &CertificateDer<'static>,
    identity: Option<&rcgen::CertifiedKey<rcgen::KeyPair>>,
) -> Result<usize, String> {
    let config = Arc::new(client_config(trusted, b"h2", identity));
    let connector =
        tower::service_fn(move |_: http::Uri| connect_with(addr, config.clone()).map_ok(TokioIo::new));
    // The connector makes it TLS (tonic without its TLS features refuses `https` URIs).
    let endpoint = tonic::transport::Endpoint::from_static("http://localhost");
    let channel = endpoint.connect_with_connector(connector).await.map_err(|e| format!("{e:?}"))?;
    let mut request = tonic::Request::new(pb::ListReplicasRequest {});
    request.metadata_mut().insert("authorization", "Bearer s3cret".parse().unwrap());
    let listed = RouterAdminClient::new(channel).list_replicas(request).await;
    listed.map(|reply| reply.into_inner().replicas.len()).map_err(|e| e.to_string())
}

/// With `--admin-tls`, the admin service serves TLS with the proxy's certificate, to the
/// clients of its `--tls-client-ca` only; a plain client gets no answer. A certificate
/// rotated in place is the admin's from the reload on, as it is the proxy's.
#[tokio::test]
async fn the_admin_service_serves_tls_with_the_proxys_certificate() {
    let dir = crate::support::directory("tls-admin");
    let (cert, key) = (dir.join("tls.crt"), dir.join("tls.key"));
    let first = new_certificate(&cert, &key);
    let authority = Authority::new();
    let client = authority.client("operator");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(2, agent_config, &shutdown).await;
    let config = RouterConfig {
        tls_cert: Some(cert.clone()),
        tls_key: Some(key.clone()),
        tls_client_ca: Some(authority.write(&dir, "ca")),
        admin_tls: true,
        admin_token: Some("s3cret".into()),
        ..router_config(&agents)
    };
    let mut reloader = Reloader::new(&config);
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    let admin = fleet.router.admin_addr;
    assert_eq!(list_over_tls(admin, &first, Some(&client)).await, Ok(2));
    assert!(list_over_tls(admin, &first, None).await.is_err(), "a client without a certificate");
    if let Ok(mut plain) = RouterAdminClient::connect(fleet.router.admin_url()).await {
        let mut request = tonic::Request::new(pb::ListReplicasRequest {});
        request.metadata_mut().insert("authorization", "Bearer s3cret".parse().unwrap());
        let code = plain.list_replicas(request).await.map(|_| ()).map_err(|e| e.code());
        // Not served, nor refused by the service (which would be `Unauthenticated`).
        assert!(
            matches!(code, Err(c) if c != tonic::Code::Unauthenticated),
            "a plain client, with the token: {code:?}"
        );
    }

    // `kvroute-admin` over TLS, trusting the certificate's file, with a client certificate.
    let (client_cert, client_key) = crate::support::write_identity(&client, &dir, "operator");
    let admin_cli = kvroute_router::admin_cli::Cli {
        url: format!("https://localhost:{}", admin.port()),
        token: Some("s3cret".into()),
        ca_cert: Some(cert.clone()),
        server_name: None,
        client_cert: Some(client_cert),
        client_key: Some(client_key),
        output: kvroute_router::admin_cli::Output::Table,
        command: kvroute_router::admin_cli::Command::List,
    };
    let mut listed = Vec::new();
    kvroute_router::admin_cli::run(&admin_cli, &mut listed).await.unwrap();
    assert_eq!(String::from_utf8(listed).unwrap().lines().filter(|l| l.starts_with("agent-")).count(), 2);
    let anonymous = kvroute_router::admin_cli::Cli { client_cert: None, client_key: None, ..admin_cli };
    assert!(
        kvroute_router::admin_cli::run(&anonymous, &mut Vec::new()).await.is_err(),
        "no client certificate"
    );

    let second = new_certificate(&cert, &key);
    assert_eq!(reloader.apply(&fleet.router.state, &config).await.tls, Some(Ok(())));
    assert_eq!(list_over_tls(admin, &second, Some(&client)).await, Ok(2));
    assert!(list_over_tls(admin, &first, Some(&client)).await.is_err(), "the old certificate is gone");
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn admin_tls_needs_the_proxys_certificate() {
    let config = RouterConfig { admin_tls: true, ..RouterConfig::default() };
    let errors = config.validate().unwrap_err();
    assert!(errors.iter().any(|e| e.starts_with("--admin-tls needs --tls-cert")), "{errors:?}");
}

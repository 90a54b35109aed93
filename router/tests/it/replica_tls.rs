//! HTTPS to replicas (`https://` URLs, agents serving `--ssl-certfile`): routed, cached and
//! streamed as over plain HTTP, health-checked, and refused when the replica's certificate is
//! not one the router trusts; with mutual TLS, the router shows its own certificate.

use std::path::{Path, PathBuf};

use kvroute_router::config::Config as RouterConfig;
use kvroute_router::reload::Reloader;
use serde_json::{Value, json};

use crate::fleet::{FLEET_MODEL, Fleet, Http, agent_config, first_data, router_config};
use crate::support::{Authority, sample, wait_until, write_identity};

/// An agent serving HTTPS with `dir/replica.{crt,key}`, asking clients for a certificate of
/// `dir/ca.crt`'s authority if `mutual`.
fn https_agent(dir: &Path, mutual: bool) -> impl Fn(&str) -> kvroute_replica_agent::Config {
    let dir = dir.to_owned();
    move |name| kvroute_replica_agent::Config {
        ssl_certfile: Some(dir.join("replica.crt")),
        ssl_keyfile: Some(dir.join("replica.key")),
        ssl_ca_certs: mutual.then(|| dir.join("ca.crt")),
        lora_adapters: vec!["sql".into()],
        ..agent_config(name)
    }
}

/// An authority (`dir/ca.crt`), the replicas' certificate for 127.0.0.1 (`dir/replica.*`) and a
/// client certificate for the router (`dir/router.*`), all signed by it; returns the router's.
fn pki(dir: &Path) -> (PathBuf, PathBuf) {
    let authority = Authority::new();
    authority.write(dir, "ca");
    write_identity(&authority.server("127.0.0.1"), dir, "replica");
    write_identity(&authority.client("router"), dir, "router")
}

fn completion(prompt: &str) -> Value {
    json!({"model": FLEET_MODEL, "prompt": prompt, "max_tokens": 2})
}

/// A router's answer to a completion: its status, and its error's message if any.
async fn complete(http: &Http, router: &str) -> (u16, String) {
    let reply = http.post(&format!("{router}/v1/completions"), &completion("hello")).await;
    let message = match reply.status.as_u16() {
        200 => String::new(),
        _ => reply.json()["error"]["message"].as_str().unwrap_or_default().to_owned(),
    };
    (reply.status.as_u16(), message)
}

/// A router config in which a failing replica stays eligible (never unhealthy nor ejected), so
/// each request reaches it and says why it failed.
fn forgiving(config: RouterConfig) -> RouterConfig {
    RouterConfig { unhealthy_after: 1_000, eject_after: 1_000, ..config }
}

/// Replicas behind `https://` URLs, their certificate trusted by `--replica-ca-cert`: a prompt
/// comes back to the replica that cached it, a stream's first chunk comes before its end, a
/// body too long to be written at once goes out whole, and the health checks read the replicas'
/// adapter lists. A router that does not trust their authority sends them nothing: its
/// requests fail with an OpenAI-shaped error that says why.
#[tokio::test]
async fn https_replicas_are_routed_to_as_plain_ones() {
    let dir = crate::support::directory("replica-tls");
    pki(&dir);
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(2, https_agent(&dir, false), &shutdown).await;
    assert!(agents.iter().all(|a| a.http_url().starts_with("https://")));
    let config = RouterConfig { replica_ca_cert: Some(dir.join("ca.crt")), ..router_config(&agents) };
    let fleet = Fleet::around(agents, config.clone(), shutdown.clone()).await;
    let state_ = fleet.router.state.clone();
    wait_until("the adapter the replicas list over HTTPS is learned", || {
        state_.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned())
    })
    .await;

    let url = fleet.url("/v1/completions");
    let prompt = "a system prompt long enough to fill several blocks of four tokens each";
    let first = fleet.http.post(&url, &completion(prompt)).await;
    assert_eq!(first.status, 200, "{:?}", first.body);
    let replica = first.header("x-kvroute-replica").unwrap().to_owned();
    crate::fleet::index_matches(
        &fleet.router,
        fleet.agents.iter().flatten().find(|a| a.name == replica).unwrap(),
    )
    .await;
    let again = fleet.http.post(&url, &completion(&format!("{prompt} and a question"))).await;
    assert_eq!(again.status, 200, "{:?}", again.body);
    assert_eq!(again.header("x-kvroute-replica"), Some(replica.as_str()));
    assert!(again.cached_tokens() > 0, "{:?}", again.body);

    let mut streamed = completion(prompt);
    streamed["stream"] = json!(true);
    streamed["max_tokens"] = json!(20);
    let mut body = fleet.http.stream(&url, &streamed).await.into_body();
    assert!(first_data(&mut body).await.starts_with(b"data: "));

    // Longer than the proxy writes in one go (16 KiB), so written as the answer is watched for.
    let long = "word ".repeat(5_000);
    let reply = fleet.http.post(&url, &completion(&long)).await;
    assert_eq!(reply.status, 200, "{:?}", String::from_utf8_lossy(&reply.body));
    assert!(reply.json()["usage"]["prompt_tokens"].as_u64().unwrap() >= 5_000, "{:?}", reply.body);

    // Without the authority: the system's, which do not know it.
    let untrusting = forgiving(RouterConfig { replica_ca_cert: None, ..config });
    let router = kvroute_router::start(untrusting, shutdown.child_token()).await.unwrap();
    wait_until("the second router is ready", || router.fleet().ready()).await;
    let (status, message) = complete(&fleet.http, &router.url()).await;
    assert!(
        status == 502 && message.contains("TLS handshake: invalid peer certificate"),
        "{status} {message}"
    );
    let _ = std::fs::remove_dir_all(dir);
}

/// Replicas that ask for a client certificate (mutual TLS) serve a router that shows one of
/// their authority's (`--replica-client-cert`), not one that shows none or another's. A reload
/// names the certificate, and one renewed in place is used without a reload: the proxy's
/// connections and the health checks take it up.
#[tokio::test]
async fn replicas_asking_for_a_certificate_get_the_routers_renewed_in_place() {
    let dir = crate::support::directory("replica-mtls");
    let (good_cert, good_key) = pki(&dir);
    let (cert, key) = write_identity(&Authority::new().client("router"), &dir, "client");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, https_agent(&dir, true), &shutdown).await;
    let config = forgiving(RouterConfig {
        replica_ca_cert: Some(dir.join("ca.crt")),
        tls_check_ms: 50,
        ..router_config(&agents)
    });
    let mut reloader = Reloader::new(&config);
    let fleet = Fleet::around(agents, config.clone(), shutdown).await;
    let router = fleet.router.url();
    let status = async || complete(&fleet.http, &router).await;
    let (refused, message) = status().await;
    assert!(
        refused == 502 && message.contains("CertificateRequired"),
        "no client certificate: {refused} {message}"
    );

    let named = RouterConfig {
        replica_client_cert: Some(cert.clone()),
        replica_client_key: Some(key.clone()),
        ..config.clone()
    };
    let reloaded = reloader.apply(&fleet.router.state, &named).await;
    assert_eq!(reloaded.replica_tls, Some(Ok(())));
    assert!(reloaded.applied.contains(&"replica-client-cert".to_owned()), "{:?}", reloaded.applied);
    let (refused, message) = status().await;
    assert!(
        refused == 502 && message.contains("alert"),
        "another authority's certificate: {refused} {message}"
    );

    let router = fleet.router.state.clone();
    let learned = move || router.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned());
    assert!(!learned(), "no health check got through");
    std::fs::copy(&good_cert, &cert).unwrap();
    std::fs::copy(&good_key, &key).unwrap();
    crate::support::wait_until_async("the renewed certificate is shown", async || status().await.0 == 200)
        .await;
    wait_until("a health check shows it too, and reads the adapters", learned).await;
    let metrics = String::from_utf8(fleet.http.get(&fleet.url("/metrics")).await.body.to_vec()).unwrap();
    let loaded = "kvroute_router_replica_tls_loads_total{outcome=\"loaded\"}";
    // (A check between the two copies may load, or refuse, a certificate without its key.)
    assert!(sample(&metrics, loaded) >= Some(2), "the reload and the renewal: {metrics}");
    let expiry = rcgen::CertificateParams::default().not_after.unix_timestamp();
    let line = format!("kvroute_router_replica_tls_client_certificate_expiry_timestamp_seconds {expiry}");
    assert!(metrics.lines().any(|l| l == line), "{line} not in\n{metrics}");

    // A reload naming a file that cannot be read keeps the certificate in use.
    let missing = RouterConfig { replica_client_cert: Some(dir.join("missing.crt")), ..named.clone() };
    let reloaded = reloader.apply(&fleet.router.state, &missing).await;
    assert!(matches!(&reloaded.replica_tls, Some(Err(why)) if why.contains("missing.crt")), "{reloaded:?}");
    assert_eq!(status().await.0, 200);

    // A renewal the watcher refused is refused again by a reload naming the same files (it
    // said they were read again, the older certificate still shown).
    let refused = "kvroute_router_replica_tls_loads_total{outcome=\"refused\"}";
    let scrape = async || {
        let metrics = fleet.http.get(&fleet.url("/metrics")).await.body.to_vec();
        sample(&String::from_utf8(metrics).unwrap(), refused)
    };
    let before = scrape().await;
    std::fs::write(&cert, "not a certificate").unwrap();
    crate::support::wait_until_async("the watcher refuses it", async || scrape().await > before).await;
    let reloaded = reloader.apply(&fleet.router.state, &named).await;
    assert!(matches!(&reloaded.replica_tls, Some(Err(_))), "{reloaded:?}");
    assert_eq!(status().await.0, 200, "the certificate in use stays");
    let _ = std::fs::remove_dir_all(dir);
}

/// Replicas found by discovery, reached over HTTPS by address (`--discovery-https`), their
/// certificates naming a service (`--replica-tls-server-name`); checked against the address
/// instead, the certificate is refused.
#[tokio::test]
async fn discovered_replicas_are_reached_over_https_by_their_service_name() {
    use kvroute_router::discovery::{DiscoveryConfig, DiscoveryMode};
    let dir = crate::support::directory("replica-tls-discovery");
    let authority = Authority::new();
    authority.write(&dir, "ca");
    write_identity(&authority.server("replica.test"), &dir, "replica");
    let shutdown = tokio_util::sync::CancellationToken::new();
    let agents = Fleet::start_agents(1, https_agent(&dir, false), &shutdown).await;
    let port = |endpoint: &str| endpoint.rsplit(':').next().unwrap().parse::<u16>().unwrap();
    let discovery = DiscoveryConfig {
        discovery: DiscoveryMode::Dns,
        discovery_service: Some("localhost".into()),
        discovery_http_port: agents[0].http_addr.port(),
        discovery_events_port: port(&agents[0].events_endpoint),
        discovery_replay_port: agents[0].replay_endpoint.as_deref().map(port),
        discovery_https: true,
        ..DiscoveryConfig::default()
    };
    let config = RouterConfig {
        discovery,
        replicas: Vec::new(),
        replica_ca_cert: Some(dir.join("ca.crt")),
        replica_tls_server_name: Some("replica.test".into()),
        ..router_config(&agents)
    };
    let fleet = Fleet::around(agents, config.clone(), shutdown.clone()).await;
    let (status, message) = complete(&fleet.http, &fleet.router.url()).await;
    assert_eq!(status, 200, "{message}");
    let state = fleet.router.state.clone();
    wait_until("the health checks read the adapter list by the service name too", || {
        state.decider.prompts.tokenization().lora_adapters().contains(&"sql".to_owned())
    })
    .await;
    let members = fleet.router.fleet().members();
    assert_eq!(members[0].replica.spec.http_url, format!("https://{}", fleet.agent(0).http_addr));

    let by_address = forgiving(RouterConfig { replica_tls_server_name: None, ..config });
    let router = kvroute_router::start(by_address, shutdown.child_token()).await.unwrap();
    wait_until("the second router is ready", || router.fleet().ready()).await;
    let (status, message) = complete(&fleet.http, &router.url()).await;
    assert!(status == 502 && message.contains("not valid for name \"127.0.0.1\""), "{status} {message}");
    let _ = std::fs::remove_dir_all(dir);
}

/// The router's replica TLS files are checked up front, every problem named.
#[test]
fn replica_tls_files_are_checked_at_start() {
    let dir = crate::support::directory("replica-tls-config");
    let (cert, key) = pki(&dir);
    let with = |ca: Option<PathBuf>, identity: Option<(PathBuf, PathBuf)>| RouterConfig {
        replica_ca_cert: ca,
        replica_client_cert: identity.as_ref().map(|(c, _)| c.clone()),
        replica_client_key: identity.map(|(_, k)| k),
        ..RouterConfig::default()
    };
    assert_eq!(with(Some(dir.join("ca.crt")), Some((cert.clone(), key.clone()))).validate(), Ok(()));
    let errors = with(Some(dir.join("missing.crt")), None).validate().unwrap_err();
    assert!(
        errors.len() == 1 && errors[0].contains("--replica-ca-cert") && errors[0].contains("missing.crt"),
        "{errors:?}"
    );
    let errors = with(None, Some((key.clone(), key.clone()))).validate().unwrap_err();
    assert!(errors.len() == 1 && errors[0].contains("router.key"), "a key is no certificate: {errors:?}");
    let unnamed =
        RouterConfig { replica_tls_server_name: Some("label-.example".into()), ..RouterConfig::default() };
    let errors = unnamed.validate().unwrap_err();
    assert!(errors.len() == 1 && errors[0].contains("--replica-tls-server-name"), "{errors:?}");
    let half = RouterConfig { replica_client_cert: Some(cert), ..RouterConfig::default() };
    let errors = half.validate().unwrap_err();
    assert!(errors.iter().any(|e| e.contains("go together")), "{errors:?}");
    let _ = std::fs::remove_dir_all(dir);
}
